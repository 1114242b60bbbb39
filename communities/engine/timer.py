"""Where a rank's wall time goes: a partition into train, exchange, signature, idle, eval, other and turn.

Three rules make the split honest:

- **Exclusive nesting.** A section opened inside another (the gradient
  Allreduce inside a training step, an exchange served while waiting on a
  request) pauses the outer one, so no second is counted twice. The loop runs
  inside an ``other`` section, so what no inner section claims (checkpoints,
  log writes, the loop's own work) is measured as ``other``, and the
  categories add up to the elapsed wall time: a check, not a definition.
- **Waiting is idle, whatever call it happens in.** Every rank enters a
  collective (an Allreduce of gradients, a global average, a consensus
  evaluation) in the same order, and all leave it together, so the rank that
  arrived last waited least: its time is the transfer. ``settle`` takes, call by
  call, the minimum over ranks of each collective's duration as its transfer
  and moves the rest to ``idle``. It costs one Allreduce per call site at the
  end, and nothing in the loop.
- **A replica's turn is not idle.** The replicas of a population's process run
  one at a time; while the others run, a replica waits for its turn, not for
  anyone's data. The world counts those seconds (``turn_seconds``: the other
  replicas' running time while this one waited), every other category is
  measured on a clock that leaves them out, and they are a category of their
  own, ``turn`` (0 with one replica per process).

``summary.json``'s ``time_split`` and ``compare``'s wall columns come from here.
The wall clock of a resumed run continues from its checkpoint.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np

from ..results import TIME_CATEGORIES, TimeCategory


class Timer:
    """Exclusive wall time per category, the run's elapsed wall time, and collective calls to settle."""

    CATEGORIES = TIME_CATEGORIES

    def __init__(self, turns: Optional[Callable[[], float]] = None,
                 waits: Optional[Callable[[], float]] = None) -> None:
        self.total: Dict[str, float] = {c: 0.0 for c in TIME_CATEGORIES}  # plain names: they reach JSON
        self._before = 0.0  # wall time of earlier segments of a resumed run
        self._start: Optional[float] = None
        self._turns = turns or (lambda: 0.0)  # seconds other replicas of the process ran while this one waited
        self._turns_at_start = 0.0
        self._waits = waits or (lambda: 0.0)  # seconds the process waited on other processes (a population's)
        self._waits_at_start = 0.0
        self._waited_before = 0.0
        self._open: List[list] = []  # [category's name, time it last resumed]
        self.calls: Dict[str, List[float]] = {}  # site -> durations of its collective calls, in order
        self.call_categories: Dict[str, List[str]] = {}

    def start(self) -> None:
        """The loop begins: elapsed time counts from here."""
        self._start = time.perf_counter()
        self._turns_at_start = self._turns()
        self._waits_at_start = self._waits()

    def process_waited(self) -> float:
        """Seconds this rank's process waited on other processes since the loop began (a population's hub: its
        collectives and exchanges between processes), earlier segments of a resumed run included."""
        return self._waited_before + (self._waits() - self._waits_at_start if self._start is not None else 0.0)

    def _now(self) -> float:
        """The clock of every category but ``turn``: wall time less the turns waited (``__init__``'s ``turns``)."""
        return time.perf_counter() - self._turns()

    def _turned(self) -> float:
        """Seconds waited for turns since ``start``."""
        return self._turns() - self._turns_at_start if self._start is not None else 0.0

    def elapsed(self) -> float:
        """Seconds of this run on this rank, earlier segments of a resumed run included."""
        return self._before + (time.perf_counter() - self._start if self._start is not None else 0.0)

    @contextmanager
    def __call__(self, category: str) -> Iterator[None]:
        """Count the block's time in ``category`` (a ``TimeCategory``), pausing the enclosing section.

        A plain name is accepted for what it equals; anything else is a ValueError naming it.
        """
        name = TimeCategory(category).value
        now = self._now()
        if self._open:
            outer = self._open[-1]
            self.total[outer[0]] += now - outer[1]
        self._open.append([name, now])
        try:
            yield
        finally:
            end = self._now()
            cat, since = self._open.pop()
            self.total[cat] += end - since
            if self._open:
                self._open[-1][1] = end

    @contextmanager
    def collective(self, site: str) -> Iterator[None]:
        """A collective every rank calls in the same order: its duration is recorded for ``settle``.

        The time stays in the enclosing category until then.
        """
        category = self._open[-1][0] if self._open else TimeCategory.IDLE.value
        start = self._now()
        try:
            with self(category):
                yield
        finally:
            self.calls.setdefault(site, []).append(self._now() - start)
            self.call_categories.setdefault(site, []).append(category)

    def settle(self, world) -> float:
        """Move each collective call's wait (its duration minus the fastest rank's) to idle; returns the total.

        Every rank must call it (one Allreduce per site). A site whose call
        counts differ between ranks is left as measured.
        """
        moved = 0.0
        for site in sorted(self.calls):
            d = np.asarray(self.calls[site], dtype=np.float64)
            counts = world.allgather(np.array([d.size], dtype=np.int64))[world.alive]
            if (counts != d.size).any():
                continue
            transfer = world.allreduce_array(d, "min")
            waits = d - transfer
            for cat, w in zip(self.call_categories[site], waits):
                if cat != TimeCategory.IDLE:
                    self.total[cat] -= w
                    self.total[TimeCategory.IDLE.value] += w
                    moved += w
        self.calls.clear()
        self.call_categories.clear()
        return moved

    def reassign(self, seconds: float, source: str, target: str) -> None:
        """Move ``seconds`` already counted in ``source`` to ``target``: a population's stacked training step,
        which every replica of the process waited through, is each one's share of training."""
        src, dst = TimeCategory(source).value, TimeCategory(target).value
        moved = min(float(seconds), self.total[src])
        self.total[src] -= moved
        self.total[dst] += moved

    def split(self) -> Dict[str, float]:
        """Seconds per category so far, the section still open included (they add up to ``elapsed()``)."""
        out = dict(self.total)
        if self._open:
            cat, since = self._open[-1]
            out[cat] += self._now() - since
        out[TimeCategory.TURN.value] += self._turned()
        return out

    def state_dict(self) -> dict:
        total = dict(self.total)
        total[TimeCategory.TURN.value] += self._turned()
        return {"total": total, "wall": self.elapsed(), "process_waited": self.process_waited(),
                "calls": {k: list(v) for k, v in self.calls.items()},
                "call_categories": {k: list(v) for k, v in self.call_categories.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.total.update({k: v for k, v in state["total"].items() if k in self.total})
        self._before = float(state["wall"])
        self._waited_before = float(state.get("process_waited", 0.0))
        self.calls = {k: list(v) for k, v in state.get("calls", {}).items()}
        self.call_categories = {k: list(v) for k, v in state.get("call_categories", {}).items()}
