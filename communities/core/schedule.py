"""Annealing schedules: a scalar that moves from ``start`` to ``end`` over a horizon.

Used for p_cross(t), the partner temperature T(t), the community count k(t) and
the ``ema`` merge weight a(t). Pure functions of t; no state, so every rank and a
resumed run compute the same value.
"""
from __future__ import annotations

import math


def progress(t: float, begin: int, horizon: int) -> float:
    """Fraction of the annealing done at unit t, clipped to [0, 1]."""
    return min(1.0, max(0.0, (t - begin) / float(horizon)))


def value(t: float, start: float, end: float, shape: str = "linear", begin: int = 0, horizon: int = 100) -> float:
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
    return value(t, sched.start, sched.end, sched.shape, sched.begin, sched.horizon)


def finished(sched, t: float) -> bool:
    """True once the schedule has reached its end value."""
    return sched.shape == "constant" or t >= sched.begin + sched.horizon
