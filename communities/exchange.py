"""The pairwise exchange as the engine performs it: Sendrecv of the flat buffer, then merge.

Kept as one function so the engine and ``communities bench exchange`` run the
same code. ``swap_and_merge_blocked`` is the same exchange with the distance
and the merge fused block by block (bitwise the same merged weights, no
P-sized temporary); ``blocked_distance`` is ``torch.dist`` the same way.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import merge
from .comm import World


def swap_and_merge(world: World, flat: torch.Tensor, recv: torch.Tensor, peer: int, a: float, tag: int = 2,
                   distance: bool = True) -> float:
    """Exchange ``flat`` with ``peer`` into ``recv`` and merge in place; returns ||w_mine - w_peer|| (or nan)."""
    world.sendrecv(flat, recv, peer, tag=tag)
    d = float(torch.dist(flat, recv)) if distance else float("nan")
    merge.interpolate_(flat, recv, a)
    return d


# Elements per block of ``merge_with_distance_``: 256 Ki float32 = 1 MiB, so a block of the two
# operands and the scratch are still in cache between the distance and the merge. Measured on a
# 2-core EPYC (512 KiB L2, 32 MiB L3): 1 MiB blocks beat 64 KiB..4 MiB ones at 16 and 64 MB.
MERGE_BLOCK = 1 << 18


def merge_with_distance_(flat: torch.Tensor, recv: torch.Tensor, a: float, block: int = MERGE_BLOCK,
                         scratch: Optional[torch.Tensor] = None) -> float:
    """``merge.interpolate_(flat, recv, a)`` plus ``||flat - recv||`` (before), block by block.

    ``torch.dist`` materialises ``flat - recv``: a P-sized temporary that, above
    glibc's mmap threshold (32 MiB at most), is a fresh mapping on every call, so
    its page faults cost several times the transfer itself (64 MiB: ~48 ms vs a
    ~9 ms Sendrecv on the 2-core reference machine). Here the difference of each
    block goes to a small scratch buffer, its squared norm is summed in float64,
    and the block is merged while it is still in cache. The merged weights are
    bitwise those of ``interpolate_`` on the whole buffer (lerp is elementwise and
    blocks are a multiple of the SIMD width). The distance differs from
    ``torch.dist`` by rounding only, and is the more accurate of the two: blocks
    are summed in float64 (torch.dist of 5M float32 entries is off by ~1e-4
    relative, this by ~1e-7).
    Device tensors take the plain path: their allocator caches the temporary.
    """
    if flat.device.type != "cpu" or flat.dim() != 1 or recv.shape != flat.shape:
        d = float(torch.dist(flat, recv))
        merge.interpolate_(flat, recv, a)
        return d
    n = flat.numel()
    block = max(64, int(block) // 64 * 64)
    if scratch is None or scratch.numel() < min(block, n) or scratch.dtype != flat.dtype:
        scratch = torch.empty(min(block, n), dtype=flat.dtype)
    exact = flat.dtype in (torch.float32, torch.float64)
    total = 0.0
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        f, r, s = flat[lo:hi], recv[lo:hi], scratch[: hi - lo]
        torch.sub(r, f, out=s)
        total += float(torch.dot(s, s)) if exact else float(torch.linalg.vector_norm(s, dtype=torch.float64)) ** 2
        merge.interpolate_(f, r, a)
    return math.sqrt(total)


def blocked_distance(x: torch.Tensor, y: torch.Tensor, block: int = MERGE_BLOCK,
             scratch: Optional[torch.Tensor] = None) -> float:
    """``||x - y||`` like ``float(torch.dist(x, y))``, without a P-sized temporary (see ``merge_with_distance_``)."""
    if x.device.type != "cpu" or x.dim() != 1 or y.shape != x.shape or x.dtype not in (torch.float32, torch.float64):
        return float(torch.dist(x, y))
    n = x.numel()
    block = max(64, int(block) // 64 * 64)
    if scratch is None or scratch.numel() < min(block, n) or scratch.dtype != x.dtype:
        scratch = torch.empty(min(block, n), dtype=x.dtype)
    total = 0.0
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        s = scratch[: hi - lo]
        torch.sub(y[lo:hi], x[lo:hi], out=s)
        total += float(torch.dot(s, s))
    return math.sqrt(total)


def swap_and_merge_blocked(world: World, flat: torch.Tensor, recv: torch.Tensor, peer: int, a: float, tag: int = 2,
                           distance: bool = True, block: int = MERGE_BLOCK,
                           scratch: Optional[torch.Tensor] = None) -> float:
    """``swap_and_merge`` with the distance and merge fused block by block (``merge_with_distance_``).

    Same contract, same merged weights bit for bit; the returned distance agrees
    with ``torch.dist`` to rounding. One Sendrecv of the whole buffer, as before:
    chunking the transfer itself was measured slower (``communities bench exchange``).
    """
    world.sendrecv(flat, recv, peer, tag=tag)
    if not distance:
        merge.interpolate_(flat, recv, a)
        return float("nan")
    return merge_with_distance_(flat, recv, a, block=block, scratch=scratch)
