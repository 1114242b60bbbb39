"""Data-parallel groups (``train.group_size``): the layout, the calls inside a group, the view across groups.

Inside a group, sums are the pairwise tree over its members in rank order (the bits of the same call between
processes); across groups, every group speaks through its lead: gathers keep the leads' rows, sums add the
leads' values only, and a member of a group receives exactly what its lead received from the partner group.
(Between processes: tests/mpi/test_groups_mpi.py.)
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from communities import config
from communities.core.groups import GroupLayout, tree_mean_rows
from communities.core.placement import tree_sum
from communities.errors import ConfigError, Disagreement
from communities.refusals import check_placement, group_placement_problem, placement_refusal
from communities.runtime import population
from communities.runtime.comm import World
from communities.runtime.groups import build_groups
from communities.runtime.tags import Tag
from communities.workload.vectorized import StackedTrainer

from .test_engine_parts import make_cfg


@pytest.fixture
def world():
    w = World(timeout=0)
    yield w
    w.close()


# ---------------------------------------------------------------- the layout (pure)


def test_the_layout_names_groups_members_and_leads():
    lay = GroupLayout(8, 4)
    assert lay.groups == 2 and lay.members(1) == [4, 5, 6, 7]
    assert [lay.group_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert lay.leads().tolist() == [0, 4]
    alive = np.array([False, True, True, True, False, False, False, False])
    assert lay.leads(alive).tolist() == [1, -1] and lay.group_alive(alive).tolist() == [True, False]
    assert lay.lead(0, alive) == 1
    with pytest.raises(ValueError, match="no replica alive"):
        lay.lead(1, alive)
    assert lay.of_groups(np.arange(8) * 10).tolist() == [0, 40]


def test_the_layout_refuses_what_cannot_be_grouped():
    with pytest.raises(ValueError, match="must divide world_size=6"):
        GroupLayout(6, 4)
    assert group_placement_problem(8, 64, 2) is None  # groups inside a process's 32
    assert group_placement_problem(8, 64, 16) is None  # each group spans two processes of 4
    problem = group_placement_problem(4, 24, 4)  # blocks of 6: neither divides the other
    assert problem is not None and "group_size=4" in problem and "6 replicas each" in problem
    assert not GroupLayout(64, 8).spans_processes(2) and GroupLayout(64, 8).spans_processes(16)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 7), st.integers(1, 3), st.integers(1, 5))
def test_the_stacked_group_mean_is_the_members_tree(size, groups, width):
    rows = torch.randn(size * groups, width, generator=torch.Generator().manual_seed(size * 31 + width),
                       dtype=torch.float32)
    got = tree_mean_rows(rows, size)
    for g in range(groups):
        want = tree_sum(list(rows[g * size: (g + 1) * size])) / size
        assert torch.equal(got[g], want)  # bit for bit: the order MPI's Allreduce and the hub's tree use


# ---------------------------------------------------------------- the config


def _cfg(**dotted) -> config.Config:
    return make_cfg(**{k.replace("__", "."): v for k, v in dotted.items()})


def test_the_config_refuses_groups_where_they_cannot_work_naming_the_key():
    with pytest.raises(ConfigError, match=r"train.group_size=3 is refused with world_size=8 \(a group size must"):
        _cfg(world_size=8, train__group_size=3)
    for key, value, named in (("strategy", "allreduce", "strategy='allreduce'"),
                              ("examples__track", True, "examples.track"),
                              ("faults__hostile_rank", 1, "faults.hostile_rank")):
        with pytest.raises(ConfigError, match=r"train.group_size=2 is refused with " + named.replace(".", r"\.")):
            _cfg(**{"train__group_size": 2, "strategy": "community", key: value})
    # protocol async: a group must lie inside a process, which the placement decides (refusals.placement_refusal)
    assert _cfg(train__group_size=2, strategy="community", protocol="async").protocol == "async"
    cfg = _cfg(train__group_size=2, strategy="community")
    with pytest.raises(ConfigError, match="leaves 1 group"):
        cfg.check_world(2)
    cfg.check_world(4)


def test_a_population_refuses_groups_that_straddle_its_blocks():
    with pytest.raises(ConfigError, match=r"train.group_size=4 with world_size=24 on 4 processes"):
        check_placement(_cfg(world_size=24, train__group_size=4), 4)
    assert check_placement(_cfg(world_size=24, train__group_size=3), 4) == 24


def test_a_lost_member_leaves_its_group_except_where_groups_span_processes():
    """comm.fault_tolerance shrink with groups: a group inside a process, or one replica per process, goes on
    without a lost member (tests/mpi/test_groups_mpi.py); a group spanning processes is refused, naming the key."""
    shrink = dict(comm__fault_tolerance="shrink", strategy="community")
    assert placement_refusal(_cfg(world_size=16, train__group_size=2, **shrink), 4) is None
    assert placement_refusal(_cfg(world_size=16, train__group_size=2, **shrink), 16) is None
    why = placement_refusal(_cfg(world_size=16, train__group_size=8, **shrink), 4)
    assert why is not None and "train.group_size=8" in why and "comm.fault_tolerance=shrink" in why


# ---------------------------------------------------------------- inside a group: the hub's tree


def test_inside_a_group_sums_are_the_members_tree_and_broadcasts_the_roots(world):
    rows = [torch.randn(129, generator=torch.Generator().manual_seed(r)) for r in range(8)]
    lay = GroupLayout(8, 4)

    def replica(w):
        intra = w.intra_group(lay)
        t = rows[w.rank].clone()
        intra.allreduce_sum_(t)
        arr = intra.allreduce_array(np.array([w.rank, 1.0]), "sum")
        b = torch.full((5,), float(w.rank))
        intra.bcast_(b, 2)  # from member 2 of each group
        small = intra.bcast_array(np.array([w.rank * 7], dtype=np.int64) if intra.member == 2 else None, (1,),
                                  np.int64, 2)
        return t, arr.tolist(), b.tolist(), int(small[0]), w.bytes_in_group, w.bytes_sent

    out = population.run_population(world, 8, replica)
    for r, (t, arr, b, small, inside, sent) in enumerate(out):
        g = r // 4
        assert torch.equal(t, tree_sum(rows[4 * g: 4 * g + 4]))
        assert arr == [sum(range(4 * g, 4 * g + 4)), 4.0]
        assert b == [float(4 * g + 2)] * 5 and small == (4 * g + 2) * 7
        ring = 2 * 3 * 129 * 4 // 4
        assert inside == sent == ring + (4 * 5 * 3 + 8 * 3 if r % 4 == 2 else 0)  # the root's copies to 3 members


def test_members_that_enter_different_calls_are_a_disagreement(world):
    lay = GroupLayout(4, 2)

    def replica(w):
        intra = w.intra_group(lay)
        if w.rank == 1:
            intra.bcast_(torch.zeros(2), 0)
        else:
            intra.allreduce_sum_(torch.zeros(2))

    with pytest.raises(Disagreement, match="members of group 0 entered different calls"):
        population.run_population(world, 4, replica)


# ---------------------------------------------------------------- across groups: the leads speak


def test_across_groups_the_leads_speak_and_members_receive_their_leads_bytes(world):
    def replica(w):
        gw = build_groups(w, 2)
        assert gw is not None and (gw.rank, gw.size, gw.member) == (w.rank // 2, 4, w.rank % 2)
        rows = gw.allgather(np.array([w.rank], dtype=np.int64))
        total = gw.allreduce_scalar(1.0)  # one per group
        top = gw.allreduce_array(np.array([float(w.rank)]), "max")
        mine = torch.full((3,), float(w.rank))
        got = torch.empty(3)
        gw.sendrecv(mine, got, gw.rank ^ 1, tag=Tag.WEIGHTS)  # group g with group g ^ 1
        head = gw.sendrecv_array(np.array([w.rank], dtype=np.int64), gw.rank ^ 1, tag=Tag.HEADER)
        vec = gw.sendrecv_vector(np.arange(w.rank + 1, dtype=np.float64), gw.rank ^ 1, tag=Tag.SIGNATURES)
        return rows.tolist(), total, float(top[0]), got.tolist(), int(head[0]), vec.tolist(), gw.bytes_sent

    out = population.run_population(world, 8, replica)
    for r, (rows, total, top, got, head, vec, between) in enumerate(out):
        partner_lead = 2 * ((r // 2) ^ 1)
        assert rows == [[0], [2], [4], [6]] and total == 4.0 and top == 7.0
        assert got == [float(partner_lead)] * 3 and head == partner_lead  # the partner's lead's, on every member
        assert vec == list(range(partner_lead + 1))
        gathered = 8 * 7  # every replica's row joins the gather; only leads send the exchanges between groups
        assert between == gathered if r % 2 else between > gathered
    with pytest.raises(AttributeError, match="not available across data-parallel groups"):
        population.run_population(world, 4, lambda w: build_groups(w, 2).isend)


# ---------------------------------------------------------------- the stacked step


def test_stacked_members_of_a_group_take_the_same_steps_as_their_average():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    flat0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    cfg = _cfg(train__lr=0.1, train__momentum=0.9, train__batch_size=8).train
    xs = [torch.randn(24, 6, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    ys = [torch.randint(0, 3, (24,), generator=torch.Generator().manual_seed(10 + r)) for r in range(4)]
    trainer = StackedTrainer(model, torch.stack([flat0] * 4), cfg, name="mlp")
    trainer.train_unit(xs, ys, [0, 1, 2, 3], seed=0, t=1, steps=3, group_size=2)
    w = trainer.flats
    assert torch.equal(w[0], w[1]) and torch.equal(w[2], w[3]) and not torch.equal(w[0], w[2])
    # the same as one model whose gradient is the mean of its two members' (sequential, torch.optim)
    from communities.workload import models, train

    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    opt = train.make_optimizer(cfg, ref.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    plans = [list(train.batches(24, 8, 0, r, 1, steps=3)) for r in (0, 1)]
    flat_grad = models.bind_flat_grad_(ref)
    for k in range(3):
        grads = []
        for r in (0, 1):
            flat_grad.zero_()
            loss_fn(ref(xs[r][plans[r][k]]), ys[r][plans[r][k]]).backward()
            grads.append(flat_grad.clone())
        flat_grad.copy_(tree_sum(grads) / 2)
        opt.step()
    got = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    assert torch.allclose(w[0], got, atol=1e-6)
    with pytest.raises(ValueError, match="do not form groups of 3"):
        trainer.train_unit(xs, ys, [0, 1, 2, 3], seed=0, t=2, steps=1, group_size=3)
