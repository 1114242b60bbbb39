"""How two partners combine their weights: swap headers, then one payload, merged by the rule.

``PairExchange`` is what the engine's mixers run for every pairwise exchange,
and what ``communities bench exchange`` times: at most two round trips. First a
header Sendrecv (so both sides decide the same way what to do with what
follows, and know the size of everything that follows); then one ``Payload``:
the weights, and whatever else the merge needs (optimizer moments under
``merge.optimizer_state: average``, the seen-at table under
``merge.partner_policy: least_recent``), laid out identically on both sides in
one contiguous buffer and moved by one Sendrecv. Only a payload above
``WHOLE_MAX_BYTES`` is cut, for memory: its weights go in cache-sized chunks
with the distance and the merge fused (``swap_and_merge_chunked``), the rest in
one more Sendrecv. Either way the merged weights are bitwise those of one
whole-buffer ``lerp_``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...core import merge
from ...results import Event
from ...runtime.comm import Tag, World


def swap_and_merge(world: World, flat: torch.Tensor, recv: torch.Tensor, peer: int, a: float, tag: int = Tag.WEIGHTS,
                   distance: bool = True, send: Optional[torch.Tensor] = None) -> float:
    """Exchange ``flat`` (or ``send`` in its place) with ``peer`` into ``recv`` and merge in place; returns
    ||w_mine - w_peer|| (or nan)."""
    world.sendrecv(flat if send is None else send, recv, peer, tag=tag)
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
                           tag: int = Tag.WEIGHTS, distance: bool = True, send: Optional[torch.Tensor] = None) -> float:
    """``swap_and_merge`` one 1 MiB chunk at a time: Sendrecv a chunk, merge it while it is in cache.

    A whole-buffer Sendrecv followed by a merge streams the weights through
    memory about five times (the copy in, then lerp's two reads and one write);
    here the partner's chunk lands in a cache-sized buffer and the local chunk
    is still cached from being sent, so the merge costs little more than the
    copy itself. It also needs no P-sized receive buffer. Same merged weights,
    bit for bit, as ``interpolate_`` on the whole buffer; the distance is summed
    in float64 over chunks (see ``merge_with_distance_``). Device tensors, and
    anything not a flat float vector, take the whole-buffer path of
    ``swap_and_merge`` with a temporary receive buffer. ``send`` replaces what
    is sent (chunk by chunk too).
    """
    send = flat if send is None else send
    if (flat.device.type != "cpu" or flat.dim() != 1 or flat.dtype != buffers.recv.dtype
            or send.shape != flat.shape or send.dtype != flat.dtype):
        return swap_and_merge(world, flat, torch.empty_like(flat), peer, a, tag=tag, distance=distance, send=send)
    n, chunk = flat.numel(), buffers.chunk
    total = 0.0
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        f, r = flat[lo:hi], buffers.recv[: hi - lo]
        world.sendrecv(send[lo:hi], r, peer, tag=tag)
        if distance:
            total += merge_with_distance_(f, r, a, block=chunk, scratch=buffers.diff) ** 2
        else:
            merge.interpolate_(f, r, a)
    return math.sqrt(total) if distance else float("nan")


def merge_chunks_(flat: torch.Tensor, theirs: torch.Tensor, a: float, buffers: ChunkBuffers,
                  distance: bool = True) -> float:
    """The merge of ``swap_and_merge_chunked`` on a buffer received whole: chunk by chunk, the same calls.

    So the merged weights and the distance (its per-chunk norms, squared and
    summed in float64) have the same bits whether the weights came in one
    message or chunk by chunk.
    """
    n, chunk = flat.numel(), buffers.chunk
    total = 0.0
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        f, r = flat[lo:hi], theirs[lo:hi]
        if distance:
            total += merge_with_distance_(f, r, a, block=chunk, scratch=buffers.diff) ** 2
        else:
            merge.interpolate_(f, r, a)
    return math.sqrt(total) if distance else float("nan")


HEADER_FIELDS = 5  # the numbers of a header without pbt's


@dataclass(frozen=True)
class Header:
    """What partners swap before the payload (float64 numbers, no pickle): all that sizes it.

    Five numbers; under ``pbt`` also the score, whether the side may adopt, and its hyperparameters (both sides
    run one config, so both send as many)."""

    samples: float  # examples trained on so far (merge.rule: clock)
    loss: float  # the last unit's training loss (merge.rule: loss)
    size: int  # weights held: partners must hold the same model
    state: int  # optimizer-moment elements offered for averaging (merge.optimizer_state: average; 0: none)
    diverged: bool  # never merge a diverged rank into a partner
    score: float = 0.0  # pbt: the loss on this side's own held-out data (lower is better)
    ready: bool = False  # pbt: this side may adopt its partner's hyperparameters (pbt.ready)
    hyper: Tuple[float, ...] = ()  # pbt: this side's hyperparameters, in ``core.pbt.Space`` order

    def to_array(self) -> np.ndarray:
        base = [self.samples, self.loss, float(self.size), float(self.state), float(self.diverged)]
        if self.hyper:
            base += [self.score, float(self.ready), *self.hyper]
        return np.array(base, dtype=np.float64)

    @classmethod
    def from_array(cls, a: np.ndarray) -> "Header":
        pbt = len(a) > HEADER_FIELDS
        return cls(float(a[0]), float(a[1]), int(a[2]), max(0, int(a[3])), bool(a[4]),
                   float(a[5]) if pbt else 0.0, bool(a[6]) if pbt else False,
                   tuple(float(v) for v in a[7:]) if pbt else ())


def decide(mine: Header, other: Header, merge_cfg, diverged_policy: str, t: int,
           alpha: Optional[float] = None) -> Tuple[float, Event]:
    """(a, event): the weight this side gives the partner's weights, and what the exchange does.

    A diverged model is never merged into a healthy one: the healthy side keeps
    its weights (``skip_diverged``), the diverged side takes its partner's
    (``reset``) or is left alone (``quarantined``). Both sides reach the same
    verdict from the same two headers. ``alpha`` replaces ``merge_cfg.alpha`` (pbt: the pair's own).
    """
    if mine.diverged and not other.diverged and diverged_policy == "reset":
        return 1.0, Event.RESET
    if mine.diverged:
        return 0.0, Event.QUARANTINED if diverged_policy == "quarantine" else Event.SKIP_DIVERGED
    if other.diverged:
        return 0.0, Event.SKIP_DIVERGED
    a = merge.coefficient(merge_cfg.rule, merge.Side(mine.samples, mine.loss), merge.Side(other.samples, other.loss),
                          merge_cfg.alpha if alpha is None else alpha, t, merge_cfg.ema)
    return a, Event.MERGE


# A payload up to this many bytes travels in one Sendrecv, into a receive buffer kept between exchanges (and,
# when more than the weights travel, from a send buffer kept likewise): at most 2 x 64 MiB held. Above it the
# weights go chunk by chunk (``swap_and_merge_chunked``): no payload-sized buffer, at the price of a message
# per MiB, which on a network is a latency each.
WHOLE_MAX_BYTES = 64 << 20


def optimizer_moments(model: torch.nn.Module, opt: torch.optim.Optimizer) -> List[torch.Tensor]:
    """The optimizer state averaged by ``merge.optimizer_state: average``: every floating tensor of a parameter's
    state with the parameter's size (momentum, Adam's moments; not ``step``), in parameter then key order."""
    return [v for p in model.parameters() for k, v in sorted(opt.state[p].items())
            if torch.is_tensor(v) and v.is_floating_point() and v.numel() == p.numel()]


@dataclass(frozen=True)
class Section:
    """One part of a payload: its place in the payload's bytes, its dtype and element count."""

    name: str
    dtype: torch.dtype
    numel: int
    offset: int  # bytes from the payload's start

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _typed(buf: torch.Tensor, sec: Section, base: int = 0) -> torch.Tensor:
    """``sec`` of the byte buffer ``buf`` (which starts at payload byte ``base``) as a typed vector: a view where
    its offset allows one, else a copy (sections are packed without padding, so as many bytes travel as before)."""
    raw = buf[sec.offset - base: sec.end - base]
    if (sec.offset - base) % _itemsize(sec.dtype):
        raw = raw.clone()
    return raw.view(sec.dtype)


@dataclass
class Received:
    """What a payload swap leaves besides the merged weights: the partner's parts, this side's packed beside."""

    distance: float  # ||w_mine - w_peer|| before the merge (nan when not asked)
    state: Optional[torch.Tensor] = None  # the partner's optimizer moments, flat
    my_state: Optional[torch.Tensor] = None  # this side's, packed the same way (merge in place, then unpack)
    seen_at: Optional[np.ndarray] = None  # the partner's seen-at table


class Payload:
    """One side's bytes after the header: the weights, then the optimizer moments and the seen-at table if they
    travel, packed back to back with no padding.

    Both sides build it from what both headers said (the model's size, the
    moments' size, the world size), so its ``sections`` are the same on both:
    one contiguous send buffer and one receive buffer of the same layout, one
    Sendrecv. Nothing received is unpickled; each part is read back as the
    dtype and size this side expects.
    """

    def __init__(self, weights: torch.Tensor, *, outgoing: Optional[torch.Tensor] = None,
                 state: Sequence[torch.Tensor] = (), seen_at: Optional[np.ndarray] = None):
        if outgoing is not None and (outgoing.shape != weights.shape or outgoing.dtype != weights.dtype):
            raise ValueError("outgoing must have the weights' shape and dtype")
        self.weights = weights  # merged in place
        self.outgoing = weights if outgoing is None else outgoing  # what is sent for them (a Byzantine lie)
        self.state = list(state)
        self.seen_at = None if seen_at is None else np.ascontiguousarray(seen_at, dtype=np.int64)
        parts: List[Tuple[str, torch.dtype, int]] = [("weights", weights.dtype, weights.numel())]
        if self.state:
            parts.append(("state", reduce(torch.promote_types, [v.dtype for v in self.state]),
                          sum(v.numel() for v in self.state)))
        if self.seen_at is not None:
            parts.append(("seen_at", torch.int64, self.seen_at.size))
        self.sections: Dict[str, Section] = {}
        offset = 0
        for name, dtype, numel in parts:
            self.sections[name] = Section(name, dtype, int(numel), offset)
            offset = self.sections[name].end
        self.nbytes = offset

    @property
    def lies(self) -> bool:
        return self.outgoing is not self.weights

    @property
    def extras(self) -> int:
        """Bytes after the weights."""
        return self.nbytes - self.sections["weights"].nbytes

    def pack_extras(self, buf: torch.Tensor, base: int) -> None:
        """Write the parts after the weights into ``buf`` (a byte buffer starting at payload byte ``base``)."""
        sec = self.sections.get("state")
        if sec is not None:
            dst = buf[sec.offset - base: sec.end - base]
            if (sec.offset - base) % _itemsize(sec.dtype) == 0:
                typed, offset = dst.view(sec.dtype), 0
                for v in self.state:
                    typed[offset: offset + v.numel()].copy_(v.reshape(-1))
                    offset += v.numel()
            else:
                dst.copy_(_bytes(torch.cat([v.reshape(-1).to(sec.dtype) for v in self.state])))
        sec = self.sections.get("seen_at")
        if sec is not None and self.seen_at is not None:
            buf[sec.offset - base: sec.end - base].copy_(torch.from_numpy(self.seen_at.view(np.uint8)))

    def unpack(self, send: torch.Tensor, recv: torch.Tensor, base: int, distance: float) -> Received:
        """The partner's parts from ``recv`` (and this side's moments from ``send``), both starting at ``base``."""
        got = Received(distance)
        sec = self.sections.get("state")
        if sec is not None:
            got.state, got.my_state = _typed(recv, sec, base), _typed(send, sec, base)
        sec = self.sections.get("seen_at")
        if sec is not None:
            got.seen_at = recv[sec.offset - base: sec.end - base].cpu().numpy().view(np.int64).copy()
        return got


class PairExchange:
    """One rank's end of pairwise exchanges: the header swap, then the payload swap with the weights' merge."""

    def __init__(self, world: World, numel: int, dtype: torch.dtype, *, whole_max: int = WHOLE_MAX_BYTES):
        self.world, self.numel, self.whole_max = world, int(numel), int(whole_max)
        self.buffers = ChunkBuffers(numel, dtype)
        self._held: Dict[str, torch.Tensor] = {}  # the whole-payload send and receive buffers, kept

    def swap_headers(self, mine: Header, partner: int) -> Header:
        """Blocking: returns the partner's header (this is where a rank waits for a partner still training)."""
        other = Header.from_array(self.world.sendrecv_array(mine.to_array(), partner, tag=Tag.HEADER))
        if other.size != mine.size:
            raise RuntimeError(f"rank {self.world.rank} holds {mine.size} weights but partner rank {partner} "
                               f"holds {other.size}: the models differ")
        if mine.state and other.state and other.state != mine.state:
            raise RuntimeError(f"rank {self.world.rank} holds {mine.state} optimizer-moment elements but partner "
                               f"rank {partner} holds {other.state}: the optimizers differ")
        return other

    def swap(self, payload: Payload, partner: int, a: float, distance: bool = True) -> Received:
        """Swap payloads with ``partner`` and merge the weights in place (``w <- (1-a) w + a theirs``).

        One Sendrecv up to ``whole_max`` bytes (device tensors always); above, the
        weights chunk by chunk fused with the merge, then the rest in one more.
        """
        w = payload.sections["weights"]
        flat = payload.weights
        if payload.nbytes > self.whole_max and flat.device.type == "cpu":
            d = swap_and_merge_chunked(self.world, flat, partner, a, self.buffers, distance=distance,
                                       send=payload.outgoing)
            if not payload.extras:
                return Received(d)
            send = torch.empty(payload.extras, dtype=torch.uint8)
            recv = torch.empty_like(send)
            payload.pack_extras(send, base=w.end)
            self.world.sendrecv(send, recv, partner, tag=Tag.WEIGHTS)
            return payload.unpack(send, recv, w.end, d)
        recv = self._buffer("recv", payload.nbytes, flat.device)
        if payload.extras:
            send = self._buffer("send", payload.nbytes, flat.device)
            send[: w.end].copy_(_bytes(payload.outgoing))
            payload.pack_extras(send, base=0)
        else:
            send = _bytes(payload.outgoing)  # the weights alone: sent from where they lie
        self.world.sendrecv(send, recv, partner, tag=Tag.WEIGHTS)
        theirs = _typed(recv, w)
        if payload.lies or flat.device.type != "cpu" or flat.dim() != 1:
            d = float(torch.dist(flat, theirs)) if distance else float("nan")
            merge.interpolate_(flat, theirs, a)
        else:
            d = merge_chunks_(flat, theirs, a, self.buffers, distance)
        return payload.unpack(send, recv, 0, d)

    def _buffer(self, slot: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._held.get(slot)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._held[slot] = buf
        return buf[:nbytes]
