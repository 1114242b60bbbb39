"""Functional similarity of models: logits and linear CKA on a shared probe batch.

Pure numpy; no MPI. Every rank evaluates its model on the same probe batch
(``probe_indices``), reduces what it sees to a fixed-size block
(``logits_signature`` or ``cka_sketch``), allgathers the blocks as buffers, and
computes the same (N, N) similarity (``cka_matrix``) from the same bytes, so
that every rank builds the same tree from ``cka_distances``.

Linear CKA (Kornblith et al. 2019) of representations X (n x p) and Y (n x q)
of the same n examples, with Xc, Yc centred over the examples::

    CKA(X, Y) = ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)
              = <Kx, Ky>_F / (||Kx||_F ||Ky||_F),   Kx = Xc Xc^T, Ky = Yc Yc^T (n x n)

It lies in [0, 1], is invariant to orthogonal transforms and isotropic scaling
of either side (and to translations, through the centring), and is 1 for
X == Y. A constant representation (Kx = 0) has no defined CKA; here it is 0 to
everything else (distance 1), and 1 to itself on a diagonal.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from scipy.spatial.distance import squareform

_SKETCH_STREAM = 0x534B4554  # seed streams, so that one config seed drives independent draws
_PROBE_STREAM = 0x50524F42
_CHUNK = 1 << 22  # elements of a temporary in the deterministic kernels (32 MiB of float64)


def _matrix(a, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu().double().numpy()
    a = np.asarray(a, dtype=np.float64)
    if a.ndim < 2:
        raise ValueError(f"{name} must be (n, width) (more dims are flattened), got shape {a.shape}")
    a = a.reshape(a.shape[0], -1)
    if a.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 examples, got {a.shape[0]}")
    return a


def _centre(X: np.ndarray) -> np.ndarray:
    return X - X.mean(axis=0, keepdims=True)


def linear_cka(X, Y) -> float:
    """Linear CKA of (n x p) and (n x q) representations of the same n examples, in float64.

    Uses the p x q cross-covariance or the n x n Gram matrices, whichever is
    cheaper; 0.0 if either side is constant.
    """
    X, Y = _matrix(X, "X"), _matrix(Y, "Y")
    if X.shape[0] != Y.shape[0]:
        raise ValueError(f"X and Y must describe the same examples: {X.shape[0]} vs {Y.shape[0]} rows")
    Xc, Yc = _centre(X), _centre(Y)
    n, p, q = X.shape[0], X.shape[1], Y.shape[1]
    if n * n * (p + q) < n * (p * q + p * p + q * q):
        Kx, Ky = Xc @ Xc.T, Yc @ Yc.T
        cross, nx, ny = float(np.sum(Kx * Ky)), float(np.linalg.norm(Kx)), float(np.linalg.norm(Ky))
    else:
        cross = float(np.sum((Yc.T @ Xc) ** 2))
        nx, ny = float(np.linalg.norm(Xc.T @ Xc)), float(np.linalg.norm(Yc.T @ Yc))
    if not (nx > 0 and ny > 0 and math.isfinite(cross)):
        return 0.0
    return float(min(max(cross / (nx * ny), 0.0), 1.0))


def cka_sketch(features, k: int, seed: int, method: str = "gaussian", dtype=np.float32) -> np.ndarray:
    """Centre (n x width) features over the examples and project the width to k columns: an (n x k) block.

    Every rank calls it with the same seed, so all ranks use the same
    projection S (width x k) and allgather equal-size blocks; more than 2 dims
    (e.g. conv maps n x C x H x W) are flattened.

    Why CKA survives: linear CKA depends on the features only through the
    example Gram matrix ``Kx = Xc Xc^T``, i.e. the inner products between the
    n centred example vectors in R^width. ``S`` with ``E[S S^T] = I``
    (Gaussian entries N(0, 1/k), or a count-sketch: one bucket and one sign per
    column) gives ``(Xc S)(Xc S)^T = Xc S S^T Xc^T ~ Kx``: the
    Johnson-Lindenstrauss lemma on the n example vectors, so every entry is
    preserved to ``eps ||x_a|| ||x_b||`` with k = O(log(n) / eps^2). In
    aggregate, the relative Frobenius error of the Gram matrix is about
    ``sqrt(r / k)`` with ``r = tr(Kx)^2 / ||Kx||_F^2`` the effective rank of
    the centred features, and CKA, a cosine between Gram matrices, moves by
    about as much. Most of that error is a systematic downward bias (the
    sketch inflates ``||Kx||_F``), which ``cka_matrix(..., debias=True)``
    removes; what is left is the O(sqrt(r) / k)-ish spread. Measured on random
    ReLU features (effective rank ~ 20, n = 128, width 512, tests/unit/test_similarity),
    worst |error| per pair for k = 64 / 128 / 256: plain 0.25 / 0.16 / 0.08,
    debiased 0.09 / 0.07 / 0.03 (mean 0.025 / 0.02 / 0.01). Learnt representations have
    fast-decaying spectra (small r); for isotropic, high-rank features
    (r ~ k or more) the sketch carries little and k must grow.

    ``width <= k``: the centred features are zero-padded to k columns, which
    leaves the Gram matrix, hence CKA, exactly unchanged.
    """
    X = _matrix(features, "features")
    k = int(k)
    if k < 1:
        raise ValueError(f"sketch width k must be >= 1, got {k}")
    if method not in ("gaussian", "countsketch"):
        raise ValueError(f"method={method!r} is not one of ('gaussian', 'countsketch')")
    n, width = X.shape
    Xc = _centre(X)
    if width <= k:
        out = np.zeros((n, k), dtype=np.float64)
        out[:, :width] = Xc
        return out.astype(dtype)
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & (2**63 - 1), _SKETCH_STREAM, width, k]))
    if method == "gaussian":
        S = rng.standard_normal((width, k)) / math.sqrt(k)
        return (Xc @ S).astype(dtype)
    bucket = rng.integers(0, k, size=width)
    sign = rng.integers(0, 2, size=width).astype(np.float64) * 2.0 - 1.0
    out_t = np.zeros((k, n), dtype=np.float64)
    np.add.at(out_t, bucket, (Xc * sign).T)
    return out_t.T.astype(dtype)


def sketch_is_exact(width: int, k: int) -> bool:
    """Whether ``cka_sketch`` of this width zero-pads (exact, use ``debias=False``) rather than projects."""
    return int(width) <= int(k)


def _gram(X: np.ndarray) -> np.ndarray:
    """``X X^T`` without BLAS: ``K += x_c x_c^T`` for the columns c in order (elementwise ops, a fixed order)."""
    n, k = X.shape
    K = np.zeros((n, n), dtype=np.float64)
    tmp = np.empty((n, n), dtype=np.float64)
    cols = np.ascontiguousarray(X.T)
    for c in range(k):
        np.multiply.outer(cols[c], cols[c], out=tmp)
        K += tmp
    return K


def cka_matrix(blocks, debias: bool = False) -> np.ndarray:
    """(N, N) linear CKA between N ranks' (n x k) blocks: symmetric, ones on the diagonal, in float64.

    Deterministic for given bytes on any machine: no BLAS or threads. Each
    block is centred (its column means, summed row by row), its Gram matrix is
    accumulated column by column (``K += x_c x_c^T``, elementwise), normalised
    to unit Frobenius norm, and each pair's entry is one contiguous sum of the
    elementwise product of two normalised Grams, so an entry depends only on
    its two blocks (permuting the blocks permutes the matrix bitwise). Blocks
    with non-finite entries (a diverged rank) count as constant: CKA 0 to all.
    Cost: N n^2 k for the Grams plus N^2 n^2 / 2 for the pairs (2-core reference machine,
    n = 256, k = 128: ~20 ms per block, ~1.5 s for N = 64).

    ``debias=True`` is for blocks that are projections (``cka_sketch`` with
    width > k, not zero-padded ones). A projection inflates every
    ``||K||_F^2`` by about ``tr(K)^2 / k`` (the squared trace of a Gram is
    r times its squared norm, r the effective rank), and a cross term
    ``<Kx, Ky>`` by ``<Xc, Yc>_F^2 / k`` only as far as the two feature spaces
    are aligned, so plain sketched CKA is biased low, more so between models
    whose units are not aligned (with r = 20: about -0.24 at k = 64, -0.07 at
    k = 256). With Gaussian S (entries N(0, 1/k)),
    ``E <Xs Xs^T, Ys Ys^T> = <Kx, Ky> + (tr(Xc Yc^T)^2 + tr((Xc Yc^T)^2)) / k``,
    so this subtracts the leading terms, measured on the sketches::

        CKA = (<Kx, Ky> - <Xc, Yc>_F^2 / k) / sqrt((||Kx||^2 - tr(Kx)^2 / k) (||Ky||^2 - tr(Ky)^2 / k))

    leaving a bias of a few thousandths (count-sketches have nearly the same
    fourth moments). A block whose corrected norm is not positive (its sketch
    is isotropic: effective rank ~ k) counts as constant.
    """
    B = _numpy_blocks(blocks)
    N, n, k = B.shape
    V = np.zeros((N, n * n), dtype=np.float64)
    scale = np.zeros(N, dtype=np.float64)  # debias: 1 / ||K_i||_F, the factor V[i] carries
    trace2 = np.zeros(N, dtype=np.float64)  # debias: tr(K_i)^2 / (k ||K_i||_F^2)
    for i in range(N):
        X = B[i]
        if not np.isfinite(X).all():
            B[i] = 0.0
            continue
        B[i] = _centre(X)
        K = _gram(B[i])
        norm = math.sqrt(float(np.sum(K * K)))
        if norm > 0 and math.isfinite(norm):
            V[i] = (K / norm).reshape(-1)
            scale[i] = 1.0 / norm
            trace2[i] = (float(np.trace(K)) / norm) ** 2 / k
    C = np.eye(N, dtype=np.float64)
    if debias:
        den = 1.0 - trace2
        live = (scale > 0) & (den > 0)
        root = np.where(live, np.sqrt(np.where(live, den, 1.0)), 0.0)
        F = B.reshape(N, n * k)
    rows = max(1, _CHUNK // max(1, n * max(n, k)))
    for i in range(N - 1):
        for lo in range(i + 1, N, rows):
            hi = min(N, lo + rows)
            s = (V[lo:hi] * V[i]).sum(axis=1)
            if debias:
                t = (F[lo:hi] * F[i]).sum(axis=1)  # <Xc_i, Xc_j>_F = tr(Xc_i Xc_j^T)
                ok = live[lo:hi] & live[i]
                s = s - (t * t) * (scale[lo:hi] * scale[i]) / k
                s = np.where(ok, s / np.where(ok, root[lo:hi] * root[i], 1.0), 0.0)
            s = np.clip(s, 0.0, 1.0)
            C[i, lo:hi] = s
            C[lo:hi, i] = s
    return C


def _numpy_blocks(blocks) -> np.ndarray:
    if isinstance(blocks, torch.Tensor):
        blocks = blocks.detach().cpu().numpy()
    B = np.array(blocks, dtype=np.float64)  # a copy: the caller's buffer is never touched
    if B.ndim != 3 or B.shape[0] < 1 or B.shape[1] < 2:
        raise ValueError(f"blocks must be (N >= 1, n >= 2, k), got shape {B.shape}")
    return B


def cka_distances(blocks, debias: bool = False) -> np.ndarray:
    """``1 - CKA`` clipped to [0, 1], condensed in scipy's order: ready for ``hierarchy.linkage``."""
    C = cka_matrix(blocks, debias=debias)
    if C.shape[0] < 2:
        raise ValueError("need at least 2 blocks for pairwise distances")
    D = np.clip(1.0 - C, 0.0, 1.0)
    np.fill_diagonal(D, 0.0)
    return squareform(D, checks=False)


def probe_indices(n_train: int, size: int, seed: int) -> np.ndarray:
    """The shared probe batch: ``size`` distinct sorted int64 indices into the training pool, from ``seed``.

    The same on every rank running the same numpy (Generator streams are not
    promised stable across numpy versions). A stream of its own: the same
    config seed used elsewhere draws independently.
    """
    n_train, size = int(n_train), int(size)
    if not 1 <= size <= n_train:
        raise ValueError(f"probe size must be in [1, n_train={n_train}], got {size}")
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & (2**63 - 1), _PROBE_STREAM]))
    return np.sort(rng.choice(n_train, size=size, replace=False)).astype(np.int64)


def logits_signature(logits, center: bool = True) -> np.ndarray:
    """What the ``logits`` signature kind allgathers: the (n, C) probe logits, flattened, float32.

    ``center=True`` (default) subtracts each example's mean logit. Softmax is
    invariant to adding a constant to an example's logits, so two models with
    the same predictive distribution can have logits a per-example shift
    apart; the centred logits are the same for both (they equal the centred
    log-probabilities, ``log_softmax(z) - mean(log_softmax(z))``), and unlike
    the probabilities themselves they do not saturate. Centring is done in
    float64, then cast.
    """
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().cpu().double().numpy()
    L = np.asarray(logits, dtype=np.float64)
    if L.ndim != 2 or L.shape[1] < 1:
        raise ValueError(f"logits must be (n, C), got shape {L.shape}")
    if center:
        L = L - L.mean(axis=1, keepdims=True)
    return np.ascontiguousarray(L, dtype=np.float32).reshape(-1)
