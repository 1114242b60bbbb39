"""``protocol.Rekeyed``: one generator re-keyed per key gives ``protocol.rng``'s streams (a stacked unit's batch
shuffles draw through it), for every kind of draw the engine makes, and batches are the same through either."""
from __future__ import annotations

import numpy as np

from communities.core import protocol
from communities.workload import train


def test_rekeyed_streams_are_the_fresh_generators_streams():
    keyed = protocol.Rekeyed()
    for seed, purpose, t, i in [(0, 1, 0, 0), (3, 1, 7, 63), (2**40, 5, 10**6, 1023), (1, 16, 3, 2)]:
        a, b = protocol.rng(seed, purpose, t, i), keyed(seed, purpose, t, i)
        assert np.array_equal(a.permutation(301), b.permutation(301))
        assert np.array_equal(a.random(5), b.random(5)) and a.poisson(2.5) == b.poisson(2.5)
        assert np.array_equal(a.integers(0, 10, 7), b.integers(0, 10, 7))


def test_batches_are_the_same_through_a_rekeyed_generator():
    keyed = protocol.Rekeyed()
    for rank in range(5):
        for steps in (None, 7):
            fresh = list(train.batches(50 + rank, 16, 3, rank, 4, steps=steps))
            got = list(train.batches(50 + rank, 16, 3, rank, 4, steps=steps, keyed=keyed))
            assert len(fresh) == len(got) and all(np.array_equal(a, b) for a, b in zip(fresh, got))
