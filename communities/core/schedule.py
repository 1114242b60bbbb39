"""Annealing schedules: a scalar that moves from ``start`` to ``end`` over a horizon.

Used for p_cross(t), the partner temperature T(t), the community count k(t),
the ``ema`` merge weight a(t) and the learning rate's warmup and decay. Pure
functions of t; no state, so every rank and a resumed run compute the same value.
"""
from __future__ import annotations

import math


def progress(t: float, begin: int, horizon: int) -> float:
    """Fraction of the annealing done at unit t, clipped to [0, 1]."""
    return min(1.0, max(0.0, (t - begin) / float(horizon)))


def value(t: float, start: float, end: float, shape: str = "linear", begin: int = 0, *, horizon: int = 100) -> float:
    """Schedule value at unit t. Shapes: linear, cosine (slow-fast-slow), exp (geometric), constant."""
    u = progress(t, begin, horizon)
    if shape == "constant":
        return float(start)
    if shape == "linear":
        return start + (end - start) * u
    if shape == "cosine":
        return start + (end - start) * 0.5 * (1.0 - math.cos(math.pi * u))
    if shape == "exp":
        if start <= 0 or end <= 0:
            raise ValueError("exp schedule needs start > 0 and end > 0")
        return start * (end / start) ** u
    raise ValueError(f"unknown schedule shape {shape!r}; expected linear, cosine, exp or constant")


def evaluate(sched, t: float) -> float:
    """``value`` for a config ``Schedule`` section."""
    return value(t, sched.start, sched.end, sched.shape, sched.begin, horizon=sched.horizon)


def finished(sched, t: float) -> bool:
    """True once the schedule has reached its end value."""
    return sched.shape == "constant" or t >= sched.begin + sched.horizon


def lr_factor(progress: float, kind: str = "constant", warmup: float = 0.0, floor: float = 0.1) -> float:
    """The learning rate's share of its peak at ``progress`` (0 to 1) of the budget: a linear rise from 0 over the
    first ``warmup``, then constant, or (``cosine``) a half cosine from 1 down to ``floor`` at the end."""
    u = min(max(float(progress), 0.0), 1.0)
    if u < warmup:
        return u / warmup
    if kind == "constant":
        return 1.0
    if kind != "cosine":
        raise ValueError(f"unknown learning-rate schedule {kind!r}; expected constant or cosine")
    v = (u - warmup) / (1.0 - warmup) if warmup < 1 else 1.0
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * v))
