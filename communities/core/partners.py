"""The partner law: who a rank merges with, given its community.

Flat: ``P(j | i) ∝ p_intra`` inside i's community, ``p_cross(t)`` outside.
Hierarchical: ``P(j | i) ∝ exp(-h_ij / T(t))`` with ``h_ij`` the cophenetic height
(normalised by the tree's top) at which i and j join.
Both exclude i itself and become uniform gossip as p_cross -> p_intra or T -> inf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np


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


class CopheneticHeights:
    """The normalised cophenetic heights of a linkage tree, one rank's row at a time.

    ``row(i)`` is row i of ``squareform(cophenet(Z)) / top`` (top: the last merge's
    height; all zeros when it is not positive), bit for bit, in O(N) time and memory:
    with the leaves in a dendrogram order, the merge that joins i and j is the
    latest (largest index) of the merges between their positions, because a merge's
    ancestors come later in Z. So no N x N (or condensed N(N-1)/2) array is built:
    at N = 1,024 the condensed heights were 4 MB per round, the square 8 MB.
    """

    def __init__(self, Z: np.ndarray):
        Z = np.asarray(Z, dtype=np.float64)
        n = len(Z) + 1
        top = float(Z[-1, 2]) if Z.size else 0.0
        # the height of each merge, divided as cophenet's values were (a zero tree when top <= 0)
        self.merge_heights = Z[:, 2] / top if top > 0 else np.zeros(len(Z))
        start = [0] * (2 * n - 1)  # first position of each node's leaves in the order
        gap = np.zeros(max(n - 1, 0), dtype=np.int64)  # gap[q]: the merge joining positions q and q + 1
        rows = Z[:, :2].astype(np.int64).tolist()
        for k in range(n - 2, -1, -1):
            a, b = rows[k]
            s = start[n + k]
            left = 1 if a < n else int(Z[a - n, 3])
            start[a], start[b] = s, s + left
            gap[s + left - 1] = k
        self.n = n
        self.position = np.asarray(start[:n], dtype=np.int64)  # leaf -> its position in the order
        self.gap = gap
        self._back = np.empty(max(n - 1, 0), dtype=np.int64)

    def row(self, i: int) -> np.ndarray:
        """Heights of rank i with every rank (0 at i), a fresh float64 vector."""
        n, p = self.n, int(self.position[i])
        at = np.empty(n, dtype=np.int64)  # per position: the merge joining it with i's position
        np.maximum.accumulate(self.gap[p:], out=at[p + 1:])
        if p > 0:
            back = self._back[:p]
            np.maximum.accumulate(self.gap[p - 1::-1], out=back)
            at[:p] = back[::-1]
        at[p] = 0
        h = self.merge_heights[at] if n > 1 else np.zeros(1)
        h[p] = 0.0
        return h[self.position]


def cophenetic_heights(Z: np.ndarray) -> CopheneticHeights:
    """Normalised cophenetic heights (so in [0, 1]) of a linkage, served per row."""
    return CopheneticHeights(Z)


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


def hierarchical_probabilities(heights: CopheneticHeights, i: int, temperature: float) -> np.ndarray:
    h = heights.row(i)
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


def hypercube_pairs(groups: Sequence[Sequence[int]], stage: int) -> List[Tuple[int, int]]:
    """One stage of the one-peer hypercube schedule inside each group (Ying et al. 2021): the member at position p
    of a group of m pairs with position ``p XOR 2^b``, b = stage mod ceil(log2 m), where that position exists.

    Every rank is in at most one pair, so a stage is a matching (deadlock-free in any order). Averaging each pair
    (merge weight 0.5) over any ceil(log2 m) consecutive stages gives a group of m = 2^k members its exact mean;
    other sizes leave the members past the last power of two unpaired at some stages (mixing, not exact).
    Pairs are (lower rank, higher rank), sorted.
    """
    pairs: List[Tuple[int, int]] = []
    for members in groups:
        ranks = sorted(int(r) for r in members)
        m = len(ranks)
        if m < 2:
            continue
        bit = 1 << (int(stage) % max(1, (m - 1).bit_length()))
        for p in range(m):
            q = p ^ bit
            if p < q < m:
                pairs.append((ranks[p], ranks[q]))
    return sorted(pairs)


def draw(probabilities: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw; deterministic for a given generator state."""
    return draw_from_cdf(np.cumsum(probabilities), rng)


def draw_from_cdf(cdf: np.ndarray, rng: np.random.Generator) -> int:
    """``draw`` given the cumulative sum of the probabilities (``protocol.exchange_list`` takes a block's at once)."""
    u = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))


def staleness_row(seen_at_i: np.ndarray, i: int, t: int, power: float = 2.0) -> np.ndarray:
    """Partner weights of the model on rank i that favour shards it saw least recently (``merge.partner_policy``).

    ``seen_at_i[j]`` is the last unit at which the model now on rank i trained
    on rank j's shard (-1: never). The weight is ``(1 + t - seen_at) ** power``,
    so a shard never seen weighs most; it is 0 at i (no self-merge).
    """
    seen = np.asarray(seen_at_i, dtype=np.float64)
    w = (1.0 + float(t) - seen) ** float(power)
    w[i] = 0.0
    return w


class Staleness:
    """The staleness factors of a signature round, one initiator's row at a time (``bias[i]``).

    Built from the gathered (N, N) ``seen_at`` table at unit ``t``; a row costs O(N)
    when drawn, so no N x N float matrix of factors is held.
    """

    def __init__(self, seen_at: np.ndarray, t: int, power: float = 2.0):
        self.seen_at, self.t, self.power = np.asarray(seen_at, dtype=np.int64), int(t), float(power)

    def __getitem__(self, i: int) -> np.ndarray:
        return staleness_row(self.seen_at[i], i, self.t, self.power)


@dataclass
class Law:
    """The partner law in force: the latest round's communities plus the schedules' values at t."""

    kind: str  # flat | hierarchical | uniform | frozen (consensus.mode: the communities no longer merge)
    n: int
    labels: Optional[np.ndarray] = None
    heights: Optional[CopheneticHeights] = None  # normalised cophenetic heights, per row
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
            return hierarchical_probabilities(self.heights, i, self.temperature)
        return uniform_probabilities(self.n, i)

    def rows(self, ids: List[int]) -> np.ndarray:
        """``np.stack([self.probabilities(i) for i in ids])``, bit for bit, built as one (len(ids), N) array for
        the flat and uniform laws (the hierarchical and frozen laws row by row)."""
        ids_a = np.asarray(ids, dtype=np.int64)
        k = len(ids_a)
        flat = self.kind == "flat" and self.labels is not None
        if flat:
            labels = np.asarray(self.labels)
            w = np.where(labels[ids_a][:, None] == labels[None, :], float(self.p_intra), float(self.p_cross))
        elif self.kind == "uniform":
            w = np.ones((k, self.n), dtype=np.float64)
        else:
            return np.stack([self.probabilities(int(i)) for i in ids_a]) if k else np.zeros((0, self.n))
        w[np.arange(k), ids_a] = 0.0
        total = w.sum(axis=1)
        alone = ~(total > 0) if flat else np.zeros(k, dtype=bool)  # alone with p_cross == 0: uniform
        if alone.any():
            w[alone] = 1.0
            w[np.flatnonzero(alone), ids_a[alone]] = 0.0
            total[alone] = w[alone].sum(axis=1)
        return w / total[:, None]
