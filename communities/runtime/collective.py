"""Set-up steps that every rank passes together, or none does.

A user error during set-up (a bad config, dataset, model or run directory) must
stop every rank with one message and exit 2 everywhere; a rank that failed alone
would leave the others waiting in their next collective. These two helpers turn
a failure on one rank into the same error on every rank.
"""
from __future__ import annotations

from typing import Optional

from ..errors import SETUP_ERRORS, ConfigError, ResultsError, RunComplete, collective
from .view import WorldView


def collective_check(world: WorldView, fn, root: Optional[int] = None):
    """Run ``fn`` on ``root`` (the lead by default) and share its outcome, so a failure there stops every rank.

    A user error is re-raised on every rank as a ConfigError marked collective:
    the CLI then exits 2 everywhere with one message and no traceback. Any other
    failure aborts the job, with the traceback printed by ``root`` alone.
    """
    msg, out = "", None
    root = world.root(root)
    if world.rank == root:
        try:
            out = fn()
        except RunComplete as exc:
            msg = f"done\0{exc}"
        except SETUP_ERRORS as exc:
            msg = f"user\0{exc}"
        except Exception as exc:
            msg = f"bug\0{type(exc).__name__}: {exc}"
            world.bcast_text(msg, root)
            raise
    msg = world.bcast_text(msg, root)
    if msg:
        kind, text = msg.split("\0", 1)
        if kind == "bug":
            err = RuntimeError(f"rank {root} failed during set-up: {text}")
            err.failed_rank = root  # type: ignore[attr-defined]  # the CLI prints one traceback, the failing rank's
            raise err
        if kind == "done":
            raise RunComplete(text)
        raise collective(ConfigError(text))
    return out


def on_every_rank(world: WorldView, fn):
    """Run local (collective-free) ``fn`` on every rank; a user error anywhere is raised on every rank.

    The error names each failing rank and its message, so rank 0 can print it
    once and every rank can exit 2 instead of some waiting forever.
    """
    out, err = None, None
    try:
        out = fn()
    except SETUP_ERRORS as exc:
        err = exc
    messages = world.allgather_text("" if err is None else str(err))
    by_message: dict = {}
    for r, m in enumerate(messages):
        if m:
            by_message.setdefault(m, []).append(r)
    if by_message:
        if len(by_message) == 1 and len(next(iter(by_message.values()))) == world.size:
            raise collective(ResultsError(next(iter(by_message))))  # the same failure everywhere
        raise collective(ResultsError("; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}"
                                                for m, r in by_message.items())))
    return out
