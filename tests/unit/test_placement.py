"""Placement of replicas over processes: blocks, refusals, and the tree order of sums."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from communities.core.placement import Placement, is_power_of_two, largest_divisor, pairs_by_kind, tree_sum


def test_blocks_are_contiguous_and_cover_every_replica():
    p = Placement(64, 4)
    assert p.per_process == 16
    assert [list(p.block(k))[0] for k in range(4)] == [0, 16, 32, 48]
    assert sorted(r for k in range(4) for r in p.block(k)) == list(range(64))
    assert all(p.process_of(r) == k for k in range(4) for r in p.block(k))
    assert p.same_process(0, 15) and not p.same_process(15, 16)


def test_a_process_count_that_does_not_divide_is_refused_naming_both_numbers():
    with pytest.raises(ValueError, match=r"world_size=64 .* 3 MPI processes.*for example 2"):
        Placement(64, 3)
    with pytest.raises(ValueError, match="at least 1"):
        Placement(0, 1)


def test_helpers():
    assert [is_power_of_two(n) for n in (1, 2, 3, 4, 6, 1024)] == [True, True, False, True, False, True]
    assert largest_divisor(12, 5) == 4 and largest_divisor(7, 3) == 1
    assert Placement(8, 2).bitwise_sums and not Placement(12, 2).bitwise_sums
    assert pairs_by_kind([(0, 1), (0, 4), (5, 6)], Placement(8, 2)) == {"in_process": 2, "network": 1}


def test_tree_sum_order_is_the_pairwise_tree():
    rows = [torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    # ((1e8 + 1) + (-1e8 + 1)) in float32: each inner sum rounds the 1 away
    assert float(tree_sum(rows)) == 0.0
    assert tree_sum(rows[:1]) is not rows[0]  # a new tensor, never the input


@settings(max_examples=30, deadline=None)
@given(log_n=st.integers(0, 6), log_p=st.integers(0, 6), seed=st.integers(0, 2**31 - 1))
def test_a_tree_over_blocks_then_over_block_sums_is_the_tree_over_all(log_n, log_p, seed):
    """Why placement cannot change a mean's bits for powers of two: sum inside each process, then across."""
    n, p = 2 ** log_n, 2 ** min(log_p, log_n)
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, 33)).astype(np.float32) * (10.0 ** rng.integers(-3, 4, (n, 1))).astype(np.float32)
    rows = [torch.from_numpy(r) for r in w]
    pl = Placement(n, p)
    partial = [tree_sum([rows[r] for r in pl.block(k)]) for k in range(p)]
    assert torch.equal(tree_sum(partial), tree_sum(rows))
