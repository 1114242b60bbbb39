"""The pairing rule of posted exchanges (``comm.exchange: posted``): nobody waits for a partner's batch.

Pure state machine, no MPI, like ``rendezvous.py``; the engine feeds it the
control messages a rank receives and acts on what it returns
(``engine/mixing/async_posted.py``). Under the blocking rule both sides of an exchange
meet in one ``Sendrecv``, so whoever asks waits for the partner's next batch
boundary. Here each side *posts* its half and trains on:

1. A rank sends ``REQ`` to its partner and trains on. It has at most one
   request of its own outstanding, and at most ``max_flights`` exchanges in
   flight or asked for (a late answer honoured, below, may add one); the
   engine sets it by ``flights_for``, so that overlapping merges add up to at
   most one full step.
2. A rank that reads a ``REQ`` *accepts* it, unless it already has an exchange
   in flight with that rank or ``max_flights`` of them, or its own request to
   that rank timed out unanswered (``BUSY`` then). Accepting, it posts its half
   (a copy of its weights, its header and the signature rows the requester
   lacks) and answers ``ACK``; it does not wait for anything. Of two *crossed*
   requests (each from the other's target) the lower rank's is answered, ACK or
   BUSY, and the higher rank's dropped: the higher rank's request ends there.
3. A requester that reads the ``ACK`` posts its half. An ``ACK`` always commits:
   one that answers a request given up after ``timeout`` is honoured all the
   same, since its sender has posted and waits for the other half. So every
   half that is posted is received, and no message is left unmatched.
4. Each side merges when both halves have arrived, at a batch boundary of its
   own, by the displacement rule (``merge.displace_``), which conserves the
   pair's sum whatever either side trained, or merged with others, in between.

Since nothing blocks, a rank may take part in several exchanges at once (the
blocking rule's ``BUSY`` kept waits from forming cycles; here there are no
waits); a pair has at most one in flight, so the messages of two exchanges are
never confused.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .rendezvous import Kind, Message


@dataclass(frozen=True)
class Flight:
    """An exchange this rank has committed to and posted its half of (or must now post)."""

    partner: int
    initiator: int
    rid: int
    partner_unit: int  # the partner's unit, from its REQ or ACK
    flags: int  # the request's flags (SIGNATURES_ONLY: no weights travel)


@dataclass
class _Request:
    target: int
    rid: int
    since: float
    flags: int


@dataclass
class Outcome:
    """What handling a message (or a tick) decided: messages to send, a half to post, a request that ended."""

    send: List[Message] = field(default_factory=list)
    post: Optional[Flight] = None  # post this side's half of this exchange now
    ended: Optional[Tuple[str, int]] = None  # (busy | timeout | superseded | posted, partner) of this rank's request


MAX_FLIGHTS = 4  # exchanges one rank may have in flight: each holds a copy of the weights and a receive buffer


def flights_for(a_max: float, cap: int = MAX_FLIGHTS) -> int:
    """How many exchanges may overlap on one rank when each can move it by up to ``a_max`` of a difference.

    Overlapping merges all displace from the weights posted before them, so k of them at weight a add up to
    k a of a step: past 1 the rank is pushed beyond its partners (measured: replicas diverging at lr 0.2 with
    4 overlapping merges at a = 0.5). At most floor(1 / a_max), so the sum stays a convex step; at least 1."""
    if not a_max > 0:
        return cap
    return max(1, min(cap, int(1.0 / a_max + 1e-9)))


class PostedRendezvous:
    """One rank's side of the posted pairing rule."""

    def __init__(self, rank: int, timeout: float, max_flights: int = MAX_FLIGHTS):
        if max_flights < 1:
            raise ValueError(f"max_flights={max_flights} must be at least 1")
        self.rank, self.timeout, self.max_flights = int(rank), float(timeout), int(max_flights)
        self.request: Optional[_Request] = None  # my outstanding REQ, awaiting ACK or BUSY
        self.flights: Dict[int, Flight] = {}  # partner -> an exchange posted and not yet merged
        self.given_up: Dict[Tuple[int, int], int] = {}  # (target, rid) -> flags of requests that timed out
        self._next_rid = 0

    @property
    def can_ask(self) -> bool:
        """No request of its own outstanding, and room for another exchange in flight."""
        return self.request is None and len(self.flights) < self.max_flights

    @property
    def settled(self) -> bool:
        """Nothing outstanding and nothing in flight."""
        return self.request is None and not self.flights

    def ask(self, target: int, now: float, unit: int = 0, flags: int = 0) -> Message:
        if not self.can_ask:
            raise RuntimeError(f"rank {self.rank}: a request while one is outstanding or {self.max_flights} "
                               "exchanges are in flight")
        if target == self.rank:
            raise ValueError("a rank cannot merge with itself")
        if target in self.flights:
            raise RuntimeError(f"rank {self.rank}: a request to rank {target}, with an exchange in flight with it")
        self._next_rid += 1
        self.request = _Request(int(target), self._next_rid, now, flags)
        return Message(Kind.REQ, int(target), self._next_rid, unit, flags)

    def receive(self, msg: Message, now: float, unit: int = 0) -> Outcome:
        out = Outcome()
        k, peer, rid = msg.kind, msg.peer, msg.rid
        if k == Kind.REQ:
            crossed = self.request is not None and self.request.target == peer
            if crossed and peer > self.rank:
                return out  # drop it: the peer, the higher rank, answers my request (ACK or BUSY)
            if crossed:  # the peer drops my request: it ends here, whether I accept the peer's or not
                out.ended = ("superseded", peer)
                self.request = None
            if (peer in self.flights or len(self.flights) + (self.request is not None) >= self.max_flights
                    or any(target == peer for target, _ in self.given_up)):
                # (a request to the peer that timed out: its ACK may still come and commit us)
                out.send.append(Message(Kind.BUSY, peer, rid, unit))
            else:
                out.post = self._commit(Flight(peer, peer, rid, msg.unit, msg.flags))
                out.send.append(Message(Kind.ACK, peer, rid, unit))
        elif k == Kind.ACK:
            r = self.request
            if r is not None and r.target == peer and r.rid == rid:
                self.request = None
                out.ended = ("posted", peer)
                out.post = self._commit(Flight(peer, self.rank, rid, msg.unit, r.flags))
            elif (peer, rid) in self.given_up:  # the partner posted its half: honour it
                flags = self.given_up.pop((peer, rid))
                out.post = self._commit(Flight(peer, self.rank, rid, msg.unit, flags))
            else:
                raise RuntimeError(f"rank {self.rank}: ACK {rid} from rank {peer} answers no request of mine")
        elif k == Kind.BUSY:
            r = self.request
            if r is not None and r.target == peer and r.rid == rid:
                self.request = None
                out.ended = ("busy", peer)
            self.given_up.pop((peer, rid), None)
        else:
            raise ValueError(f"{k.name} is not a message of the posted pairing rule")
        return out

    def _commit(self, flight: Flight) -> Flight:
        if flight.partner in self.flights:
            raise RuntimeError(f"rank {self.rank}: a second exchange in flight with rank {flight.partner}")
        self.flights[flight.partner] = flight
        return flight

    def merged(self, partner: int) -> None:
        """Both halves of the exchange with ``partner`` arrived and were merged."""
        del self.flights[partner]

    def tick(self, now: float) -> Outcome:
        """Give up a request that outlasted ``timeout`` (its ACK, if it comes, is still honoured)."""
        out = Outcome()
        r = self.request
        if r is not None and now - r.since > self.timeout:
            self.given_up[(r.target, r.rid)] = r.flags
            out.ended = ("timeout", r.target)
            self.request = None
        return out
