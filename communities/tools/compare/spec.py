"""A comparison spec (``configs/compare/*.yaml``) as a typed model: what ``communities compare`` runs and
against which target. Bad input is a ``SpecError`` that names the file, the key and what is allowed, before
anything runs.

A spec's keys::

    name: digits_groups              # results/<name>/
    base: configs/quickstart.yaml    # relative to the spec's directory, the working directory or the repo
    world_size: 8
    processes: 2                     # optional: MPI processes hosting the replicas (default: one per replica)
    seeds: [0, 1, 2]                 # or a count: 3 means 0, 1, 2
    target_accuracy: 0.9             # or target_loss (nats per token) or target_bpb (bits per byte): one of the three
    overrides: [consensus.stop=false]   # for every run (optional; also a {key.path: value} mapping)
    strategies:
      - community                       # a strategy name ...
      - {name: community_hier, strategy: community, overrides: [partners.law=hierarchical]}
    launcher: "srun --mpi=pmix -n {n}"  # optional; default: mpiexec next to python, else on PATH
    timeout: 3600                       # optional, seconds per run
    description: ...                    # optional, the first paragraph of compare.md
    cases: [...]                        # optional: one spec per case (``Case``), e.g. one per dataset
"""
from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Dict, List, Optional, Sequence, Type, Union

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..jobs import ROOT

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
# the targets, one per spec: the consensus test accuracy to reach (higher is better), or a language model's
# consensus test loss in nats per token or bits per byte to get down to (lower is better)
TARGET_KEYS = ("target_accuracy", "target_loss", "target_bpb")
TARGET_UNITS = {"target_loss": "nats per token", "target_bpb": "bits per byte"}


class SpecError(ValueError):
    """A bad comparison spec: the message names the file, the key and what is allowed."""


@dataclass(frozen=True)
class Target:
    """When a run has reached its goal: the consensus test accuracy at or above ``value`` (``acc``), or its loss in
    nats per token (``loss``) or bits per byte (``bpb``) at or below it: a language model's, lower is better."""

    metric: str  # acc, loss or bpb: the consensus curve it reads (curves.run_curve)
    value: float

    NAMES: ClassVar[Dict[str, str]] = {"acc": "accuracy", "loss": "loss", "bpb": "bpb"}

    @property
    def key(self) -> str:
        """The spec's key (and compare.json's): target_accuracy, target_loss or target_bpb."""
        return f"target_{self.NAMES[self.metric]}"

    @property
    def name(self) -> str:
        return self.NAMES[self.metric]

    @property
    def lower_is_better(self) -> bool:
        return self.metric != "acc"

    def reached(self, values: np.ndarray) -> np.ndarray:
        """Which of ``values`` meet the target (NaN, a missing figure, never does)."""
        v = np.asarray(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            return np.isfinite(v) & ((v <= self.value) if self.lower_is_better else (v >= self.value))

    def text(self) -> str:
        """``0.9`` (an accuracy, as the tables always said), ``loss <= 2.5`` or ``bpb <= 3.6``."""
        return f"{self.value:g}" if self.metric == "acc" else f"{self.metric} <= {self.value:g}"

    def phrase(self) -> str:
        """The target in a sentence: what a consensus evaluation must show."""
        if self.metric == "acc":
            return f"test accuracy >= {self.value:g}"
        unit = "nats per token" if self.metric == "loss" else "bits per byte"
        return f"test loss <= {self.value:g} {unit}"


# --------------------------------------------------------------------------- the values a key may take


def _label(value: Any) -> str:
    text = str(value)
    if not _NAME.match(text):
        raise ValueError("may hold only letters, digits, '_', '.', '-'")
    return text


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("must be a positive integer")
    return value


def _overrides(value: Any) -> List[str]:
    """None, one ``key.path=value`` string, a list of them, or a ``{key.path: value}`` mapping, as a list."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        return [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in value.items()]
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise ValueError("must be a list of 'key.path=value' strings")
    return list(value)


def _seeds(value: Any) -> List[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = list(range(value))  # "seeds: 3" means 0, 1, 2
    if not isinstance(value, list) or not value or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value):
        raise ValueError("must be a non-empty list of non-negative integers (or a count)")
    if len(set(value)) != len(value):
        raise ValueError("a seed repeats")
    return value


def _launcher(value: Any) -> Union[None, str, List[str]]:
    if value is not None and not isinstance(value, (str, list)):
        raise ValueError("must be a command string or a list")
    return value


def _timeout(value: Any) -> Optional[float]:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
        raise ValueError("must be a positive number of seconds")
    return value


Label = Annotated[str, BeforeValidator(_label)]
Overrides = Annotated[List[str], BeforeValidator(_overrides)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Arm(_Strict):
    """One compared strategy (an entry of ``strategies``: a strategy name, or a mapping): a label used in run
    names (``name``, by default the strategy), the engine strategy (by default the label) and its overrides."""

    name: Label
    strategy: str
    overrides: Overrides = []

    @model_validator(mode="before")
    @classmethod
    def _from_entry(cls, entry: Any) -> Any:
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, dict):
            raise ValueError("must be a strategy name or a mapping")
        label = entry.get("name") or entry.get("strategy")
        if not label:
            raise ValueError("needs a name or a strategy")
        return {**entry, "name": label, "strategy": str(entry.get("strategy") or label)}

    @property
    def label(self) -> str:
        return self.name


class Spec(_Strict):
    """One comparison: the strategies x seeds of one base config, run in the same engine (see the module)."""

    name: Label
    base: Path
    world_size: Annotated[int, BeforeValidator(_positive_int)] = 8
    processes: Optional[Annotated[int, BeforeValidator(_positive_int)]] = None
    seeds: Annotated[List[int], BeforeValidator(_seeds)] = [0]
    target_accuracy: Optional[float] = None  # 0.9 when no target is given; None where the target is a loss
    target_loss: Optional[float] = None  # a language model's consensus test loss to reach, nats per token
    target_bpb: Optional[float] = None  # ... or bits per byte
    strategies: List[Arm]
    overrides: Overrides = []
    launcher: Annotated[Union[None, str, List[str]], BeforeValidator(_launcher)] = None
    timeout: Annotated[Optional[float], BeforeValidator(_timeout)] = None
    description: Annotated[str, BeforeValidator(lambda v: str(v or ""))] = ""

    @model_validator(mode="before")
    @classmethod
    def _one_target(cls, raw: Any) -> Any:
        given = [k for k in TARGET_KEYS if isinstance(raw, dict) and raw.get(k) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} are set together; give one target: target_accuracy (consensus "
                             "test accuracy, higher is better), or a language model's target_loss (nats per token) "
                             "or target_bpb (bits per byte), lower is better")
        return {**raw, "target_accuracy": 0.9} if isinstance(raw, dict) and not given else raw

    @field_validator("target_accuracy", "target_loss", "target_bpb", mode="before")
    @classmethod
    def _target(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        number = not isinstance(value, bool) and isinstance(value, (int, float))
        if info.field_name == "target_accuracy":
            if not number or not 0 < value <= 1:
                raise ValueError("must lie in (0, 1]")
        elif not number or not 0 < value < math.inf:
            raise ValueError(f"must be a positive number ({TARGET_UNITS[str(info.field_name)]}, lower is better)")
        return float(value)

    @field_validator("base", mode="before")
    @classmethod
    def _resolve_base(cls, value: Any, info: ValidationInfo) -> Path:
        """Relative to the spec's directory, the working directory or the repository: the first that has it."""
        p = Path(str(value))
        spec_path = (info.context or {}).get("spec_path")
        if p.is_absolute():
            return p
        for root in ([spec_path.parent] if spec_path else []) + [Path.cwd(), ROOT]:
            if (root / p).exists():
                return (root / p).resolve()
        return p

    @field_validator("strategies")
    @classmethod
    def _labels_differ(cls, arms: List[Arm]) -> List[Arm]:
        if not arms:
            raise ValueError("must be a non-empty list")
        labels = [a.label for a in arms]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"the labels {dup} repeat; give each arm its own name")
        return arms

    @model_validator(mode="after")
    def _processes_divide(self) -> "Spec":
        if self.processes is not None and self.world_size % self.processes:
            raise ValueError(f"processes: {self.processes} does not divide world_size={self.world_size}")
        return self

    @property
    def arms(self) -> List[Arm]:
        return self.strategies

    @property
    def target(self) -> Target:
        """The spec's one target."""
        if self.target_loss is not None:
            return Target("loss", self.target_loss)
        if self.target_bpb is not None:
            return Target("bpb", self.target_bpb)
        return Target("acc", 0.9 if self.target_accuracy is None else self.target_accuracy)


class Case(_Strict):
    """One entry of a spec's ``cases``: its own ``name`` (appended to the spec's), and what it replaces: ``base``,
    ``world_size``, ``processes``, ``seeds``, a target (of any kind: it replaces the spec's), ``description``;
    its ``overrides`` are added to the spec's. The strategies are the spec's. The values are checked as the
    case's whole spec (``Spec``)."""

    name: Label
    base: Any = None
    world_size: Any = None
    processes: Any = None
    seeds: Any = None
    overrides: Overrides = []
    description: Any = None
    target_accuracy: Any = None
    target_loss: Any = None
    target_bpb: Any = None


SPEC_KEYS = (*Spec.model_fields, "cases")


# --------------------------------------------------------------------------- reading


def _where(loc: Sequence[Any]) -> str:
    """``strategies[1].name`` from pydantic's ``('strategies', 1, 'name')``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(err: Any, keys: Sequence[str]) -> str:
    loc = [p for p in err["loc"] if not str(p).startswith("function-")]
    where = _where(loc)
    if err["type"] == "extra_forbidden":
        allowed = sorted(Arm.model_fields) if "strategies" in map(str, loc) else list(keys)
        near = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        return f"unknown key {where!r}{hint}; allowed: {', '.join(allowed)}"
    msg = err["msg"].removeprefix("Value error, ")
    got = "" if err["type"] == "missing" or "input" not in err or isinstance(err["input"], dict) else \
        f" (got {err['input']!r})"
    return f"{where}: {msg}{got}" if where else msg


def _validated(model: Type[BaseModel], raw: Any, where: str, keys: Sequence[str], **context: Any) -> Any:
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: the top level must be a mapping")
    try:
        return model.model_validate(raw, context=context)
    except ValidationError as exc:
        lines = dict.fromkeys(_message(e, keys) for e in exc.errors())
        raise SpecError(f"{where}: " + "; ".join(lines)) from None


def spec_from_dict(raw: Any, path: Optional[Path] = None, where: Optional[str] = None) -> Spec:
    """A ``Spec`` from a spec's data (``path``: the file it came from; ``base`` is resolved against it)."""
    return _validated(Spec, raw, where or (str(path) if path else "spec"), SPEC_KEYS, spec_path=path)


def load_spec(path: Union[str, Path]) -> Spec:
    """A one-case spec (``load_specs`` reads specs with ``cases`` too)."""
    specs = load_specs(path)
    if len(specs) != 1:
        raise SpecError(f"{path}: holds {len(specs)} cases; use load_specs")
    return specs[0]


def spec_name(path: Union[str, Path]) -> str:
    """The ``name`` a spec file gives (its cases' results are ``<name>_<case>``), read as ``load_specs`` reads it."""
    from ...config import read_yaml

    raw = read_yaml(Path(path), what="spec")
    return str(raw.get("name")) if isinstance(raw, dict) else ""


def load_specs(path: Union[str, Path]) -> List[Spec]:
    """The specs of a file: one, or one per entry of its ``cases`` (``Case``: e.g. one per dataset)."""
    from ...config import ConfigError, read_yaml

    path = Path(path)
    try:
        raw = read_yaml(path, what="spec")
    except ConfigError as exc:
        raise SpecError(str(exc)) from None
    if not isinstance(raw, dict) or "cases" not in raw:
        return [spec_from_dict(raw, path)]
    cases = raw["cases"]
    if not isinstance(cases, list) or not cases or not all(isinstance(c, dict) for c in cases):
        raise SpecError(f"{path}: cases must be a non-empty list of mappings")
    specs = []
    for k, entry in enumerate(cases):
        where = f"{path}: cases[{k}]"
        case = _validated(Case, entry, where, tuple(Case.model_fields))
        own_target = any(key in entry for key in TARGET_KEYS)  # a case's target replaces the spec's, of any kind
        merged = {key: v for key, v in raw.items() if key != "cases" and not (own_target and key in TARGET_KEYS)}
        merged.update({key: v for key, v in entry.items() if key != "overrides"})
        merged["name"] = f"{raw.get('name')}_{case.name}"
        try:
            merged["overrides"] = _overrides(raw.get("overrides")) + case.overrides
        except ValueError as exc:
            raise SpecError(f"{path}: overrides: {exc}") from None
        specs.append(spec_from_dict(merged, path, where))
    return specs
