"""How IFCA's k shared models start (``ifca.init``): the pure parts, functions of arrays.

Why: with a few ranks per group, IFCA's first pick among k untrained models is
noise, several groups end up sharing one model and never leave it (issue 23).
Its authors' remedies are a good initial clustering or restarts:

- ``kmeans_assignment``: k-means on the rows every rank holds alike (the
  allgathered signatures of the warmed-up local models), numbered in order of
  first appearance so that the result does not depend on k-means' own numbering;
- ``lowest_loss``: which of several short starts to keep (the lowest training
  loss; no test data is looked at).

Every rank calls them on the same bytes and so derives the same answer.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def canonical_labels(labels: np.ndarray) -> np.ndarray:
    """The same partition, its clusters numbered 0, 1, ... in order of their first member."""
    labels = np.asarray(labels)
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first, kind="stable"), kind="stable")  # rank of each cluster's first member
    return order[inverse.reshape(-1)].astype(np.int64)


def kmeans_assignment(rows: np.ndarray, k: int, seed: int, n_init: int = 10) -> np.ndarray:
    """Each row's cluster among ``k`` by scikit-learn's k-means (seeded, one thread: the same on every rank).

    ``rows`` is (N, d), N >= k; identical rows may leave fewer than k clusters used.
    """
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or not 1 <= k <= rows.shape[0]:
        raise ValueError(f"k-means of {k} clusters needs an (N, d) array with N >= k, got shape {rows.shape}")
    if not np.isfinite(rows).all():
        raise ValueError("k-means on non-finite rows (a diverged rank?): the initial clusters cannot be formed")
    if k == 1:
        return np.zeros(rows.shape[0], dtype=np.int64)
    with threadpool_limits(1):
        km = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(rows)
    return canonical_labels(km.labels_)


def lowest_loss(losses: Sequence[float]) -> int:
    """The index of the lowest loss, the first on ties; a non-finite loss is never the lowest (all: the first)."""
    values = np.asarray(losses, dtype=np.float64)
    if values.size == 0:
        raise ValueError("no start to choose from")
    values = np.where(np.isfinite(values), values, np.inf)
    return int(np.argmin(values))
