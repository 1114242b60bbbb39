"""One local unit of training on a rank's shard, and evaluation.

A unit is one epoch over the shard or a fixed number of steps. Shuffling uses a
generator keyed by (seed, rank, t), so a unit's batches depend only on where it
sits in virtual time: the same on a resumed run as on an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..core import protocol


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    """SGD or AdamW from a TrainConfig."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    raise ValueError(f"train.optimizer={cfg.optimizer!r} is not one of sgd, adamw")


@dataclass
class UnitResult:
    loss: float
    accuracy: float
    samples: int
    steps: int


def batches(n: int, batch_size: int, seed: int, rank: int, t: int, steps: Optional[int]):
    """Index batches for unit t: one shuffled epoch, or exactly ``steps`` full batches.

    In step mode every batch has ``min(batch_size, n)`` examples, drawn from
    successive permutations, so ranks with different shard sizes take the same
    number of equal steps (what a per-step collective needs).
    """
    g = protocol.rng(seed, protocol.Purpose.SHUFFLE, t, rank)
    if steps is None:
        perm = g.permutation(n)
        for lo in range(0, n, batch_size):
            yield perm[lo: lo + batch_size]
        return
    size = min(batch_size, n)
    pool = g.permutation(n)
    for _ in range(steps):
        while len(pool) < size:
            pool = np.concatenate([pool, g.permutation(n)])
        yield pool[:size]
        pool = pool[size:]


def train_unit(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, cfg, seed: int,
               rank: int, t: int, steps: Optional[int] = None, grad_sync: Optional[Callable[[], None]] = None,
               between_batches: Optional[Callable[[int], None]] = None) -> UnitResult:
    """Train one unit; returns mean loss and accuracy over the unit's batches.

    ``steps`` fixes the number of steps (else one epoch, or ``cfg.steps_per_unit``
    in step mode). ``grad_sync`` runs between backward and the optimizer step
    (the allreduce strategy averages gradients there); gradients are then kept
    as tensors, not set to None, so a flat gradient buffer stays bound.
    ``between_batches(k)`` runs after the k-th optimizer step: where the
    asynchronous protocol serves its partners, and where injected slowdowns sleep.
    """
    model.train()
    if steps is None and cfg.unit == "steps":
        steps = cfg.steps_per_unit
    total_loss = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    seen = n_steps = 0
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    for idx in batches(len(y), cfg.batch_size, seed, rank, t, steps):
        if len(idx) < 2 and has_bn and grad_sync is None:
            continue  # BatchNorm cannot train on a batch of one
        ix = torch.as_tensor(idx, device=x.device)
        xb, yb = x[ix], y[ix]
        out = model(xb)
        loss = F.cross_entropy(out, yb)
        opt.zero_grad(set_to_none=grad_sync is None)
        loss.backward()
        if grad_sync is not None:
            grad_sync()
        opt.step()
        total_loss += loss.detach().double() * len(idx)
        correct += (out.detach().argmax(1) == yb).sum()
        seen += len(idx)
        n_steps += 1
        if between_batches is not None:
            between_batches(n_steps)
    seen_f = max(seen, 1)
    return UnitResult(float(total_loss) / seen_f, float(correct) / seen_f, seen, n_steps)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> Tuple[float, float]:
    """(accuracy, mean cross-entropy) on (x, y)."""
    model.eval()
    total_loss = 0.0
    correct = 0
    for lo in range(0, len(y), batch_size):
        out = model(x[lo: lo + batch_size])
        yb = y[lo: lo + batch_size]
        total_loss += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    n = max(len(y), 1)
    return correct / n, total_loss / n
