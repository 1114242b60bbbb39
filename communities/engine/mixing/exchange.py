"""How two partners combine their weights: swap headers, then one payload, merged by the rule.

``PairExchange`` is what the engine's mixers run for every pairwise exchange,
and what ``communities bench exchange`` times. First a header Sendrecv (so both
sides decide the same way what to do with what follows, and know the size of
everything that follows); then one ``Payload``: the weights, and whatever else
the merge needs (optimizer moments under ``merge.optimizer_state: average``,
the seen-at table under ``merge.partner_policy: least_recent``), laid out
identically on both sides and moved by one Sendrecv. The payload goes out from
where its parts lie (``World.sendrecv_parts``: an MPI datatype over their
addresses), never packed into a send buffer, and lands in one receive buffer
kept between exchanges. The merge and the distance it logs are one pass over
memory (``core.fused_merge``); for a model of two chunks or more each side
computes the distance over its own half and the pair swaps the two partial
sums (8 bytes, counted as monitoring), so both log the same distance for half
the work. Only a payload above ``WHOLE_MAX_BYTES`` is cut, for memory: its
weights go in cache-sized chunks, each merged as it lands
(``swap_and_merge_chunked``), the rest in one more Sendrecv. Either way the
merged weights are bitwise those of one whole-buffer ``lerp_``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...core import merge
from ...core.fused_merge import MERGE_BLOCK, merge_blocks_
from ...results import Event
from ...runtime.comm import Tag
from ...runtime.view import WorldView

# The unit of ``swap_and_merge_chunked``'s messages: 1 MiB of float32 (a multiple of ``MERGE_BLOCK``). Also the
# grain of the halves whose distance each side computes.
CHUNK = 1 << 18

# From this many weights on, each side of an exchange computes the distance over its half and the pair swaps the
# halves (8 bytes): two chunks, 2 MiB of float32. Below, the message would cost more than the half it saves.
SHARE_MIN = 2 * CHUNK

# A payload's part of this many bytes or more goes out as a message of its own, from where it lies; smaller
# ones are packed together (a message each would cost more than their copy: 200 moments of 8 KiB..160 KiB went
# at 0.4 of a Sendrecv of as many bytes as messages, at 0.6 packed).
PART_MIN = 1 << 20

Span = Tuple[int, int]  # the elements [lo, hi) of the weights whose distance this side computes


def swap_and_merge(world: WorldView, flat: torch.Tensor, recv: torch.Tensor, peer: int, a: float,
                   *, tag: int = Tag.WEIGHTS, distance: bool = True, send: Optional[torch.Tensor] = None) -> float:
    """Exchange ``flat`` (or ``send`` in its place) with ``peer`` into ``recv`` and merge in place; returns
    ||w_mine - w_peer|| (or nan). The plain path: ``torch.dist``, then ``lerp_``."""
    world.sendrecv(flat if send is None else send, recv, peer, tag=tag)
    d = float(torch.dist(flat, recv)) if distance else float("nan")
    merge.interpolate_(flat, recv, a)
    return d


def merge_with_distance_(flat: torch.Tensor, recv: torch.Tensor, a: float, block: int = MERGE_BLOCK,
                         scratch: Optional[torch.Tensor] = None) -> float:
    """``merge.interpolate_(flat, recv, a)``; returns ``||flat - recv||`` (before), in one pass over memory
    (``fused_merge.merge_blocks_``). Device tensors, and anything not a flat vector, take the plain path (their
    allocator caches the temporary)."""
    if flat.device.type != "cpu" or flat.dim() != 1 or recv.shape != flat.shape:
        d = float(torch.dist(flat, recv))
        merge.interpolate_(flat, recv, a)
        return d
    size = min(max(64, int(block) // 64 * 64), max(flat.numel(), 1))
    if scratch is None or scratch.numel() < size or scratch.dtype != flat.dtype:
        scratch = torch.empty(size, dtype=flat.dtype)
    return math.sqrt(merge_blocks_(flat, recv, a, scratch[:size]))


class ChunkBuffers:
    """The scratch of the merge: the partner's chunk (``swap_and_merge_chunked``) and a block's difference."""

    def __init__(self, n: int, dtype: torch.dtype, *, chunk: int = CHUNK, block: int = MERGE_BLOCK):
        self.chunk = max(64, int(chunk) // 64 * 64)
        size = min(self.chunk, max(int(n), 1))
        self.recv = torch.empty(size, dtype=dtype)
        self.diff = torch.empty(min(size, max(64, int(block) // 64 * 64)), dtype=dtype)


def _inside(lo: int, hi: int, span: Span) -> bool:
    return span[0] <= lo and hi <= span[1] and lo < hi


def _swap_chunks_(world: WorldView, flat: torch.Tensor, peer: int, a: float, buffers: ChunkBuffers, *, tag: int,
                  send: torch.Tensor, span: Span, own_span: Span) -> Tuple[float, float]:
    """Sendrecv chunk by chunk, each merged as it lands; returns (``||flat - theirs||^2`` over ``own_span``,
    ``||send - theirs||^2`` over ``span``), spans on chunk boundaries. The two differ only for a lie."""
    n, chunk = flat.numel(), buffers.chunk
    own = shown = 0.0
    lie = send is not flat
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        r = buffers.recv[: hi - lo]
        world.sendrecv(send[lo:hi], r, peer, tag=tag)
        if lie and _inside(lo, hi, span):
            shown += float(torch.dist(send[lo:hi], r)) ** 2
        if _inside(lo, hi, own_span):
            own = merge_blocks_(flat[lo:hi], r, a, buffers.diff, own)
        else:
            merge.interpolate_(flat[lo:hi], r, a)
    return own, (shown if lie else own)


def swap_and_merge_chunked(world: WorldView, flat: torch.Tensor, peer: int, a: float, buffers: ChunkBuffers, *,
                           tag: int = Tag.WEIGHTS, distance: bool = True, send: Optional[torch.Tensor] = None) -> float:
    """``swap_and_merge`` one 1 MiB chunk at a time: Sendrecv a chunk, merge it while it is in cache.

    The partner's chunk lands in a cache-sized buffer and the local chunk is
    still cached from being sent, and no P-sized receive buffer is needed; the
    price is a message per chunk (a rendezvous each: on a crowded machine, a
    wait for the partner to be scheduled each). Same merged weights, bit for
    bit, as ``interpolate_`` on the whole buffer, and the same distance as a
    ``PairExchange`` that received the buffer whole. Device tensors, and
    anything not a flat float vector, take the whole-buffer path of
    ``swap_and_merge`` with a temporary receive buffer. ``send`` replaces what
    is sent (chunk by chunk too).
    """
    send = flat if send is None else send
    if (flat.device.type != "cpu" or flat.dim() != 1 or flat.dtype != buffers.recv.dtype
            or send.shape != flat.shape or send.dtype != flat.dtype):
        return swap_and_merge(world, flat, torch.empty_like(flat), peer, a, tag=tag, distance=distance, send=send)
    span = (0, flat.numel()) if distance else (0, 0)
    own, _ = _swap_chunks_(world, flat, peer, a, buffers, tag=tag, send=send, span=span, own_span=span)
    return math.sqrt(own) if distance else float("nan")


def _merge_received_(flat: torch.Tensor, theirs: torch.Tensor, a: float, buffers: ChunkBuffers, span: Span) -> float:
    """Merge a partner's weights received whole; returns ``||flat - theirs||^2`` over ``span``, summed chunk by
    chunk as ``_swap_chunks_`` sums it (so the distance has the same bits either way). Outside ``span``: lerp_."""
    lo_, hi_ = span
    merge.interpolate_(flat[:lo_], theirs[:lo_], a)
    merge.interpolate_(flat[hi_:], theirs[hi_:], a)
    total = 0.0
    for lo in range(lo_, hi_, buffers.chunk):
        hi = min(hi_, lo + buffers.chunk)
        total = merge_blocks_(flat[lo:hi], theirs[lo:hi], a, buffers.diff, total)
    return total


def _squared_distance(mine: torch.Tensor, theirs: torch.Tensor, span: Span) -> float:
    """``||mine - theirs||^2`` over ``span``, summed in float64 (the plain path's half of a shared distance)."""
    lo, hi = span
    if hi <= lo:
        return 0.0
    return float(torch.linalg.vector_norm(mine[lo:hi] - theirs[lo:hi], dtype=torch.float64)) ** 2


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
           *, alpha: Optional[float] = None) -> Tuple[float, Event]:
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
                          merge_cfg.alpha if alpha is None else alpha, t, ema=merge_cfg.ema)
    return a, Event.MERGE


# A payload up to this many bytes travels in one Sendrecv, into a receive buffer kept between exchanges (at most
# 64 MiB held). Above it the weights go chunk by chunk (``swap_and_merge_chunked``): no payload-sized buffer, at
# the price of a message per MiB, which on a network is a latency each.
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
    """What a payload swap leaves besides the merged weights: the partner's parts, and this side's moments."""

    distance: float  # ||w_mine - w_peer|| before the merge (nan when not asked)
    state: Optional[torch.Tensor] = None  # the partner's optimizer moments, flat
    seen_at: Optional[np.ndarray] = None  # the partner's seen-at table
    mine: Sequence[torch.Tensor] = field(default_factory=list)  # this side's moments, where they lie

    @property
    def my_state(self) -> Optional[torch.Tensor]:
        """This side's moments laid out as ``state`` (a copy: the merge goes to the moments themselves)."""
        if self.state is None:
            return None
        return torch.cat([v.reshape(-1).to(self.state.dtype) for v in self.mine])

    def merge_state_(self, a: float) -> None:
        """Merge this side's moments with the partner's in place, each ``interpolate_``'d with its slice of
        ``state``: bitwise the merge of the two packed vectors (lerp is elementwise)."""
        if self.state is None:
            return
        offset = 0
        for v in self.mine:
            theirs = self.state[offset: offset + v.numel()]
            offset += v.numel()
            if v.dtype == theirs.dtype:
                merge.interpolate_(v, theirs.view_as(v), a)
            else:  # merged in the payload's dtype, as packed
                tmp = v.to(theirs.dtype)
                merge.interpolate_(tmp, theirs.view_as(tmp), a)
                v.copy_(tmp)


class Payload:
    """One side's bytes after the header: the weights, then the optimizer moments and the seen-at table if they
    travel, back to back with no padding.

    Both sides build it from what both headers said (the model's size, the
    moments' size, the world size), so its ``sections`` are the same on both:
    the parts go out as one message from where they lie (``parts``), and land
    in one receive buffer of the same layout. Nothing received is unpickled;
    each part is read back as the dtype and size this side expects.
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

    def parts(self, weights: bool = True) -> List[torch.Tensor]:
        """What goes out, in payload order, as contiguous tensors whose bytes concatenated are the payload's (or
        its extras'): the sent weights and the moments where they lie; a moment of another dtype than its
        section's is converted, as packing would."""
        out = [self.outgoing] if weights else []
        sec = self.sections.get("state")
        if sec is not None:
            out += [v.reshape(-1) if v.dtype == sec.dtype else v.reshape(-1).to(sec.dtype) for v in self.state]
        if self.seen_at is not None:
            out.append(torch.from_numpy(self.seen_at))
        return [t if t.is_contiguous() else t.contiguous() for t in out]

    def unpack(self, recv: torch.Tensor, base: int, distance: float) -> Received:
        """The partner's parts from ``recv`` (a byte buffer starting at payload byte ``base``)."""
        got = Received(distance, mine=self.state)
        sec = self.sections.get("state")
        if sec is not None:
            got.state = _typed(recv, sec, base)
        sec = self.sections.get("seen_at")
        if sec is not None:
            got.seen_at = recv[sec.offset - base: sec.end - base].cpu().numpy().view(np.int64).copy()
        return got


class PairExchange:
    """One rank's end of pairwise exchanges: the header swap, then the payload swap with the weights' merge."""

    def __init__(self, world: WorldView, numel: int, dtype: torch.dtype, *, whole_max: int = WHOLE_MAX_BYTES):
        self.world, self.numel, self.whole_max = world, int(numel), int(whole_max)
        self.buffers = ChunkBuffers(numel, dtype)
        self._held: Dict[str, torch.Tensor] = {}  # the whole-payload receive buffer (and a packing one), kept

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

    def halves(self, n: int, partner: int) -> Optional[Span]:
        """The half of the weights whose distance this side computes (the lower rank the first), on chunk
        boundaries; None below ``SHARE_MIN`` weights (each side computes all of it)."""
        h = (n // 2) // self.buffers.chunk * self.buffers.chunk
        if n < SHARE_MIN or h == 0:
            return None
        return (0, h) if self.world.rank < partner else (h, n)

    def swap(self, payload: Payload, partner: int, a: float, distance: bool = True) -> Received:
        """Swap payloads with ``partner`` and merge the weights in place (``w <- (1-a) w + a theirs``).

        One Sendrecv up to ``whole_max`` bytes (device tensors always); above, the
        weights chunk by chunk fused with the merge, then the rest in one more.
        Both sides must pass the same ``distance`` (it decides whether the pair
        swaps the halves of its distance).
        """
        flat, n = payload.weights, payload.weights.numel()
        half = self.halves(n, partner) if distance else None
        span = half or ((0, n) if distance else (0, 0))
        if payload.nbytes > self.whole_max and flat.device.type == "cpu" and flat.dim() == 1:
            own, shown = _swap_chunks_(self.world, flat, partner, a, self.buffers, tag=Tag.WEIGHTS,
                                       send=payload.outgoing, span=span,
                                       own_span=(0, n) if payload.lies and distance else span)
            own_d = math.sqrt(own)
            got = self._swap_extras(payload, partner)
        else:
            recv = self._buffer("recv", payload.nbytes, flat.device)
            self._send(payload.parts(), payload.nbytes, recv, partner)
            theirs = _typed(recv, payload.sections["weights"])
            if payload.lies or flat.device.type != "cpu" or flat.dim() != 1:
                shown = _squared_distance(payload.outgoing, theirs, span) if half else 0.0
                if distance and (payload.lies or not half):
                    own_d = merge_with_distance_(flat, theirs, a, scratch=self.buffers.diff)
                else:
                    own_d = math.nan
                    merge.interpolate_(flat, theirs, a)
            else:
                shown = _merge_received_(flat, theirs, a, self.buffers, span)
                own_d = math.sqrt(shown)
            got = payload.unpack(recv, 0, math.nan)
        if not distance:
            return got
        got.distance = own_d
        if half is not None:
            total = self._swap_partials(shown, partner)
            if not payload.lies:  # a liar logs the distance of its own weights (its partner saw the lie's)
                got.distance = math.sqrt(total)
        return got

    def _swap_extras(self, payload: Payload, partner: int) -> Received:
        """After chunked weights: the moments and the seen-at table in one more Sendrecv."""
        base = payload.sections["weights"].end
        if not payload.extras:
            return Received(float("nan"))
        recv = torch.empty(payload.extras, dtype=torch.uint8)
        self._send(payload.parts(weights=False), payload.extras, recv, partner)
        return payload.unpack(recv, base, float("nan"))

    def _swap_partials(self, mine: float, partner: int) -> float:
        """The pair's squared distance: this side's half and the partner's, summed lower half first (so both sides
        hold the same bits). The 8 bytes only serve the log: monitoring, not training traffic."""
        with self.world.metered("monitoring"):
            theirs = float(self.world.sendrecv_array(np.array([mine], dtype=np.float64), partner,
                                                     tag=Tag.DISTANCE)[0])
        return mine + theirs if self.world.rank < partner else theirs + mine

    def _send(self, parts: List[torch.Tensor], nbytes: int, recv: torch.Tensor, partner: int) -> None:
        """One round trip of ``parts``' bytes back to back into ``recv``: each part of ``PART_MIN`` bytes or more
        from where it lies, the runs of smaller ones between them packed into a send buffer kept between
        exchanges (``World.sendrecv_parts``: a message each, all in flight). A world without it (a population's
        hub, data-parallel groups) gets the whole payload packed into one message."""
        parts = [_bytes(t) for t in parts if t.numel()]
        if len(parts) == 1:
            self.world.sendrecv(parts[0], recv, partner, tag=Tag.WEIGHTS)
            return
        sendrecv_parts = getattr(self.world, "sendrecv_parts", None)
        small = sum(b.numel() for b in parts if b.numel() < PART_MIN or sendrecv_parts is None)
        send = self._buffer("send", small, recv.device)
        messages: List[torch.Tensor] = []
        offset = run = 0  # the send buffer's bytes used, and where the run being packed started
        for b in parts:
            if b.numel() >= PART_MIN and sendrecv_parts is not None:
                if offset > run:
                    messages.append(send[run:offset])
                messages.append(b)
                run = offset
            else:
                send[offset: offset + b.numel()].copy_(b)
                offset += b.numel()
        if offset > run:
            messages.append(send[run:offset])
        if sendrecv_parts is None:
            self.world.sendrecv(send, recv, partner, tag=Tag.WEIGHTS)
        else:
            sendrecv_parts(messages, recv, partner, tag=Tag.WEIGHTS)

    def _buffer(self, slot: str, nbytes: int, device: torch.device) -> torch.Tensor:
        buf = self._held.get(slot)
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._held[slot] = buf
        return buf[:nbytes]
