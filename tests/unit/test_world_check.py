"""The launcher and MPI must agree on the world (a set-up failure under mpiexec: tests/mpi/test_world_check_mpi.py)."""
import os
import subprocess
import sys

import pytest

from communities.runtime.launcher import launcher_mismatch, launcher_world_size
from tests.helpers.mpi import ROOT


@pytest.mark.parametrize("env, mpi_size, bad", [
    ({}, 1, False),
    ({"PMI_SIZE": "4"}, 1, True),                      # mpi4py's MPI is not the launcher's: 4 worlds of 1
    ({"PMI_SIZE": "4"}, 4, False),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, 4, True),          # any disagreement, not only a world of 1
    ({"OMPI_COMM_WORLD_SIZE": "8"}, 4, True),
    ({"PMIX_SIZE": "3"}, 2, True),
    ({"OMPI_COMM_WORLD_SIZE": "4", "SLURM_NTASKS": "16"}, 4, False),
    # inside an sbatch allocation SLURM_NTASKS is the allocation's: mpiexec -n 4 there is legitimate
    ({"SLURM_NTASKS": "16", "SLURM_JOB_ID": "7"}, 4, False),
    ({"SLURM_NTASKS": "16", "SLURM_JOB_ID": "7"}, 1, False),
    # a process srun started for a step: the step's task count must be MPI's world
    ({"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEPID": "0"}, 1, True),
    ({"SLURM_NTASKS": "4", "SLURM_STEPID": "0"}, 1, True),
    ({"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEPID": "0"}, 4, False),
    ({"SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEPID": "1"}, 4, False),
    # srun -n1 mpiexec -n 4: a world larger than the step is an mpiexec nested in it
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_STEPID": "0"}, 4, False),
    ({"PMI_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEPID": "0"}, 4, False),
])
def test_launcher_mismatch(env, mpi_size, bad):
    msg = launcher_mismatch(mpi_size, env)
    assert bool(msg) == bad, msg
    if bad:
        var, n = launcher_world_size(env)
        assert f"{var}={n}" in msg and f"world of {mpi_size}" in msg


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_", "MPI_LOCAL"))}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | extra


def _run_single(tmp_path, *overrides, **extra) -> subprocess.CompletedProcess:
    """``communities run`` as one plain process (no mpiexec), with launcher variables in its environment."""
    return subprocess.run([sys.executable, "-m", "communities", "run", "configs/quickstart.yaml",
                           f"output.root={tmp_path}", "--no-progress", *overrides],
                          cwd=ROOT, capture_output=True, text=True, env=_env(**extra), timeout=120)


def test_a_launcher_world_that_mpi_does_not_see_exits_2(tmp_path):
    res = _run_single(tmp_path, PMI_SIZE="4")
    assert res.returncode == 2, res.stderr
    assert "the launcher started 4 processes (PMI_SIZE=4) but MPI reports a world of 1" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "quickstart").exists()


def test_an_sbatch_allocation_alone_is_no_launcher_mismatch(tmp_path):
    """SLURM_NTASKS of the allocation (no srun step) says nothing about this mpiexec's world."""
    # (the quickstart's 8 replicas would run on this one process; asynchronous ones that average optimizer
    # moments cannot: a refusal to look for)
    res = _run_single(tmp_path, "protocol=async", "merge.optimizer_state=average", SLURM_NTASKS="4", SLURM_JOB_ID="1")
    assert res.returncode == 2 and "launcher" not in res.stderr, res.stderr
    assert "world_size=8 replicas on 1 MPI processes" in res.stderr  # the config's own check speaks instead
    step = _run_single(tmp_path, SLURM_NTASKS="4", SLURM_STEP_NUM_TASKS="4", SLURM_STEPID="0", SLURM_JOB_ID="1")
    assert step.returncode == 2 and "(SLURM_STEP_NUM_TASKS=4) but MPI reports a world of 1" in step.stderr
