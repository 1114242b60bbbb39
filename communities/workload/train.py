"""One local unit of training on a rank's shard, and evaluation.

A unit is one epoch over the shard or a fixed number of steps. Shuffling uses a
generator keyed by (seed, rank, t), so a unit's batches depend only on where it
sits in virtual time: the same on a resumed run as on an uninterrupted one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Tuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..core import protocol
from ..core import schedule as schedules
from . import optim_calls


class PrivateSteps(Protocol):
    """What a training step asks of DP-SGD (``private.PrivateGradient``, privacy.enabled): whether batches are
    Poisson samples, the unit's noise stream, and a backward that leaves the clipped, noised gradient."""

    poisson: bool

    def generator(self, t: int) -> torch.Generator: ...

    def backward(self, xb: torch.Tensor, yb: torch.Tensor, denom: float, opt: torch.optim.Optimizer,
                 gen: torch.Generator, *, set_to_none: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        ...


def make_optimizer(cfg, params) -> torch.optim.Optimizer:
    """SGD or AdamW from a TrainConfig."""
    optim_calls.skip_compiler_guards()
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                               weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    raise ValueError(f"train.optimizer={cfg.optimizer!r} is not one of sgd, adamw")


def cross_entropy(out: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """A classifier's (batch, classes) logits against labels, or a sequence model's (batch, time, vocabulary)
    logits against the next tokens: per example, the mean over its tokens (nats per token)."""
    if out.ndim == 3:
        if reduction == "mean":
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1).long())
        per = F.cross_entropy(out.transpose(1, 2), y.long(), reduction="none").mean(1)
        return per.sum() if reduction == "sum" else per
    return F.cross_entropy(out, y, reduction=reduction)


def correct(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Right predictions summed over examples (a sequence's: the share of its tokens predicted right)."""
    hits = out.argmax(-1) == y
    return hits.double().mean(1).sum() if out.ndim == 3 else hits.sum()


def scheduled(cfg) -> bool:
    """Whether a TrainConfig's learning rate moves over the budget (train.schedule, train.warmup); an object
    without those keys (a caller's own settings with the optimizer's) keeps it constant."""
    return getattr(cfg, "schedule", "constant") != "constant" or getattr(cfg, "warmup", 0.0) > 0


def lr_factor(cfg, t: int, k: int, steps: int) -> float:
    """The learning rate's share of its peak at step k (1-based) of ``steps`` in unit t: a function of virtual
    time, so a resumed run, every strategy and every protocol compute the same."""
    return schedules.lr_factor((t - 1 + k / max(steps, 1)) / cfg.budget, cfg.schedule, cfg.warmup, cfg.min_lr)


@dataclass
class UnitResult:
    loss: float
    accuracy: float
    samples: int
    steps: int


def poisson_steps(n: int, batch_size: int, steps: Optional[int]) -> int:
    """Steps of a Poisson-sampled unit: ``steps``, else an epoch's worth (n / batch size, at least 1)."""
    return steps if steps is not None else max(1, round(n / batch_size))


def steps_per_unit(cfg, n: int, poisson: bool) -> int:
    """Optimizer steps one unit takes on a shard of n examples (a TrainConfig): what DP-SGD's accounting counts."""
    if cfg.unit == "steps":
        return cfg.steps_per_unit
    return poisson_steps(n, cfg.batch_size, None) if poisson else -(-n // cfg.batch_size)


def lockstep_steps(shard_sizes, batch_size: int) -> int:
    """Steps of an epoch unit when every step is a collective (strategy allreduce): the longest shard's epoch."""
    return -(-max(int(n) for n in shard_sizes) // batch_size)


def batches(n: int, batch_size: int, seed: int, rank: int, t: int, *, steps: Optional[int], poisson: bool = False,
            keyed: Optional[Callable[..., np.random.Generator]] = None):
    """Index batches for unit t: one shuffled epoch, or exactly ``steps`` full batches.

    In step mode every batch has ``min(batch_size, n)`` examples, drawn from
    successive permutations, so ranks with different shard sizes take the same
    number of equal steps (what a per-step collective needs).

    ``poisson`` (privacy.sampling: poisson): every step takes each example
    independently with probability ``q = batch_size / n``, the sampling DP-SGD's
    accountant assumes; batches vary in size and may be empty.

    ``keyed`` (a ``protocol.Rekeyed``, for batches consumed at once) gives the same stream as ``protocol.rng``.
    """
    g = (keyed or protocol.rng)(seed, protocol.Purpose.SHUFFLE, t, rank)
    if poisson:
        q = min(1.0, batch_size / n)
        for _ in range(poisson_steps(n, batch_size, steps)):
            yield np.flatnonzero(g.random(n) < q)
        return
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


def train_unit(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, cfg, *, seed: int,
               rank: int, t: int, steps: Optional[int] = None, grad_sync: Optional[Callable[[], None]] = None,
               between_batches: Optional[Callable[[int], None]] = None,
               private: Optional[PrivateSteps] = None) -> UnitResult:
    """Train one unit; returns mean loss and accuracy over the unit's batches.

    ``steps`` fixes the number of steps (else one epoch, or ``cfg.steps_per_unit``
    in step mode). ``grad_sync`` runs between backward and the optimizer step
    (the allreduce strategy averages gradients there); gradients are then kept
    as tensors, not set to None, so a flat gradient buffer stays bound.
    ``between_batches(k)`` runs after the k-th optimizer step: where the
    asynchronous protocol serves its partners, and where injected slowdowns sleep.
    ``private`` (privacy.enabled) computes each step's gradient as DP-SGD's clipped,
    noised sum instead of the plain backward.
    """
    model.train()
    if steps is None and cfg.unit == "steps":
        steps = cfg.steps_per_unit
    total_loss = torch.zeros((), dtype=torch.float64, device=x.device)
    right = torch.zeros((), dtype=torch.float64, device=x.device)
    seen = n_steps = 0
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    poisson = private is not None and private.poisson
    gen = private.generator(t) if private is not None else None
    plan = list(batches(len(y), cfg.batch_size, seed, rank, t, steps=steps, poisson=poisson))
    peaks = [g["lr"] for g in opt.param_groups] if scheduled(cfg) else None  # the groups' lr between units
    try:
        for k, idx in enumerate(plan, 1):
            if peaks is not None:
                for g, peak in zip(opt.param_groups, peaks):
                    g["lr"] = peak * lr_factor(cfg, t, k, len(plan))
            res = _step(model, opt, x, y, idx, cfg=cfg, has_bn=has_bn, grad_sync=grad_sync, private=private,
                        poisson=poisson, gen=gen)
            if res is None:
                continue
            loss, hits = res
            total_loss += loss * len(idx)
            right += hits
            seen += len(idx)
            n_steps += 1
            if between_batches is not None:
                between_batches(n_steps)
    finally:
        if peaks is not None:
            for g, peak in zip(opt.param_groups, peaks):
                g["lr"] = peak
    seen_f = max(seen, 1)
    # Poisson batches: count the expected examples, as the noisy sum is divided by them; the drawn count is a
    # function of the shard that DP-SGD does not protect (what partners are told: merge.rule clock)
    samples = n_steps * min(cfg.batch_size, len(y)) if poisson else seen
    return UnitResult(float(total_loss) / seen_f, float(right) / seen_f, samples, n_steps)


def _step(model, opt, x, y, idx, *, cfg, has_bn, grad_sync, private, poisson, gen):
    """One optimizer step on the batch ``idx``: (its loss, its right predictions) as tensors, zeros for an empty
    Poisson batch, or None for a batch BatchNorm cannot train on."""
    if len(idx) < 2 and has_bn and grad_sync is None:
        return None  # BatchNorm cannot train on a batch of one
    ix = torch.as_tensor(idx, device=x.device)
    xb, yb = x[ix], y[ix]
    if private is None:
        out = model(xb)
        loss = cross_entropy(out, yb)
        opt.zero_grad(set_to_none=grad_sync is None)
        loss.backward()
    else:  # the expected batch size under Poisson sampling, the batch's own under shuffling
        denom = min(cfg.batch_size, len(y)) if poisson else len(idx)
        out, loss = private.backward(xb, yb, denom, opt, gen, set_to_none=grad_sync is None)
    if grad_sync is not None:
        grad_sync()
    optim_calls.step(opt)
    if out is None or loss is None:  # an empty Poisson batch: its step is the noise alone
        zero = torch.zeros((), dtype=torch.float64, device=x.device)
        return zero, zero
    return loss.detach().double(), correct(out.detach(), yb)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> Tuple[float, float]:
    """(accuracy, mean cross-entropy) on (x, y), in eval mode; the model's mode is restored after (a score taken
    between batches, as pbt's under protocol async, must not leave dropout or batch norm in eval mode)."""
    if not x.is_floating_point():  # token windows: at most 4,096 tokens per pass (the logits are tokens x vocabulary)
        batch_size = max(1, min(batch_size, 4096 // max(int(x.shape[-1]), 1)))
    was = model.training
    model.eval()
    total_loss = 0.0
    right = 0.0
    try:
        for lo in range(0, len(y), batch_size):
            out = model(x[lo: lo + batch_size])
            yb = y[lo: lo + batch_size]
            total_loss += float(cross_entropy(out, yb, reduction="sum"))
            right += float(correct(out, yb))
    finally:
        model.train(was)
    n = max(len(y), 1)
    return right / n, total_loss / n
