"""Exact and near-exact mixing (issue 24's first parts): the one-peer hypercube reaches the exact mean of 2^k
replicas in k stages, every stage is a matching; with an outer optimizer (Nesterov on the merge's pseudo-gradient)
pairwise merges conserve the mean when every replica merges at every stage (a hypercube of 2^k), and not when merges
fire by random clocks (a replica's momentum then decays only when it merges); the community schedule's groups;
and what the options cannot run with is refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from communities import config as config_mod
from communities.core import merge, partners
from communities.core.clustering import Communities
from communities.engine.mixing import strategies
from communities.errors import ConfigError


def _average_pairs(x: np.ndarray, pairs) -> None:
    for i, j in pairs:
        x[i] = x[j] = 0.5 * (x[i] + x[j])


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 7), st.integers(0, 50), st.integers(0, 2**31 - 1))
def test_the_hypercube_reaches_the_exact_mean_of_2k_replicas_in_k_stages(k, start, seed):
    n = 1 << k
    x = np.random.default_rng(seed).normal(size=(n, 4))
    mean = x.mean(0)
    for stage in range(start, start + k):
        _average_pairs(x, partners.hypercube_pairs([range(n)], stage))
    assert np.allclose(x, mean, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=1, max_size=40, unique=True), st.integers(0, 30))
def test_every_stage_is_a_matching_inside_each_group(ranks, stage):
    half = len(ranks) // 2
    groups = [ranks[:half], ranks[half:]]
    pairs = partners.hypercube_pairs(groups, stage)
    seen = [r for p in pairs for r in p]
    assert len(seen) == len(set(seen))  # nobody twice: deadlock-free in any order
    assert all(i < j for i, j in pairs) and pairs == sorted(pairs)
    where = {r: g for g, members in enumerate(groups) for r in members}
    assert all(where[i] == where[j] for i, j in pairs)  # never across groups
    # a group of 2 always pairs; a group of m >= 2 pairs at least one at every stage
    assert all(any(i in g for i, _ in pairs) for g in groups if len(g) >= 2)


def _outer_run(x: np.ndarray, stages, lr: float = 0.7, momentum: float = 0.9) -> np.ndarray:
    """Pairwise averages (a = 0.5) each followed by each side's Nesterov outer step, no training (lr = 0)."""
    w = [torch.tensor(row) for row in x]
    outer = [merge.OuterOptimizer(x.shape[1], lr=lr, momentum=momentum, nesterov=True, dtype=torch.float64)
             for _ in w]
    for pairs in stages:
        for i, j in pairs:
            before_i, before_j = w[i].clone(), w[j].clone()
            merged = 0.5 * (before_i + before_j)
            w[i], w[j] = merged.clone(), merged.clone()
            outer[i].step_(before_i, w[i])
            outer[j].step_(before_j, w[j])
    return torch.stack(w).numpy()


def test_an_outer_step_on_a_full_matching_conserves_the_mean_and_converges():
    """Every replica merges at every stage: the momenta sum to zero forever (each pair's pseudo-gradients are
    opposite), so sum_i w_i never moves; the spread falls to nothing."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 5))
    mean, spread0 = x.mean(0), np.abs(x - x.mean(0)).max()
    out = _outer_run(x, [partners.hypercube_pairs([range(8)], s) for s in range(300)])
    assert np.allclose(out.mean(0), mean, atol=1e-10)
    assert np.abs(out - mean).max() < 1e-6 * spread0


def test_an_outer_step_on_clock_fired_merges_does_not_conserve_the_mean():
    """Merges fired by random clocks: a replica's momentum decays only when it merges, so the momenta stop summing
    to zero and the mean drifts. The outer optimizer on gossip trades exact conservation for speed."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 5))
    stages = []
    for _ in range(200):
        order = rng.permutation(8)
        k = int(rng.integers(1, 4))  # 1..3 of the 4 possible pairs merge this unit
        stages.append([tuple(sorted((int(order[2 * p]), int(order[2 * p + 1])))) for p in range(k)])
    out = _outer_run(x, stages)
    assert not np.allclose(out.mean(0), x.mean(0), atol=1e-6)
    plain = _outer_run(x, stages, lr=1.0, momentum=0.0)  # lr 1, momentum 0: the plain merge, which conserves
    assert np.allclose(plain.mean(0), x.mean(0), atol=1e-12)


def _cfg(**sections) -> config_mod.Config:
    return config_mod.from_dict(sections)


def test_the_community_hypercube_pairs_inside_communities_until_a_unit_spans_the_world():
    cfg = _cfg(strategy="community", partners={"schedule": "hypercube",
                                              "p_cross": {"start": 0.0, "end": 1.0, "begin": 10, "horizon": 10}})
    s = strategies.make(cfg, 8)
    assert s.hypercube(0) == []  # no round yet: no communities, no merges (as under the law)
    labels = np.array([0, 0, 1, 1, 0, 1, 0, 1])
    s.communities = Communities(Z=np.zeros((7, 4)), labels=labels, cut_height=1.0, distances=np.zeros(28))
    for t in range(1, 10):  # p_cross 0: inside the communities only
        assert all(labels[i] == labels[j] for i, j in s.hypercube(t))
    assert s.groups(25) == [list(range(8))]  # p_cross 1 from t = 20: every unit spans the world
    out = np.zeros(8, dtype=bool)
    out[3] = True
    assert all(3 not in p for p in s.hypercube(25, out))  # an unavailable rank is left out


def test_gossip_hypercube_pairs_over_the_world():
    s = strategies.make(_cfg(strategy="gossip", partners={"schedule": "hypercube"}), 4)
    assert s.hypercube(0) == [(0, 1), (2, 3)] and s.hypercube(1) == [(0, 2), (1, 3)]


@pytest.mark.parametrize("raw,key", [
    ({"strategy": "ring", "partners": {"schedule": "hypercube"}}, "strategy='ring'"),
    ({"protocol": "async", "partners": {"schedule": "hypercube"}}, "protocol='virtual_clock'"),
    ({"partners": {"schedule": "hypercube"}, "merge": {"partner_policy": "least_recent"}}, "partner_policy"),
    ({"strategy": "diloco", "merge": {"average_every": 4}}, "merge.period"),
    ({"protocol": "async", "merge": {"average_every": 4}}, "average_every=4"),
    ({"consensus": {"mode": "auto"}, "merge": {"average_every": 4}}, "consensus.mode='auto'"),
    ({"train": {"after_budget": "train"}}, "train.after_budget='train' is refused with protocol='virtual_clock'"),
])
def test_what_the_mixing_options_cannot_run_with_is_refused(raw, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        config_mod.from_dict(raw)
