"""A discrete-event queue for the simulations of the asynchronous pairing (tests/unit/test_posted.py and
tests/unit/test_async_population.py): events at times, messages delayed at random but FIFO per pair, as MPI's
are, and a count of those in flight."""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

import numpy as np


class EventQueue:
    """Set ``rng`` and ``delay`` before use; ``run_events`` pops events in time order until none is left."""

    def __init__(self, rng: np.random.Generator, delay: float):
        self.rng, self.delay = rng, delay
        self.events, self.seq, self.now = [], itertools.count(), 0.0
        self.last, self.in_transit = defaultdict(float), 0

    def at(self, t, fn):
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def _deliver(self, src, dst, fn):
        arrive = max(self.now + self.rng.uniform(0.1, 1.0) * self.delay, self.last[(src, dst)] + 1e-9)
        self.last[(src, dst)] = arrive
        self.in_transit += 1

        def land():
            self.in_transit -= 1
            fn()
        self.at(arrive, land)
