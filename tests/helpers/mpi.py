"""Shared test helpers: running the engine and small MPI scripts under a real mpiexec."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository root


def mpiexec() -> str:
    """The mpiexec that belongs to this interpreter's environment, else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        pytest.skip("no mpiexec found: pip install mpich, or install a system MPI")
    return found


def mpi_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    return env


def run_mpi(n: int, args, timeout: float = 240, cwd=None, check: bool = True,
            program=None) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` (or ``PROGRAM ARGS``) on n ranks; kill the whole process group on timeout so nothing
    hangs."""
    cmd = [mpiexec(), "-n", str(n)]
    if "Open MPI" in _mpi_flavour():
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    cmd += [str(program or sys.executable)] + [str(a) for a in args]
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"mpiexec -n {n} {args} timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}") \
            from None
    res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"mpiexec -n {n} {args} exited {proc.returncode}\n{out[-4000:]}\n{err[-4000:]}")
    return res


_FLAVOUR = None


def _mpi_flavour() -> str:
    global _FLAVOUR
    if _FLAVOUR is None:
        try:
            _FLAVOUR = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=30).stdout
        except Exception:
            _FLAVOUR = ""
    return _FLAVOUR


def run_engine(n: int, config: str, tmp_path: Path, *overrides, timeout: float = 300, check: bool = True,
               extra=()) -> subprocess.CompletedProcess:
    """``communities run CONFIG output.root=TMP overrides...`` on n ranks."""
    args = ["-m", "communities", "run", str(ROOT / config) if not Path(config).is_absolute() else config,
            f"output.root={tmp_path}", "--no-progress", *extra, *overrides]
    return run_mpi(n, args, timeout=timeout, check=check)


def initial_mean_and_final(config_path: Path, n: int, run_dir: Path):
    """(mean of the n per-rank initial weights, the run's consensus parameters, mean spread), float64."""
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
    mean0 = torch.stack(inits).mean(0)
    spread0 = float(torch.stack([torch.dist(w, mean0) for w in inits]).mean() / mean0.norm())
    w = torch.load(run_dir / "consensus.pt", weights_only=True)
    names = [k for k, _ in models.build(cfg.model, ds.input_shape, ds.n_classes).named_parameters()]
    final = torch.cat([w[k].reshape(-1) for k in names]).double()
    return mean0, final, spread0


# --------------------------------------------------------------------------- a run to interrupt


def start(n, config, root, *overrides):
    """``communities run CONFIG output.root=ROOT overrides...`` on n ranks, in the background (its own session)."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "communities", "run", str(config),
           f"output.root={root}", "--no-progress", *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for(path: Path, proc, timeout=120):
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"run ended before {path} appeared:\n{proc.communicate()[1][-3000:]}"
        assert time.time() - t0 < timeout, f"{path} did not appear"
        time.sleep(0.1)


def finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out, err
