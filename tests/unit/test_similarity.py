"""Functional similarity (communities.core.similarity), without MPI: linear CKA, its sketch, the CKA matrix."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from communities.core import similarity as sim


def reference_cka(X, Y):
    """Independent reference: HSIC with the centring matrix H = I - 11^T / n on linear kernels."""
    X, Y = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    n = X.shape[0]
    H = np.eye(n) - np.ones((n, n)) / n
    K, L = X @ X.T, Y @ Y.T

    def hsic(A, B):
        return np.trace(A @ H @ B @ H) / (n - 1) ** 2

    return hsic(K, L) / np.sqrt(hsic(K, K) * hsic(L, L))


def _orthogonal(rng, p):
    q, r = np.linalg.qr(rng.standard_normal((p, p)))
    return q * np.sign(np.diag(r))


# ----------------------------------------------------------------------------- linear CKA

@pytest.mark.parametrize("n,p,q", [(50, 8, 12), (30, 60, 5), (10, 100, 120), (200, 3, 3)])
def test_linear_cka_matches_hsic_reference(n, p, q):
    rng = np.random.default_rng(n + p + q)
    X = rng.standard_normal((n, p)) + rng.standard_normal(p)  # non-centred on purpose
    Y = np.tanh(X @ rng.standard_normal((p, q))) + 0.3 * rng.standard_normal((n, q))
    got = sim.linear_cka(X, Y)
    assert got == pytest.approx(reference_cka(X, Y), rel=1e-10, abs=1e-12)
    assert sim.linear_cka(Y, X) == pytest.approx(got, rel=1e-12)
    assert sim.linear_cka(X, X) == pytest.approx(1.0, abs=1e-12)
    assert sim.linear_cka(torch.from_numpy(X), torch.from_numpy(Y)) == pytest.approx(got, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(4, 40), p=st.integers(1, 12), q=st.integers(1, 12), seed=st.integers(0, 2**32 - 1),
       scale=st.floats(1e-3, 1e3), shift=st.floats(-100, 100))
def test_linear_cka_invariances(n, p, q, seed, scale, shift):
    rng = np.random.default_rng(seed)
    X, Y = rng.standard_normal((n, p)), rng.standard_normal((n, q))
    base = sim.linear_cka(X, Y)
    assert 0.0 <= base <= 1.0
    assert base == pytest.approx(reference_cka(X - X.mean(0), Y - Y.mean(0)), rel=1e-8, abs=1e-10)
    assert sim.linear_cka(X @ _orthogonal(rng, p), Y) == pytest.approx(base, rel=1e-8, abs=1e-10)
    assert sim.linear_cka(X, Y @ _orthogonal(rng, q)) == pytest.approx(base, rel=1e-8, abs=1e-10)
    assert sim.linear_cka(scale * X, Y) == pytest.approx(base, rel=1e-8, abs=1e-10)
    assert sim.linear_cka(X + shift, Y) == pytest.approx(base, rel=1e-6, abs=1e-8)


def test_linear_cka_edge_cases():
    X = np.random.default_rng(0).standard_normal((10, 3))
    assert sim.linear_cka(X, np.ones((10, 4))) == 0.0  # a constant representation
    with pytest.raises(ValueError):
        sim.linear_cka(X, X[:9])
    with pytest.raises(ValueError):
        sim.linear_cka(X[:1], X[:1])


# ----------------------------------------------------------------------------- the sketch

def _relu_pair(rng, n, width, kind, d_in=16):
    """Hidden ReLU features of two random one-layer nets on the same inputs (effective rank ~ 15-20)."""
    data = rng.standard_normal((n, d_in)) * np.linspace(2.0, 0.2, d_in)
    W1 = rng.standard_normal((d_in, width)) / np.sqrt(d_in)
    if kind == "similar":  # a perturbed copy: units aligned
        W2 = W1 + 0.5 * rng.standard_normal(W1.shape) / np.sqrt(d_in)
        other = data
    elif kind == "different":  # independent units, same inputs: functionally close, unaligned
        W2, other = rng.standard_normal(W1.shape) / np.sqrt(d_in), data
    else:  # unrelated inputs
        W2, other = W1, rng.standard_normal((n, d_in))
    return np.maximum(data @ W1, 0), np.maximum(other @ W2, 0)


# Stated tolerances (n = 128, width = 512, effective rank ~ 15-20): |sketched - exact CKA| per pair.
# Worst seen over 72 pairs per setting (12 seeds): plain 0.25 / 0.16 / 0.08, debiased 0.09 / 0.07 / 0.03,
# debiased mean 0.025 / 0.02 / 0.009 for k = 64 / 128 / 256.
PLAIN_TOL = {64: 0.30, 128: 0.20, 256: 0.10}
DEBIASED_TOL = {64: 0.12, 128: 0.08, 256: 0.05}


@pytest.mark.parametrize("k", [64, 128, 256])
@pytest.mark.parametrize("method", ["gaussian", "countsketch"])
def test_cka_sketch_preserves_cka(k, method):
    rng = np.random.default_rng(k)
    plain, debiased = [], []
    for trial, kind in enumerate(["similar", "different", "unrelated"] * 2):
        X, Y = _relu_pair(rng, 128, 512, kind)
        exact = sim.linear_cka(X, Y)
        blocks = np.stack([sim.cka_sketch(X, k, seed=trial, method=method),
                           sim.cka_sketch(Y, k, seed=trial, method=method)])
        assert blocks.shape == (2, 128, k) and blocks.dtype == np.float32
        plain.append(sim.cka_matrix(blocks)[0, 1] - exact)
        debiased.append(sim.cka_matrix(blocks, debias=True)[0, 1] - exact)
    plain, debiased = np.abs(plain), np.abs(debiased)
    assert plain.max() < PLAIN_TOL[k], plain
    assert debiased.max() < DEBIASED_TOL[k], debiased
    assert debiased.mean() < 0.03 and debiased.mean() < plain.mean() + 1e-3


def test_cka_sketch_is_exact_when_narrow_and_seeded():
    rng = np.random.default_rng(3)
    X, Y = rng.standard_normal((40, 20)), rng.standard_normal((40, 30))
    assert sim.sketch_is_exact(30, 32) and not sim.sketch_is_exact(33, 32)
    a, b = sim.cka_sketch(X, 32, 0, dtype=np.float64), sim.cka_sketch(Y, 32, 0, dtype=np.float64)
    assert sim.linear_cka(a, b) == pytest.approx(sim.linear_cka(X, Y), rel=1e-10)  # zero-padded, exact
    np.testing.assert_allclose(a.mean(axis=0), 0.0, atol=1e-12)
    W = rng.standard_normal((40, 300))
    s1, s2 = sim.cka_sketch(W, 16, seed=9), sim.cka_sketch(W.copy(), 16, seed=9)
    assert s1.tobytes() == s2.tobytes()  # every rank draws the same projection
    assert sim.cka_sketch(W, 16, seed=10).tobytes() != s1.tobytes()
    conv = rng.standard_normal((40, 3, 4, 5))  # more dims are flattened
    assert sim.cka_sketch(conv, 16, 1).shape == (40, 16)
    with pytest.raises(ValueError):
        sim.cka_sketch(W, 0, 1)
    with pytest.raises(ValueError):
        sim.cka_sketch(W, 16, 1, method="srht")


# ----------------------------------------------------------------------------- the matrix

def _blocks(N=6, n=24, k=8, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n, k))
    return np.stack([base + (i % 3) * rng.standard_normal((n, k)) for i in range(N)]).astype(np.float32)


@pytest.mark.parametrize("debias", [False, True])
def test_cka_matrix_symmetric_diag_one_and_bitwise_reproducible(debias):
    B = _blocks()
    C = sim.cka_matrix(B, debias=debias)
    assert C.shape == (6, 6) and C.dtype == np.float64
    assert np.array_equal(C, C.T)
    assert np.array_equal(np.diag(C), np.ones(6))
    assert ((C >= 0) & (C <= 1)).all()
    again = sim.cka_matrix(B, debias=debias)
    from_copy = sim.cka_matrix(np.frombuffer(B.tobytes(), dtype=np.float32).reshape(B.shape), debias=debias)
    from_tensor = sim.cka_matrix(torch.from_numpy(B.copy()), debias=debias)
    assert C.tobytes() == again.tobytes() == from_copy.tobytes() == from_tensor.tobytes()
    perm = np.random.default_rng(1).permutation(6)  # an entry depends on its two blocks only
    assert sim.cka_matrix(B[perm], debias=debias).tobytes() == C[np.ix_(perm, perm)].tobytes()
    assert B.tobytes() == _blocks().tobytes()  # the input is not modified


def test_cka_matrix_matches_pairwise_linear_cka():
    B = _blocks(N=5, n=30, k=12, seed=4).astype(np.float64)
    C = sim.cka_matrix(B)
    for i in range(5):
        for j in range(5):
            if i != j:
                assert C[i, j] == pytest.approx(sim.linear_cka(B[i], B[j]), rel=1e-10, abs=1e-12)


def test_cka_matrix_degenerate_blocks():
    B = _blocks(N=4).astype(np.float64)
    B[1] = 3.0  # constant
    B[2, 0, 0] = np.nan  # a diverged rank
    C = sim.cka_matrix(B)
    assert np.array_equal(np.diag(C), np.ones(4))
    assert (C[1, [0, 2, 3]] == 0).all() and (C[2, [0, 1, 3]] == 0).all()
    with pytest.raises(ValueError):
        sim.cka_matrix(np.zeros((3, 5)))
    with pytest.raises(ValueError):
        sim.cka_matrix(np.zeros((3, 1, 4)))


def test_cka_distances_condensed_for_linkage():
    B = _blocks(N=6)
    d = sim.cka_distances(B)
    C = sim.cka_matrix(B)
    assert d.shape == (15,)
    np.testing.assert_array_equal(d, squareform(np.clip(1 - C, 0, 1) * (1 - np.eye(6)), checks=False))
    assert ((d >= 0) & (d <= 1)).all()
    Z = hierarchy.linkage(d, method="average")
    labels = hierarchy.fcluster(Z, 3, "maxclust")
    assert labels[0] == labels[3]  # blocks 0 and 3 are both the unperturbed base: distance 0
    with pytest.raises(ValueError):
        sim.cka_distances(B[:1])


def test_cka_groups_planted_models():
    """Two groups of models (different inputs-to-features maps) separate under CKA of their sketches."""
    rng = np.random.default_rng(11)
    n, d_in, width = 64, 8, 256
    data = rng.standard_normal((n, d_in))
    protos = [rng.standard_normal((d_in, width)) for _ in range(2)]
    feats = [np.maximum(data @ (protos[g] + 0.3 * rng.standard_normal((d_in, width))), 0)
             for g in (0, 0, 0, 1, 1, 1)]
    feats[3:] = [np.tanh(f[:, ::-1] ** 2) for f in feats[3:]]
    B = np.stack([sim.cka_sketch(f, 64, seed=5) for f in feats])
    labels = hierarchy.fcluster(hierarchy.linkage(sim.cka_distances(B, debias=True), "average"), 2, "maxclust")
    assert len(set(labels[:3])) == 1 and len(set(labels[3:])) == 1 and labels[0] != labels[3]


# ----------------------------------------------------------------------------- probe batch, logits

def test_probe_indices():
    a = sim.probe_indices(1000, 64, seed=3)
    assert a.dtype == np.int64 and a.shape == (64,)
    assert np.unique(a).size == 64 and a.min() >= 0 and a.max() < 1000 and np.all(np.diff(a) > 0)
    assert np.array_equal(a, sim.probe_indices(1000, 64, seed=3))
    assert not np.array_equal(a, sim.probe_indices(1000, 64, seed=4))
    assert np.array_equal(sim.probe_indices(10, 10, 0), np.arange(10))
    for bad in [(10, 11), (10, 0)]:
        with pytest.raises(ValueError):
            sim.probe_indices(*bad, seed=0)


def test_logits_signature_is_shift_invariant():
    rng = np.random.default_rng(0)
    L = rng.standard_normal((16, 10)) * 3
    s = sim.logits_signature(L)
    assert s.dtype == np.float32 and s.shape == (160,)
    shifted = L + rng.standard_normal((16, 1)) * 50  # a per-example constant: same softmax
    np.testing.assert_allclose(sim.logits_signature(shifted), s, atol=1e-5)
    np.testing.assert_allclose(s.reshape(16, 10).sum(axis=1), 0, atol=1e-5)
    logp = torch.log_softmax(torch.from_numpy(L), dim=1)
    np.testing.assert_allclose(sim.logits_signature(logp), s, atol=1e-5)  # = centred log-probabilities
    raw = sim.logits_signature(torch.from_numpy(L).float(), center=False)
    np.testing.assert_array_equal(raw, L.astype(np.float32).reshape(-1))
    with pytest.raises(ValueError):
        sim.logits_signature(np.zeros(5))
