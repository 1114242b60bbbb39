"""User errors and exit codes: the one home of both.

A *user error* is one the user can fix (a config key, a dataset, a model, a run
directory): the command prints one line naming the key or file and exits
``EXIT_USER`` on every rank, before any rank trains. Anything else is a bug or a
failure of the machine: the failing rank prints its traceback and the job aborts.

An error raised identically on every rank is marked *collective*: every rank can
then exit cleanly without ``MPI_Abort`` (nobody is left waiting).
"""
from __future__ import annotations

from enum import Enum

EXIT_OK = 0
EXIT_FAILURE = 1  # a bug or a crash: the job was aborted
EXIT_USER = 2  # a user error: nothing trained, or a full disk stopped the run (inspect: a missing or damaged file)
EXIT_WATCHDOG = 3  # the watchdog aborted the job: a blocking MPI wait outlasted comm.timeout
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal or STOP file, checkpoint written; resume with --resume


class StopReason(str, Enum):
    """Why every rank stops before its budget of units (``Mixer.stop_reason``, read by the loop)."""

    SIGNAL = "signal"  # SIGUSR1/SIGTERM, a STOP file or a failed write: checkpoint, then EXIT_PREEMPTED
    BUDGET = "budget"  # the wall-clock budget (``protocol: async``) is spent: finish as at the end


class UserError(Exception):
    """Something the user can fix; the message names the key, the value or the file."""


class ConfigError(UserError, ValueError):
    """A bad config: the message names the key, the value and the allowed range."""


class DataError(UserError, ValueError):
    """A dataset or partition that cannot be used; the message says which and why."""


class ModelError(UserError, ValueError):
    """A model that cannot be built, flattened or merged; the message names it."""


class ResultsError(UserError, RuntimeError):
    """A results file that is missing or damaged; the message names the file."""


class DiskError(ResultsError):
    """The run directory could not be written (disk full, quota, read-only or failing filesystem).

    Fixable by the user (free space, then ``--resume``); the message names the path and the free space.
    """


class RunLocked(UserError, RuntimeError):
    """Another run holds the run directory's lock; the message names its host and pid."""


class Disagreement(UserError, RuntimeError):
    """Ranks hold different values of something they must share; raised identically on every rank."""

    collective = True


# What set-up failures count as the user's to fix. OSError: a run directory that cannot be written.
SETUP_ERRORS = (UserError, OSError)


class Preempted(Exception):
    """Every rank raises this after the collective stop and checkpoint; the command exits EXIT_PREEMPTED."""

    collective = True


class RunComplete(Exception):
    """``--resume`` of a run that already finished: nothing to do (exit 0)."""

    collective = True


def collective(exc: Exception) -> Exception:
    """Mark an error that every rank raises identically (safe to exit without MPI_Abort)."""
    exc.collective = True  # type: ignore[attr-defined]
    return exc


def is_collective(exc: BaseException) -> bool:
    return bool(getattr(exc, "collective", False))
