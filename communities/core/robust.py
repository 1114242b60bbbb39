"""Defences against diverged and hostile ranks, and the fault injection that tests them.

Pure functions of arrays. A *diverged* rank (non-finite weights or loss, or a
loss blown up past ``loss_factor`` times its first unit's) is never merged into
a partner: the partner keeps its weights and the diverged rank is reset to the
partner's (or quarantined). A *hostile* rank (one that sends scaled or random
weights) shows up as a signature far from everyone else's; with
``robust.enabled`` every rank derives the same outlier mask from the same
gathered signatures, drops exchanges that involve an outlier, and leaves
outliers out of averages and the consensus model.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def is_diverged(weight_sum: float, loss: float, first_loss: float, loss_factor: float) -> bool:
    """True if the weights or the loss are non-finite, or the loss exceeds ``loss_factor`` x the first unit's."""
    if not math.isfinite(weight_sum) or not math.isfinite(loss):
        return True
    return math.isfinite(first_loss) and first_loss > 0 and loss > loss_factor * first_loss


def sanitize(signatures: np.ndarray) -> np.ndarray:
    """Rows with NaN/Inf (diverged ranks) become zero: a zero signature sits apart from every other."""
    S = np.array(signatures, dtype=np.float64, copy=True)
    bad = ~np.isfinite(S).all(axis=1)
    S[bad] = 0.0
    return S


def outliers(signatures: np.ndarray, factor: float) -> np.ndarray:
    """Ranks whose signature lies more than ``factor`` x the median distance from the coordinate-wise median.

    The median is what one hostile rank (of at least three) cannot move far;
    honest ranks in planted groups sit at comparable distances from it.
    Non-finite rows are not flagged: they are diverged ranks, which must stay in
    the exchanges so that a partner can reset them (``robust.diverged``); they
    are never merged into anyone, and the consensus leaves them out anyway.
    """
    S = np.asarray(signatures, dtype=np.float64)
    finite = np.isfinite(S).all(axis=1)
    mask = np.zeros(len(S), dtype=bool)
    if finite.sum() < 3:
        return mask
    centre = np.median(S[finite], axis=0)
    r = np.linalg.norm(S[finite] - centre, axis=1)
    scale = np.median(r)
    if scale > 0:
        mask[np.flatnonzero(finite)[r > factor * scale]] = True
    return mask


def hostile_payload(flat: torch.Tensor, kind: str, scale: float, generator: torch.Generator) -> torch.Tensor:
    """What a simulated Byzantine rank sends instead of its weights."""
    if kind == "scale":
        return flat * scale
    if kind == "random":
        noise = torch.randn(flat.numel(), generator=generator, dtype=flat.dtype).to(flat.device)
        return noise * (float(flat.norm()) / max(float(noise.norm()), 1e-12))
    raise ValueError(f"faults.hostile_kind={kind!r} is not one of scale, random")
