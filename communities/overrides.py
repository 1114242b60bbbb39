"""From a config file and its overrides to the plain dict that config.py validates.

Three steps, each on plain JSON-like data (config.py's ``plain``), with OmegaConf where
it does the work (merging mappings, resolving interpolations):

- **Overrides merge** (``merge_override``): ``key.path=value`` sets one value; a mapping
  value merges into the section it names, so ``partners.p_cross={start: 0.1, end: 1.0}``
  keeps the file's ``shape``, ``begin`` and ``horizon``. A section the file leaves out
  starts from its default. A free-form table (``faults.speed``, ``pbt.params``, ...) given
  whole is replaced whole: its keys are data, not settings.
- **Interpolation** (``resolve``): ``${oc.env:SCRATCH}`` is an environment variable,
  ``${oc.env:SCRATCH,/tmp}`` one with a default, ``${train.lr}`` another key's value
  (OmegaConf's grammar). It is resolved once, after the overrides, on the process that
  reads the file (rank 0 of a run), against the config as it will be validated (defaults
  included). A plain ``${SCRATCH}`` is a reference to a config key, as in OmegaConf and
  Hydra, never the environment: a typo cannot silently read a variable, and the error
  says how to write one. ``???`` marks a value that must be given.
- **Run names** (``render_name``): ``name: "lr{train.lr}_s{seed}"`` is a template over
  keys, filled from the validated config, so that the runs of a sweep get names of
  their own.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable, Dict, Iterator, List, Tuple

from .errors import ConfigError

ENV = re.compile(r"\$\{oc\.env:([^,}\s]+)\}")  # an environment variable without a default
TEMPLATE_KEY = re.compile(r"\{([^{}]*)\}")


def merge_override(tree: dict, parts: List[str], value: Any, defaults: dict, *, replace: bool = False) -> None:
    """Set ``tree[parts]`` to ``value`` in place: a mapping merges into the mapping there (OmegaConf.merge) unless
    ``replace``; sections along the path that ``tree`` leaves out start from ``defaults``.

    ConfigError (without the file's name) where the path runs through a value."""
    node, default = tree, defaults
    for depth, p in enumerate(parts[:-1]):
        default = default.get(p) if isinstance(default, dict) else None
        if node.get(p) is None:
            node[p] = _copy(default) if isinstance(default, dict) else {}
        if not isinstance(node[p], dict):
            raise ConfigError(f"{'.'.join(parts[: depth + 1])!r} is a value, not a section")
        node = node[p]
    last = parts[-1]
    default = default.get(last) if isinstance(default, dict) else None
    if isinstance(value, dict) and not replace:
        base = node.get(last)
        if base is None and isinstance(default, dict):
            base = _copy(default)  # what the file leaves out is the default: the override merges into that
        if isinstance(base, dict):
            from omegaconf import OmegaConf

            value = _omegaconf(lambda: OmegaConf.to_container(
                OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(value)), resolve=False))
    node[last] = value


def _copy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def _strings(tree: Any, path: str = "") -> Iterator[Tuple[str, str]]:
    """(dotted key, value) of every string in a plain tree."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _strings(v, f"{path}[{i}]")
    elif isinstance(tree, str):
        yield path, tree


def needs_resolving(tree: Any) -> bool:
    """Whether a string of the tree holds an interpolation or OmegaConf's ``???`` (a value that must be given)."""
    return any("${" in v or v == "???" for _, v in _strings(tree))


def resolve(tree: dict, defaults: dict) -> dict:
    """``tree`` with its interpolations resolved against ``defaults`` overlaid by ``tree``; only ``tree``'s own keys
    are returned (a section the file wrote in part stays in part). ConfigError naming the key and, for an unset
    environment variable, the variable."""
    if not needs_resolving(tree):
        return tree
    for key, value in _strings(tree):
        if value == "???":  # (OmegaConf's merge would fill it from the defaults)
            raise ConfigError(f"{key}: ??? marks a value that must be given: set {key} in the file or as an "
                              f"override ({key}=...)")
        for name in ENV.findall(value):
            if name not in os.environ:
                raise ConfigError(f"{key}: the environment variable {name} is not set ({key}={value!r}); set it, or "
                                  f"give a default: ${{oc.env:{name},DEFAULT}}")
    from omegaconf import OmegaConf

    def work() -> Any:
        view = OmegaConf.merge(OmegaConf.create(defaults), OmegaConf.create(tree))
        return OmegaConf.to_container(view, resolve=True, throw_on_missing=True)

    return _pick(_omegaconf(work), tree)


def _pick(resolved: Any, shape: Any) -> Any:
    """The values of ``resolved`` at the keys of ``shape`` (its mappings walked, everything else taken whole)."""
    if isinstance(shape, dict) and isinstance(resolved, dict):
        return {k: _pick(resolved.get(k), v) for k, v in shape.items()}
    return resolved


def _omegaconf(work: Callable[[], Any]) -> Any:
    """``work()``, an OmegaConf error turned into a ConfigError naming the key."""
    from omegaconf.errors import GrammarParseError, InterpolationKeyError, MissingMandatoryValue, OmegaConfBaseException

    try:
        return work()
    except TypeError as exc:  # OmegaConf.merge of a list and a mapping at one key
        raise ConfigError(f"a list and a mapping at one key cannot be merged ({exc})") from None
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        first = str(getattr(exc, "msg", None) or exc).splitlines()[0]
        if isinstance(exc, MissingMandatoryValue):  # (a ${key} of a ??? value)
            raise ConfigError(f"{key}: refers to a value that must be given (???)") from None
        if isinstance(exc, InterpolationKeyError):
            found = re.search(r"Interpolation key '(.+?)' not found", first)
            name = found.group(1) if found else "?"
            raise ConfigError(f"{key}: ${{{name}}} names no config key; an environment variable is written "
                              f"${{oc.env:{name}}}") from None
        if isinstance(exc, GrammarParseError):
            raise ConfigError(f"{key}: not a valid interpolation ({first}); a literal '${{' is written '\\${{'") \
                from None
        raise ConfigError(f"{key}: {first}") from None


def is_template(name: Any) -> bool:
    return isinstance(name, str) and ("{" in name or "}" in name)


def render_name(template: str, values: dict, path_of: Callable[[str], List[str]]) -> str:
    """``template`` with each ``{key.path}`` replaced by that key's value in ``values`` (the validated config):
    numbers as Python writes them (``0.1``, ``1e-05``), booleans ``true``/``false``, lists joined by ``-``,
    characters a directory name cannot hold as ``.``. ConfigError naming the key that is not one."""
    def one(match: "re.Match[str]") -> str:
        key = match.group(1).strip()
        node: Any = values
        for part in path_of(key) if key else [""]:
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"name={template!r}: {{{key}}} is not a config key (a template names keys, "
                                  "e.g. {train.lr} or {seed})")
            node = node[part]
        if isinstance(node, dict):
            raise ConfigError(f"name={template!r}: {{{key}}} is a section; name one of its values, e.g. "
                              f"{{{key}.{next(iter(node), 'x')}}}")
        return re.sub(r"[^A-Za-z0-9_.\-]", ".", _word(node))

    name = TEMPLATE_KEY.sub(one, template)
    if "{" in name or "}" in name:
        raise ConfigError(f"name={template!r}: a brace without its pair; a template names keys as {{train.lr}}")
    return name


def _word(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, list):
        return "-".join(_word(v) for v in value)
    return str(value)


def tables(model: Any, prefix: str = "") -> Dict[str, Any]:
    """The dotted paths of a pydantic model's free-form tables (``Dict`` fields): given whole, they are replaced."""
    out: Dict[str, Any] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if getattr(ann, "__origin__", None) is dict:
            out[prefix + name] = ann
        elif isinstance(ann, type) and hasattr(ann, "model_fields"):
            out.update(tables(ann, f"{prefix}{name}."))
    return out
