"""Stop requests (SIGUSR1, SIGTERM) noted from the moment the process starts.

The handler only sets a flag; the ranks act on it together at the next signature
round (one tiny Allreduce), checkpoint and exit 75. ``communities run`` installs
it before it imports torch or MPI, so a signal that arrives during the seconds of
start-up is not fatal: it stops the run at its first round instead.
"""
from __future__ import annotations

import signal
from typing import Any, Dict

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_requested = False


def _note(signum, frame) -> None:
    global _requested
    _requested = True


def install() -> Dict[int, Any]:
    """Route SIGUSR1/SIGTERM to the flag; returns the previous handlers (empty off the main thread)."""
    previous: Dict[int, Any] = {}
    for sig in SIGNALS:
        try:
            previous[sig] = signal.signal(sig, _note)
        except ValueError:  # not the main thread: signals cannot be handled here
            pass
    return previous


def restore(previous: Dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def requested() -> bool:
    return _requested
