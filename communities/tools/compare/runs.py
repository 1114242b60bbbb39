"""The runs of a comparison: one engine job per (strategy, seed), planned, checked and launched one after
another::

    LAUNCHER python -m communities run BASE [spec overrides] [strategy overrides] \\
        strategy=S seed=K name=<spec>_<label>_s<K> output.root=results/<spec>/runs world_size=N

A run is complete when its ``meta.json`` says so and its ``summary.json`` is there.
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Union

from .. import jobs
from .spec import Arm, Spec, SpecError


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


def launcher_argv(n: int, launcher: Optional[Union[str, List[str]]] = None, mpiexec: Optional[str] = None) -> List[str]:
    """The launch prefix for n ranks. ``{n}`` in a launcher is replaced; without it, ``-n N`` is appended."""
    if launcher:
        parts = shlex.split(launcher) if isinstance(launcher, str) else [str(p) for p in launcher]
        if any("{n}" in p for p in parts):
            return [p.replace("{n}", str(n)) for p in parts]
        return parts + ["-n", str(n)]
    exe = mpiexec or jobs.find_mpiexec()
    if not exe:
        raise SpecError("no mpiexec next to the interpreter or on PATH: pass --mpiexec PATH or set launcher: in the "
                        "spec (e.g. 'srun --mpi=pmix -n {n}')")
    return [exe, "-n", str(n), *jobs.launcher_flags(exe)]


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
    from ...config import ConfigError, load

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


def execute(plan: RunPlan, log_path: Path, timeout: Optional[float]) -> None:
    """Run one job to completion, its output to ``log_path``; end all of it on timeout, Ctrl-C or SIGTERM."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in plan.cmd) + "\n")
        log.flush()
        proc = jobs.start(plan.cmd, env=jobs.child_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            jobs.end(proc)
            rc = None
        except BaseException:  # Ctrl-C, SIGTERM (see main_compare): the ranks may stop cleanly, then the rest ends
            jobs.end(proc, grace=15.0)
            raise
    plan.seconds = time.perf_counter() - t0
    if rc == 0 and run_complete(plan.path):
        plan.status = "done"
    else:
        plan.status = "failed"
        plan.error = (f"timed out after {timeout:g}s" if rc is None else f"exit {rc}") + f"; log: {log_path}"
