"""The pure math, without MPI: schedules, signatures, clustering, partner law, protocol, merge rules."""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import adjusted_rand_score

from communities.core import clustering, merge, partners, protocol, schedule, signature

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


def test_countsketch_distortion_holds_for_low_rank_drift():
    """A rank-1 or rank-2 update of one layer is the typical drift; its rows are correlated, so a sketch whose
    buckets depend on the column alone would see it through one random scalar (spread ~2.5x JL's)."""
    d, rows, cols = 256, 400, 500
    sk = signature.CountSketch(rows * cols + 123, d, seed=3, columns=1000)  # 200 rows of the (rows, m) view
    rng = np.random.default_rng(0)
    ratios = []
    for k in range(60):
        rank = 1 + k % 2
        x = torch.zeros(rows * cols + 123)
        x[61: 61 + rows * cols] = torch.from_numpy((rng.normal(size=(rows, rank)) @ rng.normal(size=(rank, cols)))
                                                   .astype(np.float32).reshape(-1))
        ratios.append(float(sk(x).norm() ** 2 / x.double().norm() ** 2))
    ratios = np.array(ratios)
    eps = math.sqrt(2.0 / d)  # JL: std of the squared-norm ratio
    assert abs(ratios.mean() - 1.0) < 3 * eps / math.sqrt(len(ratios)) + 0.02
    assert ratios.std() < 1.5 * eps, f"squared-norm ratio spread {ratios.std():.3f} vs JL {eps:.3f}"


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
    held = sum(t.numel() * t.element_size() for t in (sk.row_sign, sk.row_shift, sk.col_sign, sk.bucket))
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


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-3, 9), st.integers(0, 12)), min_size=1, max_size=300))
def test_adjusted_rand_is_scikit_learns_bit_for_bit(pairs):
    """The engine scores each round without scikit-learn (one import less on every rank): the same float."""
    groups, labels = (np.array(v) for v in zip(*pairs))
    assert clustering.adjusted_rand(labels, groups) == adjusted_rand_score(groups, labels)
    assert clustering.adjusted_rand(labels, None) is None


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
    cold = partners.hierarchical_probabilities(h, 0, 0.02)
    hot = partners.hierarchical_probabilities(h, 0, 1e6)
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
    def spread():
        return float(sum(torch.dist(w, torch.stack(W).mean(0)) ** 2 for w in W))
    s_prev = spread()
    for t in range(40):
        i, j = rng.choice(6, 2, replace=False)
        me, other = merge.Side(10, 1.0), merge.Side(20, 2.0)
        a_i = merge.coefficient(rule, me, other, 0.5, t, ema=sched)
        a_j = merge.coefficient(rule, other, me, 0.5, t, ema=sched)
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
    merge.OuterOptimizer(10, lr=1.0, momentum=0.0, nesterov=False).step_(before, merged)
    assert torch.allclose(merged, target)


def test_a_world_of_one_is_one_community():
    com = clustering.find_communities(np.ones((1, 8)), cut="auto")
    assert com.count == 1 and com.Z.shape == (0, 4)


# ----------------------------------------------------------------------------- fast distances, same communities

def _pdist_reference(S, metric):
    """What clustering.pairwise computed before the Gram blocks: scipy pdist on float64 (unit rows for cosine)."""
    from scipy.spatial.distance import pdist

    S = np.asarray(S, dtype=np.float64)
    if metric == "euclidean":
        return pdist(S, "euclidean")
    norms = np.linalg.norm(S, axis=1, keepdims=True)
    U = np.divide(S, norms, out=np.zeros_like(S), where=norms > 0)
    return np.clip(pdist(U, "sqeuclidean") / 2.0, 0.0, 2.0)


def _signature_sets():
    rng = np.random.default_rng(7)
    S, _ = planted(8, 40, d=256, spread=0.3)
    yield "planted", S
    yield "planted float32", S.astype(np.float32)
    yield "gaussian", rng.normal(size=(300, 48))
    base = rng.normal(size=128)
    yield "near consensus", base + 1e-6 * rng.normal(size=(200, 128))
    far = rng.normal(size=(120, 64)) * 1e3 + 50.0
    far[60:70] = far[:10] + 1e-4 * rng.normal(size=(10, 64))  # a few near-duplicate pairs: recomputed directly
    far[80] = far[3]  # an exact duplicate
    yield "offset, near duplicates", far
    z = rng.normal(size=(40, 16))
    z[[5, 17]] = 0.0  # zero signatures
    yield "zero rows", z
    yield "two ranks", rng.normal(size=(2, 8))
    yield "block edge", rng.normal(size=(clustering._BLOCK + 2, 8))


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_fast_distances_equal_scipy_pdist(metric):
    for name, S in _signature_sets():
        ref = _pdist_reference(S, metric)
        got = clustering.pairwise(S, metric)
        assert clustering._gram_distances(clustering._rows(S, metric), metric) is not None, name  # not pdist
        assert got.shape == ref.shape and got.dtype == np.float64, name
        zero = ref == 0
        assert np.array_equal(got[zero], ref[zero]), name
        rel = np.abs(got[~zero] - ref[~zero]) / ref[~zero]
        assert rel.max(initial=0.0) <= 1e-12, (name, float(rel.max()))
        assert np.array_equal(got, clustering.pairwise(S, metric)), name  # the same bytes give the same bits


def test_many_near_duplicates_and_non_finite_rows_fall_back_to_pdist():
    rng = np.random.default_rng(3)
    base = rng.normal(size=(2, 32))
    S = base[np.arange(100) % 2] + 1e-9 * rng.normal(size=(100, 32))  # two tight groups: most pairs are close
    assert clustering._gram_distances(clustering._rows(S, "euclidean"), "euclidean") is None
    assert np.array_equal(clustering.pairwise(S, "euclidean"), _pdist_reference(S, "euclidean"))
    S = rng.normal(size=(10, 8))
    S[4, 2] = np.nan
    assert np.isnan(clustering.pairwise(S, "euclidean")).sum() == 9  # as pdist: the linkage then refuses it


@pytest.mark.parametrize("method,metric", [("average", "cosine"), ("complete", "cosine"), ("ward", "euclidean"),
                                           ("single", "euclidean"), ("average", "euclidean")])
def test_find_communities_gives_the_labels_of_the_pdist_version(method, metric):
    """On planted data the fast distances build the tree, cut and labels that pdist + sklearn silhouettes gave."""
    from scipy.cluster import hierarchy

    from communities.tools.bench import clustering as bench

    for seed, (groups, per, d) in enumerate([(4, 4, 64), (8, 24, 256), (5, 60, 32)]):
        S, truth = planted(groups, per, d=d, spread=0.4, seed=seed)
        S = S.astype(np.float32)
        ref_d = _pdist_reference(S, metric)
        ref_Z = hierarchy.linkage(ref_d, method=method)
        for cut in ("auto", "maxclust"):
            com = clustering.find_communities(S, method, metric, cut, k=groups, min_separation=0.05)
            assert np.allclose(com.Z, ref_Z, rtol=1e-12, atol=1e-14)
            assert np.array_equal(com.Z[:, [0, 1, 3]], ref_Z[:, [0, 1, 3]])  # the same merges, in the same order
            if cut == "auto":
                scale = 1.0
                if metric == "euclidean":
                    scale = float(np.sqrt(np.mean(np.sum(S.astype(np.float64) ** 2, axis=1))))
                ref = bench.cut_auto_sklearn(ref_Z, ref_d, min(16, S.shape[0] - 1), 0.25, 0.05 * scale)
            else:
                ref = clustering.canonical(hierarchy.fcluster(ref_Z, t=groups, criterion="maxclust"))
            assert np.array_equal(com.labels, ref), (seed, cut)
            assert adjusted_rand_score(truth, com.labels) == 1.0


def test_hierarchical_probabilities_equal_the_general_form():
    """The fast path (no scan for non-finite logits) gives the bits of the plain formula."""
    S, _ = planted(3, 5, d=16)
    n = S.shape[0]
    h = partners.cophenetic_heights(clustering.find_communities(S, cut="maxclust", k=3).Z)
    for i in range(n):
        for T in (1e-3, 0.07, 1.0, 1e9, np.inf):
            logits = -h.row(i) / T
            logits[i] = -np.inf
            logits -= logits[np.isfinite(logits)].max()
            w = np.exp(logits)
            assert np.array_equal(partners.hierarchical_probabilities(h, i, T), w / w.sum()), (i, T)


# ----------------------------------------------------------------------------- outer optimizer

def test_outer_optimizer_is_torch_sgd_with_nesterov_on_pseudo_gradients():
    """DiLoCo's outer step: OuterOptimizer on g = w_before - w_merged equals torch.optim.SGD(nesterov) on g."""
    gen = torch.Generator().manual_seed(0)
    n, lr, mu = 257, 0.7, 0.9
    w0 = torch.randn(n, generator=gen, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    sgd = torch.optim.SGD([p], lr=lr, momentum=mu, nesterov=True)
    outer = merge.OuterOptimizer(n, lr=lr, momentum=mu, nesterov=True, dtype=torch.float64)
    w = w0.clone()
    for step in range(6):
        g = torch.randn(n, generator=gen, dtype=torch.float64) * (0.5 + step)
        p.grad = g.clone()
        sgd.step()
        before = w.clone()
        merged = before - g  # what a merge leaves; its pseudo-gradient before - merged is g up to rounding
        outer.step_(before, merged)
        w = merged
        assert torch.allclose(w, p.detach(), rtol=0, atol=1e-12), step
        assert torch.allclose(outer.m, sgd.state[p]["momentum_buffer"], rtol=0, atol=1e-12), step
