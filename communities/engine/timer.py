"""Where a rank's wall time goes: train, exchange, signature, idle, eval.

``summary.json``'s ``time_split`` and ``compare``'s wall columns come from here.
The wall clock of a resumed run continues from its checkpoint, so a run's
figures read the same whether or not it was interrupted.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Dict, Iterator

from ..results import TIME_CATEGORIES


class Timer:
    """Accumulates wall time per category, and the run's elapsed wall time."""

    CATEGORIES = TIME_CATEGORIES

    def __init__(self) -> None:
        self.total: Dict[str, float] = {c: 0.0 for c in self.CATEGORIES}
        self._before = 0.0  # wall time of earlier segments of a resumed run
        self._start: float | None = None

    def start(self) -> None:
        """The loop begins: elapsed time counts from here."""
        self._start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds of this run on this rank, earlier segments of a resumed run included."""
        return self._before + (time.perf_counter() - self._start if self._start is not None else 0.0)

    @contextmanager
    def __call__(self, category: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.total[category] += time.perf_counter() - start

    def state_dict(self) -> dict:
        return {"total": dict(self.total), "wall": self.elapsed()}

    def load_state_dict(self, state: dict) -> None:
        self.total.update(state["total"])
        self._before = float(state["wall"])
