"""The merge and the distance in one pass over memory: ``w <- lerp(w, theirs, a)`` and ``||w - theirs||^2``.

An exchange needs both: the merge, and the distance it logs (``MergeRow``).
Computed apart (``torch.dist``, then ``lerp_``) they stream the two buffers
through memory twice and materialise a P-sized difference. Here the buffers
go block by block: the difference of a block into a small scratch (the one
read of both operands from memory), its squared norm, then the block's merge
from that difference while everything is still in cache (the one write).

The merged weights are bitwise those of one whole-buffer ``lerp_``: ATen's
lerp computes ``fma(a, r - w, w)`` for ``|a| < 0.5`` and
``fma(a - 1, r - w, r)`` otherwise (in float32 for float32 tensors, its scalar
tail as its vector body), and ``torch.add(base, s, alpha=c)`` computes
``fma(s, c, base)``; with ``s = r - w`` these are the same operations, and the
add reads the difference still in cache instead of both operands again. A
process checks that once per dtype on its own kernels (``add_matches_lerp``)
and keeps ``lerp_`` where they differ (other dtypes always).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import numpy as np
import torch

from . import merge

# Elements per block: 32 Ki float32 = 128 KiB, so a block of both operands and of the difference stay in L2
# between the three calls that touch them. Measured with ``communities bench exchange`` (``local`` columns) on
# the 2-core reference machine: 32 Ki beats 8 Ki..128 Ki at 16 and 64 MB (smaller blocks pay each call's ~1 us
# dispatch, larger ones fall out of L2).
MERGE_BLOCK = 1 << 15

_EXACT = (torch.float32, torch.float64)  # the dtypes whose dot is exact enough, and whose add form is lerp's


def add_form(dtype: torch.dtype, a: float) -> Optional[Tuple[bool, float]]:
    """``lerp_(w, r, a)`` as an add on ``s = r - w``: (from_theirs, c) for ``w + c s`` (False) or ``r + c s`` (True),
    with ``c`` the weight lerp itself computes in the tensor's precision; None where only lerp gives lerp's bits."""
    if dtype not in _EXACT:
        return None
    kind = np.float32 if dtype == torch.float32 else np.float64
    w = kind(a)
    if abs(float(w)) < 0.5:
        return False, float(w)
    return True, float(w - kind(1))


@functools.lru_cache(maxsize=None)
def add_matches_lerp(dtype: torch.dtype) -> bool:
    """Whether this process's add kernel gives ``lerp_``'s bits for ``dtype`` (both branches, vector body and
    scalar tail): checked once, on a few thousand random entries."""
    if dtype not in _EXACT:
        return False
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4099, generator=g, dtype=dtype)
    r = w + torch.randn(4099, generator=g, dtype=dtype) * 10.0 ** torch.randint(-6, 2, (4099,), generator=g)
    for a in (0.25, 0.5, 0.7, 1.0 / 3.0, 0.9999, 0.0001):
        want = w.clone().lerp_(r, a)
        got = w.clone()
        s = r - got
        _update_(got, r, s, a, add_form(dtype, a))
        if not torch.equal(got, want):
            return False
    return True


def _update_(w: torch.Tensor, r: torch.Tensor, s: torch.Tensor, a: float, form: Optional[Tuple[bool, float]]) -> None:
    """``merge.interpolate_(w, r, a)`` given ``s = r - w``: from the difference (``form``), or lerp itself."""
    if a == 1.0 or a == 0.0 or form is None:
        merge.interpolate_(w, r, a)
    elif form[0]:
        torch.add(r, s, alpha=form[1], out=w)
    else:
        w.add_(s, alpha=form[1])


def merge_blocks_(flat: torch.Tensor, theirs: torch.Tensor, a: float, scratch: torch.Tensor,
                  acc: float = 0.0) -> float:
    """``merge.interpolate_(flat, theirs, a)``; returns ``acc`` plus ``||flat - theirs||^2`` (before the merge).

    Blocks of ``scratch.numel()`` elements (flat contiguous CPU vectors). Each
    block's squared norm is a dot in the tensor's dtype, summed in float64 in
    block order: a buffer merged piece by piece, passing ``acc`` on, gets the
    same sum bit for bit as long as the pieces start on block boundaries.
    Accurate to ~1e-7 relative (torch.dist of 5M float32 entries: ~1e-4).
    """
    block = scratch.numel()
    form = add_form(flat.dtype, a) if add_matches_lerp(flat.dtype) else None
    exact = flat.dtype in _EXACT
    for w, r in zip(flat.split(block), theirs.split(block)):
        s = scratch[: w.numel()]
        torch.sub(r, w, out=s)
        acc += float(torch.dot(s, s)) if exact else float(torch.linalg.vector_norm(s, dtype=torch.float64)) ** 2
        _update_(w, r, s, a, form)
    return acc
