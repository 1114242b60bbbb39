"""Shared test helpers: running the engine and small MPI scripts under a real mpiexec."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, NamedTuple, Sequence

import pytest

from communities.tools import jobs
from tests.helpers import stacks

ROOT = jobs.ROOT  # the repository root


def mpiexec() -> str:
    """The mpiexec that belongs to this interpreter's environment, else the one on PATH (``jobs.find_mpiexec``)."""
    found = jobs.find_mpiexec()
    if not found:
        pytest.skip("no mpiexec found: pip install mpich, or install a system MPI")
    return found


def mpi_env(**extra: str) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MPLBACKEND="Agg", **extra)


LAUNCHER_HUNG = -1000  # the exit code ``run_command`` gives a job whose launcher outlived all its ranks
ORPHANED_LAUNCHER_S = 20.0  # how long a launcher may stay on alone before it counts as hung


def communicate(proc: subprocess.Popen, timeout: float, launcher_may_hang: bool = False):
    """``proc.communicate`` with a deadline (``subprocess.TimeoutExpired`` past it), and, with
    ``launcher_may_hang``, one more way out.

    Open MPI 5.0.11's prterun, started with ``--with-ft ulfm``, at times never returns once every rank has
    exited: its main thread blocks on a mutex, and a rank that was SIGKILLed stays an unreaped zombie. It was
    seen after ranks that all exit non-zero (a STOP: 75, once in nine runs of that test here; a refused
    resume: 2, once in CI, no stack taken). When its session has held nothing but the launcher for
    ORPHANED_LAUNCHER_S, the launcher is killed and the job's code is LAUNCHER_HUNG: what the ranks did is on
    disk, and the callers check that instead.
    """
    deadline, alone_since = time.monotonic() + timeout, None
    while True:
        try:
            out, err = proc.communicate(timeout=1.0)  # (retrying after TimeoutExpired loses no output)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if now > deadline:
                raise
            if not launcher_may_hang or not jobs.only_leader_left(proc.pid):
                alone_since = None
                continue
            alone_since = alone_since or now
            if now - alone_since > ORPHANED_LAUNCHER_S:
                jobs.end(proc)
                out, err = proc.communicate()
                note = (f"[tests] {proc.args[0]} outlived every rank by {ORPHANED_LAUNCHER_S:.0f}s and was killed "
                        f"(exit {LAUNCHER_HUNG})")
                print(note, file=sys.stderr, flush=True)
                return LAUNCHER_HUNG, out, f"{err}\n{note}\n"


def run_command(cmd, timeout: float, what: str, cwd=None, check: bool = True, env=None, on_timeout=None,
                launcher_may_hang: bool = False) -> subprocess.CompletedProcess:
    """Run an ``mpiexec`` command line in its own session; kill the whole session on timeout (no hang),
    then call ``on_timeout`` (for ranks that left the session). ``launcher_may_hang``: see ``communicate``
    (``check`` then accepts LAUNCHER_HUNG as well as 0)."""
    proc = jobs.start(cmd, cwd=cwd or ROOT, env=mpi_env(**(env or {})), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    try:
        code, out, err = communicate(proc, timeout, launcher_may_hang)
    except subprocess.TimeoutExpired:
        where = stacks.describe(jobs.job_processes(proc.pid))  # before the kill: where each process waited
        jobs.end(proc)
        if on_timeout is not None:
            on_timeout()
        out, err = proc.communicate()
        raise AssertionError(f"{what} timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}{where}") from None
    res = subprocess.CompletedProcess(cmd, code, out, err)
    if check and code not in ((0, LAUNCHER_HUNG) if launcher_may_hang else (0,)):
        raise AssertionError(f"{what} exited {code}\n{out[-4000:]}\n{err[-4000:]}")
    return res


def mpi_command(n: int, args, program=None) -> list:
    """``mpiexec -n N python ARGS`` (or ``PROGRAM ARGS``) of this environment (Open MPI: oversubscribed, root
    allowed)."""
    exe = mpiexec()
    return [exe, "-n", str(n), *jobs.launcher_flags(exe), str(program or sys.executable)] + [str(a) for a in args]


def run_mpi(n: int, args, timeout: float = 240, cwd=None, check: bool = True,
            program=None) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (or ``PROGRAM ARGS``) on n ranks; kill the whole process group on timeout so nothing
    hangs."""
    return run_command(mpi_command(n, args, program), timeout, f"mpiexec -n {n} {args}", cwd=cwd, check=check)


def engine_args(config, root: Path, *overrides, extra=()) -> list:
    """The arguments of ``communities run CONFIG output.root=ROOT --no-progress EXTRA OVERRIDES``."""
    path = str(ROOT / config) if not Path(config).is_absolute() else str(config)
    return ["run", path, f"output.root={root}", "--no-progress", *extra, *overrides]


def run_engine(n: int, config: str, tmp_path: Path, *overrides, timeout: float = 300, check: bool = True,
               extra=()) -> subprocess.CompletedProcess:
    """``communities run CONFIG output.root=TMP overrides...`` on n ranks."""
    return run_mpi(n, ["-m", "communities", *engine_args(config, tmp_path, *overrides, extra=extra)],
                   timeout=timeout, check=check)


class Job(NamedTuple):
    """One ``communities run`` of a batch: its config, output root, overrides and extra options."""

    config: object
    root: Path
    overrides: Sequence[str] = ()
    extra: Sequence[str] = ()


def run_batch(n: int, jobs: Dict[str, Job], timeout: float = 600, check: bool = True, env=None
              ) -> Dict[str, subprocess.CompletedProcess]:
    """Run several engine jobs on n ranks in one mpiexec (tests/helpers/batch.py): one start-up for all.

    Returns each job's result as ``run_engine`` would (exit code: the highest over the ranks; stdout and
    stderr: every rank's, in rank order). ``check`` raises for a job that did not exit 0. A job that
    crashes a rank aborts the batch, like its own job: the error names the job that was running.
    """
    with tempfile.TemporaryDirectory(prefix="batch_") as tmp:
        out = Path(tmp)
        spec = [{"name": name, "argv": engine_args(j.config, j.root, *j.overrides, extra=j.extra)}
                for name, j in jobs.items()]
        (out / "jobs.json").write_text(json.dumps(spec))
        res = run_command(mpi_command(n, [ROOT / "tests" / "helpers" / "batch.py", out / "jobs.json", out]),
                          timeout, f"batch of {len(jobs)} runs on {n} ranks", check=False, env=env)

        def read(name: str, kind: str) -> str:
            return "".join(p.read_text() for p in (out / f"{name}.{r}.{kind}" for r in range(n)) if p.exists())

        results = {}
        for name in jobs:
            code_file = out / f"{name}.code"
            if not code_file.exists():
                raise AssertionError(f"batch job {name!r} did not finish (mpiexec exited {res.returncode})\n"
                                     f"{read(name, 'out')[-3000:]}\n{read(name, 'err')[-3000:]}\n{res.stderr[-3000:]}")
            code = max(json.loads(code_file.read_text()))
            results[name] = subprocess.CompletedProcess(name, code, read(name, "out"), read(name, "err"))
            if check and code != 0:
                raise AssertionError(f"batch job {name!r} exited {code}\n{results[name].stdout[-3000:]}\n"
                                     f"{results[name].stderr[-3000:]}")
        return results


class TinyRuns:
    """A batch of runs of the tiny config (tests/conftest.py): ``runs[name]`` is a job's run directory,
    ``runs.result[name]`` its output and exit code, ``runs.config`` the config file they ran."""

    def __init__(self, root: Path, config: Path, results: Dict[str, subprocess.CompletedProcess]):
        self.root, self.config, self.result = root, config, results

    def __getitem__(self, name: str) -> Path:
        return self.root / name / "tiny"


def tiny_batch(tmp_path_factory, label: str, n: int, jobs: Dict[str, Sequence[str]], timeout: float = 840,
               check: bool = True) -> TinyRuns:
    """Run ``{name: overrides}`` of the tiny config on n ranks in one batch (``run_batch``), each under its own
    output root; for a module-scoped fixture."""
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp(label)
    config = root / "tiny.yaml"
    config.write_text(TINY)
    results = run_batch(n, {name: Job(config, root / name, overrides) for name, overrides in jobs.items()},
                        timeout=timeout, check=check)
    return TinyRuns(root, config, results)


def initial_weights(config_path: Path, n: int) -> list:
    """The n ranks' initial parameters under ``model.init=per_rank``, float64."""
    import torch

    from communities import config
    from communities.workload import data, models

    cfg = config.load(config_path, ["model.init=per_rank"])
    ds = data.load(cfg.data, cfg.seed)
    inits = []
    for rank in range(n):
        torch.manual_seed(models.init_seed(cfg.seed, rank, "per_rank"))
        flat, n_params = models.flatten_(models.build(cfg.model, ds.input_shape, ds.n_classes))
        inits.append(flat[:n_params].double())
    return inits


def consensus_weights(config_path: Path, run_dir: Path):
    """The run's ``consensus.pt`` as one float64 vector, in the model's parameter order."""
    import torch

    from communities import config
    from communities.workload import data, models

    cfg = config.load(config_path)
    ds = data.load(cfg.data, cfg.seed)
    w = torch.load(run_dir / "consensus.pt", weights_only=True)
    names = [k for k, _ in models.build(cfg.model, ds.input_shape, ds.n_classes).named_parameters()]
    return torch.cat([w[k].reshape(-1) for k in names]).double()


def initial_mean_and_final(config_path: Path, n: int, run_dir: Path):
    """(mean of the n per-rank initial weights, the run's consensus parameters, mean spread), float64."""
    import torch

    inits = initial_weights(config_path, n)
    mean0 = torch.stack(inits).mean(0)
    spread0 = float(torch.stack([torch.dist(w, mean0) for w in inits]).mean() / mean0.norm())
    return mean0, consensus_weights(config_path, run_dir), spread0


# --------------------------------------------------------------------------- a run to interrupt


def start(n, config, root, *overrides):
    """``communities run CONFIG output.root=ROOT overrides...`` on n ranks, in the background (its own session)."""
    cmd = mpi_command(n, ["-m", "communities", "run", config, f"output.root={root}", "--no-progress", *overrides])
    return jobs.start(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc, timeout=120):
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path} appeared:\n{proc.communicate()[1][-3000:]}"
        assert time.time() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.1)


def finish(proc, timeout=240, launcher_may_hang: bool = False):
    """(exit code, stdout, stderr) of a job started with ``start_new_session``; on timeout, where its
    processes waited, and the group killed. ``launcher_may_hang``: see ``communicate``."""
    try:
        return communicate(proc, timeout, launcher_may_hang)
    except subprocess.TimeoutExpired:
        where = stacks.describe(jobs.job_processes(proc.pid))  # before the kill: where each process waited
        jobs.end(proc)
        proc.communicate()
        raise AssertionError(f"the job did not end in {timeout}s{where}") from None
