"""How two ranks agree to merge without a clock: the pairing rule of the asynchronous protocol.

Pure state machine, no MPI: the engine feeds it the control messages a rank
receives and sends the messages it returns (``engine/mixing/async_mixer.py``). The
rule, for one rank:

1. A rank has at most one request of its own outstanding (``REQ`` to its
   target). While it waits for the answer it accepts nobody: every other
   request gets ``BUSY``. The one exception is a *crossed* request, from its own
   target: the pair then merges once, as the lower rank's request (the higher
   rank answers it ``ACK``; the lower rank drops the higher one's request).
2. A free rank (training, or done and serving until every rank is done)
   answers a request ``ACK`` at its next poll, and then waits for the
   requester's ``GO`` or ``NO``; meanwhile it answers other requests ``BUSY``.
3. A requester answers the ``ACK`` of its live request ``GO``, and both enter the
   exchange. It answers any other ``ACK`` (of a request it gave up, or one a
   crossed request superseded) ``NO``.
4. A request unanswered after ``timeout`` seconds is given up and the partner
   logged; an offer whose ``GO`` does not come within ``timeout`` is abandoned,
   but a ``GO`` that arrives later is still honoured (the requester has
   committed to the exchange and is waiting in it).

Why it cannot deadlock: a rank blocks only inside an exchange that both sides
have committed to (``GO`` sent, or ``GO`` received), so no two ranks wait on
each other in a cycle. Every other wait is a poll loop that keeps answering, and
each is bounded by the partner's next poll or by ``timeout``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Dict, List, Optional, Tuple


class Kind(IntEnum):
    """Control messages (three int64 on the wire: kind, request id, the sender's unit)."""

    REQ = 1  # merge with me?
    ACK = 2  # ready: send GO to start the exchange (or NO)
    GO = 3  # both enter the exchange now
    NO = 4  # not any more (the request was given up or superseded)
    BUSY = 5  # cannot now: waiting on my own request, or holding an offer
    STOP = 6  # not part of the pairing: a rank was asked to stop, so every rank stops (the engine handles it)


SIGNATURES_ONLY = 1  # a request's flag: swap signature tables, not weights (no partner law yet)


@dataclass(frozen=True)
class Message:
    kind: Kind
    peer: int  # the other rank: the destination of a message sent, the source of one received
    rid: int  # the request id, chosen by the requester
    unit: int = 0  # the sender's unit of training when it sent it (merge schedules use the pair's minimum)
    flags: int = 0  # a request's flags (SIGNATURES_ONLY), echoed by nothing: the pair learns them from the REQ


@dataclass(frozen=True)
class Exchange:
    """An exchange both sides have committed to: perform it now."""

    partner: int
    initiator: int
    rid: int
    partner_unit: int = 0  # the partner's unit, from its REQ or ACK
    flags: int = 0  # the flags of the request being served


@dataclass
class _Pending:
    target: int
    rid: int
    since: float
    unit: int = 0  # an offer: the requester's unit
    flags: int = 0  # the request's flags


@dataclass
class Outcome:
    """What handling a message (or a tick) decided: messages to send, an exchange to run, a request that ended."""

    send: List[Message] = field(default_factory=list)
    exchange: Optional[Exchange] = None
    ended: Optional[Tuple[str, int]] = None  # (busy | timeout | superseded, partner) of this rank's own request


class Rendezvous:
    """One rank's side of the pairing rule."""

    def __init__(self, rank: int, timeout: float):
        self.rank, self.timeout = int(rank), float(timeout)
        self.request: Optional[_Pending] = None  # my outstanding request
        self.offer: Optional[_Pending] = None  # the request I acknowledged, awaiting GO or NO
        self.abandoned: Dict[Tuple[int, int], int] = {}  # (requester, rid) -> flags of offers given up (late GO)
        self._next_rid = 0

    @property
    def idle(self) -> bool:
        """Neither waiting on a request of its own nor holding an offer."""
        return self.request is None and self.offer is None

    def ask(self, target: int, now: float, unit: int = 0, flags: int = 0) -> Message:
        """Start a request to ``target`` (the caller must wait until it ends: ``request`` becomes None)."""
        if not self.idle:
            raise RuntimeError(f"rank {self.rank}: a request while one is outstanding or an offer is held")
        if target == self.rank:
            raise ValueError("a rank cannot merge with itself")
        self._next_rid += 1
        self.request = _Pending(int(target), self._next_rid, now, flags=flags)
        return Message(Kind.REQ, int(target), self._next_rid, unit, flags)

    def receive(self, msg: Message, now: float, unit: int = 0) -> Outcome:
        """Handle one received control message; ``unit`` is this rank's, stamped on what it sends."""
        out = Outcome()
        k, peer, rid = msg.kind, msg.peer, msg.rid
        if k == Kind.REQ:
            if self.request is not None and self.request.target == peer:  # crossed
                if peer < self.rank:  # the lower rank's request is the one served
                    out.ended = ("superseded", peer)
                    self.request = None
                    self.offer = _Pending(peer, rid, now, msg.unit, msg.flags)
                    out.send.append(Message(Kind.ACK, peer, rid, unit))
                # else: drop it: the peer, the higher rank, answers my request ACK
            elif not self.idle:
                out.send.append(Message(Kind.BUSY, peer, rid, unit))
            else:
                self.offer = _Pending(peer, rid, now, msg.unit, msg.flags)
                out.send.append(Message(Kind.ACK, peer, rid, unit))
        elif k == Kind.ACK:
            r = self.request
            if r is not None and r.target == peer and r.rid == rid:
                self.request = None
                out.send.append(Message(Kind.GO, peer, rid, unit))
                out.exchange = Exchange(peer, self.rank, rid, msg.unit, r.flags)
            else:
                out.send.append(Message(Kind.NO, peer, rid, unit))
        elif k == Kind.GO:
            o = self.offer
            if o is not None and o.target == peer and o.rid == rid:
                self.offer = None
                out.exchange = Exchange(peer, peer, rid, msg.unit, o.flags)
            elif (peer, rid) in self.abandoned:
                flags = self.abandoned.pop((peer, rid))
                out.exchange = Exchange(peer, peer, rid, msg.unit, flags)  # the requester is already waiting in it
            else:
                raise RuntimeError(f"rank {self.rank}: GO {rid} from rank {peer} answers no offer of mine")
        elif k == Kind.NO:
            o = self.offer
            if o is not None and o.target == peer and o.rid == rid:
                self.offer = None
            self.abandoned.pop((peer, rid), None)
        elif k == Kind.STOP:
            raise ValueError("STOP is the engine's, not the pairing rule's")
        elif k == Kind.BUSY:
            r = self.request
            if r is not None and r.target == peer and r.rid == rid:
                self.request = None
                out.ended = ("busy", peer)
        return out

    def tick(self, now: float) -> Outcome:
        """Give up a request or an offer that outlasted ``timeout``."""
        out = Outcome()
        if self.request is not None and now - self.request.since > self.timeout:
            out.ended = ("timeout", self.request.target)
            self.request = None
        if self.offer is not None and now - self.offer.since > self.timeout:
            self.abandoned[(self.offer.target, self.offer.rid)] = self.offer.flags
            self.offer = None
        return out
