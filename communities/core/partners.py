"""The partner law: who a rank merges with, given its community.

Flat: ``P(j | i) ∝ p_intra`` inside i's community, ``p_cross(t)`` outside.
Hierarchical: ``P(j | i) ∝ exp(-h_ij / T(t))`` with ``h_ij`` the cophenetic height
(normalised by the tree's top) at which i and j join.
Both exclude i itself and become uniform gossip as p_cross -> p_intra or T -> inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy.cluster import hierarchy


def flat_weights(labels: np.ndarray, i: int, p_intra: float, p_cross: float) -> np.ndarray:
    """Unnormalised partner weights of rank i (zero on i)."""
    labels = np.asarray(labels)
    w = np.where(labels == labels[i], float(p_intra), float(p_cross))
    w[i] = 0.0
    return w


def flat_probabilities(labels: np.ndarray, i: int, p_intra: float, p_cross: float) -> np.ndarray:
    w = flat_weights(labels, i, p_intra, p_cross)
    total = w.sum()
    if total <= 0:  # i alone in its community and p_cross == 0: fall back to uniform
        w = np.ones_like(w)
        w[i] = 0.0
        total = w.sum()
    return w / total


def frozen_probabilities(labels: np.ndarray, i: int) -> np.ndarray:
    """Partners inside i's frozen community only, uniformly; all zero when i is alone in it (no merges)."""
    labels = np.asarray(labels)
    w = (labels == labels[i]).astype(np.float64)
    w[i] = 0.0
    total = w.sum()
    return w / total if total > 0 else w


def cophenetic_heights(Z: np.ndarray) -> np.ndarray:
    """Condensed cophenetic heights divided by the top merge height (so in [0, 1])."""
    h = hierarchy.cophenet(Z)
    top = float(Z[-1, 2]) if Z.size else 0.0
    return h / top if top > 0 else np.zeros_like(h)


_LEFT: dict = {}  # n -> condensed index of (j, 0) minus 1, so that (j, i) for j < i is _LEFT[n][j] + i


def _left_offsets(n: int) -> np.ndarray:
    off = _LEFT.get(n)
    if off is None:
        j = np.arange(n, dtype=np.int64)
        off = n * j - j * (j + 1) // 2 - j - 1
        if len(_LEFT) > 8:
            _LEFT.clear()
        _LEFT[n] = off
    return off


def condensed_row(condensed: np.ndarray, n: int, i: int) -> np.ndarray:
    """Row i of the square matrix behind a condensed distance vector (0 on the diagonal).

    The entries right of the diagonal are one contiguous slice of the condensed
    vector; those left of it are a gather at offsets cached per n.
    """
    row = np.empty(n, dtype=np.float64)
    row[i] = 0.0
    if i > 0:
        np.take(condensed, _left_offsets(n)[:i] + i, out=row[:i])
    if i < n - 1:
        start = n * i - i * (i + 1) // 2
        row[i + 1:] = condensed[start: start + n - i - 1]
    return row


def hierarchical_probabilities(heights: np.ndarray, n: int, i: int, temperature: float) -> np.ndarray:
    h = condensed_row(heights, n, i)
    logits = np.divide(h, -float(temperature), out=h)  # = -h / T, bit for bit
    # the largest logit of the other ranks (heights are finite and T > 0: no scan for non-finite values)
    top = max(logits[:i].max(initial=-np.inf), logits[i + 1:].max(initial=-np.inf))
    logits[i] = -np.inf
    if not np.isfinite(top):  # odd heights or temperature: the general form
        top = logits[np.isfinite(logits)].max()
    logits -= top
    w = np.exp(logits, out=logits)
    return w / w.sum()


def uniform_probabilities(n: int, i: int) -> np.ndarray:
    w = np.ones(n, dtype=np.float64)
    w[i] = 0.0
    return w / w.sum()


def ring_partner(i: int, n: int, t: int) -> int:
    """Ring neighbour, alternating right and left with t so information flows both ways."""
    return (i + 1) % n if t % 2 == 0 else (i - 1) % n


def draw(probabilities: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw; deterministic for a given generator state."""
    cdf = np.cumsum(probabilities)
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


def staleness_weights(seen_at: np.ndarray, t: int, power: float = 2.0) -> np.ndarray:
    """(N, N) partner weights that favour shards a model saw least recently (``merge.partner_policy``).

    ``seen_at[i, j]`` is the last unit at which the model now on rank i trained
    on rank j's shard (-1: never). The weight is ``(1 + t - seen_at) ** power``,
    so a shard never seen weighs most; the diagonal is 0 (no self-merge).
    """
    seen = np.asarray(seen_at, dtype=np.float64)
    W = (1.0 + float(t) - seen) ** float(power)
    np.fill_diagonal(W, 0.0)
    return W


@dataclass
class Law:
    """The partner law in force: the latest round's communities plus the schedules' values at t."""

    kind: str  # flat | hierarchical | uniform | frozen (consensus.mode: the communities no longer merge)
    n: int
    labels: Optional[np.ndarray] = None
    heights: Optional[np.ndarray] = None  # condensed, normalised cophenetic heights
    p_intra: float = 1.0
    p_cross: float = 1.0
    temperature: float = 1.0

    def probabilities(self, i: int) -> np.ndarray:
        """P(j | i) over all N ranks (zero on i)."""
        if self.kind == "flat" and self.labels is not None:
            return flat_probabilities(self.labels, i, self.p_intra, self.p_cross)
        if self.kind == "frozen" and self.labels is not None:
            return frozen_probabilities(self.labels, i)
        if self.kind == "hierarchical" and self.heights is not None:
            return hierarchical_probabilities(self.heights, self.n, i, self.temperature)
        return uniform_probabilities(self.n, i)
