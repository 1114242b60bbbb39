"""Communities from signatures: scipy agglomerative linkage and a cut of the tree.

Pure functions of arrays. Every rank calls them on the same allgathered bytes and
so derives the same tree and the same labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
from scipy.cluster import hierarchy
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import pdist

from .blas import aligned as _aligned
from .blas import one_blas_thread as _one_blas_thread
from .significance import Detection, detect_communities

LINKAGES = ("average", "complete", "ward", "single")
METRICS = ("cosine", "euclidean")


@dataclass(frozen=True)
class Communities:
    """A cut of the linkage tree: labels 0..C-1 numbered by first appearance in rank order."""

    Z: np.ndarray
    labels: np.ndarray
    cut_height: float
    distances: np.ndarray  # condensed pairwise distances the tree was built on
    test: Optional[Detection] = None  # cut auto with a level: the community test behind the count

    @property
    def n(self) -> int:
        return int(self.labels.size)

    @property
    def count(self) -> int:
        return int(self.labels.max()) + 1 if self.labels.size else 0


def _rows(signatures: np.ndarray, metric: str) -> np.ndarray:
    """The float64 rows the metric compares: unit rows for cosine (a zero row stays zero), else the signatures."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not one of {METRICS}")
    S = np.asarray(signatures, dtype=np.float64)
    if metric == "cosine":
        norms = np.linalg.norm(S, axis=1, keepdims=True)
        return np.divide(S, norms, out=np.zeros_like(S), where=norms > 0)
    return S


def _pdist(X: np.ndarray, metric: str) -> np.ndarray:
    """The reference: scipy's pdist (cosine as half the squared distance of unit rows, = 1 - cos)."""
    if metric == "cosine":
        return np.minimum(np.maximum(pdist(X, "sqeuclidean") / 2.0, 0.0), 2.0)
    return pdist(X, "euclidean")


# Rows of the Gram matrix per BLAS call: (256, N) float64 temporaries, 8 MiB at N = 4096.
_BLOCK = 256
# A pair is recomputed directly when its squared distance is below this fraction of |v_i|^2 + |v_j|^2 (the
# squared norms of the centred rows): there the Gram formula would lose about 10 bits to cancellation.
_CLOSE = 2.0 ** -10


def _gram_distances(X: np.ndarray, metric: str):
    """Condensed distances between the rows of X from float64 Gram blocks; None: fall back to pdist.

    The rows are centred on their mean first (differences, hence distances,
    are unchanged), so ``|v_i|^2 + |v_j|^2 - 2 v_i.v_j`` cancels little even
    when all ranks sit close to one consensus; a pair still close relative to
    its norms (``_CLOSE``) is recomputed as ``sum((x_i - x_j)^2)`` from the
    rows, as pdist does, so small distances keep their relative accuracy.
    Each (256, N - lo) block of the upper triangle is one float64 GEMM on one
    BLAS thread, on 64-byte aligned rows, in a fixed block order: the same bytes
    give the same bits on every rank that runs the same BLAS on the same kind
    of CPU. (BLAS libraries pick kernels per CPU model, and a kernel may sum in
    another order, so ranks on different CPU models could differ in the last
    bit; the engine's hash check would then stop the run with an error.)
    """
    n, d = X.shape
    V = _aligned(X - X.mean(axis=0))
    nn = (V * V).sum(axis=1)
    out = np.empty(n * (n - 1) // 2, dtype=np.float64)
    close = []  # condensed indices of the pairs to recompute
    budget = max(4 * n, n * n // 64)
    start = 0
    with _one_blas_thread():
        for lo in range(0, n - 1, _BLOCK):
            hi = min(n - 1, lo + _BLOCK)  # rows lo..hi-1; the last row has no pair to its right
            G = V[lo:hi] @ V[lo + 1:].T  # (hi - lo, n - lo - 1): row i, columns j = lo+1 .. n-1
            G *= -2.0
            G += nn[lo + 1:]
            G += nn[lo:hi, None]  # D2 = (-2 v_i.v_j + n_j) + n_i, in this order everywhere
            np.maximum(G, 0.0, out=G)
            # close pairs, D2 < _CLOSE (n_i + n_j): first against one bound for the whole block (usually none)
            suspect = G < _CLOSE * (nn[lo:hi].max() + nn[lo + 1:].max())
            if suspect.any():
                r, c = np.nonzero(suspect)
                keep = (c >= r) & (G[r, c] < _CLOSE * (nn[lo + r] + nn[lo + 1 + c]))  # j > i, and close
                r, c = r[keep], c[keep]
                # condensed index of (i, j): the start of row i, plus j - i - 1
                close.append((r + lo) * n - (r + lo) * (r + lo + 1) // 2 + (c - r))
                budget -= r.size
                if budget < 0:
                    return None  # many near-duplicate pairs: pdist is cheaper than recomputing them one by one
            for i in range(lo, hi):
                row = G[i - lo, i - lo:]  # the pairs (i, j > i)
                out[start: start + row.size] = row
                start += row.size
    if close:
        pairs = np.concatenate(close)
        ii, jj = _condensed_pairs(pairs, n)
        for k in range(0, pairs.size, 1 << 15):
            sl = slice(k, k + (1 << 15))
            diff = X[ii[sl]] - X[jj[sl]]
            out[pairs[sl]] = (diff * diff).sum(axis=1)
    if metric == "cosine":
        out *= 0.5
        np.minimum(out, 2.0, out=out)
    else:
        np.sqrt(out, out=out)
    return out


def _condensed_pairs(k: np.ndarray, n: int):
    """(i, j) of condensed indices k (i < j)."""
    k = np.asarray(k, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(np.arange(n - 1, 0, -1, dtype=np.int64))])
    i = np.searchsorted(starts, k, side="right") - 1
    j = k - starts[i] + i + 1
    return i, j


def blas_fingerprint() -> str:
    """What decides the bits of the Gram-block distances on this process: numpy's BLAS, its version, the
    kernel it picked for this CPU, and the CPU model. Ranks that share it compute identical distances."""
    import platform

    parts = [np.__version__, platform.machine()]
    try:
        from threadpoolctl import threadpool_info

        for lib in threadpool_info():
            if lib.get("user_api") == "blas" and "numpy" in str(lib.get("filepath", "")):
                parts += [str(lib.get(k)) for k in ("internal_api", "version", "architecture")]
    except Exception:  # noqa: BLE001 - without threadpoolctl the CPU model still separates machines
        parts.append("no-threadpoolctl")
    try:
        with open("/proc/cpuinfo") as fh:
            parts += [line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")][:1]
    except OSError:
        parts.append(platform.processor())
    return "|".join(parts)


def pairwise(signatures: np.ndarray, metric: str = "cosine", fast: bool = True) -> np.ndarray:
    """Condensed pairwise distances of the signature rows.

    cosine: ``1 - cos`` (half the squared distance between unit rows; a zero
    signature is at 0.5 from every nonzero one); euclidean. Equal to scipy's
    ``pdist`` to float64 rounding (within about 1e-14 relative), computed from
    Gram blocks (``_gram_distances``): BLAS GEMMs instead of pdist's pairwise
    loop, about 4x faster at N = 4096, d = 256. Non-finite rows and many
    near-duplicate pairs use pdist itself, and so does ``fast=False``: the
    engine passes it when the ranks' ``blas_fingerprint`` differ, since pdist's
    loop gives the same bits on any CPU.
    """
    X = _rows(signatures, metric)
    if X.ndim != 2:
        raise ValueError(f"need an (N, d) signature matrix, got shape {X.shape}")
    if fast and X.shape[0] >= 2 and X.shape[1] >= 1 and np.isfinite(X).all():
        d = _gram_distances(X, metric)
        if d is not None:
            return d
    return _pdist(X, metric)


def build_tree(signatures: np.ndarray, method: str = "average", metric: str = "cosine",
               distances: Optional[np.ndarray] = None, fast: bool = True):
    """(Z, condensed distances).

    ``distances`` (condensed, e.g. ``1 - CKA``) replaces the metric on the signatures. ``ward`` is defined for
    euclidean distances: a cosine distance, or a precomputed one, is ``1 - (a similarity of unit vectors)``, half
    the squared euclidean distance between them, so ``ward`` builds its tree on ``sqrt(2 d)`` (Ward's tree of
    the unit rows); the distances returned stay ``d``.
    """
    if method not in LINKAGES:
        raise ValueError(f"linkage={method!r} is not one of {LINKAGES}")
    S = np.asarray(signatures)
    if S.ndim != 2 or S.shape[0] < 2:
        raise ValueError(f"need an (N >= 2, d) signature matrix, got shape {S.shape}")
    if distances is None:
        d = pairwise(S, metric, fast)
    else:
        d = np.asarray(distances, dtype=np.float64)
        if d.shape != (S.shape[0] * (S.shape[0] - 1) // 2,) or not np.isfinite(d).all():
            raise ValueError(f"precomputed distances must be a finite condensed vector for {S.shape[0]} ranks, "
                             f"got shape {d.shape}")
    on_units = method == "ward" and (distances is not None or metric == "cosine")
    Z = hierarchy.linkage(np.sqrt(2.0 * np.maximum(d, 0.0)) if on_units else d, method=method)
    return Z, d


def canonical(labels: np.ndarray) -> np.ndarray:
    """Renumber labels 0.. in order of first appearance, so equal partitions give equal arrays."""
    labels = np.asarray(labels)
    _, first = np.unique(labels, return_index=True)
    order = labels[np.sort(first)]
    remap = {int(v): i for i, v in enumerate(order)}
    return np.array([remap[int(v)] for v in labels], dtype=np.int64)


def height_for_k(Z: np.ndarray, k: int) -> float:
    """A height between the merges that leave k and k-1 clusters (for drawing the cut)."""
    n = Z.shape[0] + 1
    k = int(min(max(k, 1), n))
    heights = Z[:, 2]
    lo = heights[n - k - 1] if n - k - 1 >= 0 else 0.0
    hi = heights[n - k] if n - k < len(heights) else heights[-1] * 1.05 + 1e-12
    return float((lo + hi) / 2.0)


def cut_maxclust(Z: np.ndarray, k: int) -> np.ndarray:
    return canonical(hierarchy.fcluster(Z, t=max(1, int(k)), criterion="maxclust"))


def cut_distance(Z: np.ndarray, threshold: float) -> np.ndarray:
    return canonical(hierarchy.fcluster(Z, t=float(threshold), criterion="distance"))


def _encode(labels: np.ndarray):
    """Labels as 0..K-1 in sorted order of value (what sklearn's LabelEncoder does), and K."""
    values, codes = np.unique(np.asarray(labels), return_inverse=True)
    return codes.reshape(-1).astype(np.int64), len(values)


def _cluster_sums(distances: np.ndarray, n: int, codes: np.ndarray, K: int, block: int = 256) -> np.ndarray:
    """(N, K): entry (i, k) is the sum of D[i, j] over the j in cluster k, straight from the condensed vector.

    No square matrix: per block of rows, the pairs (i, j > i) are laid out once
    and counted twice, into row i by the cluster of j (a weighted ``bincount``)
    and into row j by the cluster of i (``add.reduceat`` over the block's rows
    sorted by cluster). numpy only, in a fixed order: deterministic.
    """
    rows = np.zeros((n, K), dtype=np.float64)
    cols = np.zeros((K, n), dtype=np.float64)  # cols[k, j]: the pairs (i < j) with i in cluster k
    start = 0
    for lo in range(0, n - 1, block):
        hi = min(n - 1, lo + block)
        B = np.zeros((hi - lo, n - lo - 1), dtype=np.float64)  # B[r, c] = D[lo + r, lo + 1 + c] for c >= r
        for i in range(lo, hi):
            m = n - 1 - i
            B[i - lo, i - lo:] = distances[start: start + m]
            start += m
        bins = (np.arange(hi - lo, dtype=np.int64)[:, None] * K + codes[None, lo + 1:]).ravel()
        rows[lo:hi] += np.bincount(bins, weights=B.ravel(), minlength=(hi - lo) * K).reshape(hi - lo, K)
        order = np.argsort(codes[lo:hi], kind="stable")
        sorted_codes = codes[lo:hi][order]
        first = np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]])
        cols[sorted_codes[first], lo + 1:] += np.add.reduceat(B[order], first, axis=0)
    return rows + cols.T


def _silhouette_from_sums(sums: np.ndarray, codes: np.ndarray, K: int) -> float:
    """Mean silhouette from the per-cluster distance sums, with sklearn's arithmetic step for step."""
    n = codes.size
    freqs = np.bincount(codes, minlength=K)
    rows = np.arange(n)
    cd = sums.copy()
    intra = cd[rows, codes]
    cd[rows, codes] = np.inf
    cd /= freqs
    inter = cd.min(axis=1)
    denom = (freqs - 1).take(codes, mode="clip")
    with np.errstate(divide="ignore", invalid="ignore"):
        intra = intra / denom
        sil = inter - intra
        sil /= np.maximum(intra, inter)
    return float(np.mean(np.nan_to_num(sil)))


def silhouette_scores(distances: np.ndarray, labelings) -> list:
    """Mean silhouette of each labelling over the same condensed distances.

    Equal to ``sklearn.metrics.silhouette_score(squareform(distances), labels,
    metric="precomputed")`` for each labelling, to rounding: the O(N^2) pass over
    the distances is done once, for the finest labelling, and the per-cluster sums
    of every coarser labelling that is a union of its clusters (the cuts of one
    tree are nested) are sums of those columns, O(N K) each. The pass reads the
    condensed vector directly (``_cluster_sums``), without a square matrix; the
    sums are added in another order than sklearn's, so scores can differ from
    its in the last bits. Deterministic: numpy bincounts and row sums, no BLAS.
    """
    labelings = [np.asarray(lab) for lab in labelings]
    if not labelings:
        return []
    distances = np.asarray(distances, dtype=np.float64)
    n = labelings[0].size
    if distances.shape != (n * (n - 1) // 2,):
        raise ValueError(f"condensed distances of shape {distances.shape} do not fit {n} labels")
    encoded = [_encode(lab) for lab in labelings]
    fine = int(np.argmax([k for _, k in encoded]))
    f_codes, f_k = encoded[fine]
    f_sums = _cluster_sums(distances, n, f_codes, f_k)
    _, first = np.unique(f_codes, return_index=True)
    scores = []
    for codes, k in encoded:
        mapping = codes[first]  # the coarse cluster of each fine cluster
        if np.array_equal(mapping[f_codes], codes):
            sums = np.zeros((codes.size, k), dtype=np.float64)
            for f in range(f_k):
                sums[:, mapping[f]] += f_sums[:, f]
        else:  # not nested in the finest labelling: a pass of its own
            sums = _cluster_sums(distances, n, codes, k)
        scores.append(_silhouette_from_sums(sums, codes, k))
    return scores


def cut_auto(Z: np.ndarray, distances: np.ndarray, max_k: int = 16, min_silhouette: float = 0.25,
             min_separation: float = 0.0) -> np.ndarray:
    """The k in 2..max_k with the best silhouette, or one community when none qualifies.

    A k qualifies when its silhouette reaches ``min_silhouette`` and the closest
    pair of its communities joins at a height of at least ``min_separation``
    (heights in the units of ``Z``). Silhouette alone is scale-free and would
    split ranks that agree to three decimals; the separation floor makes
    converged ranks one community without any schedule.

    The silhouettes are sklearn's (precomputed metric), computed by
    ``silhouette_scores`` in one pass over the distances for all k at once.
    """
    n = Z.shape[0] + 1
    if n < 3:
        return np.zeros(n, dtype=np.int64)
    candidates = []
    for k in range(2, min(max_k, n - 1) + 1):
        if Z[n - k, 2] < min_separation:  # the k communities would join below the floor
            break
        labels = hierarchy.fcluster(Z, t=k, criterion="maxclust")
        if len(np.unique(labels)) < 2:
            continue
        candidates.append(labels)
    best_k, best_s = 1, -np.inf
    for labels, s in zip(candidates, silhouette_scores(distances, candidates)):
        if s > best_s + 1e-12:
            best_k, best_s = len(np.unique(labels)), s
    if best_s < min_silhouette:
        return np.zeros(n, dtype=np.int64)
    return cut_maxclust(Z, best_k)


# Lloyd steps at most, refining a cut (they stop as soon as no row moves: a few, on the signatures measured)
def refine(rows: np.ndarray, labels: np.ndarray, steps: int = 20) -> np.ndarray:
    """Lloyd's k-means steps seeded from ``labels``: each row moves to its nearest community mean, until nothing moves.

    Why: an agglomerative tree never revisits a merge, so a few rows joined early to the wrong branch stay
    there; Lloyd's steps from the tree's cut fix them (on a planted shift at 256 replicas, average linkage's cut
    had ARI 0.41, k-means 0.98-0.99). numpy element-wise sums only (no BLAS): the same bits on any CPU. A
    community that empties is dropped; labels come back numbered by first appearance.
    """
    X = np.asarray(rows, dtype=np.float64)
    labels = canonical(labels)
    for _ in range(int(steps)):
        k = int(labels.max()) + 1
        counts = np.bincount(labels, minlength=k).astype(np.float64)
        sums = np.stack([np.bincount(labels, weights=X[:, j], minlength=k) for j in range(X.shape[1])], axis=1)
        means = sums / counts[:, None]
        d2 = np.empty((X.shape[0], k))
        for c in range(k):
            diff = X - means[c]
            d2[:, c] = (diff * diff).sum(axis=1)
        moved = np.argmin(d2, axis=1)
        if np.array_equal(moved, labels):
            break
        labels = canonical(moved)
    return labels


REFINE_STEPS = 50


def geometry(signatures: np.ndarray, metric: str, distances: Optional[np.ndarray] = None) -> np.ndarray:
    """The rows in the euclidean space the clustering measures: the signatures (euclidean), unit rows (cosine),
    or, for precomputed distances d (``1 - CKA``: half a squared distance of unit vectors), a classical-scaling
    embedding whose euclidean distances are ``sqrt(2 d)``."""
    if distances is None:
        return _rows(signatures, metric)
    from scipy.spatial.distance import squareform

    D2 = squareform(2.0 * np.maximum(np.asarray(distances, dtype=np.float64), 0.0))
    B = -0.5 * (D2 - D2.mean(axis=0)[None, :] - D2.mean(axis=1)[:, None] + D2.mean())
    with _one_blas_thread():
        w, V = np.linalg.eigh(_aligned(B))
    keep = np.flatnonzero(w > max(w[-1], 0.0) * 1e-12)[::-1]
    return V[:, keep] * np.sqrt(w[keep])


def cut_k(Z: np.ndarray, k: int, rows: Optional[np.ndarray] = None) -> np.ndarray:
    """The tree's cut into k communities (maxclust), refined by Lloyd steps on ``rows`` where given."""
    labels = cut_maxclust(Z, k)
    return labels if rows is None or labels.max() < 1 else refine(rows, labels, REFINE_STEPS)


def between_means(distances: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """(C, C): the mean distance between the members of two communities (the diagonal: inside one)."""
    codes, k = _encode(labels)
    sums = _cluster_sums(np.asarray(distances, dtype=np.float64), codes.size, codes, k)  # (N, C)
    pair_sums = np.zeros((k, k))
    for c in range(k):
        pair_sums[c] = sums[codes == c].sum(axis=0)
    sizes = np.bincount(codes, minlength=k).astype(np.float64)
    pairs = np.outer(sizes, sizes) - np.diag(sizes)  # the diagonal counts ordered pairs i != j
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(pairs > 0, pair_sums / np.maximum(pairs, 1.0), 0.0)


def merge_closer_than(labels: np.ndarray, distances: np.ndarray, floor: float) -> np.ndarray:
    """Merge, closest pair first, communities whose members lie less than ``floor`` apart on average."""
    labels = canonical(labels)
    while labels.max() >= 1 and floor > 0:
        M = between_means(distances, labels)
        np.fill_diagonal(M, np.inf)
        a, b = np.unravel_index(int(np.argmin(M)), M.shape)
        if not M[a, b] < floor:
            break
        labels = canonical(np.where(labels == max(a, b), min(a, b), labels))
    return labels


def cut_tested(Z: np.ndarray, distances: np.ndarray, rows: np.ndarray, *, max_k: int, alpha: float, draws: int,
               null: str, seed: int, t: int, max_rows: Optional[int] = None, refined: bool = True,
               min_silhouette: Optional[float] = None, min_separation: float = 0.0):
    """(labels, Detection): as many communities as the community test finds (``significance``), cut from the
    tree and refined by Lloyd steps; communities closer than ``min_separation`` are merged, and a partition under
    ``min_silhouette`` (a user's floor, None: none) becomes one community."""
    det = detect_communities(rows, max_k=max_k, alpha=alpha, draws=draws, seed=seed, t=t, null=null,
                             max_rows=max_rows)
    n = Z.shape[0] + 1
    if det.k < 2:
        return np.zeros(n, dtype=np.int64), det
    labels = cut_k(Z, det.k, rows if refined else None)
    labels = merge_closer_than(labels, distances, min_separation)
    if min_silhouette is not None and labels.max() >= 1 and \
            silhouette_scores(distances, [labels])[0] < min_silhouette:
        labels = np.zeros(n, dtype=np.int64)
    return labels, det


def find_communities(
    signatures: np.ndarray,
    method: str = "ward",
    metric: str = "cosine",
    cut: str = "auto",
    *,
    k: Optional[int] = None,
    threshold: Optional[float] = None,
    max_k: int = 16,
    min_silhouette: Optional[float] = None,
    min_separation: float = 0.0,
    distances: Optional[np.ndarray] = None,
    fast: bool = True,
    alpha: Optional[float] = 0.05,
    draws: int = 39,
    null: str = "uniform",
    test_rows: Optional[int] = 512,
    refined: bool = True,
    seed: int = 0,
    t: int = 0,
) -> Communities:
    """Linkage plus cut. ``cut`` is maxclust (needs k), distance (needs threshold) or auto.

    auto with a level ``alpha``: the community test (``significance.detect_communities``, ``draws`` null draws
    keyed by ``seed`` and ``t``, on at most ``test_rows`` rows) decides how many communities there are;
    ``alpha=None``: the k in 2..max_k with the best silhouette, or one community under ``min_silhouette`` (the
    cut before the test, ``cut_auto``).
    ``refined``: every cut is refined by Lloyd steps on the rows (``refine``).

    ``min_separation`` (auto only) is a cosine distance, or for the euclidean
    metric a distance relative to the signatures' RMS norm; with precomputed
    ``distances`` (``1 - CKA``), a distance on their own scale.
    """
    if np.asarray(signatures).shape[0] == 1:  # a world of one: one community, an empty tree
        return Communities(Z=np.zeros((0, 4)), labels=np.zeros(1, dtype=np.int64), cut_height=0.0,
                           distances=np.zeros(0))
    Z, d = build_tree(signatures, method, metric, distances, fast)
    scale = 1.0
    if metric == "euclidean" and distances is None:
        rms = float(np.sqrt(np.mean(np.sum(np.asarray(signatures, dtype=np.float64) ** 2, axis=1))))
        scale = rms if rms > 0 else 1.0
    rows = geometry(signatures, metric, distances) if refined or (cut == "auto" and alpha is not None) else None
    test = None
    if cut == "maxclust":
        if k is None:
            raise ValueError("cut='maxclust' needs k")
        labels = cut_k(Z, k, rows)
    elif cut == "distance":
        if threshold is None:
            raise ValueError("cut='distance' needs threshold")
        labels = cut_distance(Z, threshold)
        if rows is not None and labels.max() >= 1:
            labels = refine(rows, labels, REFINE_STEPS)
    elif cut == "auto" and alpha is not None:
        assert rows is not None
        labels, test = cut_tested(Z, d, rows, max_k=max_k, alpha=alpha, draws=draws, null=null, seed=seed, t=t,
                                  max_rows=test_rows, refined=refined, min_silhouette=min_silhouette,
                                  min_separation=min_separation * scale)
    elif cut == "auto":
        labels = cut_auto(Z, d, max_k=max_k, min_silhouette=-np.inf if min_silhouette is None else min_silhouette,
                          min_separation=min_separation * scale)
        if rows is not None and labels.max() >= 1:
            labels = refine(rows, labels, REFINE_STEPS)
    else:
        raise ValueError(f"cut={cut!r} is not one of maxclust, distance, auto")
    count = int(labels.max()) + 1
    height = float(threshold) if cut == "distance" and threshold is not None else height_for_k(Z, count)
    return Communities(Z=Z, labels=labels, cut_height=height, distances=d, test=test)


def adjusted_rand(labels: np.ndarray, groups: Union[Sequence[int], np.ndarray, None]) -> Optional[float]:
    """Adjusted Rand index of communities against planted groups (None without groups): 1 is a perfect recovery.

    Every rank scores every signature round, so this is computed here from the pair counts in exact integers
    rather than by importing scikit-learn on each rank for it (1.9 CPU-seconds a process on the 2-core machine);
    it returns scikit-learn's ``adjusted_rand_score`` bit for bit (tests/unit/test_math.py): the same exact
    counts, then one correctly rounded division.
    """
    if groups is None:
        return None
    truth, found = np.asarray(groups).ravel(), np.asarray(labels).ravel()
    if truth.shape != found.shape:
        raise ValueError(f"labels of {found.size} ranks against groups of {truth.size}")
    n = int(truth.size)
    _, a = np.unique(truth, return_inverse=True)
    _, b = np.unique(found, return_inverse=True)
    cells = np.unique(a.ravel() * (int(b.max(initial=0)) + 1) + b.ravel(), return_counts=True)[1]
    both = int((cells.astype(object) ** 2).sum())  # ordered pairs (with self-pairs) together in both partitions
    rows = int((np.bincount(a.ravel()).astype(object) ** 2).sum())  # ... together among the groups
    cols = int((np.bincount(b.ravel()).astype(object) ** 2).sum())  # ... together among the communities
    together, only_groups, only_found = both - n, rows - both, cols - both
    apart = n * n - only_found - only_groups - both
    if only_groups == 0 and only_found == 0:  # the same partition (one community, or every rank alone, included)
        return 1.0
    return 2.0 * (together * apart - only_groups * only_found) / (
        (together + only_groups) * (only_groups + apart) + (together + only_found) * (only_found + apart))


# --------------------------------------------------------------------------- ids across rounds


def _first_appearance(labels: np.ndarray) -> np.ndarray:
    """Codes 0.. in order of first appearance by rank, so equal partitions get equal codes."""
    labels = np.asarray(labels).ravel()
    if labels.size == 0:
        return labels.astype(np.int64)
    _, first, inv = np.unique(labels, return_index=True, return_inverse=True)
    code = np.empty(first.size, dtype=np.int64)
    code[np.argsort(first, kind="stable")] = np.arange(first.size)
    return code[inv.ravel()]


def stable_labels(label_arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Community ids that persist across rounds (rounds x N), so a timeline shows splits and merges.

    Raw labels are renumbered every round, so colouring by them would make
    communities flicker. Round 0 keeps its labels (renumbered by first appearance).
    Each later round is matched to the previous round's ids by maximum total overlap
    (``linear_sum_assignment`` on the contingency table):

    - a matched community keeps the id it overlaps;
    - an unmatched one (the smaller part of a split, or one with no overlap) gets a
      fresh id, never used before;
    - when communities merge, the merged one keeps the id of the part it overlaps
      most; the other id ends.

    Ties go to the older (smaller) id and to the community holding the lowest rank,
    so the result is a deterministic function of the inputs.
    """
    arrays = [np.asarray(a).ravel() for a in label_arrays]
    if not arrays:
        return np.zeros((0, 0), dtype=np.int64)
    n = arrays[0].size
    for r, a in enumerate(arrays):
        if a.size != n:
            raise ValueError(f"round {r} labels {a.size} ranks, round 0 labels {n}")
    out = np.empty((len(arrays), n), dtype=np.int64)
    out[0] = _first_appearance(arrays[0])
    next_id = int(out[0].max()) + 1 if n else 0
    for r in range(1, len(arrays)):
        prev_ids, prev_code = np.unique(out[r - 1], return_inverse=True)
        cur = _first_appearance(arrays[r])
        n_prev, n_cur = prev_ids.size, int(cur.max()) + 1 if n else 0
        overlap = np.zeros((n_prev, n_cur), dtype=np.int64)
        np.add.at(overlap, (prev_code.ravel(), cur), 1)
        # A tie-break below one unit of overlap in total: it never changes the total
        # overlap, only which of the equally good matchings is chosen.
        k = min(n_prev, n_cur) + 1
        tie = (np.arange(n_prev)[:, None] * n_cur + np.arange(n_cur)[None, :] + 1) / ((n_prev * n_cur + 1) * k)
        rows, cols = linear_sum_assignment(overlap - tie, maximize=True)
        new_id = np.full(n_cur, -1, dtype=np.int64)
        for p, c in zip(rows, cols):
            if overlap[p, c] > 0:
                new_id[c] = prev_ids[p]
        for c in range(n_cur):
            if new_id[c] < 0:
                new_id[c] = next_id
                next_id += 1
        out[r] = new_id[cur]
    return out
