"""Which launcher a generated SLURM script uses: ``srun`` where SLURM speaks the MPI library's PMI, else ``mpirun``.

``srun`` starts the ranks as a job step: SLURM places, binds, accounts and signals them, and no
second launcher runs inside the allocation. It needs a PMI plugin that the MPI library under
mpi4py speaks: PMI-2 (``--mpi=pmi2``) for MPICH, the ``mpich`` PyPI wheel, Intel MPI and
MVAPICH; PMIx (``--mpi=pmix``) for Open MPI 5, which dropped PMI-2. ``srun --mpi=list``
names the plugins the cluster's SLURM was built with, and ``python -m mpi4py
--mpi-lib-version`` names the library without starting MPI: where the one fits the other the
default is ``srun``. Elsewhere it is ``mpirun``, the library's own launcher (MPICH's hydra and
Open MPI's prterun read the allocation from SLURM's environment).

``mpirun`` is also needed for lost-rank survival (``comm.fault_tolerance: shrink``): ULFM is
Open MPI's ``mpirun --with-ft ulfm``, and srun ends the whole step when one task dies.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

LAUNCHERS = ("auto", "srun", "mpirun", "mpiexec")  # mpiexec: another name for mpirun
PMI_FOR = {"Open MPI": "pmix"}  # the PMI an MPI library needs from srun; every other one speaks PMI-2
DEFAULT_PMI = "pmi2"
PROBE_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Launch:
    """The choice written into the script: ``launcher`` (srun or mpirun), srun's ``--mpi`` plugin, and why."""

    launcher: str
    srun_mpi: str
    why: str


def _output(cmd: Sequence[str]) -> Optional[str]:
    """A command's stdout and stderr, or None when it cannot run or fails."""
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout + res.stderr if res.returncode == 0 else None


def srun_plugins(srun: Optional[str] = None) -> Optional[frozenset]:
    """The MPI plugin types ``srun --mpi=list`` names (pmi2, pmix, pmix_v4, ...); None without a working srun."""
    srun = srun or shutil.which("srun")
    if srun is None:
        return None
    text = _output([srun, "--mpi=list"])
    return None if text is None else plugins_listed(text)


def plugins_listed(text: str) -> frozenset:
    """The plugin names in ``srun --mpi=list``'s output (one per line after a header; SLURM 20 to 24)."""
    names = set()
    for line in text.splitlines():
        line = line.strip().removeprefix("srun:").strip()
        if re.fullmatch(r"[a-z][a-z0-9_]*", line):
            names.add(line)
        found = re.search(r"plugin versions available:\s*(.*)$", line)
        if found:
            names.update(n for n in re.split(r"[\s,]+", found.group(1)) if n)
    return frozenset(names)


def mpi_library(python: str) -> Optional[str]:
    """The first line of the MPI library's version text, from ``PYTHON -m mpi4py --mpi-lib-version``."""
    text = _output([python, "-m", "mpi4py", "--mpi-lib-version"])
    if not text or not text.strip():
        return None
    return " ".join(text.replace("\0", "").strip().splitlines()[0].split())


def pmi_for(library: Optional[str]) -> str:
    """The srun ``--mpi`` plugin an MPI library speaks: pmix for Open MPI, pmi2 for the others."""
    for name, pmi in PMI_FOR.items():
        if library and name in library:
            return pmi
    return DEFAULT_PMI


def offers(plugins: frozenset, pmi: str) -> bool:
    """Whether srun lists ``pmi`` (pmix also as a versioned pmix_vN)."""
    return pmi in plugins or (pmi == "pmix" and any(p.startswith("pmix_") for p in plugins))


def choose(requested: str, *, python: str, srun_mpi: Optional[str], ulfm: bool,
           plugins: Optional[frozenset] = None, library: Optional[str] = None, probe: bool = True) -> Launch:
    """The launcher for ``requested`` (auto, srun, mpirun or mpiexec).

    ``plugins`` and ``library`` are probed (srun --mpi=list, PYTHON -m mpi4py) where not given and ``probe``.
    An explicit ``srun_mpi`` is taken as given. Raises ValueError for srun with ``ulfm``.
    """
    if requested == "mpiexec":
        requested = "mpirun"
    if ulfm and requested == "srun":
        raise ValueError("--launcher srun with comm.fault_tolerance=shrink: srun ends the whole job step when one "
                         "task dies; surviving a lost rank needs Open MPI's mpirun --with-ft ulfm (--launcher mpirun)")
    if library is None and probe and (requested != "mpirun" and srun_mpi is None):
        library = mpi_library(python)
    wanted = srun_mpi or pmi_for(library)
    lib = library or "the MPI library (not identified)"
    if requested == "srun":
        return Launch("srun", wanted, f"--launcher srun; srun --mpi={wanted} for {lib}")
    if requested == "mpirun":
        return Launch("mpirun", wanted, "--launcher mpirun")
    if ulfm:
        return Launch("mpirun", wanted, "comm.fault_tolerance=shrink needs Open MPI's mpirun --with-ft ulfm "
                                        "(srun ends the step when one task dies)")
    if plugins is None and probe:
        plugins = srun_plugins()
    if plugins is None:
        return Launch("mpirun", wanted, "no working `srun --mpi=list` here to tell whether this SLURM speaks "
                                        f"{wanted}; pass --launcher srun if it does")
    if offers(plugins, wanted):
        return Launch("srun", wanted, f"srun --mpi=list offers {wanted}, which {lib} speaks")
    listed = ", ".join(sorted(plugins)) or "nothing"
    return Launch("mpirun", wanted, f"srun --mpi=list offers {listed}, not {wanted}, which {lib} needs")
