"""Communities from signatures: scipy agglomerative linkage and a cut of the tree.

Pure functions of arrays. Every rank calls them on the same allgathered bytes and
so derives the same tree and the same labels.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy.cluster import hierarchy
from scipy.spatial.distance import pdist

LINKAGES = ("average", "complete", "ward", "single")
METRICS = ("cosine", "euclidean")


@dataclass(frozen=True)
class Communities:
    """A cut of the linkage tree: labels 0..C-1 numbered by first appearance in rank order."""

    Z: np.ndarray
    labels: np.ndarray
    cut_height: float
    distances: np.ndarray  # condensed pairwise distances the tree was built on

    @property
    def n(self) -> int:
        return int(self.labels.size)

    @property
    def count(self) -> int:
        return int(self.labels.max()) + 1 if self.labels.size else 0


def pairwise(signatures: np.ndarray, metric: str = "cosine") -> np.ndarray:
    """Condensed distances; a zero signature is at cosine distance 1 from everything."""
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not one of {METRICS}")
    S = np.asarray(signatures, dtype=np.float64)
    if metric == "cosine":
        norms = np.linalg.norm(S, axis=1, keepdims=True)
        U = np.divide(S, norms, out=np.zeros_like(S), where=norms > 0)
        d = pdist(U, "sqeuclidean") / 2.0  # = 1 - cos for unit vectors
        return np.clip(d, 0.0, 2.0)
    return pdist(S, "euclidean")


def build_tree(signatures: np.ndarray, method: str = "average", metric: str = "cosine",
               distances: Optional[np.ndarray] = None):
    """(Z, condensed distances). ``ward`` is defined for euclidean distances only.

    ``distances`` (condensed, e.g. ``1 - CKA``) replaces the metric on the signatures.
    """
    if method not in LINKAGES:
        raise ValueError(f"linkage={method!r} is not one of {LINKAGES}")
    if method == "ward" and (metric != "euclidean" or distances is not None):
        raise ValueError("ward linkage needs the euclidean metric on the signatures")
    S = np.asarray(signatures)
    if S.ndim != 2 or S.shape[0] < 2:
        raise ValueError(f"need an (N >= 2, d) signature matrix, got shape {S.shape}")
    if distances is None:
        d = pairwise(S, metric)
    else:
        d = np.asarray(distances, dtype=np.float64)
        if d.shape != (S.shape[0] * (S.shape[0] - 1) // 2,) or not np.isfinite(d).all():
            raise ValueError(f"precomputed distances must be a finite condensed vector for {S.shape[0]} ranks, "
                             f"got shape {d.shape}")
    Z = hierarchy.linkage(d, method=method)
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


def _cluster_sums(D: np.ndarray, codes: np.ndarray, K: int, block: int = 256) -> np.ndarray:
    """(N, K): row i holds the sum of D[i, j] over the j of each cluster, summed in increasing j.

    One weighted ``bincount`` per block of rows: the same sums in the same order as
    sklearn's ``_silhouette_reduce`` (a bincount per row), so bitwise equal to them.
    """
    n = D.shape[0]
    out = np.empty((n, K), dtype=np.float64)
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        bins = (np.arange(hi - lo, dtype=np.int64)[:, None] * K + codes[None, :]).ravel()
        out[lo:hi] = np.bincount(bins, weights=D[lo:hi].ravel(), minlength=(hi - lo) * K).reshape(hi - lo, K)
    return out


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
    tree are nested) are sums of those columns, O(N K) each. The finest labelling's
    score is bitwise sklearn's; a coarser one can differ in the last bits, because
    its cluster sums are added in a different order. Deterministic: numpy
    bincounts and column sums, no BLAS.
    """
    from scipy.spatial.distance import squareform

    labelings = [np.asarray(lab) for lab in labelings]
    if not labelings:
        return []
    D = squareform(np.asarray(distances, dtype=np.float64))
    encoded = [_encode(lab) for lab in labelings]
    fine = int(np.argmax([k for _, k in encoded]))
    f_codes, f_k = encoded[fine]
    f_sums = _cluster_sums(D, f_codes, f_k)
    _, first = np.unique(f_codes, return_index=True)
    scores = []
    for codes, k in encoded:
        mapping = codes[first]  # the coarse cluster of each fine cluster
        if np.array_equal(mapping[f_codes], codes):
            sums = np.zeros((codes.size, k), dtype=np.float64)
            for f in range(f_k):
                sums[:, mapping[f]] += f_sums[:, f]
        else:  # not nested in the finest labelling: a pass of its own
            sums = _cluster_sums(D, codes, k)
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


def find_communities(
    signatures: np.ndarray,
    method: str = "average",
    metric: str = "cosine",
    cut: str = "auto",
    k: Optional[int] = None,
    threshold: Optional[float] = None,
    max_k: int = 16,
    min_silhouette: float = 0.25,
    min_separation: float = 0.0,
    distances: Optional[np.ndarray] = None,
) -> Communities:
    """Linkage plus cut. ``cut`` is maxclust (needs k), distance (needs threshold) or auto.

    ``min_separation`` (auto only) is a cosine distance, or for the euclidean
    metric a distance relative to the signatures' RMS norm; with precomputed
    ``distances`` (``1 - CKA``), a distance on their own scale.
    """
    if np.asarray(signatures).shape[0] == 1:  # a world of one: one community, an empty tree
        return Communities(Z=np.zeros((0, 4)), labels=np.zeros(1, dtype=np.int64), cut_height=0.0,
                           distances=np.zeros(0))
    Z, d = build_tree(signatures, method, metric, distances)
    scale = 1.0
    if metric == "euclidean" and distances is None:
        rms = float(np.sqrt(np.mean(np.sum(np.asarray(signatures, dtype=np.float64) ** 2, axis=1))))
        scale = rms if rms > 0 else 1.0
    if cut == "maxclust":
        if k is None:
            raise ValueError("cut='maxclust' needs k")
        labels = cut_maxclust(Z, k)
    elif cut == "distance":
        if threshold is None:
            raise ValueError("cut='distance' needs threshold")
        labels = cut_distance(Z, threshold)
    elif cut == "auto":
        labels = cut_auto(Z, d, max_k=max_k, min_silhouette=min_silhouette, min_separation=min_separation * scale)
    else:
        raise ValueError(f"cut={cut!r} is not one of maxclust, distance, auto")
    count = int(labels.max()) + 1
    height = float(threshold) if cut == "distance" else height_for_k(Z, count)
    return Communities(Z=Z, labels=labels, cut_height=height, distances=d)
