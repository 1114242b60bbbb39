"""A user's own functions, named in a config as ``module:function`` (``data.dataset``, ``model.name``).

Each is imported, checked against the call communities makes, and called with only
the keywords its signature accepts, so a function that needs none of them keeps
working and a wrong signature is one error naming the function and the signature
expected (exit 2), never a traceback from deep inside the engine. Modules are
looked up on the usual import path, then in the current directory and the config
file's directory (``add_search_path``): ``my_data.py`` beside a config works with
the installed ``communities`` command as with ``python -m communities``.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Callable, Dict, List, Mapping, Sequence, Type

from ..errors import UserError

# directories appended to sys.path for user modules (after it: a user module never shadows an installed one)
SEARCHED: List[str] = []

# the calls communities makes, as the errors show them
DATASET_SIGNATURE = ("def fn(seed, root, rank, world_size) -> (x_train, y_train, x_test, y_test) | dict | "
                     "(train_set, test_set); every parameter optional, accept only those you need")
MODEL_SIGNATURE = "def fn(input_shape, n_classes) -> torch.nn.Module"


def add_search_path(*directories) -> None:
    """Let user modules be imported from these directories too (appended to ``sys.path``, in order)."""
    for d in directories:
        path = os.path.abspath(os.fspath(d))
        if path not in sys.path:
            sys.path.append(path)
        if path not in SEARCHED:
            SEARCHED.append(path)


def is_plugin(spec: str) -> bool:
    return ":" in spec


def resolve(spec: str, key: str, error: Type[UserError]) -> Callable:
    """The function ``module:function`` names; ``error(...)`` naming ``key`` when it cannot be had."""
    mod_name, _, fn_name = spec.partition(":")
    where = f"{key}={spec!r}"
    if not mod_name or not fn_name or ":" in fn_name:
        raise error(f"{where} is not of the form 'module:function' (e.g. my_data:load)")
    try:
        module = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and mod_name.startswith(exc.name):  # the module itself (or its package) is missing
            searched = ", ".join(SEARCHED) or os.getcwd()
            raise error(f"{where}: no module named {exc.name!r} (looked on the Python path and in {searched}; "
                        "put the file beside the config or in the current directory, or install it)") from None
        raise error(f"{where}: importing {mod_name!r} failed: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # a syntax error or an exception at the module's top level
        raise error(f"{where}: importing {mod_name!r} failed: {type(exc).__name__}: {exc}") from exc
    fn = getattr(module, fn_name, None)
    if fn is None:
        found = getattr(module, "__file__", None) or mod_name
        raise error(f"{where}: {found} has no {fn_name!r}") from None
    if not callable(fn):
        raise error(f"{where}: {fn_name!r} is a {type(fn).__name__}, not a function")
    return fn


def keywords(fn: Callable, offered: Mapping[str, object], spec: str, key: str, expected: str,
             *, error: Type[UserError], required: Sequence[str] = ()) -> Dict[str, object]:
    """The subset of ``offered`` that ``fn`` accepts as keywords; ``error`` if it needs anything else.

    ``required`` names keywords ``fn`` must accept. A parameter without a default that communities does
    not pass (or a positional-only one) makes the call impossible: the error names it and ``expected``.
    """
    name = spec.partition(":")[2]
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: call it with everything required
        return {k: offered[k] for k in required}
    params = sig.parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(offered)
    out, problems = {}, []
    for p in params.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in offered and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            out[p.name] = offered[p.name]
        elif p.default is p.empty:
            problems.append(f"parameter {p.name!r} is not one communities passes")
    problems += [f"it does not accept {k!r}" for k in required if k not in out]
    if problems:
        raise error(f"{key}={spec!r}: {name}{sig} cannot be called as {expected}: {'; '.join(problems)}")
    return out


def names_any(fn: Callable, names: Sequence[str]) -> bool:
    """Whether ``fn``'s signature names any of these parameters (not merely ``**kwargs``)."""
    try:
        return any(n in inspect.signature(fn).parameters for n in names)
    except (TypeError, ValueError):
        return False


def call(fn: Callable, kwargs: Dict[str, object], spec: str, key: str, error: Type[UserError]):
    """``fn(**kwargs)``; an exception in the user's code becomes one ``error`` naming the function."""
    name = spec.partition(":")[2]
    try:
        return fn(**kwargs)
    except UserError:
        raise
    except Exception as exc:  # the user's code: one line naming it on every rank, not a traceback per rank
        args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise error(f"{key}={spec!r}: {name}({args}) raised {type(exc).__name__}: {exc}") from exc
