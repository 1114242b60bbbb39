"""Ghost norms and book-keeping: per-example gradient norms and the clipped gradient sum of Linear and Conv1d
layers from what one forward and one backward leave, without a second backward.

A Linear layer ``y = W a + b`` on a batch of sequences (``a_i``: (T, d_in), its
output's gradient ``g_i``: (T, d_out); a plain batch is T = 1) has the per-example
gradients ``G_i = g_i^T a_i`` and ``sum_t g_it``. Their squared norms are

- ``||a_i||^2 ||g_i||^2`` for T = 1 (the ghost norm: no per-example gradient),
- ``sum((a_i a_i^T) * (g_i g_i^T))`` through the (T, T) Gram matrices, or
  ``||g_i^T a_i||^2`` materialised: whichever costs fewer multiplications
  (``T^2 (d_in + d_out)`` against ``T d_in d_out``), as the book-keeping paper
  (Bu et al. 2023) and Opacus's fast gradient clipping choose;
- ``||sum_t g_it||^2`` for the bias.

The clipped sum ``sum_i c_i G_i`` is one product, ``(c g)^T a`` over all examples
and positions ("book-keeping"), and the bias's ``sum_i c_i sum_t g_it``.

A Conv1d layer (one group, any stride, padding, padding mode and dilation) is the
same Linear on its unfolded input: ``a``: (B, L_out, C_in k), ``g``: (B, L_out, C_out).

Everything here is tensors in, tensors out: ``clipping.GhostClipper`` keeps a
layer's inputs and output gradient with hooks and calls these.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F


def handles(module: nn.Module) -> bool:
    """Whether ``module`` is a layer this module computes exactly (a Linear; a Conv1d of one group)."""
    return type(module) is nn.Linear or (type(module) is nn.Conv1d and module.groups == 1)


def conv1d_unfold(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """The (B, L_out, C_in k) windows of ``conv``'s (B, C_in, L) input, padded as ``conv`` pads: row ``t`` of
    example ``i`` is what the kernel, flattened as ``conv.weight[o].reshape(-1)``, meets at output position t."""
    (k,), (stride,), (dil,) = conv.kernel_size, conv.stride, conv.dilation
    if conv.padding == "same":
        total = dil * (k - 1)
        left, right = total // 2, total - total // 2
    elif conv.padding == "valid":
        left = right = 0
    else:
        left = right = int(conv.padding[0])
    if left or right:
        mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
        x = F.pad(x, (left, right), mode=mode)
    span = dil * (k - 1) + 1
    win = x.unfold(2, span, stride)  # (B, C_in, L_out, span)
    if dil > 1:
        win = win[..., ::dil]
    return win.permute(0, 2, 1, 3).reshape(x.shape[0], win.shape[2], -1).contiguous()  # (a view when C_in is 1)


def layer_view(module: nn.Module, inputs: Tuple[torch.Tensor, ...], grad_out: torch.Tensor,
               n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(a, g) of a layer ``handles`` takes: (B, d_in) and (B, d_out), or (B, T, d_in) and (B, T, d_out); the
    weight's gradient is ``g^T a`` summed over examples and positions. A RuntimeError when the layer's input is
    not a batch of ``n`` examples first (an unbatched call: no example's gradient to take)."""
    x = inputs[0]
    if x.dim() < 2 or x.shape[0] != n or grad_out.shape[0] != n or (type(module) is nn.Conv1d and x.dim() != 3):
        raise RuntimeError(f"a {type(module).__name__} layer's input of shape {tuple(x.shape)} is not a batch of "
                           f"{n} examples first")
    x = x.to(grad_out.dtype)
    if type(module) is nn.Conv1d:
        return conv1d_unfold(module, x), grad_out.transpose(1, 2)
    if x.dim() == 2:
        return x, grad_out
    return x.reshape(n, -1, x.shape[-1]), grad_out.reshape(n, -1, grad_out.shape[-1])


def gram_is_cheaper(t: int, d_in: int, d_out: int) -> bool:
    """Whether the (T, T) Gram matrices take fewer multiplications than the (d_out, d_in) per-example gradients."""
    return t * (d_in + d_out) <= d_in * d_out


def _weight_squared_norms(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    if a.dim() == 2:  # the ghost norm
        return torch.linalg.vecdot(a, a) * torch.linalg.vecdot(g, g)
    t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    if gram_is_cheaper(t, d_in, d_out):
        return (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2)).clamp_min(0)
    return torch.bmm(g.transpose(1, 2), a).square().sum((1, 2))


def squared_norms(a: torch.Tensor, g: torch.Tensor, *, bias: bool, weight: bool = True) -> torch.Tensor:
    """Each example's squared gradient norm of one layer (its weight's when ``weight``, plus its bias's when
    ``bias``: the parameters trained), from the ``layer_view`` pair, without per-example gradients where that is
    cheaper; float32 of shape (B,)."""
    sq = _weight_squared_norms(a, g) if weight else torch.zeros(g.shape[0], dtype=g.dtype, device=g.device)
    if bias:
        s = g if g.dim() == 2 else g.sum(1)
        sq = sq + torch.linalg.vecdot(s, s)
    return sq


def clipped_sums(a: torch.Tensor, g: torch.Tensor, factors: torch.Tensor,
                 *, bias: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Book-keeping: ``sum_i c_i g_i^T a_i`` as a (d_out, d_in) matrix, and ``sum_i c_i sum_t g_it`` when
    ``bias`` (else None), in one product over all examples and positions."""
    cg = g * factors.to(g.dtype).view(-1, *([1] * (g.dim() - 1)))
    d_out, d_in = g.shape[-1], a.shape[-1]
    flat_g, flat_a = cg.reshape(-1, d_out), a.reshape(-1, d_in)
    return flat_g.t().mm(flat_a), (flat_g.sum(0) if bias else None)


def total_norms(per_layer: List[torch.Tensor], scale: float) -> torch.Tensor:
    """The per-example gradient norms (float64) of the model from its layers' squared norms, times ``scale``."""
    if not per_layer:
        raise ValueError("no layer's norms to add")
    sq = torch.stack(per_layer).double().sum(0)
    return sq.sqrt() * scale if scale != 1 else sq.sqrt()

