"""Whether the signatures hold communities at all, and how many: a test calibrated against a null.

Why: a fixed floor on a clustering score (the silhouette) means something else at
every N. At 1,024 replicas under concept shift the right partition had a
silhouette of 0.24 and a floor of 0.25 refused it; on a planted shift at 256 the
silhouettes of correct partitions were all under 0.1. What is wanted is the
answer to "would a cloud without communities, of this size and this shape,
split this well?", at a stated false-positive rate.

The test, per signature round (pure functions of the gathered rows):

1. The rows (unit rows for the cosine metric), centred, are reduced to their
   top ``r = max_k - 1`` principal-component scores ``Y = U_r diag(s_r)``: k
   communities differ in at most k - 1 directions, and the remaining ones only
   add noise to every split alike.
2. The statistic is the profile ``L_k = log(W_k / W_1)``, k = 2..max_k, of
   Ward's tree on Y: ``W_k`` is the within-community sum of squares of the tree
   cut into k (Ward merges add ``h^2 / 2`` to it, so one tree gives every k).
3. The null draws are clouds without communities of the same size and spread,
   put through the same steps as the rows (a parametric bootstrap): n rows of
   independent uniform scores on every principal axis the rows span, with
   variances set so that the draws' principal variances match the rows' on
   average (``null_variances``), centred and reduced to *their own* top r
   principal scores. Re-estimating the axes inside each draw matters with
   few rows: the observed top components are the directions that happen to
   spread the rows most, which makes them look more split than axes taken as
   known (with the axes fixed, clouds of the null's own shape were split at
   twice the level up to 64 rows). Uniform is the least favourable unimodal
   reference (Tibshirani, Walther & Hastie 2001, the gap statistic's reference
   "aligned with the principal components"): a uniform cloud splits more
   cleanly than a Gaussian of the same variance, so a Gaussian cloud, or any
   flatter-topped unimodal one, is rejected less often than the level. (A
   Gaussian null with the rows' own covariance, as SigClust's, Liu et al.
   2008, was rejected on a quarter of real IID first rounds at 64 replicas:
   their top components are flatter than Gaussian.)
4. Each profile is standardised by the mean and deviation of the other B
   profiles (leave one out) and reduced to its largest standardised gap
   ``T = max_k z_k``; the p-value is the rank of the observed T among the
   B + 1 (a Monte Carlo test: the observed rows and B draws from the null are
   exchangeable, so P(p <= alpha) = floor(alpha (B + 1)) / (B + 1)).
5. Communities exist when ``p <= alpha``; their number is the gap statistic's
   rule on ``gap_k = mean(L_k of the draws) - L_k``: the smallest k with
   ``gap_k >= gap_{k+1} - s_{k+1}`` (``s``: the draws' deviation times
   sqrt(1 + 1/B)).

Every draw comes from the counter-keyed generator of (seed, Purpose.COMMUNITY,
t, draw), so every rank derives the same p-value from the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import numpy as np
from scipy import linalg
from scipy.cluster import hierarchy

from .blas import aligned, one_blas_thread
from .protocol import Purpose, rng

# A profile value is log(W_k / W_1); a cut with W_k = 0 (duplicate rows) counts as this far below W_1.
_FLOOR = 1e-300
# The counter of the subsample's stream (the null draws use 0, 1, ...: the protocol's rng takes i < 2^20)
_SUBSAMPLE = (1 << 20) - 1
# Null draws whose mean spectrum sets the null's axis variances (null_variances), per pass
SPECTRUM_DRAWS = 16


@dataclass(frozen=True)
class Detection:
    """The outcome of one test: ``k`` communities (1: none found), with the evidence behind it."""

    k: int
    p_value: float
    alpha: float
    draws: int
    statistic: float  # T: the observed profile's largest standardised gap
    z: np.ndarray = field(repr=False)  # (max_k - 1,): standardised gaps for k = 2..max_k
    gap: np.ndarray = field(repr=False)  # (max_k - 1,): mean null profile minus the observed one
    components: int = 0  # r: principal components the test looked at

    @property
    def significant(self) -> bool:
        return self.p_value <= self.alpha

    def to_dict(self) -> Dict[str, object]:
        """As round.json records it."""
        return {"k": self.k, "p_value": self.p_value, "alpha": self.alpha, "draws": self.draws,
                "statistic": _finite(self.statistic), "components": self.components,
                "z": [_finite(v) for v in self.z.tolist()], "gap": [_finite(v) for v in self.gap.tolist()]}


def _finite(v: float) -> Optional[float]:
    return float(v) if np.isfinite(v) else None


def principal_scores(rows: np.ndarray, r: int):
    """(Y, s): the top-r principal-component scores of the centred rows (N, r), and all their singular values.

    One LAPACK SVD on one BLAS thread, on 64-byte aligned float64 rows (the same bits on every rank that runs
    the same BLAS on the same kind of CPU, as ``clustering.pairwise``).
    """
    X = np.asarray(rows, dtype=np.float64)
    X = aligned(X - X.mean(axis=0))
    with one_blas_thread():
        U, s, _ = np.linalg.svd(X, full_matrices=False)
    r = int(min(r, s.size))
    return U[:, :r] * s[:r], s


def ward_profile(Y: np.ndarray, max_k: int) -> np.ndarray:
    """``log(W_k / W_1)`` for k = 2..max_k of Ward's tree on the rows of Y (scipy; its heights h add h^2/2 to W)."""
    n = Y.shape[0]
    Z = hierarchy.linkage(Y, method="ward")
    added = np.cumsum(Z[:, 2] ** 2 / 2.0)  # W after each merge: W_k after the first n - k merges
    total = added[-1]
    if not total > 0:
        return np.zeros(max_k - 1)
    w = added[n - np.arange(2, max_k + 1) - 1]
    return np.log(np.maximum(w / total, _FLOOR))


NULLS = ("uniform", "gaussian")


def _unit_scores(n: int, m: int, seed: int, t: int, draw: int, *, null: str) -> np.ndarray:
    """One draw's (n, m) independent scores of unit variance, uniform or Gaussian, keyed by (seed, t, draw)."""
    gen = rng(seed, Purpose.COMMUNITY, t, draw)
    if null == "uniform":
        return gen.uniform(-np.sqrt(3.0), np.sqrt(3.0), size=(n, m))
    return gen.standard_normal(size=(n, m))


class NullDraws:
    """The B null draws of one test, their unit scores drawn and centred once.

    Why: the axis variances are set from the first draws' spectra (``variances``) before every draw is reduced to
    its top scores (``scores``); a draw scaled by axis variances ``var`` is its centred units times ``sqrt(var)``
    (centring commutes with scaling the columns), so the (m, m) Gram matrices of the units are formed once, each
    scaling is an element-wise product, and the eigensolves of all draws run as one stacked call.
    """

    def __init__(self, n: int, m: int, *, seed: int, t: int, draws: int, null: str = "uniform"):
        if m > n:
            raise ValueError(f"{m} axes among {n} rows: the rows span at most n - 1 axes once centred")
        units = np.stack([_unit_scores(n, m, seed, t, b, null=null) for b in range(draws)])
        self.centred = units - units.mean(axis=1, keepdims=True)  # (B, n, m)
        with one_blas_thread():  # (B, m, m): the smaller Gram matrix, as the rows span at most n - 1 axes
            self.gram = np.matmul(self.centred.transpose(0, 2, 1), self.centred)
        self.n = n

    def _grams(self, var: np.ndarray, count: int) -> np.ndarray:
        root = np.sqrt(var)
        return self.gram[:count] * np.outer(root, root)

    def spectra(self, var: np.ndarray, count: int) -> np.ndarray:
        """(count, m'): the principal variances of the first ``count`` draws on axes ``var``, largest first."""
        with one_blas_thread():
            w = np.linalg.eigvalsh(self._grams(var, count))
        return np.maximum(w[:, ::-1], 0.0) / (self.n - 1.0)

    def variances(self, s: np.ndarray, *, passes: int = 2) -> np.ndarray:
        """The null's axis variances: those whose draws' principal variances match the rows' on average.

        Why not the rows' own ``s^2 / (n - 1)``: sample principal variances are more spread than the axes' (the
        top ones inflated, the bottom ones shrunk, the more so the fewer the rows), so a null taking them as its
        axes would be re-estimated more spread still, look more split, and reject clouds of its own shape far
        below the level. Each pass scales every axis down by observed over drawn where the draws' are larger
        (the method of moments, on the first ``SPECTRUM_DRAWS`` draws; only down: the smallest sample variances
        are shrunk so far that matching them would lift the bottom axes above the top ones).
        """
        m = self.centred.shape[2]
        observed = s[:m] ** 2 / (self.n - 1.0)
        var = observed.copy()
        count = min(self.centred.shape[0], SPECTRUM_DRAWS)
        for _ in range(passes):
            drawn = self.spectra(var, count)[:, :m].mean(axis=0)
            var = np.sort(var * np.minimum(observed / np.maximum(drawn, _FLOOR), 1.0))[::-1]
        return var

    def scores(self, var: np.ndarray, r: int) -> np.ndarray:
        """(B, n, r): every draw's own top-r principal scores on axes ``var`` (as ``principal_scores``, up to
        each column's sign)."""
        G = self._grams(var, self.centred.shape[0])
        k = G.shape[1]
        r = min(r, k)
        with one_blas_thread():
            if k <= 128:  # one stacked full solve; past that a partial solve per draw is cheaper
                V = np.linalg.eigh(G)[1]
            else:
                V = np.stack([linalg.eigh(g, subset_by_index=[k - r, k - 1])[1] for g in G])
            V = V[:, :, ::-1][:, :, :r]
            return np.matmul(self.centred * np.sqrt(var), V)


def null_variances(s: np.ndarray, n: int, seed: int, t: int, *, draws: int, null: str = "uniform",
                   passes: int = 2) -> np.ndarray:
    """The null's axis variances for rows of singular values ``s`` (``NullDraws.variances``)."""
    s = s[s > s[0] * 1e-12]  # the axes the rows span (centring removes one)
    return NullDraws(n, s.size, seed=seed, t=t, draws=draws, null=null).variances(s, passes=passes)


def _leave_one_out_z(profiles: np.ndarray) -> np.ndarray:
    """(B + 1, K - 1): each profile's gaps standardised by the mean and deviation of the other B profiles."""
    m = profiles.shape[0] - 1
    total, sq = profiles.sum(axis=0), (profiles * profiles).sum(axis=0)
    mean = (total[None, :] - profiles) / m
    var = ((sq[None, :] - profiles * profiles) - m * mean * mean) / (m - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = (mean - profiles) / np.sqrt(np.maximum(var, 0.0))
    return np.where(np.isfinite(z), z, 0.0)


def choose_k(z: np.ndarray, gap: np.ndarray, sd: np.ndarray, critical: float) -> int:
    """The number of communities once the test has found some (entry i is k = i + 2).

    Tibshirani et al.'s rule, the smallest k with ``gap_k >= gap_{k+1} - sd_{k+1}``, taken among the k whose own
    standardised gap clears the test's critical value (a k the test would not have found alone is no answer;
    with few rows the gaps of small k are tiny and noisy, and the rule alone would stop at k = 2). The k of the
    largest standardised gap when none of them satisfies the rule.
    """
    strong = np.flatnonzero(z > critical)
    if strong.size == 0:
        return int(np.argmax(z)) + 2
    for i in strong:
        if i + 1 >= gap.size or gap[i] >= gap[i + 1] - sd[i + 1]:
            return int(i) + 2
    return int(strong[np.argmax(z[strong])]) + 2


def tested_k(n: int) -> int:
    """The largest k the test weighs among n rows: a quarter of them (communities of four on average), and at
    least 4 while communities keep two members.

    Why: near k = n / 2 the profile measures how the rows pair up with their nearest neighbours, and real IID
    signatures are more clumped at that scale than any cloud without communities (at k up to n / 2, a fifth of
    the IID first rounds of 32 replicas were split); 4 keeps 4 planted groups of 2 in reach at n = 8.
    """
    return min(n // 2, max(4, n // 4))


def subsample(n: int, size: Optional[int], seed: int, t: int) -> np.ndarray:
    """The rows the test looks at: all n, or ``size`` of them drawn without replacement (sorted), keyed by
    (seed, t) apart from the null draws."""
    if size is None or n <= size:
        return np.arange(n)
    return np.sort(rng(seed, Purpose.COMMUNITY, t, _SUBSAMPLE).choice(n, size=int(size), replace=False))


def detect_communities(rows: np.ndarray, *, max_k: int, alpha: float, draws: int, seed: int, t: int,
                       null: str = "uniform", max_rows: Optional[int] = None) -> Detection:
    """Whether the rows (N, d) hold communities, tested at level ``alpha`` with ``draws`` null draws (module
    docstring); past ``max_rows`` rows, on a seeded subsample of that many (Ward's tree costs O(N^2) a draw)."""
    X = np.asarray(rows, dtype=np.float64)
    X = X[subsample(X.shape[0], max_rows, seed, t)]
    n = X.shape[0]
    max_k = int(min(max_k, tested_k(n)))
    if n < 3 or max_k < 2 or draws < 3:
        return Detection(1, 1.0, alpha, 0, float("nan"), np.zeros(0), np.zeros(0), 0)
    Y, s = principal_scores(X, max_k - 1)
    if not s[0] > 0:  # every row the same: nothing to split
        return Detection(1, 1.0, alpha, 0, float("nan"), np.zeros(max_k - 1), np.zeros(max_k - 1), 0)
    r = Y.shape[1]
    profiles = np.empty((draws + 1, max_k - 1))
    profiles[0] = ward_profile(Y, max_k)
    spanned = s[s > s[0] * 1e-12]  # the axes the rows span (centring removes one)
    null_draws = NullDraws(n, spanned.size, seed=seed, t=t, draws=draws, null=null)
    for b, Yb in enumerate(null_draws.scores(null_draws.variances(spanned), r)):
        profiles[b + 1] = ward_profile(Yb, max_k)
    z = _leave_one_out_z(profiles)
    stat = z.max(axis=1)
    p = float(1 + np.count_nonzero(stat[1:] >= stat[0])) / (draws + 1)
    drawn = profiles[1:]
    gap = drawn.mean(axis=0) - profiles[0]
    sd = drawn.std(axis=0) * np.sqrt(1.0 + 1.0 / draws)
    k = 1
    if p <= alpha:
        # the critical value: the observed statistic must exceed all but floor(alpha (B + 1)) - 1 of the draws'
        critical = float(np.sort(stat[1:])[::-1][max(int(np.floor(alpha * (draws + 1) + 1e-9)) - 1, 0)])
        k = choose_k(z[0], gap, sd, critical)
    return Detection(k, p, alpha, draws, float(stat[0]), z[0], gap, r)
