"""The pairwise exchange as the engine performs it: Sendrecv of the flat buffer, then merge.

Kept as one function so the engine and ``communities bench exchange`` run the
same code. ``swap_and_merge_chunked`` is the same exchange one cache-sized
chunk at a time, with the distance and the merge fused (bitwise the same
merged weights, no P-sized temporary or receive buffer).
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


class ChunkBuffers:
    """The two chunk-sized scratch buffers of ``swap_and_merge_chunked``: the partner's chunk and a difference."""

    def __init__(self, n: int, dtype: torch.dtype, chunk: int = MERGE_BLOCK):
        self.chunk = max(64, int(chunk) // 64 * 64)
        size = min(self.chunk, max(int(n), 1))
        self.recv = torch.empty(size, dtype=dtype)
        self.diff = torch.empty(size, dtype=dtype)


def swap_and_merge_chunked(world: World, flat: torch.Tensor, peer: int, a: float, buffers: ChunkBuffers,
                           tag: int = 2, distance: bool = True) -> float:
    """``swap_and_merge`` one 1 MiB chunk at a time: Sendrecv a chunk, merge it while it is in cache.

    A whole-buffer Sendrecv followed by a merge streams the weights through
    memory about five times (the copy in, then lerp's two reads and one write);
    here the partner's chunk lands in a cache-sized buffer and the local chunk
    is still cached from being sent, so the merge costs little more than the
    copy itself. It also needs no P-sized receive buffer. Same merged weights,
    bit for bit, as ``interpolate_`` on the whole buffer; the distance is summed
    in float64 over chunks (see ``merge_with_distance_``). Device tensors, and
    anything not a flat float vector, take the whole-buffer path of
    ``swap_and_merge`` with a temporary receive buffer.
    """
    if flat.device.type != "cpu" or flat.dim() != 1 or flat.dtype != buffers.recv.dtype:
        return swap_and_merge(world, flat, torch.empty_like(flat), peer, a, tag=tag, distance=distance)
    n, chunk = flat.numel(), buffers.chunk
    total = 0.0
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        f, r = flat[lo:hi], buffers.recv[: hi - lo]
        world.sendrecv(f, r, peer, tag=tag)
        if distance:
            total += merge_with_distance_(f, r, a, block=chunk, scratch=buffers.diff) ** 2
        else:
            merge.interpolate_(f, r, a)
    return math.sqrt(total) if distance else float("nan")
