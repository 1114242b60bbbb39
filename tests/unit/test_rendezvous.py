"""The asynchronous pairing rule (core/rendezvous.py), driven by a discrete-event simulation of N ranks.

The simulation plays what the engine does, with random batch times, message
delays (FIFO per pair of ranks, as MPI guarantees), crossed requests, ranks
that finish early and serve the others, and frozen ranks. It checks the
protocol's promises: no deadlock (every rank reaches the end), every exchange
is entered by both sides with the same id, a crossed pair merges once, and a
frozen partner costs a requester at most ``timeout``.
"""
from __future__ import annotations

import heapq
import itertools
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from communities.core.rendezvous import Exchange, Kind, Message, Rendezvous


class Sim:
    """N ranks training units of batches; a rank's timer fires after each unit with probability ``p_fire``."""

    def __init__(self, n, seed, units=6, batches=4, p_fire=0.6, timeout=2.0, freeze=None, exchange_time=0.05,
                 delay=0.02, speeds=None):
        self.n, self.rng = n, np.random.default_rng(seed)
        self.units, self.batches, self.p_fire, self.timeout = units, batches, p_fire, timeout
        self.exchange_time, self.delay = exchange_time, delay
        self.speeds = speeds or [1.0] * n
        self.freeze = freeze or {}  # rank -> (start, duration)
        self.rz = [Rendezvous(r, timeout) for r in range(n)]
        self.inbox = [[] for _ in range(n)]  # delivered, not yet read
        self.last_arrival = defaultdict(float)  # (src, dst) -> time of the last delivery: FIFO per pair
        self.events = []
        self.seq = itertools.count()
        self.now = 0.0
        self.entered = defaultdict(list)  # (initiator, rid) -> [(rank, partner)]
        self.pending_ex = {}  # rank -> (Exchange, time entered)
        self.ended = defaultdict(list)  # rank -> [(reason, partner, waited)]
        self.done = set()
        self.finished = set()
        self.exchanges_done = 0

    # ---------------------------------------------------------------- plumbing
    def at(self, t, fn):
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def send(self, src, msg: Message):
        arrive = max(self.now + self.rng.uniform(0.1, 1.0) * self.delay, self.last_arrival[(src, msg.peer)] + 1e-9)
        self.last_arrival[(src, msg.peer)] = arrive
        dst = msg.peer
        self.at(arrive, lambda: self.inbox[dst].append(Message(msg.kind, src, msg.rid)))

    def frozen(self, r):
        f = self.freeze.get(r)
        return f is not None and f[0] <= self.now < f[0] + f[1]

    def thaw_time(self, r):
        f = self.freeze[r]
        return f[0] + f[1]

    # ---------------------------------------------------------------- one rank's program
    def poll(self, r):
        """Read every delivered message; returns an exchange to run, if one was committed."""
        ex = None
        while self.inbox[r] and ex is None:
            msg = self.inbox[r].pop(0)
            out = self.rz[r].receive(msg, self.now)
            for m in out.send:
                self.send(r, m)
            if out.ended:
                self.ended[r].append(out.ended)
            ex = out.exchange
        out = self.rz[r].tick(self.now)
        if out.ended:
            self.ended[r].append(out.ended)
        return ex

    def run_rank(self, r, unit, batch, then):
        """Continue rank r's program; ``then`` is what follows a finished exchange or wait."""
        if self.frozen(r):
            self.at(self.thaw_time(r), lambda: self.run_rank(r, unit, batch, then))
            return
        ex = self.poll(r)
        if ex is not None:
            self.enter(r, ex, lambda: self.run_rank(r, unit, batch, then))
            return
        if self.rz[r].offer is not None:  # an offer pauses training until GO/NO (or timeout)
            self.at(self.now + 0.01, lambda: self.run_rank(r, unit, batch, then))
            return
        then()

    def train(self, r, unit, batch):
        if unit == self.units:
            self.done.add(r)
            self.serve_until_all_done(r)
            return
        if batch < self.batches:
            dt = self.rng.uniform(0.05, 0.15) * self.speeds[r]
            self.at(self.now + dt, lambda: self.run_rank(r, unit, batch + 1, lambda: self.train(r, unit, batch + 1)))
            return
        if self.rng.random() < self.p_fire:  # the merge timer fires: ask a random partner, wait for the answer
            target = int(self.rng.choice([j for j in range(self.n) if j != r]))
            self.send(r, self.rz[r].ask(target, self.now))
            self.wait(r, unit, self.now)
        else:
            self.train(r, unit + 1, 0)

    def wait(self, r, unit, since):
        def after():
            if self.rz[r].idle:
                self.train(r, unit + 1, 0)
            else:
                self.at(self.now + 0.01, lambda: self.wait(r, unit, since))
        self.run_rank(r, unit, self.batches, after)

    def serve_until_all_done(self, r):
        def after():
            if len(self.done) == self.n and self.rz[r].idle:
                self.finished.add(r)
            else:
                self.at(self.now + 0.01, lambda: self.serve_until_all_done(r))
        self.run_rank(r, self.units, self.batches, after)

    def enter(self, r, ex: Exchange, then):
        key = (ex.initiator, ex.rid)
        self.entered[key].append((r, ex.partner))
        other = self.pending_ex.get(ex.partner)
        if other is not None and other[0].partner == r and (other[0].initiator, other[0].rid) == key:
            del self.pending_ex[ex.partner]
            end = self.now + self.exchange_time
            self.exchanges_done += 1
            self.at(end, then)
            self.at(end, other[1])
        else:
            self.pending_ex[r] = (ex, then)

    def run(self, limit=1e4):
        for r in range(self.n):
            self.at(0.0, lambda r=r: self.train(r, 0, 0))
        while self.events and len(self.finished) < self.n:
            self.now, _, fn = heapq.heappop(self.events)
            if self.now > limit:
                break
            fn()
        return self


def check(sim: Sim):
    assert len(sim.finished) == sim.n, (f"deadlock or livelock: finished {sorted(sim.finished)}, blocked in exchanges "
                                        f"{ {r: e[0] for r, e in sim.pending_ex.items()} }")
    assert not sim.pending_ex
    for key, sides in sim.entered.items():
        assert len(sides) == 2, f"exchange {key} entered by {sides}"
        (a, pa), (b, pb) = sides
        assert pa == b and pb == a, f"exchange {key} mismatched: {sides}"


@given(n=st.integers(2, 9), seed=st.integers(0, 2**31 - 1), p_fire=st.sampled_from([0.3, 0.7, 1.0]))
@settings(max_examples=60, deadline=None)
def test_random_schedules_never_deadlock_and_pair_every_exchange(n, seed, p_fire):
    sim = Sim(n, seed, p_fire=p_fire).run()
    check(sim)
    assert sim.exchanges_done > 0 or p_fire < 1.0 or n == 2


def test_heterogeneous_speeds_and_busy_ranks():
    sim = Sim(8, 3, units=10, p_fire=1.0, speeds=[3.0] + [1.0] * 7).run()
    check(sim)
    reasons = {reason for r in range(8) for reason, _ in sim.ended[r]}
    assert "busy" in reasons  # with every timer firing, targets are often waiting on their own requests
    assert sim.exchanges_done >= 8


def test_crossed_requests_merge_once_as_the_lower_ranks():
    rz = [Rendezvous(0, 5.0), Rendezvous(1, 5.0)]
    req0, req1 = rz[0].ask(1, 0.0), rz[1].ask(0, 0.0)
    out1 = rz[1].receive(Message(Kind.REQ, 0, req0.rid), 0.1)  # rank 1 (higher) answers rank 0's request
    assert out1.send == [Message(Kind.ACK, 0, req0.rid)] and out1.ended == ("superseded", 0)
    out0 = rz[0].receive(Message(Kind.REQ, 1, req1.rid), 0.1)  # rank 0 drops rank 1's
    assert out0.send == [] and out0.exchange is None
    go = rz[0].receive(Message(Kind.ACK, 1, req0.rid), 0.2)
    assert go.send == [Message(Kind.GO, 1, req0.rid)] and go.exchange == Exchange(1, 0, req0.rid)
    ex = rz[1].receive(Message(Kind.GO, 0, req0.rid), 0.3)
    assert ex.exchange == Exchange(0, 0, req0.rid)
    assert rz[0].idle and rz[1].idle


def test_a_waiting_rank_serves_nobody_and_a_late_ack_is_refused():
    a = Rendezvous(2, timeout=1.0)
    req = a.ask(5, 0.0)
    assert a.receive(Message(Kind.REQ, 3, 7), 0.1).send == [Message(Kind.BUSY, 3, 7)]
    assert a.tick(2.0).ended == ("timeout", 5) and a.idle
    late = a.receive(Message(Kind.ACK, 5, req.rid), 3.0)  # the partner woke up: it is told NO
    assert late.send == [Message(Kind.NO, 5, req.rid)] and late.exchange is None


def test_an_abandoned_offer_still_honours_a_late_go():
    b = Rendezvous(4, timeout=1.0)
    assert b.receive(Message(Kind.REQ, 1, 9), 0.0).send == [Message(Kind.ACK, 1, 9)]
    b.tick(5.0)
    assert b.idle  # free to serve others again
    assert b.receive(Message(Kind.GO, 1, 9), 6.0).exchange == Exchange(1, 1, 9)
    with pytest.raises(RuntimeError, match="answers no offer"):
        b.receive(Message(Kind.GO, 2, 3), 7.0)


def test_a_frozen_rank_is_skipped_after_the_timeout():
    sim = Sim(4, 11, units=6, p_fire=1.0, timeout=1.0, freeze={2: (0.3, 8.0)}).run()
    check(sim)
    timed_out = [(r, p) for r in range(4) for reason, p in sim.ended[r] if reason == "timeout"]
    assert timed_out and all(p == 2 for _, p in timed_out)
