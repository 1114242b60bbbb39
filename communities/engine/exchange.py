"""How two partners combine their weights: swap headers, then the weights, merged by the rule.

``PairExchange`` is what the engine's mixers run for every pairwise exchange,
and what ``communities bench exchange`` times: a header Sendrecv (so both sides
decide the same way what to do with the weights that follow), then the weights
in cache-sized chunks with the distance and the merge fused
(``swap_and_merge_chunked``: bitwise the merged weights of one whole-buffer
``lerp_``, no P-sized temporary or receive buffer).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from ..core import merge
from ..results import Event
from ..runtime.comm import Tag, World


def swap_and_merge(world: World, flat: torch.Tensor, recv: torch.Tensor, peer: int, a: float, tag: int = Tag.WEIGHTS,
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
                           tag: int = Tag.WEIGHTS, distance: bool = True) -> float:
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


@dataclass(frozen=True)
class Header:
    """What partners swap before their weights (five float64 numbers, no pickle)."""

    samples: float  # examples trained on so far (merge.rule: clock)
    loss: float  # the last unit's training loss (merge.rule: loss)
    size: int  # weights held: partners must hold the same model
    has_state: bool  # holds optimizer moments to average (merge.optimizer_state: average)
    diverged: bool  # never merge a diverged rank into a partner

    def to_array(self) -> np.ndarray:
        return np.array([self.samples, self.loss, float(self.size), float(self.has_state), float(self.diverged)],
                        dtype=np.float64)

    @classmethod
    def from_array(cls, a: np.ndarray) -> "Header":
        return cls(float(a[0]), float(a[1]), int(a[2]), bool(a[3] > 0), bool(a[4]))


def decide(mine: Header, other: Header, merge_cfg, diverged_policy: str, t: int) -> Tuple[float, Event]:
    """(a, event): the weight this side gives the partner's weights, and what the exchange does.

    A diverged model is never merged into a healthy one: the healthy side keeps
    its weights (``skip_diverged``), the diverged side takes its partner's
    (``reset``) or is left alone (``quarantined``). Both sides reach the same
    verdict from the same two headers.
    """
    if mine.diverged and not other.diverged and diverged_policy == "reset":
        return 1.0, Event.RESET
    if mine.diverged:
        return 0.0, Event.QUARANTINED if diverged_policy == "quarantine" else Event.SKIP_DIVERGED
    if other.diverged:
        return 0.0, Event.SKIP_DIVERGED
    a = merge.coefficient(merge_cfg.rule, merge.Side(mine.samples, mine.loss), merge.Side(other.samples, other.loss),
                          merge_cfg.alpha, t, merge_cfg.ema)
    return a, Event.MERGE


class PairExchange:
    """One rank's end of pairwise exchanges: the header swap and the chunked weight swap with merge."""

    def __init__(self, world: World, numel: int, dtype: torch.dtype):
        self.world, self.numel = world, int(numel)
        self.buffers = ChunkBuffers(numel, dtype)

    def swap_headers(self, mine: Header, partner: int) -> Header:
        """Blocking: returns the partner's header (this is where a rank waits for a partner still training)."""
        other = Header.from_array(self.world.sendrecv_array(mine.to_array(), partner, tag=Tag.HEADER))
        if other.size != mine.size:
            raise RuntimeError(f"rank {self.world.rank} holds {mine.size} weights but partner rank {partner} "
                               f"holds {other.size}: the models differ")
        return other

    def swap_weights(self, flat: torch.Tensor, partner: int, a: float,
                     outgoing: Optional[torch.Tensor] = None) -> float:
        """Swap and merge in place (``flat <- (1-a) flat + a theirs``); returns ||flat - theirs|| before.

        ``outgoing`` replaces what is sent (a simulated Byzantine rank's lie): the
        whole-buffer path then runs, since the chunked one sends ``flat`` itself.
        """
        if outgoing is None:
            return swap_and_merge_chunked(self.world, flat, partner, a, self.buffers)
        recv = torch.empty_like(flat)
        self.world.sendrecv(outgoing, recv, partner, tag=Tag.WEIGHTS)
        distance = float(torch.dist(flat, recv))
        merge.interpolate_(flat, recv, a)
        return distance
