"""``communities compare SPEC.yaml``: run strategies x seeds in the same engine and compare them.

A spec (see ``configs/compare/``) names a base config, the strategies (each with
optional overrides), the seeds, the world size, a target (an accuracy; for a
language model a loss or bits per byte, where lower is better) and an output
name. Every (strategy, seed) is its own job, launched one after another::

    mpiexec -n N python -m communities run BASE [spec overrides] [strategy overrides] \\
        strategy=S seed=K name=<spec>_<label>_s<K> output.root=results/<spec>/runs world_size=N

and the comparison is written to ``results/<spec>/compare.md``, ``compare.json``
and two plots (consensus accuracy against bytes sent and against wall time).
Completed runs (``summary.json`` present, ``meta.json`` status complete) are
skipped unless ``--overwrite``, so an interrupted comparison resumes where it
stopped. ``--dry-run`` prints the commands.

Spec keys::

    name: digits_groups              # results/<name>/
    base: configs/quickstart.yaml    # relative to the spec's directory, the working directory or the repo
    world_size: 8
    processes: 2                     # optional: MPI processes hosting the replicas (default: one per replica)
    seeds: [0, 1, 2]
    target_accuracy: 0.9             # or target_loss (nats per token) or target_bpb (bits per byte): one of the three
    overrides: [consensus.stop=false]   # for every run (optional)
    strategies:
      - community                       # a strategy name ...
      - {name: community_hier, strategy: community, overrides: [partners.law=hierarchical]}
    launcher: "srun --mpi=pmix -n {n}"  # optional; default: mpiexec next to python, else on PATH
    timeout: 3600                       # optional, seconds per run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Dict, List, Optional, Sequence, Union

import numpy as np

from ..errors import EXIT_USER

ROOT = Path(__file__).resolve().parents[2]  # the source checkout (tools/ -> communities/ -> root)
# the targets, one per spec: the consensus test accuracy to reach (higher is better), or a language model's
# consensus test loss in nats per token or bits per byte to get down to (lower is better)
TARGET_KEYS = ("target_accuracy", "target_loss", "target_bpb")
SPEC_KEYS = {"name", "base", "world_size", "processes", "seeds", "overrides", "strategies", "launcher", "timeout",
             "description", "cases", *TARGET_KEYS}
# what a case of a multi-case spec may set (its own base config, world size, target, extra overrides)
CASE_KEYS = {"name", "base", "world_size", "processes", "seeds", "overrides", "description", *TARGET_KEYS}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


class SpecError(ValueError):
    """A bad comparison spec: the message names the key and what is allowed."""


@dataclass
class Arm:
    """One compared strategy: a label (used in run names), the engine strategy and its overrides."""

    label: str
    strategy: str
    overrides: List[str] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    """When a run has reached its goal: the consensus test accuracy at or above ``value`` (``acc``), or its loss in
    nats per token (``loss``) or bits per byte (``bpb``) at or below it: a language model's, lower is better."""

    metric: str  # acc, loss or bpb: the consensus curve it reads (run_curve)
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


@dataclass
class Spec:
    name: str
    base: Path
    world_size: int
    seeds: List[int]
    target_accuracy: Optional[float]  # None where the target is a loss (target_loss, target_bpb)
    arms: List[Arm]
    overrides: List[str] = field(default_factory=list)
    launcher: Optional[Union[str, List[str]]] = None
    timeout: Optional[float] = None
    path: Optional[Path] = None
    description: str = ""
    processes: Optional[int] = None  # MPI processes hosting the world_size replicas (None: one per replica)
    target_loss: Optional[float] = None  # a language model's consensus test loss to reach, nats per token
    target_bpb: Optional[float] = None  # ... or bits per byte

    @property
    def target(self) -> Target:
        """The spec's one target."""
        if self.target_loss is not None:
            return Target("loss", self.target_loss)
        if self.target_bpb is not None:
            return Target("bpb", self.target_bpb)
        return Target("acc", 0.9 if self.target_accuracy is None else self.target_accuracy)


@dataclass
class RunPlan:
    arm: Arm
    seed: int
    name: str
    path: Path
    cmd: List[str]
    overrides: List[str]
    status: str = "pending"  # pending | skipped | done | failed
    seconds: Optional[float] = None
    error: str = ""


# --------------------------------------------------------------------------- spec


def _overrides(value, where: str) -> List[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):  # {key.path: value} form
        return [f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in value.items()]
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise SpecError(f"{where}: overrides must be a list of 'key.path=value' strings, got {value!r}")
    return list(value)


def _resolve_base(base: str, spec_path: Optional[Path]) -> Path:
    p = Path(base)
    if p.is_absolute():
        return p
    for root in ([spec_path.parent] if spec_path else []) + [Path.cwd(), ROOT]:
        if (root / p).exists():
            return (root / p).resolve()
    return p


def load_spec(path: Union[str, Path]) -> Spec:
    """A one-case spec (``load_specs`` reads specs with ``cases`` too)."""
    specs = load_specs(path)
    if len(specs) != 1:
        raise SpecError(f"{path}: holds {len(specs)} cases; use load_specs")
    return specs[0]


def load_specs(path: Union[str, Path]) -> List[Spec]:
    """The specs of a file: one, or one per entry of its ``cases`` (e.g. one per dataset).

    A case sets its own ``name`` (appended to the spec's), and may set ``base``,
    ``world_size``, ``seeds``, a target (``target_accuracy``, ``target_loss`` or
    ``target_bpb``: it replaces the spec's), ``description``, and ``overrides``
    (added to the spec's); the strategies are the spec's.
    """
    from ..config import ConfigError, read_yaml

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
    for k, case in enumerate(cases):
        extra = sorted(set(case) - CASE_KEYS)
        if extra or "name" not in case:
            raise SpecError(f"{path}: cases[{k}]: " + (f"unknown key(s) {extra}; allowed: {sorted(CASE_KEYS)}"
                                                       if extra else "needs a name"))
        own_target = any(key in case for key in TARGET_KEYS)  # a case's target replaces the spec's, of any kind
        merged = {key: v for key, v in raw.items() if key != "cases" and not (own_target and key in TARGET_KEYS)}
        merged.update({key: v for key, v in case.items() if key != "overrides"})
        merged["name"] = f"{raw.get('name')}_{case['name']}"
        merged["overrides"] = _overrides(raw.get("overrides"), str(path)) + \
            _overrides(case.get("overrides"), f"{path}: cases[{k}]")
        specs.append(spec_from_dict(merged, path))
    return specs


def spec_from_dict(raw, path: Optional[Path] = None) -> Spec:
    where = str(path) if path else "spec"
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: the top level must be a mapping")
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        import difflib

        hints = [f"{k!r}" + (f" (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, SPEC_KEYS, 1)) else "")
                 for k in unknown]
        raise SpecError(f"{where}: unknown key(s) {', '.join(hints)}; allowed: {', '.join(sorted(SPEC_KEYS))}")
    for key in ("name", "base", "strategies"):
        if key not in raw:
            raise SpecError(f"{where}: missing key {key!r}")
    name = str(raw["name"])
    if not _NAME.match(name):
        raise SpecError(f"{where}: name={name!r} may hold only letters, digits, '_', '.', '-'")
    ws = raw.get("world_size", 8)
    if not isinstance(ws, int) or ws < 1:
        raise SpecError(f"{where}: world_size must be a positive integer, got {ws!r}")
    procs = raw.get("processes")
    if procs is not None and (not isinstance(procs, int) or procs < 1 or ws % procs):
        raise SpecError(f"{where}: processes must be a positive integer that divides world_size={ws}, got {procs!r}")
    seeds = raw.get("seeds", [0])
    if isinstance(seeds, int):
        seeds = list(range(seeds))  # "seeds: 3" means 0, 1, 2
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise SpecError(f"{where}: seeds must be a non-empty list of non-negative integers (or a count), got "
                        f"{raw.get('seeds')!r}")
    if len(set(seeds)) != len(seeds):
        raise SpecError(f"{where}: seeds {seeds} repeat a seed")
    targets = parse_target(raw, where)
    arms = []
    strategies = raw["strategies"]
    if not isinstance(strategies, list) or not strategies:
        raise SpecError(f"{where}: strategies must be a non-empty list")
    for k, entry in enumerate(strategies):
        if isinstance(entry, str):
            arm = Arm(entry, entry)
        elif isinstance(entry, dict):
            extra = sorted(set(entry) - {"name", "strategy", "overrides"})
            if extra:
                raise SpecError(f"{where}: strategies[{k}]: unknown key(s) {extra}; allowed: name, strategy, overrides")
            label = entry.get("name") or entry.get("strategy")
            if not label:
                raise SpecError(f"{where}: strategies[{k}] needs a name or a strategy")
            arm = Arm(str(label), str(entry.get("strategy") or label),
                      _overrides(entry.get("overrides"), f"{where}: strategies[{k}]"))
        else:
            raise SpecError(f"{where}: strategies[{k}] must be a strategy name or a mapping, got {entry!r}")
        if not _NAME.match(arm.label):
            raise SpecError(f"{where}: strategy label {arm.label!r} may hold only letters, digits, '_', '.', '-'")
        arms.append(arm)
    labels = [a.label for a in arms]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise SpecError(f"{where}: strategy labels {dup} repeat; give each arm its own name")
    launcher = raw.get("launcher")
    if launcher is not None and not isinstance(launcher, (str, list)):
        raise SpecError(f"{where}: launcher must be a command string or a list, got {launcher!r}")
    timeout = raw.get("timeout")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise SpecError(f"{where}: timeout must be a positive number of seconds, got {timeout!r}")
    return Spec(name=name, base=_resolve_base(str(raw["base"]), path), world_size=ws, seeds=list(seeds),
                target_accuracy=targets.get("target_accuracy"), target_loss=targets.get("target_loss"),
                target_bpb=targets.get("target_bpb"), arms=arms, overrides=_overrides(raw.get("overrides"), where),
                launcher=launcher, timeout=timeout, path=path, description=str(raw.get("description") or ""),
                processes=procs)


def parse_target(raw: dict, where: str = "spec") -> Dict[str, float]:
    """The spec's one target as ``{key: value}``: ``target_accuracy`` in (0, 1] (0.9 when none is given), or a
    language model's ``target_loss`` (nats per token) or ``target_bpb`` (bits per byte), positive numbers where
    lower is better."""
    given = [k for k in TARGET_KEYS if raw.get(k) is not None]
    if len(given) > 1:
        raise SpecError(f"{where}: {' and '.join(given)} are set together; give one target: target_accuracy "
                        "(consensus test accuracy, higher is better), or a language model's target_loss (nats per "
                        "token) or target_bpb (bits per byte), lower is better")
    key = given[0] if given else "target_accuracy"
    value = raw.get(key, 0.9)
    if key == "target_accuracy":
        if not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise SpecError(f"{where}: target_accuracy must lie in (0, 1], got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        unit = "nats per token" if key == "target_loss" else "bits per byte"
        raise SpecError(f"{where}: {key} must be a positive number ({unit}, lower is better), got {value!r}")
    return {key: float(value)}


# --------------------------------------------------------------------------- launching


def default_mpiexec() -> Optional[str]:
    """The mpiexec next to this interpreter (the mpich wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def launcher_argv(n: int, launcher: Optional[Union[str, List[str]]] = None, mpiexec: Optional[str] = None) -> List[str]:
    """The launch prefix for n ranks. ``{n}`` in a launcher is replaced; without it, ``-n N`` is appended."""
    if launcher:
        parts = shlex.split(launcher) if isinstance(launcher, str) else [str(p) for p in launcher]
        if any("{n}" in p for p in parts):
            return [p.replace("{n}", str(n)) for p in parts]
        return parts + ["-n", str(n)]
    exe = mpiexec or default_mpiexec()
    if not exe:
        raise SpecError("no mpiexec next to the interpreter or on PATH: pass --mpiexec PATH or set launcher: in the "
                        "spec (e.g. 'srun --mpi=pmix -n {n}')")
    argv = [exe, "-n", str(n)]
    if _is_open_mpi(exe):
        argv += ["--oversubscribe"]
    return argv


def _is_open_mpi(exe: str) -> bool:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except Exception:
        return False
    return "Open MPI" in out or "OpenRTE" in out


def plan_runs(spec: Spec, results_root: Path, launch: List[str], only: Optional[Sequence[str]] = None,
              seeds: Optional[Sequence[int]] = None) -> List[RunPlan]:
    runs_dir = results_root / spec.name / "runs"
    plans = []
    for arm in spec.arms:
        if only and arm.label not in only:
            continue
        for seed in (seeds if seeds is not None else spec.seeds):
            name = f"{spec.name}_{arm.label}_s{seed}"
            overrides = [*spec.overrides, *arm.overrides, f"strategy={arm.strategy}", f"seed={seed}",
                         f"name={name}", f"output.root={runs_dir}", f"world_size={spec.world_size}"]
            cmd = launch + [sys.executable, "-m", "communities", "run", str(spec.base), *overrides,
                            "--no-progress", "--overwrite"]
            plans.append(RunPlan(arm=arm, seed=seed, name=name, path=runs_dir / name, cmd=cmd, overrides=overrides))
    return plans


def run_complete(path: Path) -> bool:
    try:
        meta = json.loads((path / "meta.json").read_text())
        return meta.get("status") == "complete" and (path / "summary.json").exists()
    except (OSError, ValueError):
        return False


def validate(spec: Spec, plans: Sequence[RunPlan]) -> List[str]:
    """Config problems of each planned run (as ``communities validate`` would report them), and a target_bpb that
    its runs cannot report."""
    from ..config import ConfigError, load

    problems = []
    seen = set()
    for p in plans:
        msg = ""
        try:
            cfg = load(spec.base, p.overrides)
            cfg.check_world(spec.world_size)
            if spec.target.metric == "bpb" and corpus_bytes_per_token(cfg.data) is None:
                msg = (f"{p.arm.label}: target_bpb needs a language model's corpus whose bytes per token are known "
                       f"(data.dataset pystdlib or text, or tokens with data.lm.bytes_per_token), not "
                       f"data.dataset={cfg.data.dataset!r}"
                       + (" without data.lm.bytes_per_token" if cfg.data.dataset == "tokens" else "")
                       + "; give target_loss (nats per token) instead")
        except ConfigError as exc:
            msg = f"{p.arm.label}: {exc}"
        if msg:
            if msg not in seen:
                seen.add(msg)
                problems.append(msg)
    return problems


def corpus_bytes_per_token(data) -> Optional[float]:
    """The bytes per token of a DataConfig's corpus as its runs will record them (workload/text.py): 1 for the
    byte corpora, data.lm.bytes_per_token for a token corpus, None otherwise (a classifier's data)."""
    if data.dataset in ("pystdlib", "text"):
        return 1.0
    return data.lm.bytes_per_token if data.dataset == "tokens" else None


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MPLBACKEND", "Agg")
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + pp if pp else "")
    return env


def execute(plan: RunPlan, log_path: Path, timeout: Optional[float]) -> None:
    """Run one job to completion, its output to ``log_path``; kill its process group on timeout."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in plan.cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(plan.cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(),
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc, signal.SIGKILL)
            rc = None
        except BaseException:  # Ctrl-C, SIGTERM (see main_compare): the job is in its own session, end it too
            _kill_group(proc, signal.SIGTERM)
            raise
    plan.seconds = time.perf_counter() - t0
    if rc == 0 and run_complete(plan.path):
        plan.status = "done"
    else:
        plan.status = "failed"
        plan.error = (f"timed out after {timeout:g}s" if rc is None else f"exit {rc}") + f"; log: {log_path}"


def _kill_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


# --------------------------------------------------------------------------- reading runs


def _read_jsonl(path: Path) -> List[dict]:
    from ..results import read_jsonl

    return read_jsonl(path)


def run_curve(path: Path) -> dict:
    """One complete run's figures and its consensus curve: t, accuracy, loss (nats per token), bits per byte (NaN
    where unknown), bytes per rank, wall seconds; and a language model's training tokens per second per rank.

    ``wall`` is measured (the slowest rank's metrics.jsonl ``wall`` at that unit)
    when the run's rows carry the field, and ``wall_measured`` says so; a run
    written before the field existed gets the estimate ``wall_time * t / units``.
    """
    from ..results import Summary

    summary = Summary.read(path)
    units = int(summary.units)
    wall = float(summary.wall_time)
    lm = summary.language_model
    evals = sorted(_read_jsonl(path / "consensus.jsonl"), key=lambda r: r["t"])
    points = [(int(r["t"]), float(r["test_acc"]), *_losses(r.get("test_loss"), r.get("test_bpb"), lm))
              for r in evals if r.get("test_acc") is not None]
    if not points or points[-1][0] < units:
        points.append((units, float(summary.consensus_test_acc),
                       *_losses(summary.consensus_test_loss, summary.consensus_test_bpb, lm)))
    metrics = _read_jsonl(path / "metrics.jsonl")
    bytes_by_t = _bytes_after_unit(metrics, units, float(summary.bytes_sent_mean),
                                   trains_with_traffic=_sync_gradients(summary.strategy))
    wall_by_t = _wall_at_unit(metrics)
    ts = np.array([p[0] for p in points], dtype=np.float64)
    if evals and all("wall" in r for r in evals):  # protocol async: the consensus of wall-clock snapshots
        walls = np.array([float(r["wall"]) for r in evals if r.get("test_acc") is not None] + [wall])[: ts.size]
        measured = True
    elif wall_by_t is not None:
        walls, measured = np.array([wall_by_t(t) for t in ts]), True
    else:
        walls, measured = wall * ts / max(units, 1), False
    return {
        "summary": summary, "units": units, "wall_time": wall,
        "t": ts, "acc": np.array([p[1] for p in points]),
        "loss": np.array([p[2] for p in points]), "bpb": np.array([p[3] for p in points]),
        "bytes": np.array([bytes_by_t(t) for t in ts]),
        "wall": walls, "wall_measured": measured,
        "tokens_per_s": tokens_per_second(metrics, summary) if lm is not None else None,
    }


def _losses(loss, bpb, lm) -> tuple:
    """(loss, bits per byte) of a consensus evaluation as floats, NaN where unknown (bits per byte from the loss
    where the run's bytes per token are known and the row predates its ``test_bpb``)."""
    nats = float("nan") if loss is None else float(loss)
    if bpb is None and lm is not None:
        bpb = lm.bpb(nats)
    return nats, float("nan") if bpb is None else float(bpb)


def tokens_per_second(metrics: List[dict], summary) -> Optional[float]:
    """A language model's training tokens per second per rank: each rank's windows trained (its last metrics.jsonl
    ``samples``) x the context (summary ``context``), over its loop's wall time (summary ``time_split_per_rank``,
    else the slowest rank's ``wall_time``: evaluations, exchanges and waits included), averaged over the ranks.
    None without a context or a wall time."""
    context = summary.context
    if not context:
        return None
    samples: Dict[int, float] = {}
    for m in metrics:
        rank = int(m.get("rank", -1))
        if rank >= 0 and m.get("samples") is not None:
            samples[rank] = max(samples.get(rank, 0.0), float(m["samples"]))
    walls = (summary.time_split_per_rank or {}).get("wall") or []
    rates = []
    for rank, n in samples.items():
        wall = walls[rank] if rank < len(walls) else summary.wall_time
        if wall and wall > 0:
            rates.append(n * context / wall)
    return float(np.mean(rates)) if rates else None


def _sync_gradients(strategy: Optional[str]) -> bool:
    """Whether the engine strategy communicates inside a unit's training (allreduce: a gradient Allreduce per step)."""
    from ..config import SYNCS_GRADIENTS

    return strategy in SYNCS_GRADIENTS


def _per_unit(metrics: List[dict], key: str) -> Dict[int, List[float]]:
    out: Dict[int, List[float]] = {}
    for m in metrics:
        if m.get(key) is not None and m.get("rank", 0) >= 0:
            out.setdefault(int(m["t"]), []).append(float(m[key]))
    return out


def _bytes_after_unit(metrics: List[dict], units: int, final_mean: float, trains_with_traffic: bool = False):
    """bytes_per_rank(t): mean over ranks of the bytes sent up to and including unit t.

    ``Orchestrator._train`` appends a rank's metrics row for unit t right after
    training unit t, before that unit's exchanges, global average and signature
    round. So row t holds everything sent in units < t plus what unit t's
    training itself sent. For every strategy but ``allreduce`` training sends
    nothing, and the bytes by the end of unit t are row t+1. ``allreduce``
    (``trains_with_traffic``) sends its gradient Allreduces inside training, the
    same bytes c every unit (a fixed number of steps of one buffer); row t+1
    holds unit t+1's, so the end of unit t is row t+1 - c, with c the smallest
    increase between consecutive rows (a unit without a signature round). The
    end of the last unit is summary.json's final mean; between recorded units
    the figure is interpolated linearly.
    """
    per_t = {t: float(np.mean(v)) for t, v in _per_unit(metrics, "bytes_sent").items()}
    xs = sorted(per_t)
    c = 0.0
    if trains_with_traffic:
        steps = [per_t[b] - per_t[a] for a, b in zip(xs, xs[1:]) if b == a + 1]
        c = max(0.0, min(steps)) if steps else (per_t[xs[0]] / xs[0] if xs and xs[0] >= 1 else 0.0)
    ends = [(t - 1, per_t[t] - c) for t in xs if t >= 1]  # row t+1, less unit t+1's own training -> end of unit t
    ends.append((units, final_mean))
    ends = sorted(dict(ends).items())
    ex = np.array([e[0] for e in ends], dtype=np.float64)
    ey = np.array([e[1] for e in ends], dtype=np.float64)

    def at(t: float) -> float:
        return float(np.interp(t, ex, ey))

    return at


def _wall_at_unit(metrics: List[dict]):
    """wall(t): the largest metrics.jsonl ``wall`` over the ranks at unit t, or None when no row has the field.

    ``wall`` is a rank's seconds since its run started, taken when it appends
    the row (right after training unit t); the slowest rank's is when the
    whole world had trained unit t. Units without rows are interpolated, from
    0 s at t = 0.
    """
    per_t = _per_unit(metrics, "wall")
    if not per_t:
        return None
    known = {0: 0.0, **{t: max(v) for t, v in per_t.items()}}
    ex = np.array(sorted(known), dtype=np.float64)
    ey = np.array([known[int(t)] for t in ex], dtype=np.float64)

    def at(t: float) -> float:
        return float(np.interp(t, ex, ey))

    return at


def idle_share(path: Path, summary) -> Optional[float]:
    """The mean idle share of wall time over the ranks that were not slowed down on purpose (faults.speed); in a
    population, over the processes none of whose replicas was (the process's idle time: ``placement``)."""
    per = summary.time_split_per_rank
    if not per or "idle" not in per:
        return None
    try:
        import yaml

        slowed = set((yaml.safe_load((path / "config.yaml").read_text()) or {}).get("faults", {}).get("speed") or {})
    except (OSError, ValueError):
        slowed = set()
    place = getattr(summary, "placement", None)
    if place and place.get("idle_share_per_process"):  # a population: a slowed replica slows its whole process
        shares, block = place["idle_share_per_process"], int(place["replicas_per_process"])
        procs = [p for p in range(len(shares)) if not {r // block for r in slowed} & {p}] or list(range(len(shares)))
        return float(np.mean([shares[p] for p in procs]))
    ranks = [r for r in range(len(per["wall"])) if r not in slowed] or list(range(len(per["wall"])))
    return float(np.mean([per["idle"][r] / per["wall"][r] for r in ranks if per["wall"][r] > 0]))


def time_to_target(curve: dict, target: Union[float, Target]) -> Optional[dict]:
    """The first consensus evaluation that meets ``target`` (a float: an accuracy, at or above it; a loss or bits
    per byte: at or below it): its t, the bytes by then, the wall seconds by then, and its figure."""
    if not isinstance(target, Target):
        target = Target("acc", float(target))
    values = curve.get(target.metric)
    if values is None:
        return None
    hit = np.flatnonzero(target.reached(values))
    if hit.size == 0:
        return None
    k = int(hit[0])
    return {"t": float(curve["t"][k]), "bytes": float(curve["bytes"][k]), "wall": float(curve["wall"][k]),
            "wall_measured": bool(curve.get("wall_measured", False)), target.metric: float(values[k])}


def finite(x) -> Optional[float]:
    """A figure for JSON: None where missing or not finite."""
    return None if x is None or not math.isfinite(float(x)) else float(x)


def _stats(values: Sequence[Optional[float]]) -> dict:
    """mean and the sample standard deviation over seeds (ddof=1; null for a single seed)."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "std": None, "n": 0, "values": []}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else None, "n": int(v.size),
            "values": v.tolist()}


def delivered(summary) -> str:
    """What a run hands each rank: ``consensus``, ``communities (C)``, ``ifca (k)``, ``finetuned`` or ``own``."""
    local = summary.local_test or {}
    kind = local.get("delivered")
    models = (summary.community_models or {}).get("models")
    if kind is None:
        kind = "communities" if (summary.consensus_mode or {}).get("decision") == "communities" else (
            "own" if summary.strategy == "isolated" else "consensus")
    if kind in ("communities", "ifca") and models is not None:
        used = sum(1 for m in models if m["members"])
        return f"{kind} ({used})"
    return kind


def aggregate(spec: Spec, plans: Sequence[RunPlan]) -> dict:
    """compare.json: each run's figures and each strategy's over its seeds (a language model's runs add their
    losses, bits per byte and tokens per second; ``_``-keys stay out of the file)."""
    target = spec.target
    arms = {}
    runs = []
    curves: Dict[str, List[dict]] = {}
    for p in plans:
        absent = "incomplete" if (p.path / "meta.json").exists() else "missing"
        entry = {"strategy": p.arm.label, "engine_strategy": p.arm.strategy, "seed": p.seed, "name": p.name,
                 "path": str(p.path), "status": p.status if p.status != "pending" else absent}
        if p.error:
            entry["error"] = p.error
        if run_complete(p.path):
            c = run_curve(p.path)
            s = c["summary"]
            tt = time_to_target(c, target)
            entry.update(status="complete" if p.status == "pending" else p.status,
                         consensus_test_acc=s.consensus_test_acc, best_rank_acc=s.best_rank_acc,
                         bytes_sent_mean=s.bytes_sent_mean, wall_time=s.wall_time, units=s.units,
                         merges=s.merges, target=tt, data_bytes_mean=s.data_bytes_mean,
                         monitoring_bytes_mean=s.monitoring_bytes_mean, idle_share=idle_share(p.path, s),
                         retired_fraction=(s.examples or {}).get("retired_fraction"),
                         first_round_ari=s.first_round_ari, local_test_acc=(s.local_test or {}).get("mean_acc"),
                         delivered=delivered(s), epsilon=(s.privacy or {}).get("epsilon_max"))
            if s.task is not None:  # a language model's: lower is better
                entry.update(task=s.task, consensus_test_loss=finite(s.consensus_test_loss),
                             consensus_test_bpb=s.consensus_test_bpb, tokens_per_s_per_rank=c["tokens_per_s"])
            curves.setdefault(p.arm.label, []).append({"seed": p.seed, **c})
        runs.append(entry)
    language_models = any("task" in r for r in runs)
    for arm in spec.arms:
        mine = [r for r in runs if r["strategy"] == arm.label and "consensus_test_acc" in r]
        planned = [r for r in runs if r["strategy"] == arm.label]
        if not planned:
            continue
        hits = [r["target"] for r in mine if r["target"] is not None]
        lm = {}
        if language_models:  # the losses in both units, the training speed
            lm = {key: _stats([r.get(key) for r in mine])
                  for key in ("consensus_test_loss", "consensus_test_bpb", "tokens_per_s_per_rank")}
        target_stats = {target.name: target.value, **({"lower_is_better": True} if target.lower_is_better else {})}
        arms[arm.label] = {
            "strategy": arm.strategy, "overrides": arm.overrides, "runs": len(mine), "planned": len(planned),
            "seeds": [r["seed"] for r in mine],
            "consensus_test_acc": _stats([r["consensus_test_acc"] for r in mine]),
            "best_rank_acc": _stats([r["best_rank_acc"] for r in mine]),
            "bytes_sent_per_rank": _stats([r["bytes_sent_mean"] for r in mine]),
            "wall_time": _stats([r["wall_time"] for r in mine]),
            "idle_share": _stats([r["idle_share"] for r in mine if r["idle_share"] is not None]),
            "data_bytes_per_rank": _stats([r["data_bytes_mean"] for r in mine]),
            "retired_fraction": _stats([r["retired_fraction"] for r in mine if r["retired_fraction"] is not None]),
            "local_test_acc": _stats([r["local_test_acc"] for r in mine if r["local_test_acc"] is not None]),
            "first_round_ari": _stats([r["first_round_ari"] for r in mine if r["first_round_ari"] is not None]),
            "delivered": sorted({r["delivered"] for r in mine}),
            "epsilon": _stats([r["epsilon"] for r in mine if r.get("epsilon") is not None]),
            **lm,
            "target": {**target_stats, "reached": len(hits), "of": len(mine),
                       "t": _stats([h["t"] for h in hits]), "bytes": _stats([h["bytes"] for h in hits]),
                       "wall": _stats([h["wall"] for h in hits]),
                       "wall_measured": sum(1 for h in hits if h["wall_measured"])},
        }
    return {"name": spec.name, "base": str(spec.base), "world_size": spec.world_size, "seeds": spec.seeds,
            target.key: target.value, "overrides": spec.overrides, "strategies": arms, "runs": runs,
            "_curves": curves, "_target": target}


# --------------------------------------------------------------------------- writing


# what the plots draw against bytes and wall time: a classifier's accuracy, a language model's loss (or bits per
# byte when that is its target)
CURVE_TITLES = {"acc": "accuracy", "loss": "loss", "bpb": "bits per byte"}
CURVE_LABELS = {"acc": "consensus test accuracy", "loss": "consensus test loss (nats/token)",
                "bpb": "consensus test loss (bits/byte)"}


def target_of(agg: dict) -> Target:
    """An aggregate's target (``aggregate``'s, or compare.json's ``target_accuracy``/``_loss``/``_bpb``)."""
    if isinstance(agg.get("_target"), Target):
        return agg["_target"]
    for metric, name in Target.NAMES.items():
        if agg.get(f"target_{name}") is not None:
            return Target(metric, float(agg[f"target_{name}"]))
    raise KeyError("the aggregate names no target (target_accuracy, target_loss or target_bpb)")


def plotted_metric(target: Target, lm: bool) -> str:
    """The curve the plots draw: the target's, except a language model's accuracy target draws its loss."""
    return ("bpb" if target.metric == "bpb" else "loss") if lm else "acc"


def _fmt(x: Optional[float], fmt: str = "{:.4f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pm(st: dict, fmt: str = "{:.4f}", scale: float = 1.0) -> str:
    if st["mean"] is None:
        return "-"
    out = fmt.format(st["mean"] * scale)
    if st["std"] is not None:
        out += " ± " + fmt.format(st["std"] * scale)
    return out


def write_markdown(agg: dict, path: Path, spec: Spec) -> None:
    target = target_of(agg)
    lm = any("task" in r for r in agg["runs"])  # language models: losses (lower is better) instead of accuracies
    plotted = plotted_metric(target, lm)
    moving = any(r.get("data_bytes_mean") or r.get("retired_fraction") is not None for r in agg["runs"])
    personal = any(r.get("local_test_acc") is not None for r in agg["runs"])
    private = any(r.get("epsilon") is not None for r in agg["runs"])
    lines = [f"# Comparison `{agg['name']}`", ""]
    if spec.description:
        lines += [spec.description.strip(), ""]
    lines += [
        f"Base config `{agg['base']}`, {agg['world_size']} ranks, seeds {agg['seeds']}"
        + (f", common overrides `{' '.join(agg['overrides'])}`" if agg["overrides"] else "") + ".",
        "",
    ]
    if personal:
        lines += [
            "| strategy | runs | delivered | mean local-test acc | consensus test acc | first-round ARI "
            "| MB sent / rank | wall s |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for label, a in agg["strategies"].items():
            lines.append(
                f"| {label} | {a['runs']}/{a['planned']} | {', '.join(a['delivered']) or '-'} "
                f"| {_pm(a['local_test_acc'])} | {_pm(a['consensus_test_acc'])} "
                f"| {_pm(a['first_round_ari'], '{:.3f}')} "
                f"| {_pm(a['bytes_sent_per_rank'], '{:.2f}', 1e-6)} | {_pm(a['wall_time'], '{:.1f}')} |")
        lines += [
            "",
            "- *delivered*: the model each rank ends with (summary `local_test.delivered`): the `consensus` (mean of "
            "every rank), its frozen community's model (`communities (C)`: C communities, consensus.mode), its IFCA "
            "pick (`ifca (k)`: k shared models that some rank picked), the consensus fine-tuned on its shard "
            "(`finetuned`), or its `own` model (isolated ranks).",
            "- *mean local-test acc*: that model's accuracy on each rank's local test data (held out of its own "
            "shard, `data.local_test_fraction`, its own group's distribution), averaged over the ranks "
            "(summary `local_test.mean_acc`).",
            "- *consensus test acc*: the mean of every rank's weights on the shared test split (pooled over the "
            "groups under a `data.shift`).",
            "- *first-round ARI*: the first signature round's communities against the planted groups.",
            "",
        ]
    quality = ("consensus test loss (nats/token) | bits/byte | next-token acc" if lm else
               "consensus test acc | best-rank acc")
    lines += [
        f"| strategy | runs | {quality} | MB sent / rank | wall s | idle % |{' tokens/s / rank |' if lm else ''}"
        f" reached {target.text()} | t to target (units) | MB to target | wall s to target |"
        + (" data MB / rank | retired % |" if moving else "") + (" epsilon |" if private else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if lm else "") + ("---|---|" if moving else "")
        + ("---|" if private else ""),
    ]
    for label, a in agg["strategies"].items():
        tg = a["target"]
        figures = (f"{_pm(a['consensus_test_loss'], '{:.3f}')} | {_pm(a['consensus_test_bpb'], '{:.3f}')} "
                   f"| {_pm(a['consensus_test_acc'])}" if lm else
                   f"{_pm(a['consensus_test_acc'])} | {_pm(a['best_rank_acc'])}")
        lines.append(
            f"| {label} | {a['runs']}/{a['planned']} | {figures} "
            f"| {_pm(a['bytes_sent_per_rank'], '{:.2f}', 1e-6)} | {_pm(a['wall_time'], '{:.1f}')} "
            f"| {_pm(a['idle_share'], '{:.0f}', 100)} |"
            + (f" {_pm(a['tokens_per_s_per_rank'], '{:.0f}')} |" if lm else "")
            + f" {tg['reached']}/{tg['of']} | {_pm(tg['t'], '{:.0f}')} "
            f"| {_pm(tg['bytes'], '{:.2f}', 1e-6)} "
            f"| {_pm(tg['wall'], '{:.1f}')}{'' if tg['wall_measured'] == tg['reached'] else ' (est.)'} |"
            + (f" {_pm(a['data_bytes_per_rank'], '{:.3f}', 1e-6)} | {_pm(a['retired_fraction'], '{:.1f}', 100)} |"
               if moving else "")
            + (f" {_pm(a['epsilon'], '{:.2f}') if a['epsilon']['mean'] is not None else 'inf'} |" if private else ""))
    lines += [
        "",
        "Figures are mean ± sample standard deviation (ddof=1) over the seeds that completed; one seed shows no ±.",
        "",
    ]
    lines += [
        "- *consensus test loss*: the final Allreduce-mean model's mean cross-entropy per token on the shared "
        "held-out windows, in nats (summary `consensus_test_loss`); *bits/byte*: the same over ln 2 and the "
        "corpus's bytes per token (summary `consensus_test_bpb`; 1 byte per token for a byte corpus); "
        "*next-token acc*: its share of next tokens predicted right.",
        "- *tokens/s / rank*: the tokens a rank trained on (metrics.jsonl `samples`, windows, x summary `context`) "
        "over its loop's wall time (summary `time_split_per_rank`), averaged over the ranks.",
    ] if lm else [
        "- *consensus test acc*: the final Allreduce-mean model on the shared test split (summary.json).",
        "- *best-rank acc*: the best single rank's own model at the end.",
    ]
    lines += [
        "- *MB sent / rank*: bytes sent per rank over the run (mean over ranks; 1 MB = 10^6 bytes) as the engine "
        "counts them: exchanges and their metadata, signature allgathers, Allreduces (as ring traffic). The "
        "Allreduces that only evaluate the consensus model (summary `monitoring_bytes_mean`) and passed training "
        "examples (*data MB / rank*, summary `data_bytes_mean`) are counted apart.",
        "- *epsilon*: with `privacy.enabled`, the worst replica's epsilon at the end (summary `privacy`, at "
        "`privacy.delta`); `inf`: trained without privacy.",
        "- *retired %*: share of the training examples retired at the end (summary `examples`), where tracked.",
        "- *wall s*: the slowest rank's training loop (summary.json `wall_time`), without process start-up.",
        "- *idle %*: the share of its wall time a rank spent waiting for others (summary `time_split_per_rank`: "
        "waits in exchanges, gathers and Allreduces), averaged over the ranks not slowed on purpose "
        "(`faults.speed`).",
        f"- *to target*: the first consensus evaluation (consensus.jsonl, every `output.consensus_every` or "
        f"`train.eval_every` units, plus the final model) with {target.phrase()}; averaged over the "
        "seeds that reached it. *MB to target* is the mean over ranks of the bytes sent up to and including "
        "that unit (metrics.jsonl `bytes_sent`, whose row t is written after unit t's training and before its "
        "exchanges: row t+1 for every strategy, less unit t+1's own gradient Allreduces for allreduce; "
        "interpolated between units). *wall s to target* is the slowest rank's metrics.jsonl `wall` at that "
        "unit (seconds since its run started, taken right after training it); runs written before that field "
        "existed get an estimate, `wall_time * t / units` (marked est.), which assumes units of equal cost. "
        "Under `protocol: async`, ranks are at different units at any moment: the curve is the consensus of "
        "weight snapshots taken every `output.snapshot_seconds` of wall clock (consensus.jsonl `wall`), its t "
        "the mean unit over the ranks then.",
        "",
        f"![consensus {CURVE_TITLES[plotted]} vs bytes]({plotted}_vs_bytes.png)",
        f"![consensus {CURVE_TITLES[plotted]} vs wall time]({plotted}_vs_wall.png)",
        "",
        "## Runs",
        "",
        f"| run | strategy | seed | status | {'consensus loss | bits/byte' if lm else 'consensus acc | best-rank acc'} "
        "| MB / rank | wall s | t to target |"
        + (" delivered | local-test acc |" if personal else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if personal else ""),
    ]
    for r in agg["runs"]:
        if "consensus_test_acc" in r:
            t = r["target"]["t"] if r["target"] else None
            local = r.get("local_test_acc")
            figures = (f"{_fmt(r.get('consensus_test_loss'))} | {_fmt(r.get('consensus_test_bpb'))}" if lm else
                       f"{r['consensus_test_acc']:.4f} | {r['best_rank_acc']:.4f}")
            lines.append(f"| {r['name']} | {r['strategy']} | {r['seed']} | {r['status']} | {figures} | "
                         f"{r['bytes_sent_mean'] / 1e6:.2f} | {r['wall_time']:.1f} | "
                         f"{'-' if t is None else f'{t:.0f}'} |"
                         + (f" {r['delivered']} | {'-' if local is None else f'{local:.4f}'} |" if personal else ""))
        else:
            lines.append(f"| {r['name']} | {r['strategy']} | {r['seed']} | {r['status']} | - | - | - | - | - |"
                         + (" - | - |" if personal else "") + (f" {r['error']}" if r.get("error") else ""))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def write_plots(agg: dict, out_dir: Path) -> List[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("communities compare: matplotlib is not installed; no plots (pip install matplotlib)", file=sys.stderr)
        return []
    written = []
    estimated = [c for curves in agg["_curves"].values() for c in curves if not c.get("wall_measured")]
    wall_label = ("wall time, s (slowest rank's metrics.jsonl wall)" if not estimated else
                  "wall time, s (estimated as wall_time * t / units for runs without metrics.jsonl wall)")
    target = target_of(agg)
    y = plotted_metric(target, any("task" in r for r in agg["runs"]))
    for key, xlabel, fname, scale in (("bytes", "MB sent per rank", f"{y}_vs_bytes.png", 1e-6),
                                       ("wall", wall_label, f"{y}_vs_wall.png", 1.0)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k, (label, curves) in enumerate(agg["_curves"].items()):
            color = f"C{k % 10}"
            for c in curves:
                ax.plot(c[key] * scale, c[y], color=color, alpha=0.25, lw=1)
            common = sorted(set.intersection(*[set(c["t"].tolist()) for c in curves]))
            if common:
                xs = np.mean([[c[key][list(c["t"]).index(t)] for t in common] for c in curves], axis=0) * scale
                ys = np.mean([[c[y][list(c["t"]).index(t)] for t in common] for c in curves], axis=0)
                ax.plot(xs, ys, color=color, lw=2, marker="o", ms=3, label=f"{label} (n={len(curves)})")
        if target.metric == y:
            ax.axhline(target.value, color="grey", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(CURVE_LABELS[y])
        ax.set_title(f"{agg['name']}: {agg['world_size']} ranks, mean over seeds (thin: each seed)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right" if y != "acc" else "lower right", fontsize=8)
        fig.tight_layout()
        p = out_dir / fname
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


def write_report(spec: Spec, plans: Sequence[RunPlan], results_root: Path) -> dict:
    from ..results import atomic_write_json

    out = results_root / spec.name
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(spec, plans)
    write_markdown(agg, out / "compare.md", spec)
    write_plots(agg, out)
    public = {k: v for k, v in agg.items() if not k.startswith("_")}
    atomic_write_json(out / "compare.json", public)
    return public


# --------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="communities compare",
                                description="Run strategies x seeds of one base config and compare them.")
    p.add_argument("spec", help="comparison spec (YAML), e.g. configs/compare/digits_groups.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--overwrite", action="store_true", help="rerun runs that are already complete")
    p.add_argument("--report-only", action="store_true", help="run nothing; rewrite compare.md/json from what exists")
    p.add_argument("--results-root", default="results", help="where results/<name>/ goes (default: results)")
    p.add_argument("--mpiexec", default=None, help="mpiexec to use (default: next to python, else on PATH)")
    p.add_argument("--launcher", default=None,
                   help="launch prefix replacing mpiexec, e.g. 'srun --mpi=pmix -n {n}' (overrides the spec's)")
    p.add_argument("--only", nargs="+", default=None, metavar="LABEL", help="only these strategies of the spec")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="only these seeds (default: the spec's)")
    p.add_argument("--cases", nargs="+", default=None, metavar="CASE", help="only these cases of a spec with cases")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (overrides the spec's)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")
    return p


def main_compare(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        specs = load_specs(args.spec)
    except SpecError as exc:
        print(f"communities compare: error: {exc}", file=sys.stderr)
        return EXIT_USER
    if args.cases:  # a multi-case spec: only these cases (named as in results/<spec>_<case>/)
        names = {s.name for s in specs}
        missing = sorted({c for c in args.cases if c not in names and not any(n.endswith(f"_{c}") for n in names)})
        if missing:
            print(f"communities compare: error: --cases {missing}: not among {sorted(names)}", file=sys.stderr)
            return EXIT_USER
        specs = [s for s in specs if s.name in args.cases or any(s.name.endswith(f"_{c}") for c in args.cases)]
    rc = 0
    for spec in specs:
        rc = max(rc, compare_one(spec, args))
        if rc == EXIT_USER or (rc and args.fail_fast):
            break
    return rc


def compare_one(spec: Spec, args) -> int:
    """Run (or report) one spec: its strategies x seeds; writes results/<spec>/compare.md and .json."""
    try:
        if args.only:
            missing = sorted(set(args.only) - {a.label for a in spec.arms})
            if missing:
                raise SpecError(f"--only {missing}: not in the spec's strategies {[a.label for a in spec.arms]}")
        if not spec.base.exists():
            raise SpecError(f"{args.spec}: base config {str(spec.base)!r} not found")
        results_root = Path(args.results_root)
        launch = (launcher_argv(spec.processes or spec.world_size, args.launcher or spec.launcher, args.mpiexec)
                  if not args.report_only else [])
        plans = plan_runs(spec, results_root, launch, args.only, args.seeds)
        problems = validate(spec, plans)
    except SpecError as exc:
        print(f"communities compare: error: {exc}", file=sys.stderr)
        return EXIT_USER
    if problems:
        stream = sys.stdout if args.dry_run else sys.stderr
        print("communities compare: " + ("warning" if args.dry_run else "error") + ": invalid run configs:\n  "
              + "\n  ".join(problems), file=stream)
        if not (args.dry_run or args.report_only):
            return EXIT_USER
    timeout = args.timeout or spec.timeout
    logs = results_root / spec.name / "logs"
    if args.dry_run:
        try:
            for p in plans:
                state = "complete, skipped" if run_complete(p.path) and not args.overwrite else "to run"
                print(f"# {p.name} ({state})")
                print(" ".join(shlex.quote(c) for c in p.cmd), flush=True)
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    failed = 0
    if not args.report_only:
        try:  # a SIGTERM (a batch system's cancel) unwinds like Ctrl-C, ending the running job's process group
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        except ValueError:  # not the main thread
            pass
        todo = [p for p in plans if args.overwrite or not run_complete(p.path)]
        print(f"compare {spec.name}: {len(plans)} runs ({len(plans) - len(todo)} complete, skipped), "
              f"{spec.world_size} ranks each; logs in {logs}", flush=True)
        for k, p in enumerate(todo, 1):
            print(f"[{k}/{len(todo)}] {p.name} ...", end=" ", flush=True)
            execute(p, logs / f"{p.name}.log", timeout)
            if p.status == "done":
                print(f"done in {p.seconds:.1f}s, {_final_figure(p.path)}", flush=True)
            else:
                failed += 1
                print(f"FAILED ({p.error})", flush=True)
                if args.fail_fast:
                    break
        for p in plans:
            if p.status == "pending" and run_complete(p.path):
                p.status = "skipped"
    agg = write_report(spec, plans, results_root)
    out = results_root / spec.name
    print(_summary_table(agg))
    print(f"wrote {out / 'compare.md'}, {out / 'compare.json'} and plots")
    return 1 if failed else 0


def _final_figure(path: Path) -> str:
    """A finished run's headline: ``consensus acc 0.9756``, or a language model's loss in both units."""
    s = json.loads((path / "summary.json").read_text())
    if s.get("task") is None:
        return f"consensus acc {s['consensus_test_acc']:.4f}"
    bpb = s.get("consensus_test_bpb")
    return (f"consensus loss {_fmt(finite(s.get('consensus_test_loss')), '{:.3f}')} nats/token"
            + (f", {bpb:.3f} bits/byte" if bpb is not None else ""))


def _summary_table(agg: dict) -> str:
    personal = any(a["local_test_acc"]["n"] for a in agg["strategies"].values())
    lm = any("task" in r for r in agg["runs"])
    figures = ["consensus loss", "bits/byte"] if lm else ["consensus acc", "best-rank acc"]
    rows = [["strategy", "runs", *figures, "MB/rank", "wall s", *(["tokens/s/rank"] if lm else []),
             f"t to {target_of(agg).text()}"] + (["local-test acc", "delivered"] if personal else [])]
    for label, a in agg["strategies"].items():
        quality = ([_pm(a["consensus_test_loss"], "{:.3f}"), _pm(a["consensus_test_bpb"], "{:.3f}")] if lm else
                   [_pm(a["consensus_test_acc"]), _pm(a["best_rank_acc"])])
        rows.append([label, f"{a['runs']}/{a['planned']}", *quality,
                     _pm(a["bytes_sent_per_rank"], "{:.2f}", 1e-6), _pm(a["wall_time"], "{:.1f}"),
                     *([_pm(a["tokens_per_s_per_rank"], "{:.0f}")] if lm else []),
                     f"{_pm(a['target']['t'], '{:.0f}')} ({a['target']['reached']}/{a['target']['of']})"]
                    + ([_pm(a["local_test_acc"]), ", ".join(a["delivered"]) or "-"] if personal else []))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    sys.exit(main_compare())
