"""DP-SGD's gradient for one replica: clip every example's gradient, sum, add Gaussian noise.

The clipped sum ``sum_i c_i g_i`` with ``c_i = min(1, C / ||g_i||)`` is
computed exactly, one of three ways (``privacy.per_example``, the clippers of
``clipping.py``): ghost clipping with book-keeping (``ghost``: per-example norms
without per-example gradients, the clipped sum without a second backward),
Opacus's per-example gradients in one backward (``hooks``), or ``torch.func``
(``vmap``, for models Opacus cannot take); ``auto`` picks the fastest the
model's layers allow (``communities bench privacy`` times them against
Opacus's own step). When no factor binds (every ``c_i`` is exactly 1.0) the
gradient is the plain training step's own, so with no noise and a bound that
never binds a private run is bit for bit the plain run. Noise
``N(0, (sigma C)^2)`` per coordinate is then added to the sum, and the sum
divided by ``b``: the batch's size under ``privacy.sampling: shuffle``, the
expected batch size (``q * n``) under Poisson sampling, as Opacus does.

Models whose forward is random (dropout) or mixes examples (batch norm) are
refused: the norms must be those of the gradients applied, and an example's
gradient must depend on that example only.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from ..core import privacy, protocol
from ..errors import ConfigError
from . import clipping, train


@dataclass(frozen=True)
class DPPlan:
    """One replica's DP-SGD accounting inputs: what privacy.epsilon needs besides its step count."""

    sample_rate: float  # q = batch_size / shard size
    noise_multiplier: float  # sigma (privacy.noise_multiplier, or derived from privacy.epsilon)
    planned_steps: int  # steps of train.budget units
    planned_epsilon: float  # epsilon after the planned steps


def plan(pc, tc, n: int, shard_sizes: Sequence[int], lockstep: bool) -> DPPlan:
    """The plan of a replica with n training examples (a PrivacyConfig, a TrainConfig; a ConfigError for an
    unreachable epsilon). ``lockstep``: every step is a collective (allreduce), so an epoch unit takes the
    longest shard's steps, as the mixer does."""
    q = min(1.0, tc.batch_size / max(n, 1))
    if lockstep and tc.unit == "epoch":
        per_unit = train.lockstep_steps(shard_sizes, tc.batch_size)
    else:
        per_unit = train.steps_per_unit(tc, n, pc.sampling == "poisson")
    steps = per_unit * tc.budget
    try:
        sigma, eps = privacy.plan(pc, q, steps)
    except ValueError as exc:
        raise ConfigError(f"privacy.epsilon={pc.epsilon}: {exc}; raise it, or lower train.budget") from None
    return DPPlan(q, sigma, steps, eps)


def require_opacus() -> None:
    """A ConfigError that says how to install Opacus, when it is missing."""
    try:
        import opacus  # noqa: F401
    except ImportError as exc:
        raise ConfigError("privacy.enabled=true accounts privacy with Opacus, which is not installed "
                          f"({exc}): pip install -e '.[privacy]' (or pip install opacus)") from None


def refuse_model(model: nn.Module, name: str) -> None:
    """A ConfigError naming privacy.enabled for layers DP-SGD's clipping cannot bound."""
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase):
            raise ConfigError(f"privacy.enabled=true cannot train model.name={name!r}: its layer "
                              f"{mod_name or '(root)'} ({type(mod).__name__}) mixes the examples of a batch, so no "
                              "example's gradient is its own to clip (use GroupNorm or LayerNorm, or no norm layer)")
        if isinstance(mod, nn.modules.dropout._DropoutNd):
            raise ConfigError(f"privacy.enabled=true cannot train model.name={name!r}: its layer "
                              f"{mod_name or '(root)'} ({type(mod).__name__}) draws a random mask per pass, so the "
                              "clipping pass would bound other gradients than the ones applied (model.dropout: 0)")


def per_example_method(model: nn.Module) -> str:
    """privacy.per_example=auto: ``ghost`` where every layer with parameters is a Linear, a Conv1d of one group or
    a layer Opacus has a per-example gradient for (other convolutions, norm layers, embeddings, ...), ``vmap``
    otherwise: the fastest the layers allow for the built-in models (``communities bench privacy``)."""
    return "ghost" if clipping.ghost_supports(model) else "vmap"


def check_model(model: nn.Module, name: str, x: torch.Tensor, y: torch.Tensor, per_example: str = "vmap") -> None:
    """refuse_model, then per-example gradients of two examples: a model the method cannot take fails here,
    naming privacy.enabled, before any training."""
    refuse_model(model, name)
    method = per_example if per_example != "auto" else per_example_method(model)
    try:
        probe = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                                per_example=method)
        norms = probe.norms(x[:2], y[:2])
        probe.close()
        model.zero_grad(set_to_none=True)
    except Exception as exc:  # the user's forward() under vmap or the hooks: one line naming the model
        how = {"vmap": "torch.func (vmap of grad)", "hooks": "Opacus's hooks",
               "ghost": "ghost clipping (ghost norms, book-keeping; Opacus's grad samplers for other layers)"}[method]
        raise ConfigError(f"privacy.enabled=true needs per-example gradients of model.name={name!r} through "
                          f"{how} (privacy.per_example={method}), which raised {type(exc).__name__}: {exc}") from None
    if not bool(torch.isfinite(norms).all()):
        raise ConfigError(f"privacy.enabled=true: model.name={name!r} gives non-finite per-example gradients at "
                          "its initial weights")


class PrivateGradient:
    """Clipped, noised gradients of one replica's model (``privacy.enabled``); see the module docstring."""

    def __init__(self, model: nn.Module, *, max_grad_norm: float, noise_multiplier: float, noise: str, seed: int,
                 rank: int, poisson: bool = True, per_example: str = "auto"):
        self.model, self.poisson = model, bool(poisson)
        self.max_grad_norm, self.noise_multiplier = float(max_grad_norm), float(noise_multiplier)
        self.noise, self.seed, self.rank = noise, int(seed), int(rank)
        self.params = [p for p in model.parameters() if p.requires_grad]  # a frozen one gets no gradient, no noise
        self.n_params = sum(p.numel() for p in self.params)
        # secret: seeded from the OS's entropy, never written or sent (a partner who knew the noise could remove it)
        self._secret = torch.Generator().manual_seed(secrets.randbits(62)) if noise == "secret" else None
        self.per_example = per_example if per_example != "auto" else per_example_method(model)
        self.clipper = clipping.make(self.per_example, model, self.max_grad_norm)

    def norms(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """Each example's gradient norm at the current weights (the caller clears the gradients left)."""
        return self.clipper.norms(xb, yb)

    def close(self) -> None:
        """Leave nothing of the clipper on the model (the start-up check's probe)."""
        self.clipper.close()

    def generator(self, t: int) -> torch.Generator:
        """The unit's noise stream: secret, or keyed by (seed, t, replica) under privacy.noise='seeded'."""
        if self._secret is not None:
            return self._secret
        key = int(protocol.rng(self.seed, protocol.Purpose.DP_NOISE, t, self.rank).integers(2**62))
        return torch.Generator().manual_seed(key)

    def backward(self, xb: torch.Tensor, yb: torch.Tensor, denom: float, opt: torch.optim.Optimizer,
                 gen: torch.Generator, *, set_to_none: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Leave ``(sum_i c_i g_i + N(0, (sigma C)^2 I)) / denom`` in the parameters' ``.grad``.

        Returns (logits, mean loss) for the unit's figures, or (None, None) for an empty
        Poisson batch (whose gradient is the noise alone).
        """
        out = loss = None
        opt.zero_grad(set_to_none=set_to_none)
        if len(yb):
            out = self.clipper.clipped_backward(xb, yb, float(denom))
            loss = F.cross_entropy(out.detach(), yb)
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.noise_multiplier > 0:
            std = privacy.noise_std(self.noise_multiplier, self.max_grad_norm) / denom
            z = torch.randn(self.n_params, generator=gen, dtype=torch.float32)
            offset = 0
            for p in self.params:
                n = p.numel()
                assert p.grad is not None  # (set above)
                p.grad.add_(z[offset: offset + n].view_as(p).to(p.grad.device, p.grad.dtype), alpha=std)
                offset += n
        return out, loss
