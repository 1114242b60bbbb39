"""Shared test helpers: running the engine and small MPI scripts under a real mpiexec."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


def run_mpi(n: int, args, timeout: float = 240, cwd=None, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on n ranks; kill the whole process group on timeout so nothing hangs."""
    cmd = [mpiexec(), "-n", str(n)]
    if "Open MPI" in _mpi_flavour():
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    cmd += [sys.executable] + [str(a) for a in args]
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"mpiexec -n {n} {args} timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}")
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

    from communities import config, data, models

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


@pytest.fixture
def tiny_config(tmp_path) -> Path:
    """A config that trains in seconds: synthetic data, small MLP, 2 planted groups."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        """
name: tiny
seed: 3
data:
  dataset: synthetic
  partition: label_groups
  groups: 2
  synthetic: {n_samples: 800, n_features: 16, n_classes: 4, class_sep: 3.0}
model: {name: mlp, hidden: [16]}
train: {optimizer: sgd, lr: 0.05, momentum: 0.9, batch_size: 32, unit: steps, steps_per_unit: 4, budget: 40, eval_every: 10}
merge: {lam: 2.0, rule: constant}
signature: {dim: 64, every: 5}
partners: {p_cross: {start: 0.05, end: 1.0, shape: linear, begin: 5, horizon: 20}}
consensus: {tol: 0.05, patience: 2, stop: false}
"""
    )
    return cfg
