"""Population-based training's arithmetic (Jaderberg et al. 2017), as functions of arrays.

Each replica owns a vector of hyperparameters (``Space``: names, ranges, scales).
It draws its first values from its own counter-keyed stream, so every rank can
compute every replica's start without a message. At a merge the pair runs PBT's
*binary tournament*: the replica with the worse score (the loss on its own
held-out data) *exploits* by adopting the better one's values, then *explores*
by perturbing them (each multiplied by a factor drawn from ``factors``, or drawn
afresh with probability ``resample``), kept in range. A replica adopts at most
once per ``ready`` units: PBT's ``ready``, so a score reflects the values it
was trained with. Both sides decide from the same two headers, so they agree
without a further message; ties and two non-finite scores adopt nothing.

The tournament is greedy where pairs are many: a lower learning rate lowers the
held-out loss soonest, so at 64 replicas the population's learning rate decays
after a few units. ``truncation`` is PBT's other selection rule: at a signature
round every replica's score is gathered, and each ready replica ranked in the
bottom fraction adopts the values of one drawn from the top fraction; the
middle keeps its own, so the population moves only where the ranking is clear.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Tuple

import numpy as np

from .protocol import Purpose, rng


@dataclass(frozen=True)
class Space:
    """The learnable hyperparameters: their names (in a fixed order), ranges and scales."""

    names: Tuple[str, ...]
    low: np.ndarray  # float64, one entry per name
    high: np.ndarray
    log: np.ndarray  # bool: drawn log-uniformly

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> "Space":
        """From ``pbt.params`` ({name: range with low, high, scale}); names sorted, so every rank agrees."""
        names = tuple(sorted(params))
        rng = [params[n] for n in names]
        return cls(names, np.array([float(r.low) for r in rng], dtype=np.float64),
                   np.array([float(r.high) for r in rng], dtype=np.float64),
                   np.array([r.scale == "log" for r in rng], dtype=bool))

    def __len__(self) -> int:
        return len(self.names)

    def index(self, name: str) -> Optional[int]:
        return self.names.index(name) if name in self.names else None

    def clip(self, values: np.ndarray) -> np.ndarray:
        return np.clip(np.asarray(values, dtype=np.float64), self.low, self.high)


def draw(space: Space, rng: np.random.Generator) -> np.ndarray:
    """Fresh values, one uniform draw per hyperparameter: log-uniform on log scales, uniform otherwise."""
    u = rng.random(len(space))
    lo, hi = space.low, space.high
    with np.errstate(divide="ignore"):
        log_lo, log_hi = np.log(np.where(space.log, lo, 1.0)), np.log(np.where(space.log, hi, 1.0))
    out = np.where(space.log, np.exp(log_lo + u * (log_hi - log_lo)), lo + u * (hi - lo))
    return space.clip(out)


def first_values(space: Space, seed: int, replica: int, start: Optional[Mapping[str, float]] = None) -> np.ndarray:
    """Replica ``replica``'s first values: a draw from its own counter-keyed stream (so any rank can compute any
    replica's), with the values ``start`` gives replacing the draw's."""
    values = draw(space, rng(seed, Purpose.PBT_DRAW, 0, replica))
    for name, value in (start or {}).items():
        values[space.names.index(name)] = float(value)
    return values


def explore(space: Space, values: np.ndarray, rng: np.random.Generator, factors: Sequence[float],
            resample: float = 0.0) -> np.ndarray:
    """PBT's explore: each value multiplied by one of ``factors`` (uniformly), or with probability ``resample``
    drawn afresh from its range; the result kept in range. A fixed number of draws per call (deterministic)."""
    values = np.asarray(values, dtype=np.float64)
    coin = rng.random(len(space))
    pick = rng.integers(0, len(factors), size=len(space))
    fresh = draw(space, rng)
    scaled = values * np.asarray(factors, dtype=np.float64)[pick]
    return space.clip(np.where(coin < resample, fresh, scaled))


def better(x: float, y: float, margin: float = 0.0) -> bool:
    """Whether score ``x`` beats ``y`` (lower is better) by more than ``margin`` of |y|; a non-finite score never
    wins and loses to any finite one. Never true both ways, so a pair cannot both adopt."""
    if not math.isfinite(x):
        return False
    if not math.isfinite(y):
        return True
    return x < y - margin * abs(y)


def adopts(my_score: float, other_score: float, ready: bool, margin: float = 0.0) -> bool:
    """Whether this side adopts its partner's hyperparameters: it is ready, and the partner's score is better."""
    return bool(ready) and better(other_score, my_score, margin)


def truncation(scores: np.ndarray, ready: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Truncation selection over the whole population (Jaderberg et al. 2017): (N,) the replica each replica adopts
    from, or -1.

    Replicas are ranked by score (lower is better; a non-finite score ranks last; ties by replica). The bottom
    ``k = max(1, floor(fraction N))`` that are ``ready`` each adopt from a replica drawn uniformly from the top k,
    in replica order from ``rng`` (every rank draws the same). With ``fraction`` at most a half the two sets never
    meet, so no replica adopts its own values and none is both a source and an adopter.
    """
    scores = np.asarray(scores, dtype=np.float64)
    n = scores.size
    out = np.full(n, -1, dtype=np.int64)
    if n < 2 or not 0 < fraction <= 0.5:
        return out
    k = max(1, int(math.floor(fraction * n)))
    finite = np.isfinite(scores)
    order = np.lexsort((np.arange(n), np.where(finite, scores, 0.0), ~finite))  # finite first, by score, by index
    top, bottom = order[:k], np.sort(order[n - k:])
    draws = rng.integers(0, k, size=k)
    for i, d in zip(bottom, draws):
        if ready[i]:
            out[i] = int(top[d])
    return out


def pair_alpha(mine: float, other: float) -> float:
    """merge.alpha of a pair whose members own different ones: their mean, the same on both sides, so the pair's
    weight sum (and the population's mean) is conserved as with one shared alpha."""
    return 0.5 * (float(mine) + float(other))


def summary(names: Sequence[str], values: np.ndarray, labels: Optional[np.ndarray] = None) -> dict:
    """The final values: each replica's, and per community (labels) their median, min and max."""
    values = np.asarray(values, dtype=np.float64).reshape(-1, len(names))
    out: dict = {"names": list(names), "per_replica": values.tolist()}
    if labels is not None and len(labels) == len(values):
        groups = {}
        for c in np.unique(labels):
            block = values[np.asarray(labels) == c]
            groups[str(int(c))] = {n: {"median": float(np.median(block[:, k])), "min": float(block[:, k].min()),
                                       "max": float(block[:, k].max()), "replicas": int(len(block))}
                                   for k, n in enumerate(names)}
        out["per_community"] = groups
    out["median"] = {n: float(np.median(values[:, k])) for k, n in enumerate(names)}
    return out
