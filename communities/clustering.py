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


def build_tree(signatures: np.ndarray, method: str = "average", metric: str = "cosine"):
    """(Z, condensed distances). ``ward`` is defined for euclidean distances only."""
    if method not in LINKAGES:
        raise ValueError(f"linkage={method!r} is not one of {LINKAGES}")
    if method == "ward" and metric != "euclidean":
        raise ValueError("ward linkage needs the euclidean metric")
    S = np.asarray(signatures)
    if S.ndim != 2 or S.shape[0] < 2:
        raise ValueError(f"need an (N >= 2, d) signature matrix, got shape {S.shape}")
    d = pairwise(S, metric)
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


def cut_auto(Z: np.ndarray, distances: np.ndarray, max_k: int = 16, min_silhouette: float = 0.25,
             min_separation: float = 0.0) -> np.ndarray:
    """The k in 2..max_k with the best silhouette, or one community when none qualifies.

    A k qualifies when its silhouette reaches ``min_silhouette`` and the closest
    pair of its communities joins at a height of at least ``min_separation``
    (heights in the units of ``Z``). Silhouette alone is scale-free and would
    split ranks that agree to three decimals; the separation floor makes
    converged ranks one community without any schedule.
    """
    from sklearn.metrics import silhouette_score
    from scipy.spatial.distance import squareform

    n = Z.shape[0] + 1
    if n < 3:
        return np.zeros(n, dtype=np.int64)
    D = squareform(distances)
    best_k, best_s = 1, -np.inf
    for k in range(2, min(max_k, n - 1) + 1):
        if Z[n - k, 2] < min_separation:  # the k communities would join below the floor
            break
        labels = hierarchy.fcluster(Z, t=k, criterion="maxclust")
        if len(np.unique(labels)) < 2:
            continue
        s = silhouette_score(D, labels, metric="precomputed")
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
) -> Communities:
    """Linkage plus cut. ``cut`` is maxclust (needs k), distance (needs threshold) or auto.

    ``min_separation`` (auto only) is a cosine distance, or for the euclidean
    metric a distance relative to the signatures' RMS norm.
    """
    if np.asarray(signatures).shape[0] == 1:  # a world of one: one community, an empty tree
        return Communities(Z=np.zeros((0, 4)), labels=np.zeros(1, dtype=np.int64), cut_height=0.0,
                           distances=np.zeros(0))
    Z, d = build_tree(signatures, method, metric)
    scale = 1.0
    if metric == "euclidean":
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
