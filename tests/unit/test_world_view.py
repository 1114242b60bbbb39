"""One contract for every world the engine is handed (``runtime/view.py``), and one byte model for all of them.

mypy proves ``World``, ``ReplicaWorld``, ``GroupWorld`` and ``LeadView`` structural subtypes of ``WorldView``
(``runtime/contract.py``, under ``make lint``); here: the two worlds that define every call do define each member
of the protocol, and a collective counts the same bytes on ``World`` and on a population's ``ReplicaWorld``, over
the ranks alive, also after a lost rank (``traffic.wire_bytes``).
"""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from communities.runtime import contract, hub_ops, population
from communities.runtime.comm import World
from communities.runtime.membership import Membership
from communities.runtime.traffic import Call, wire_bytes
from communities.runtime.view import WorldView

MEMBERS = [name for name in vars(WorldView) if not name.startswith("_")]


@pytest.fixture
def world():
    w = World(timeout=0)
    yield w
    w.close()


def test_the_protocol_names_what_the_engine_asks_and_mypy_checks_four_classes():
    assert {"rank", "size", "leads", "alive", "allgather", "sendrecv", "bytes_sent", "bytes_in_group",
            "watchdog", "set_timeout", "count_sent"} <= set(MEMBERS)
    assert [c.__name__ for c in contract.VIEWS] == ["World", "ReplicaWorld", "GroupWorld", "LeadView"]


def test_world_and_a_replica_world_define_every_member_of_the_protocol(world):
    replica = population.ReplicaWorld(population.Hub(world, 2), 1)
    for view in (world, replica):
        missing = []
        for name in MEMBERS:
            try:
                inspect.getattr_static(view, name)  # (no property runs: a replica's would wait on its hub)
            except AttributeError:
                missing.append(name)
        assert missing == [], type(view).__name__


@pytest.mark.parametrize("call,nbytes,n,root,want", [
    (Call.ALLGATHER, 16, 4, False, 48),
    (Call.ALLREDUCE, 400, 4, False, 600),  # a ring: 2 (n - 1) / n of the buffer
    (Call.ALLREDUCE, 400, 1, False, 0),
    (Call.ALLTOALL, 8, 3, False, 16),
    (Call.BCAST, 10, 4, True, 30),
    (Call.BCAST, 10, 4, False, 0),
    (Call.GATHERV, 48, 4, False, 24 + 48),  # the row counts' Allgather, then the rows to the root
    (Call.GATHERV, 48, 4, True, 24),
])
def test_the_byte_model_of_each_collective(call, nbytes, n, root, want):
    assert wire_bytes(call, nbytes, n, root=root) == want


def _calls(w):
    """The collectives a view makes, each with its bytes as World's calls count them: (name, call, Call, nbytes,
    root, control)."""
    t = torch.ones(5)
    return [
        ("allgather", lambda: w.allgather(np.zeros(2)), Call.ALLGATHER, 16, False, False),
        ("allgather_text", lambda: w.allgather_text("x", width=32), Call.ALLGATHER, 32, False, True),
        ("iallgather", lambda: w.iallgather(np.zeros(3))[0].Wait(), Call.ALLGATHER, 24, False, False),
        ("allreduce_sum_", lambda: w.allreduce_sum_(t), Call.ALLREDUCE, 20, False, False),
        ("allreduce_array", lambda: w.allreduce_array(np.ones(3), "max"), Call.ALLREDUCE, 24, False, True),
        ("alltoall_counts", lambda: w.alltoall_counts(np.zeros(4, dtype=np.int64)), Call.ALLTOALL, 8, False,
         True),
        ("bcast_", lambda: w.bcast_(t, root=1), Call.BCAST, 20, w.rank == 1, True),
        ("gather_rows", lambda: w.gather_rows(np.ones((2, 3)), root=1), Call.GATHERV, 48, w.rank == 1, True),
        ("agree", lambda: w.agree(b"same", "a test"), Call.ALLGATHER, 16, False, False),
    ]


@pytest.mark.parametrize("lost", [[], [3]])
def test_a_collective_counts_the_same_bytes_on_world_and_on_a_replica_also_after_a_loss(world, lost):
    """A population's replica counts each call as ``World`` counts the same call, over the ranks alive."""
    members = [r for r in range(4) if r not in lost]

    def replica(w):
        w.membership = Membership(4, members)  # (rank 3 lost: the counts go by the 3 alive)
        counted = []
        for name, call, *_ in _calls(w):
            before = (w.bytes_sent, w.bytes_control)
            call()
            counted.append((name, w.bytes_sent - before[0], w.bytes_control - before[1]))
        return counted

    got = population.run_population(world, 4, replica)
    for r in range(4):
        like = World(timeout=0)  # World's formula for the same calls, on a world of 4 with the same survivors
        like.rank, like.membership = r, Membership(4, members)
        want = []
        for name, _, kind, nbytes, root, control in _calls(like):
            before = (like.bytes_sent, like.bytes_control)
            like.count(kind, nbytes, root=root, control=control)
            want.append((name, like.bytes_sent - before[0], like.bytes_control - before[1]))
        like.close()
        assert got[r] == want, r
        assert dict((n, s) for n, s, _ in want)["allgather"] == 16 * (len(members) - 1)  # the ranks alive


def test_a_replicas_group_mean_counts_as_worlds_split_does(world):
    """``group_mean_``: the tensor's Allreduce and the count's, over the replicas alive of the color."""
    def replica(w):
        t = torch.ones(10)
        w.group_mean_(t, color=w.rank % 2, counts=w.rank != 0)
        return w.bytes_sent

    for sent in population.run_population(world, 6, replica):
        assert sent == wire_bytes(Call.ALLREDUCE, 40, 3) + wire_bytes(Call.ALLREDUCE, 8, 3)


def test_the_hub_completes_every_kind_of_collective_a_replica_may_hand_it():
    kinds = {c for c in vars(hub_ops).values()
             if isinstance(c, type) and issubclass(c, hub_ops.Collective) and c is not hub_ops.Collective}
    assert kinds == set(population._COMPLETE)
    assert all(issubclass(k, hub_ops.Collective) for k in hub_ops.IN_PROCESS)
