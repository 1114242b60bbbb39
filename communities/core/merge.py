"""Merge rules: how two partners combine their flat weights.

Each side applies ``w_i <- (1 - a_i) w_i + a_i w_j``. With ``a_i = a_j`` (rules
constant, ema, swap) the sum ``w_i + w_j`` is unchanged, so the mean over all
ranks is conserved exactly (up to rounding). ``clock`` and ``loss`` weight the
partners: ``a_i = 2 alpha c_j / (c_i + c_j)`` with c the samples seen (clock) or the
inverse recent loss (loss); then ``c_i w_i + c_j w_j`` is conserved instead, and
with alpha = 0.5 both land on the weighted average.

Both sides compute their coefficient from the same two metadata values, so the
pair agrees without extra messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import schedule

RULES = ("constant", "clock", "loss", "ema", "swap")


@dataclass(frozen=True)
class Side:
    """What a rank tells its partner before merging (crosses MPI as float64 numbers)."""

    samples: float
    loss: float


def coefficient(rule: str, me: Side, other: Side, alpha: float = 0.5, t: int = 0, *, ema=None) -> float:
    """a_me: the weight this rank gives its partner's weights."""
    if rule == "constant":
        return float(alpha)
    if rule == "swap":
        return 1.0
    if rule == "ema":
        if ema is None:
            raise ValueError("rule 'ema' needs its schedule")
        return float(schedule.evaluate(ema, t))
    if rule == "clock":
        c_me, c_other = max(me.samples, 0.0), max(other.samples, 0.0)
    elif rule == "loss":
        c_me, c_other = _inverse_loss(me.loss), _inverse_loss(other.loss)
    else:
        raise ValueError(f"unknown merge rule {rule!r}; expected one of {RULES}")
    total = c_me + c_other
    return float(alpha) if total <= 0 else 2.0 * float(alpha) * c_other / total


def max_coefficient(rule: str, alpha: float = 0.5, ema=None) -> float:
    """The largest weight ``coefficient`` can give a partner under ``rule`` (clock and loss: up to 2 alpha)."""
    if rule == "constant":
        return float(alpha)
    if rule == "swap":
        return 1.0
    if rule == "ema":
        return float(max(ema.start, ema.end)) if ema is not None else 1.0
    if rule in ("clock", "loss"):
        return min(1.0, 2.0 * float(alpha))
    raise ValueError(f"unknown merge rule {rule!r}; expected one of {RULES}")


def _inverse_loss(loss: float) -> float:
    if not math.isfinite(loss):
        return 0.0
    return 1.0 / max(loss, 1e-8)


def interpolate_(mine: torch.Tensor, theirs: torch.Tensor, a: float) -> None:
    """In place: ``mine <- (1 - a) mine + a theirs`` (exact copy for a = 1)."""
    if a == 1.0:
        mine.copy_(theirs)
    elif a != 0.0:
        mine.lerp_(theirs, a)


def displace_(mine: torch.Tensor, theirs: torch.Tensor, sent: torch.Tensor, a: float) -> float:
    """In place: ``mine <- mine + a (theirs - sent)``; returns ``||theirs - sent||``. ``sent`` is overwritten.

    The merge of a posted exchange (``comm.exchange: posted``), where each side
    goes on training between posting a copy of its weights (``sent``) and
    merging the partner's. Applied on both sides with the same ``a``, the two
    displacements cancel: the pair's sum is conserved whatever either side
    trained meanwhile, and with nothing trained in between it is ``interpolate_``.
    """
    torch.sub(theirs, sent, out=sent)
    distance = float(torch.linalg.vector_norm(sent, dtype=torch.float64))
    if a != 0.0:
        mine.add_(sent.to(mine.device), alpha=a)
    return distance


class OuterOptimizer:
    """DiLoCo-style outer step: treat ``w_before - w_merged`` as a pseudo-gradient.

    ``m <- mu m + g``; Nesterov: ``w <- w_before - lr (g + mu m)``, else
    ``w <- w_before - lr m``. lr = 1, mu = 0 recovers the plain merge.
    """

    def __init__(self, n: int, *, lr: float, momentum: float, nesterov: bool, device="cpu", dtype=torch.float32):
        self.lr, self.mu, self.nesterov = float(lr), float(momentum), bool(nesterov)
        self.m = torch.zeros(n, device=device, dtype=dtype)

    def step_(self, before: torch.Tensor, merged: torch.Tensor) -> None:
        """Overwrite ``merged`` with the outer-optimised weights."""
        g = before - merged
        self.m.mul_(self.mu).add_(g)
        step = g.add(self.m, alpha=self.mu) if self.nesterov else self.m
        merged.copy_(before).sub_(step, alpha=self.lr)
