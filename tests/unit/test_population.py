"""A population's hub on a one-process world: replicas exchange and reduce as separate ranks would.

Every call a replica makes must give what the same call gives between processes: swapped buffers, the
pairwise-tree sum (the bits of MPI's Allreduce for powers of two), the root's broadcast, rows gathered in
rank order. Each replica keeps its own torch RNG, a replica's failure reaches the process, and replicas
that wait on each other are reported instead of hanging. (Between processes: tests/mpi/test_population_mpi.py.)
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from communities.core.placement import tree_sum
from communities.errors import Disagreement
from communities.runtime import population
from communities.runtime.comm import World
from communities.runtime.tags import Tag


@pytest.fixture
def world():
    w = World(timeout=0)
    yield w
    w.close()


def run(world, n, target):
    return population.run_population(world, n, target)


def test_pairs_swap_their_buffers_in_memory_and_count_in_process_bytes(world):
    def replica(w):
        mine = torch.full((3,), float(w.rank))
        got = torch.empty(3)
        w.sendrecv(mine, got, w.rank ^ 1, tag=Tag.WEIGHTS)
        small = w.sendrecv_array(np.array([w.rank * 10], dtype=np.int64), w.rank ^ 1, tag=Tag.HEADER)
        vec = w.sendrecv_vector(np.arange(w.rank + 1, dtype=np.float64), w.rank ^ 1, tag=Tag.SIGNATURES)
        return got.tolist(), int(small[0]), vec.tolist(), w.bytes_sent, w.bytes_in_process

    out = run(world, 4, replica)
    for r, (got, small, vec, sent, inside) in enumerate(out):
        p = r ^ 1
        assert got == [float(p)] * 3 and small == p * 10 and vec == list(range(p + 1))
        assert sent == inside > 0  # one process: every byte stayed in memory


def test_sums_are_the_pairwise_tree_and_every_replica_gets_them(world):
    rows = [torch.randn(257, generator=torch.Generator().manual_seed(r), dtype=torch.float32) for r in range(8)]
    want = tree_sum(rows)

    def replica(w):
        t = rows[w.rank].clone()
        w.allreduce_sum_(t)
        s = w.allreduce_scalar(0.1 * w.rank)
        m = w.allreduce_array(np.array([w.rank, -w.rank], dtype=np.float64), "max")
        return t, s, m.tolist()

    for t, s, m in run(world, 8, replica):
        assert torch.equal(t, want)  # the same bits, not merely close
        assert s == pytest.approx(2.8) and m == [7.0, 0.0]


def test_gathers_broadcasts_and_counts_keep_rank_order(world):
    def replica(w):
        rows = w.allgather(np.array([w.rank, w.rank ** 2]))
        texts = w.allgather_text(f"r{w.rank}")
        b = torch.full((2,), float(w.rank))
        w.bcast_(b, root=2)
        text = w.bcast_text("from two" if w.rank == 2 else None, root=2)
        counts = w.alltoall_counts(np.arange(4, dtype=np.int64) + 10 * w.rank)
        gathered = w.gather_rows(np.full((w.rank, 2), float(w.rank)), root=1)
        w.agree(b"same everywhere", "a test")
        w.barrier()
        return rows, texts, b.tolist(), text, counts.tolist(), gathered

    out = run(world, 4, replica)
    for r, (rows, texts, b, text, counts, gathered) in enumerate(out):
        assert rows.tolist() == [[k, k * k] for k in range(4)] and not rows.flags.writeable
        assert texts == ["r0", "r1", "r2", "r3"] and b == [2.0, 2.0] and text == "from two"
        assert counts == [10 * k + r for k in range(4)]  # what each replica counted for this one
        if r == 1:
            assert [g.shape for g in gathered] == [(k, 2) for k in range(4)] and gathered[3][0, 0] == 3.0
        else:
            assert gathered is None


def test_group_means_are_per_color_and_leave_out_who_does_not_count(world):
    def replica(w):
        t = torch.full((2,), float(w.rank))
        n = w.group_mean_(t, color=w.rank % 2, counts=w.rank != 2)
        return t.tolist(), n

    out = run(world, 4, replica)
    assert out[0] == ([0.0, 0.0], 1) and out[2] == ([0.0, 0.0], 1)  # color 0: ranks 0 and 2, 2 does not count
    assert out[1] == ([2.0, 2.0], 2) and out[3] == ([2.0, 2.0], 2)


def test_each_replica_draws_from_its_own_torch_rng(world):
    def alone(seed):
        torch.manual_seed(seed)
        return [torch.rand(1).item() for _ in range(3)]

    def replica(w):
        torch.manual_seed(100 + w.rank)
        draws = []
        for _ in range(3):
            draws.append(torch.rand(1).item())
            w.barrier()  # every replica runs between two draws
        return draws

    out = run(world, 3, replica)
    assert out == [alone(100 + r) for r in range(3)]


def test_a_replica_that_fails_fails_the_process(world):
    def replica(w):
        if w.rank == 1:
            raise ValueError("replica one broke")
        w.barrier()

    with pytest.raises(ValueError, match="replica one broke"):
        run(world, 2, replica)


def test_replicas_waiting_on_each_other_are_named_not_hung(world):
    def replica(w):
        if w.rank == 0:
            w.sendrecv_array(np.zeros(1), 1)
        else:
            w.barrier()

    with pytest.raises(RuntimeError, match="replica 0 in a Sendrecv with replica 1"):
        run(world, 2, replica)


def test_replicas_in_different_collectives_are_a_disagreement(world):
    def replica(w):
        w.barrier() if w.rank == 0 else w.allgather(np.zeros(1))

    with pytest.raises(Disagreement, match="different collectives"):
        run(world, 2, replica)


def test_mismatched_messages_between_a_pair_are_refused(world):
    def replica(w):
        w.sendrecv_array(np.zeros(2 if w.rank else 1), 1 - w.rank)

    with pytest.raises(Disagreement, match="exchange different messages"):
        run(world, 2, replica)


def test_shared_work_is_computed_once_per_process(world):
    calls = []

    def replica(w):
        return w.shared(("plan", 1), lambda: calls.append(w.rank) or object())

    out = run(world, 4, replica)
    assert calls == [0] and all(o is out[0] for o in out)


def test_a_replica_counts_the_time_the_others_of_its_process_ran_as_its_turn(world):
    """Replica 0 works 0.3 s while replica 1 waits for its turn: that is replica 1's turn, not its idle time."""
    def replica(w):
        w.barrier()
        if w.rank == 0:
            time.sleep(0.3)
        w.barrier()
        return w.turn_seconds()

    hub = population.Hub(world, 2)
    turns = hub.run(lambda w: replica(w))
    assert turns[1] >= 0.3 and turns[0] < 0.1 and hub.clock.ran >= 0.3
    assert hub.clock.waited >= 0.0 and World.turn_seconds(world) == 0.0  # one replica per process: never a turn

    def stacked(w):  # a step the replicas take as one (train.vectorize): each one's share is its own, the rest
        before = w.turn_seconds()  # the other's (its turn)
        w.together("step", None, lambda items: [time.sleep(0.4)] * len(items))
        return w.turn_seconds() - before

    during = population.Hub(world, 2).run(stacked)
    assert all(0.2 <= d < 0.35 for d in during), during


def test_shared_work_is_computed_again_after_a_loss(world):
    """What the replicas share for unit t (the exchange list) depends on who is alive: a recovery starts over."""
    hub = population.Hub(world, 2)
    first = hub.shared(("exchanges", 11), object)
    assert hub.shared(("exchanges", 11), object) is first
    hub.epoch += 1  # what ``_c_recover`` does after the shrink
    assert hub.shared(("exchanges", 11), object) is not first


def test_a_replica_world_refuses_the_async_calls(world):
    def replica(w):
        peer = w.rank ^ 1
        for k in range(3):
            w.post_ints(np.array([w.rank, k], dtype=np.int64), peer, Tag.CONTROL)
        barrier = w.ibarrier()
        got = []
        while len(got) < 3:
            msg = w.poll_ints(Tag.CONTROL, 2)
            if msg is None:
                w.pause(1e-4)
                continue
            got.append((msg[0], msg[1].tolist()))
        while not barrier.Test():
            w.pause(1e-4)
        w.complete_posts()
        with pytest.raises(ValueError, match="control messages only"):
            w.post_ints(np.zeros(1), peer, Tag.HEADER)
        return got

    out = run(world, 4, replica)
    for r, got in enumerate(out):
        assert got == [(r ^ 1, [r ^ 1, k]) for k in range(3)]
