"""What the launcher and the MPI library say about this job: the world size announced, the library's name.

MPI itself is loaded on first use (``mpi``), so importing the package does not start it.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple


def mpi():
    """The ``mpi4py.MPI`` module, imported on first use."""
    from mpi4py import MPI

    return MPI


def library_version() -> str:
    """The MPI library's first line of version text (Open MPI's ends in a NUL byte: removed)."""
    return mpi().Get_library_version().replace("\0", "").strip().splitlines()[0]


# Variables a launcher sets in each process it starts, holding the size of the world it started:
# Open MPI's mpirun/prterun, PMI-1/PMI-2 launchers (MPICH/Intel MPI hydra, srun --mpi=pmi2), PMIx launchers.
LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def launcher_world_size(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, int]]:
    """The world size this process's launcher announced, as ``(variable, size)``, or None.

    Only variables set per process for this launch count. ``SLURM_NTASKS`` alone does not: inside an
    sbatch allocation it is the allocation's task count, and ``mpiexec -n 4`` there legitimately starts
    a different number. It counts only in a process srun started for a job step (``SLURM_STEP_NUM_TASKS``,
    or ``SLURM_NTASKS`` with ``SLURM_STEPID`` set), and is reported as ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``.
    """
    env = os.environ if env is None else env
    for var in LAUNCHER_SIZE_VARS:
        v = env.get(var, "").strip()
        if v.isdigit():
            return var, int(v)
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        v = env.get(var, "").strip()
        if v.isdigit() and (var == "SLURM_STEP_NUM_TASKS" or env.get("SLURM_STEPID", "").strip().isdigit()):
            return var, int(v)
    return None


def launcher_mismatch(mpi_size: int, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A message when the launcher started a different number of processes than MPI put in this world.

    The usual cause: mpi4py is built against one MPI library and the job was launched with another's
    mpiexec (or srun without the matching --mpi plugin), so every process is a world of its own.
    A launcher's own per-process variable must equal MPI's world size exactly. An srun step's task count
    is compared the same way, except that a world *larger* than the step is allowed: that is an mpiexec
    nested inside the step (``srun -n1 mpiexec -n 4``) whose MPI sets none of the variables above.
    """
    launched = launcher_world_size(env)
    if launched is None:
        return None
    var, n = launched
    if n == mpi_size or (var.startswith("SLURM_") and mpi_size > n):
        return None
    hint = ("mpi4py is built against a different MPI library than the launcher, so the processes did not join "
            "one world. Use the mpiexec that belongs to mpi4py's MPI (python -m mpi4py --mpi-library) or srun "
            "--mpi=pmi2/pmix") if mpi_size == 1 else (
            "the launcher and MPI disagree on the job's processes (a stale launcher variable in the environment, "
            "or a launcher of another MPI library)")
    return f"the launcher started {n} processes ({var}={n}) but MPI reports a world of {mpi_size}: {hint}"
