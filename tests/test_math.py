"""The pure math, without MPI: schedules, signatures, clustering, partner law, protocol, merge rules."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import adjusted_rand_score

from communities import clustering, merge, partners, protocol, schedule, signature


# ----------------------------------------------------------------------------- schedules

@pytest.mark.parametrize("shape", ["linear", "cosine", "exp"])
def test_schedule_endpoints_and_monotone(shape):
    vals = [schedule.value(t, 0.02, 1.0, shape, begin=5, horizon=50) for t in range(0, 80)]
    assert vals[0] == pytest.approx(0.02) and vals[5] == pytest.approx(0.02)
    assert vals[55] == pytest.approx(1.0) and vals[-1] == pytest.approx(1.0)
    assert all(b >= a - 1e-12 for a, b in zip(vals, vals[1:]))


def test_exp_schedule_rejects_zero():
    with pytest.raises(ValueError):
        schedule.value(1, 0.0, 1.0, "exp")


# ----------------------------------------------------------------------------- signatures

def _pairs_distortion(sk, P, n_pairs, rng, scale=1.0):
    ratios = []
    for _ in range(n_pairs):
        x = torch.from_numpy(rng.normal(size=P).astype(np.float32)) * scale
        y = torch.from_numpy(rng.normal(size=P).astype(np.float32)) * scale
        exact = float(torch.dist(x.double(), y.double()))
        approx = float(np.linalg.norm(sk(x).numpy() - sk(y).numpy()))
        ratios.append(approx / exact)
    return np.array(ratios)


@pytest.mark.parametrize("kind", ["countsketch", "gaussian"])
def test_signature_distances_track_true_distances(kind):
    """JL: ||S(x-y)|| / ||x-y|| concentrates around 1 with spread ~ sqrt(2/d)."""
    d, P = 256, 50_000 if kind == "countsketch" else 5_000
    sk = signature.make_sketch(kind, P, d, seed=1)
    r = _pairs_distortion(sk, P, 60, np.random.default_rng(0))
    eps = math.sqrt(2.0 / d)  # std of the squared-norm ratio
    assert abs(np.mean(r**2) - 1.0) < 3 * eps / math.sqrt(len(r)) + 0.02
    assert np.max(np.abs(r - 1.0)) < 4 * eps


def test_countsketch_is_linear_so_drift_needs_no_copy():
    P = 70_001  # not a multiple of the column width: exercises the tail
    sk = signature.CountSketch(P, 64, seed=5)
    w0 = torch.randn(P)
    w = w0 + 1e-3 * torch.randn(P)
    signer = signature.Signer(sk, sk(w0).numpy())
    direct = sk((w - w0).contiguous()).numpy()
    assert np.allclose(signer(w), direct, rtol=1e-3, atol=1e-4 * np.abs(direct).max())


def test_countsketch_never_holds_a_P_by_d_matrix():
    P, d = 10_000_000, 256
    sk = signature.CountSketch(P, d, seed=0)
    held = sum(t.numel() * t.element_size() for t in (sk.row_sign, sk.col_sign, sk.bucket))
    assert held < 0.05 * P * 4  # far below even one copy of the weights, let alone P x d
    assert sk.m * sk.rows + sk.tail == P


def test_signature_is_seeded():
    x = torch.randn(3000)
    a = signature.CountSketch(3000, 32, seed=9)(x)
    b = signature.CountSketch(3000, 32, seed=9)(x)
    c = signature.CountSketch(3000, 32, seed=10)(x)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_dispersion_zero_at_consensus_and_scale_free():
    S = np.tile(np.arange(8.0), (5, 1))
    assert signature.dispersion(S) == 0.0
    R = np.random.default_rng(0).normal(size=(6, 16))
    assert signature.dispersion(R) == pytest.approx(signature.dispersion(R * 1e3))
    assert 0.5 < signature.dispersion(R) < 1.0


# ----------------------------------------------------------------------------- clustering

def planted(n_groups=4, per=4, d=64, spread=0.05, seed=0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(n_groups, d))
    S = np.repeat(centers, per, axis=0) + spread * rng.normal(size=(n_groups * per, d))
    return S, np.repeat(np.arange(n_groups), per)


@pytest.mark.parametrize("method,metric", [("average", "cosine"), ("complete", "cosine"), ("ward", "euclidean"),
                                           ("single", "euclidean")])
def test_planted_groups_are_recovered(method, metric):
    S, truth = planted()
    for cut, kw in (("maxclust", {"k": 4}), ("auto", {})):
        com = clustering.find_communities(S, method, metric, cut, **kw)
        assert adjusted_rand_score(truth, com.labels) >= 0.9
        assert com.count == 4


def test_auto_cut_gives_one_community_at_consensus():
    rng = np.random.default_rng(1)
    base = rng.normal(size=64)
    S = base + 1e-3 * rng.normal(size=(8, 64))
    com = clustering.find_communities(S, "average", "cosine", "auto", min_separation=0.1)
    assert com.count == 1


def test_labels_are_canonical():
    assert clustering.canonical(np.array([7, 7, 3, 9, 3])).tolist() == [0, 0, 1, 2, 1]


def test_distance_cut_and_height():
    S, _ = planted(2, 3)
    com = clustering.find_communities(S, "average", "euclidean", "distance", threshold=1e-6)
    assert com.count == 6
    com = clustering.find_communities(S, "average", "euclidean", "maxclust", k=2)
    assert com.Z[-2, 2] <= com.cut_height <= com.Z[-1, 2]


# ----------------------------------------------------------------------------- partner law

def test_flat_law_prefers_own_community_and_anneals_to_uniform():
    labels = np.array([0, 0, 0, 1, 1, 2])
    p = partners.flat_probabilities(labels, 0, 1.0, 0.01)
    assert p[0] == 0 and p.sum() == pytest.approx(1)
    assert p[1] + p[2] > 0.95
    u = partners.flat_probabilities(labels, 0, 1.0, 1.0)
    assert np.allclose(u[1:], 1 / 5)


def test_singleton_with_zero_cross_falls_back_to_uniform():
    p = partners.flat_probabilities(np.array([0, 1, 1]), 0, 1.0, 0.0)
    assert p[0] == 0 and np.allclose(p[1:], 0.5)


def test_hierarchical_law_follows_tree_and_temperature():
    S, truth = planted(2, 3)
    com = clustering.find_communities(S, "average", "euclidean", "maxclust", k=2)
    h = partners.cophenetic_heights(com.Z)
    cold = partners.hierarchical_probabilities(h, 6, 0, 0.02)
    hot = partners.hierarchical_probabilities(h, 6, 0, 1e6)
    same = truth == truth[0]
    same[0] = False
    assert cold[same].sum() > 0.99
    assert np.allclose(hot[1:], 1 / 5, atol=1e-4) and hot[0] == 0


@given(st.integers(2, 40), st.integers(0, 39))
@settings(max_examples=50, deadline=None)
def test_condensed_row_matches_squareform(n, i):
    from scipy.spatial.distance import squareform

    i = i % n
    c = np.random.default_rng(n).random(n * (n - 1) // 2)
    assert np.array_equal(partners.condensed_row(c, n, i), squareform(c)[i])


# ----------------------------------------------------------------------------- protocol

def test_merge_interval_mean_is_lambda():
    k = [protocol.merge_interval(0, t, i, 3.0) for t in range(200) for i in range(20)]
    assert min(k) >= 1 and abs(np.mean(k) - 3.0) < 0.1


def test_exchange_lists_are_a_pure_function_of_seed_and_time():
    labels = np.array([0, 0, 1, 1, 1])

    def lists():
        clock = protocol.MergeClock(5, seed=4, lam=2.0)
        out = []
        for t in range(1, 50):
            out.append(protocol.exchange_list(clock.fire(t), t, 4,
                                              lambda i: partners.flat_probabilities(labels, i, 1.0, 0.1)))
        return out

    a, b = lists(), lists()
    assert a == b
    flat = [e for es in a for e in es]
    assert all(i != j for i, j in flat) and len(flat) > 50


def test_my_exchanges_keep_list_order():
    plan = [(0, 3), (1, 2), (2, 3), (3, 1)]
    assert protocol.my_exchanges(plan, 3) == [(0, (0, 3)), (2, (2, 3)), (1, (3, 1))]


def test_exchange_order_cannot_deadlock():
    """Simulate blocking pairwise exchanges: every list drains, whatever the order of arrivals."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(2, 9))
        plan = [(int(i), int(j)) for i, j in rng.integers(0, n, size=(12, 2)) if i != j]
        queues = {r: [e for e in plan if r in e] for r in range(n)}
        progress = True
        while progress:
            progress = False
            for r in range(n):
                if queues[r]:
                    e = queues[r][0]
                    other = e[0] if e[1] == r else e[1]
                    if queues[other] and queues[other][0] == e:
                        queues[r].pop(0)
                        queues[other].pop(0)
                        progress = True
        assert all(not q for q in queues.values())


def test_digest_changes_with_content():
    a = protocol.digest(np.arange(4), np.zeros(3))
    assert a == protocol.digest(np.arange(4), np.zeros(3))
    assert a != protocol.digest(np.arange(4), np.ones(3))


# ----------------------------------------------------------------------------- merge rules

@pytest.mark.parametrize("rule", ["constant", "ema", "swap"])
def test_symmetric_merges_conserve_the_mean_and_never_raise_the_spread(rule):
    sched = type("S", (), dict(start=0.1, end=0.5, shape="linear", begin=0, horizon=10))()
    rng = np.random.default_rng(0)
    W = [torch.from_numpy(rng.normal(size=100)).double() for _ in range(6)]
    mean0 = torch.stack(W).mean(0)
    spread = lambda: float(sum(torch.dist(w, torch.stack(W).mean(0)) ** 2 for w in W))
    s_prev = spread()
    for t in range(40):
        i, j = rng.choice(6, 2, replace=False)
        me, other = merge.Side(10, 1.0), merge.Side(20, 2.0)
        a_i = merge.coefficient(rule, me, other, 0.5, t, sched)
        a_j = merge.coefficient(rule, other, me, 0.5, t, sched)
        assert a_i == a_j
        wi, wj = W[i].clone(), W[j].clone()
        merge.interpolate_(W[i], wj, a_i)
        merge.interpolate_(W[j], wi, a_j)
        assert torch.allclose(torch.stack(W).mean(0), mean0, atol=1e-12)
        s = spread()
        assert s <= s_prev + 1e-9
        s_prev = s


@pytest.mark.parametrize("rule", ["clock", "loss"])
def test_weighted_rules_conserve_the_weighted_sum(rule):
    me, other = merge.Side(100, 0.5), merge.Side(300, 2.0)
    a_me = merge.coefficient(rule, me, other, 0.5)
    a_other = merge.coefficient(rule, other, me, 0.5)
    c_me, c_other = (100, 300) if rule == "clock" else (1 / 0.5, 1 / 2.0)
    wi, wj = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    before = c_me * wi + c_other * wj
    ni, nj = wi.clone(), wj.clone()
    merge.interpolate_(ni, wj, a_me)
    merge.interpolate_(nj, wi, a_other)
    assert torch.allclose(c_me * ni + c_other * nj, before)
    assert torch.allclose(ni, nj)  # alpha 0.5: both land on the weighted average


def test_outer_optimizer_identity_at_lr1_mu0():
    before, merged = torch.randn(10), torch.randn(10)
    target = merged.clone()
    merge.OuterOptimizer(10, 1.0, 0.0, False).step_(before, merged)
    assert torch.allclose(merged, target)


def test_a_world_of_one_is_one_community():
    com = clustering.find_communities(np.ones((1, 8)), cut="auto")
    assert com.count == 1 and com.Z.shape == (0, 4)
