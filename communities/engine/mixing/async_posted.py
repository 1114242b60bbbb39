"""The asynchronous mixer with posted exchanges (``comm.exchange: posted``): no side waits for the other's batch.

Under the blocking exchange a requester waits, idle, for its partner's next
batch boundary, and then both sit in one ``Sendrecv``. Here (the rule is
``core/posted.py``) each side *posts* its half: a copy of its weights
(``Isend``), its header and the signature rows the other lacks (one float64
message), and an ``Irecv`` for the partner's weights, then trains on. Between
batches it tests what is in flight; once both halves have arrived it merges by
the displacement rule (``merge.displace_``: ``w <- w + a (theirs - sent)``), so
the pair's sum is conserved although both trained while the bytes moved.

The cost: one copy of the weights and one receive buffer per exchange in flight
(at most floor(1/a) at once, ``core/posted.flights_for``; kept for reuse), and a
merge that reads weights up to a few batches old. What
needs more than weights and a header to travel is refused by the config
(optimizer moments, the seen-at table, hard examples, pbt, an outer step).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ...core import merge, pbt
from ...core.posted import Flight, Outcome, PostedRendezvous, flights_for
from ...core.rendezvous import SIGNATURES_ONLY, Kind, Message
from ...results import Event, MergeRow
from ...runtime.comm import Tag
from .async_mixer import CONTROL_WIDTH, POLL_MAX_S, POLL_MIN_S, RETRIES, AsyncMixer
from .exchange import Header, decide

log = logging.getLogger(__name__)


@dataclass
class _Half:
    """What this side posted for one exchange and what it waits for."""

    flight: Flight
    mine: Header  # the header sent (the merge is decided from both headers, as on the other side)
    unit: int  # this side's unit when it posted
    sent: Optional[torch.Tensor]  # the copy of the weights sent (None: signatures only)
    recv: Optional[torch.Tensor]  # where the partner's weights arrive
    requests: List[Any]  # the Isends and the Irecv
    nbytes: int  # bytes this side sent
    outgoing: np.ndarray  # the header and rows sent (kept until the send completes)
    meta: Optional[np.ndarray] = None  # the partner's header and signature rows, once arrived


class PostedMixer(AsyncMixer):
    """The asynchronous mixer of one rank, with posted exchanges."""

    def __init__(self, cfg, world, timer, **parts):
        super().__init__(cfg, world, timer, **parts)
        mc = cfg.merge
        self.posted = PostedRendezvous(self.rank, self.rz.timeout,
                                       max_flights=flights_for(merge.max_coefficient(mc.rule, mc.alpha, mc.ema)))
        self.width = CONTROL_WIDTH + self.n  # control messages carry the sender's signature-table versions
        self.halves: Dict[int, _Half] = {}  # partner -> this side's half in flight
        self._spare: List[torch.Tensor] = []  # weight-sized buffers of completed exchanges, for reuse
        self._all_done = False  # the done Ibarrier completed: nobody initiates any more
        self._tried = np.zeros(self.n, dtype=bool)
        self._retries = 0
        self._draining = False  # no new request once the drain has begun

    # ------------------------------------------------------------------ serving and asking

    def serve(self) -> None:
        """Between batches: read control messages, test what is in flight, merge what has arrived."""
        self._poll_once()

    def _initiate(self, t: int) -> None:
        """Ask a partner drawn from this rank's law and train on; with no room for another exchange, next unit."""
        if not self.posted.can_ask:
            self.next_fire = t + 1
            return
        self._tried[:] = False
        self._retries = RETRIES
        self._ask(t)

    def _ask(self, t: int) -> None:
        """A partner not tried at this firing and not in an exchange with this rank already."""
        busy = self._tried.copy()
        busy[list(self.posted.flights)] = True
        target, flags = self._draw(t, busy)
        if target is not None:
            self._post(self.posted.ask(target, time.monotonic(), t, flags))

    def _control(self, m: Message) -> np.ndarray:
        return np.concatenate([super()._control(m), self.table.versions])

    def _received(self, msg: Message, extra: np.ndarray) -> None:
        if msg.kind == Kind.REQ and self._all_done:
            return  # a request that timed out at its sender, read after every rank is done: nobody waits on it
        self._act_posted(self.posted.receive(msg, time.monotonic(), self.t), extra)

    def _after_poll(self) -> None:
        self._act_posted(self.posted.tick(time.monotonic()), None)
        if self._barrier is not None and not self._all_done:
            self._all_done = bool(self._barrier.Test())
        self._progress()

    def _act_posted(self, out: Outcome, versions: Optional[np.ndarray]) -> None:
        for m in out.send:
            self._post(m)
        if out.post is not None:
            assert versions is not None  # a half is posted on a REQ or an ACK, which carry the versions
            self._post_half(out.post, versions)
        if out.ended is not None:
            reason, partner = out.ended
            if reason == "busy":
                self._tried[partner] = True
                self.record(MergeRow.declined(self.t, self.rank, partner, Event.BUSY))
                if self._retries > 0 and self.posted.can_ask and not self._draining:
                    self._retries -= 1
                    self._ask(self.t)
            elif reason == "timeout":
                self.record(MergeRow.declined(self.t, self.rank, partner, Event.TIMEOUT))
                log.info(f"communities: rank {self.rank} at t={self.t}: rank {partner} did not answer within "
                         f"comm.timeout={self.cfg.comm.timeout:g}s; skipped (a late answer is still honoured)")

    # ------------------------------------------------------------------ the halves

    def _post_half(self, flight: Flight, versions: np.ndarray) -> None:
        """Post this side's half: header and signature rows, a copy of the weights, the receive for theirs."""
        r, world, peer = self.replica, self.world, flight.partner
        with self.timer("exchange"):
            mine = self._header(self.t, [])
            rows = self.table.pack(self.table.newer_than(versions, self.cfg.signature.gossip_rows))
            meta = np.concatenate([[float(self.t)], mine.to_array(), rows])
            requests = [world.isend(meta, peer, Tag.HEADER)]
            nbytes = meta.nbytes
            sent = recv = None
            if not flight.flags & SIGNATURES_ONLY:
                sent, recv = self._buffer(), self._buffer()
                sent.copy_(r.outgoing() if r.faults.hostile else r.flat)
                requests += [world.isend(sent, peer, Tag.WEIGHTS), world.irecv(recv, peer, Tag.WEIGHTS)]
                nbytes += sent.numel() * sent.element_size()
            self.halves[peer] = _Half(flight, mine, self.t, sent, recv, requests, nbytes, meta)
        r.faults.in_exchange(self.t)

    def _buffer(self) -> torch.Tensor:
        if self._spare:
            return self._spare.pop()
        return torch.empty(self.replica.flat.numel(), dtype=self.replica.flat.dtype)

    def _progress(self) -> None:
        """Merge every exchange whose halves have both arrived (and whose sends completed)."""
        for peer in list(self.halves):
            half = self.halves[peer]
            if half.meta is None:
                half.meta = self.world.poll_floats(peer, Tag.HEADER)
            if half.meta is not None and all(req.Test() for req in half.requests):
                self._merge(half)

    def _merge(self, half: _Half) -> None:
        r, mc, peer = self.replica, self.cfg.merge, half.flight.partner
        meta = half.meta
        assert meta is not None
        with self.timer("exchange"):
            width = half.mine.to_array().size  # (both sides run one config: pbt's fields on both or neither)
            if meta.size < 1 + width or not np.isfinite(meta[0]):
                raise RuntimeError(f"rank {self.rank}: a posted header of {meta.size} numbers from rank {peer}, "
                                   f"expected at least {1 + width}")
            other = Header.from_array(meta[1:1 + width])
            try:
                self.table.merge(meta[1 + width:])
            except ValueError as exc:
                raise RuntimeError(f"rank {self.rank}: bad signature packet from rank {peer}: {exc}") from exc
            del self.halves[peer]
            self.posted.merged(peer)
            if half.sent is None or half.recv is None:
                return  # signatures only
            if other.size != half.mine.size:
                raise RuntimeError(f"rank {self.rank} holds {half.mine.size} weights but partner rank {peer} "
                                   f"holds {other.size}: the models differ")
            rule_t = min(half.unit, int(meta[0]))
            alpha = self._pair_alpha(half.mine, other)
            a, event = decide(half.mine, other, mc, self.cfg.robust.diverged, rule_t, alpha=alpha)
            before = r.flat.clone() if self.cut is not None else None
            if event == Event.RESET:
                distance = float(torch.dist(half.sent, half.recv))
                r.flat.copy_(half.recv)
                r.opt.state.clear()  # moments of a diverged model are as bad as its weights
                r.diverged = False
            else:
                distance = merge.displace_(r.flat, half.recv, half.sent, a if event == Event.MERGE else 0.0)
                if event == Event.MERGE and mc.optimizer_state == "reset":
                    r.opt.state.clear()
            self._spare += [half.sent, half.recv]
            if before is not None:  # comm.fault_tolerance shrink: undone if the partner's side was cut
                self.cut.posted((peer, half.flight.initiator, half.flight.rid), r.flat - before)
        update = a * distance if event in (Event.MERGE, Event.RESET) else 0.0
        self.record(MergeRow.pairwise(self.t, self.rank, peer, half.flight.initiator, a, update=update,
                                      distance=distance, sent=half.nbytes, event=event))
        if r.hyper is not None and self.cfg.pbt.selection == "tournament" and \
                pbt.adopts(half.mine.score, other.score, half.mine.ready, self.cfg.pbt.margin):
            r.hyper.adopt(self.t, np.asarray(other.hyper), r.opt)  # exploit the better side's, then explore
            self.record(MergeRow.adopted(self.t, self.rank, peer, half.flight.initiator, half.mine.score,
                                         partner_score=other.score))

    def _pair_alpha(self, mine: Header, other: Header) -> Optional[float]:
        """pbt with merge.alpha among its values: the pair's alpha (each side owns one), as a blocking exchange."""
        hyper = self.replica.hyper
        if hyper is None or "merge.alpha" not in hyper.names:
            return None
        k = hyper.names.index("merge.alpha")
        return pbt.pair_alpha(mine.hyper[k], other.hyper[k])

    # ------------------------------------------------------------------ the end

    def drain(self) -> None:
        """Settle this rank's own request and exchanges first, then as for blocking exchanges."""
        self._draining = True
        self._wait(lambda: self.posted.request is None, "an answer to this rank's request")
        self._wait(lambda: not self.halves, "this rank's posted exchanges")
        super().drain()

    def _stale(self, src: int, values: np.ndarray) -> None:
        """After every rank is done, an ACK still commits (its sender posted its half); requests are dropped."""
        kind = Kind(int(values[0]))
        if kind == Kind.ACK:
            msg = Message(kind, src, int(values[1]), int(values[2]), int(values[3]))
            self._act_posted(self.posted.receive(msg, time.monotonic(), self.t), values[CONTROL_WIDTH:])

    def _finish_in_flight(self) -> None:
        """Every half is posted by now (every control message has been read): wait for them and merge."""
        pause = POLL_MIN_S
        with self.timer("idle"):
            while self.halves:
                self._progress()
                self.world.pause(pause)
                pause = min(2 * pause, POLL_MAX_S)
