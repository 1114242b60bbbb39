"""DP-SGD's clipped gradient sum ``sum_i c_i g_i / b``, three ways: what ``privacy.per_example`` picks.

Every way leaves the same thing in the parameters' ``.grad`` (equal within
rounding, to each other and to Opacus's own step), and the first two take one
forward and one backward:

- ``ghost``: ghost clipping and book-keeping (``ghost.py``). A Linear or Conv1d
  layer's per-example gradient norms come from its inputs and output gradients
  kept by a forward hook and a tensor hook (``||g_i||^2 = ||b_i||^2 ||a_i||^2``;
  sequences and a convolution's unfolded windows through their Gram matrices or
  the per-example gradient, whichever is cheaper); when a factor binds, the
  clipped sum is one product of the kept inputs and scaled output gradients,
  ``sum_i c_i b_i a_i^T`` ("book-keeping", Bu et al. 2023), where Opacus's fast
  gradient clipping runs a second backward. Any other layer Opacus has a grad
  sampler for: its per-example gradients, kept for the sum. The hooks are
  registered for the step only; Opacus's own (``GradSampleHooksFastGradientClipping``)
  copy each sample into a fresh buffer and need full backward hooks, and
  measured 1.7x this step's time on the MLP (``communities bench privacy``).
- ``hooks``: Opacus's ``GradSampleHooks`` (any layer: its functorch fallback
  for the ones it has no sampler for): each example's gradient beside the
  batch's in the one backward; the clipped sum is ``einsum(c, grad_sample)``,
  as Opacus's ``DPOptimizer`` clips. A convolution that pads other than with
  zeros is refused: Opacus's conv sampler pads with zeros whatever the layer's
  ``padding_mode`` (wrong per-example gradients).
- ``vmap``: ``torch.func``'s ``vmap(grad(...))`` for the norms (any model it can
  trace, a pass of its own), then the backward of the clipped loss.

When no factor binds (every ``c_i`` is exactly 1.0) the gradient left is, bit
for bit, the plain step's (the backward of ``sum_i 1.0 * loss_i / b``): with no
noise and a bound that never binds, a private run is the plain run. The
backward scales each example's loss by ``1 / b``, so the hooks see ``g_i / b``:
norms are multiplied back by ``b``, and the kept samples sum to the answer.
"""
from __future__ import annotations

import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from ..core import privacy
from . import ghost

METHODS = ("ghost", "hooks", "vmap")


def trainable_layers(model: nn.Module) -> List[nn.Module]:
    """The modules that own parameters to train (the layers a per-example gradient is taken of)."""
    return [m for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]


def _opacus_samples(module: nn.Module) -> bool:
    """Whether Opacus's grad sampler gives ``module``'s per-example gradients (its conv samplers pad with zeros
    whatever the layer's padding mode, so a conv that pads otherwise is not one of them)."""
    from opacus.grad_sample import GradSampleHooks

    if type(module) not in GradSampleHooks.GRAD_SAMPLERS:
        return False
    return getattr(module, "padding_mode", "zeros") == "zeros"


def ghost_supports(model: nn.Module) -> bool:
    """Whether ``ghost`` can take every layer of ``model``: a Linear or a Conv1d of one group (ghost norms and
    book-keeping, ``ghost.py``), or a layer Opacus has a grad sampler for."""
    layers = trainable_layers(model)
    return bool(layers) and all(ghost.handles(m) or _opacus_samples(m) for m in layers)


def _scaled_loss(model: nn.Module, xb: torch.Tensor, yb: torch.Tensor, denom: float,
                 factors: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(logits, ``sum_i c_i loss_i / denom``) with ``c`` ones when ``factors`` is None: the expression whose
    backward is the plain step's bit for bit when every factor is 1.0."""
    out = model(xb)
    per = F.cross_entropy(out, yb, reduction="none")
    if factors is None:  # a gradient of exactly 1 / denom per example, as (per * 1.0).sum() / denom gives
        return out, per.sum() / denom
    return out, (per * factors.to(per.dtype)).sum() / denom


class Clipper:
    """One way to the clipped sum (see the module docstring)."""

    def __init__(self, model: nn.Module, max_grad_norm: float):
        self.model, self.max_grad_norm = model, float(max_grad_norm)
        self.params = [p for p in model.parameters() if p.requires_grad]  # a frozen one has nothing to clip

    def norms(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        """Each example's gradient norm at the current weights (float64); may leave gradients behind."""
        raise NotImplementedError

    def clipped_backward(self, xb: torch.Tensor, yb: torch.Tensor, denom: float) -> torch.Tensor:
        """Leave ``sum_i c_i g_i / denom`` in ``.grad`` (cleared by the caller); returns the logits."""
        raise NotImplementedError

    def close(self) -> None:
        """Leave nothing of this clipper on the model."""

    def _factors(self, norms: torch.Tensor) -> torch.Tensor:
        return privacy.clip_factors(norms, self.max_grad_norm).to(torch.float32)


class GhostClipper(Clipper):
    """Ghost norms and book-keeping for Linear and Conv1d layers (``ghost.py``), Opacus's per-example gradients
    for the others; one forward, one backward."""

    def __init__(self, model: nn.Module, max_grad_norm: float):
        super().__init__(model, max_grad_norm)
        self.layers = trainable_layers(model)
        if not ghost_supports(model):
            other = sorted({type(m).__name__ for m in self.layers if not (ghost.handles(m) or _opacus_samples(m))})
            raise ValueError("no per-example gradient (ghost.py or Opacus's) for "
                             f"{', '.join(other) or 'a model without layers'}")
        self._grad_samplers: Dict[type, Callable] = {}
        if not all(ghost.handles(m) for m in self.layers):
            from opacus.grad_sample import GradSampleHooks

            self._grad_samplers = GradSampleHooks.GRAD_SAMPLERS
        self._seen: List[Tuple[nn.Module, Tuple[torch.Tensor, ...], torch.Tensor]] = []

    def _capture(self, module: nn.Module, inputs: Sequence, output) -> None:
        """Forward hook: keep the layer's inputs, and its output's gradient when the backward reaches it."""
        if not (torch.is_tensor(output) and output.requires_grad):
            return
        acts = tuple(t.detach() for t in inputs if torch.is_tensor(t))
        output.register_hook(lambda g: self._seen.append((module, acts, g.detach())))

    def _pass(self, xb: torch.Tensor, yb: torch.Tensor, denom: float) -> Tuple[torch.Tensor, list]:
        """The one forward and backward of the unclipped loss; every layer's inputs and output gradient."""
        handles = [m.register_forward_hook(self._capture) for m in self.layers]
        self._seen = []
        try:
            out, loss = _scaled_loss(self.model, xb, yb, denom)
        finally:
            for h in handles:
                h.remove()
        loss.backward()
        seen, self._seen = self._seen, []
        if len(seen) != len(self.layers) or len({id(m) for m, _, _ in seen}) != len(seen):
            raise RuntimeError("privacy.per_example=ghost needs every layer with parameters to be called once per "
                               "forward (a layer shared or skipped: privacy.per_example=hooks or vmap)")
        return out, seen

    def _norms(self, seen: list, n: int, denom: float) -> Tuple[torch.Tensor, list]:
        """Per-example norms (times ``denom``), and what each layer keeps for the clipped sum: its (a, g) pair
        (``ghost.layer_view``), or Opacus's per-example gradients."""
        per_layer: List[torch.Tensor] = []
        kept: List[Tuple[nn.Module, Optional[torch.Tensor], Optional[torch.Tensor], Optional[dict]]] = []
        for module, acts, grad_out in seen:
            if ghost.handles(module):
                a, g = ghost.layer_view(module, acts, grad_out, n)
                bias = module.bias is not None and module.bias.requires_grad
                per_layer.append(ghost.squared_norms(a, g, bias=bias, weight=module.weight.requires_grad))
                kept.append((module, a, g, None))
            else:
                samples = self._grad_samplers[type(module)](module, list(acts), grad_out)
                for v in samples.values():
                    per_layer.append(v.reshape(n, -1).square().sum(1))
                kept.append((module, None, None, samples))
        return ghost.total_norms(per_layer, denom), kept

    def norms(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        _, seen = self._pass(xb, yb, 1.0)
        return self._norms(seen, len(yb), 1.0)[0]

    def clipped_backward(self, xb: torch.Tensor, yb: torch.Tensor, denom: float) -> torch.Tensor:
        out, seen = self._pass(xb, yb, denom)
        norms, kept = self._norms(seen, len(yb), denom)
        factors = self._factors(norms)
        if not bool((factors < 1).any()):
            return out  # no factor binds: the backward's own gradient, bit for bit
        for module, a, g, samples in kept:
            if samples is None:  # book-keeping: sum_i c_i g_i^T a_i, and sum_i c_i g_i for the bias
                weight, bias = ghost.clipped_sums(a, g, factors, bias=module.bias is not None
                                                  and module.bias.grad is not None)
                if module.weight.grad is not None:
                    module.weight.grad.copy_(weight.view_as(module.weight.grad))
                if bias is not None:
                    module.bias.grad.copy_(bias)
            else:
                for p, v in samples.items():
                    if p.grad is not None:
                        p.grad.copy_(torch.einsum("i,i...->...", factors.to(v.dtype), v))
        return out


class OnePassClipper(Clipper):
    """Opacus's ``GradSampleHooks``: per-example gradients in the one backward, the clipped sum from them. Its
    hooks are registered only inside a step: registered, even disabled, they would slow every other forward."""

    def __init__(self, model: nn.Module, max_grad_norm: float):
        from opacus.grad_sample import GradSampleHooks

        super().__init__(model, max_grad_norm)
        wrong = sorted({f"{type(m).__name__}(padding_mode={m.padding_mode!r})" for m in trainable_layers(model)
                        if type(m) in GradSampleHooks.GRAD_SAMPLERS and not _opacus_samples(m)})
        if wrong:
            raise ValueError(f"Opacus's per-example gradients of {', '.join(wrong)} pad with zeros, not as the layer "
                             "does (privacy.per_example=ghost or vmap)")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.hooks = GradSampleHooks(model, loss_reduction="sum")
        self.hooks.remove_hooks()

    def _pass(self, xb: torch.Tensor, yb: torch.Tensor, denom: float) -> Tuple[torch.Tensor, torch.Tensor]:
        """The one forward and backward of the unclipped loss with the hooks on; (logits, norms times denom)."""
        self.hooks.add_hooks(loss_reduction="sum", batch_first=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "full backward hook is firing ... no inputs require gradients"
                out, loss = _scaled_loss(self.model, xb, yb, denom)
                loss.backward()
        finally:
            self.hooks.remove_hooks()
        sq = torch.zeros(len(yb), dtype=torch.float64)
        for p in self.params:
            sample = p.grad_sample  # type: ignore[attr-defined]  # Opacus's hooks set it
            sq += torch.linalg.vector_norm(sample.reshape(len(yb), -1), dim=1).double().square()
        return out, sq.sqrt() * denom

    def norms(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        try:
            return self._pass(xb, yb, 1.0)[1]
        finally:
            self._drop_samples()

    def clipped_backward(self, xb: torch.Tensor, yb: torch.Tensor, denom: float) -> torch.Tensor:
        try:
            out, norms = self._pass(xb, yb, denom)
            factors = self._factors(norms)
            if bool((factors < 1).any()):  # the samples are g_i / denom already
                for p in self.params:
                    sample = getattr(p, "grad_sample", None)  # Opacus's hooks set it
                    if p.grad is not None and sample is not None:
                        p.grad.copy_(torch.einsum("i,i...->...", factors.to(sample.dtype), sample))
        finally:
            self._drop_samples()
        return out

    def _drop_samples(self) -> None:
        for p in self.params:
            p.grad_sample = None  # type: ignore[attr-defined]

    def close(self) -> None:
        self.hooks.remove_hooks()
        for p in self.params:
            for attr in ("grad_sample", "_forward_counter", "_current_grad_sample"):
                if hasattr(p, attr):
                    delattr(p, attr)


class VmapClipper(Clipper):
    """Norms by ``torch.func`` (a pass of its own), then the plain backward of the clipped loss."""

    def __init__(self, model: nn.Module, max_grad_norm: float):
        super().__init__(model, max_grad_norm)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self._frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
        self._per_example = vmap(grad(self._loss_of_one), in_dims=(None, None, 0, 0))

    def _loss_of_one(self, params: Dict[str, torch.Tensor], buffers: Dict[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.model, (params, buffers), (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0))

    def norms(self, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        params = {n: p.detach() for n, p in zip(self.names, self.params)}
        # frozen parameters ride with the buffers: in the forward, never differentiated
        buffers = {**{n: b.detach() for n, b in self.model.named_buffers()}, **self._frozen}
        per = self._per_example(params, buffers, xb, yb)
        sq = torch.zeros(len(yb), dtype=torch.float64, device=yb.device)
        for g in per.values():
            sq += torch.linalg.vector_norm(g.reshape(len(yb), -1), dim=1).double().square()
        return sq.sqrt()

    def clipped_backward(self, xb: torch.Tensor, yb: torch.Tensor, denom: float) -> torch.Tensor:
        factors = self._factors(self.norms(xb, yb))
        out, loss = _scaled_loss(self.model, xb, yb, denom, factors)
        loss.backward()
        return out


def make(method: str, model: nn.Module, max_grad_norm: float) -> Clipper:
    """The clipper of ``method`` (one of ``METHODS``) for ``model``."""
    kinds: Dict[str, Callable[[nn.Module, float], Clipper]] = {
        "ghost": GhostClipper, "hooks": OnePassClipper, "vmap": VmapClipper}
    return kinds[method](model, max_grad_norm)
