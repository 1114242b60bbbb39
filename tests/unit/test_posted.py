"""Posted exchanges (comm.exchange: posted): the pairing rule (core/posted.py) in a discrete-event simulation of
N ranks, the displacement merge's algebra (core/merge.displace_), and what the config refuses."""
from __future__ import annotations

import collections
import heapq
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from communities import config as config_mod
from communities.core import merge
from communities.core.posted import PostedRendezvous, flights_for
from communities.core.rendezvous import Kind, Message
from communities.errors import ConfigError
from tests.helpers.events import EventQueue


class Sim(EventQueue):
    """N ranks training units of batches; each reads its messages and tests its halves between batches.

    A half posted by i for j arrives after a random delay; messages are FIFO per pair, as MPI's are. A rank's
    timer fires after a unit with probability ``p_fire``; a frozen rank neither trains nor reads for a while.
    Done ranks go on polling until nothing is in flight anywhere (the engine's drain)."""

    def __init__(self, n, seed, units=8, batches=4, p_fire=0.7, timeout=2.0, freeze=None, delay=0.05, speeds=None,
                 max_flights=4):
        super().__init__(np.random.default_rng(seed), delay)
        self.n = n
        self.units, self.batches, self.p_fire = units, batches, p_fire
        self.speeds = speeds or [1.0] * n
        self.freeze = freeze or {}
        self.rz = [PostedRendezvous(r, timeout, max_flights) for r in range(n)]
        self.most_flights = 0
        self.inbox = [[] for _ in range(n)]
        self.arrived = set()  # (dst, src, initiator, rid): a half delivered to dst
        self.committed = defaultdict(list)  # (initiator, rid) -> ranks that committed to it
        self.merged = defaultdict(list)  # (initiator, rid) -> ranks that merged it
        self.unit = [0] * n
        self.honoured = 0
        self.ended = defaultdict(list)

    def send(self, src, msg: Message):
        dst = msg.peer
        self._deliver(src, dst, lambda: self.inbox[dst].append(Message(msg.kind, src, msg.rid, msg.unit)))

    def frozen(self, r):
        f = self.freeze.get(r)
        return f is not None and f[0] <= self.now < f[0] + f[1]

    def act(self, r, out):
        for m in out.send:
            self.send(r, m)
        if out.ended is not None:
            self.ended[r].append(out.ended)
        if out.post is not None:
            f = out.post
            if f.initiator == r and out.ended is None:
                self.honoured += 1  # an ACK to a request given up
            key = (f.initiator, f.rid)
            self.committed[key].append(r)
            self._deliver(r, f.partner, lambda: self.arrived.add((f.partner, r, *key)))

    def poll(self, r):
        rz = self.rz[r]
        msgs, self.inbox[r] = self.inbox[r], []
        for m in msgs:
            self.act(r, rz.receive(m, self.now, self.unit[r]))
        self.act(r, rz.tick(self.now))
        self.most_flights = max(self.most_flights, len(rz.flights))
        for peer, f in list(rz.flights.items()):
            if (r, peer, f.initiator, f.rid) in self.arrived:
                self.arrived.discard((r, peer, f.initiator, f.rid))
                rz.merged(peer)
                self.merged[(f.initiator, f.rid)].append(r)

    def batch(self, r, b):
        if self.frozen(r):
            self.at(self.freeze[r][0] + self.freeze[r][1], lambda: self.batch(r, b))
            return
        self.poll(r)
        if b == self.batches:  # the unit is done: the timer may fire
            self.unit[r] += 1
            choices = [j for j in range(self.n) if j != r and j not in self.rz[r].flights]
            if self.rng.random() < self.p_fire and self.rz[r].can_ask and choices:
                target = int(self.rng.choice(choices))
                self.send(r, self.rz[r].ask(target, self.now, self.unit[r]))
            if self.unit[r] >= self.units:
                self.at(self.now + 0.01, lambda: self.serve(r))
                return
            b = 0
        self.at(self.now + self.speeds[r] * self.rng.uniform(0.05, 0.15), lambda: self.batch(r, b + 1))

    def serve(self, r):
        if not self.frozen(r):
            self.poll(r)
        if not self.quiet():
            self.at(self.now + 0.01, lambda: self.serve(r))

    def quiet(self):
        return (all(u >= self.units for u in self.unit) and not self.in_transit and not any(self.inbox)
                and not self.arrived and all(rz.settled for rz in self.rz))

    def run(self, horizon=10_000.0):
        for r in range(self.n):
            self.at(0.0, lambda r=r: self.batch(r, 0))
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            if self.now > horizon:
                raise AssertionError("the simulation did not settle: a deadlock or a livelock")
            fn()
        return self


def check(sim: Sim, frozen: bool = False):
    """Everything settled; every exchange committed and merged by both sides once; and, with nobody frozen, every
    request answered (ACK or BUSY) or dropped by its own side, never left to time out."""
    assert sim.quiet()
    if not frozen:
        assert not [e for ends in sim.ended.values() for e in ends if e[0] == "timeout"]
    for key, ranks in sim.committed.items():
        initiator, _ = key
        assert len(ranks) == 2 and initiator in ranks, (key, ranks)  # both sides committed, once each
        assert sorted(sim.merged[key]) == sorted(ranks), key  # ... and both merged it, once each
    assert set(sim.merged) == set(sim.committed)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 9), seed=st.integers(0, 10_000))
def test_every_exchange_is_posted_and_merged_by_both_sides_once(n, seed):
    sim = Sim(n, seed).run()
    check(sim)
    assert sim.committed


def test_crossed_requests_merge_once_and_busy_ranks_are_declined():
    """Every timer fires: crossed requests (the higher rank's superseded) and requests declined BUSY both happen,
    and every exchange is still committed and merged by both sides once (over seeds: one run may lack either)."""
    reasons = collections.Counter()
    for seed in range(20):
        sim = Sim(4, seed, p_fire=1.0, delay=0.2).run()
        check(sim)
        reasons.update(e[0] for ends in sim.ended.values() for e in ends)
    assert reasons["superseded"] > 0 and reasons["busy"] > 0 and reasons["posted"] > 0


def test_a_frozen_partner_times_out_and_its_late_answer_is_honoured():
    """Rank 0 frozen for 30 s: requests to it time out after 2 s; when it wakes and accepts one, the requester
    commits all the same, so no half is left unreceived (over seeds: a woken rank may also answer BUSY)."""
    honoured = 0
    for seed in range(8):
        sim = Sim(4, seed, p_fire=1.0, freeze={0: (0.3, 30.0)}, units=6).run()
        check(sim, frozen=True)
        assert any(e[0] == "timeout" for r in (1, 2, 3) for e in sim.ended[r])
        honoured += sim.honoured
    assert honoured > 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), max_flights=st.sampled_from([1, 2, 4]))
def test_a_rank_takes_part_in_at_most_max_flights_exchanges_at_once(seed, max_flights):
    """Every timer fires, long delays (many crossed requests at full ranks): the cap holds (a late answer
    honoured may add one), and everything settles: every request is answered or dropped by its own side."""
    sim = Sim(6, seed, p_fire=1.0, delay=0.3, max_flights=max_flights).run()
    check(sim)
    assert 1 <= sim.most_flights <= max_flights + 1


def test_slow_ranks_do_not_block_fast_ones():
    """One rank 5x slower: the fast ranks never wait (nothing here blocks) and everything settles."""
    sim = Sim(6, 3, speeds=[5.0, 1, 1, 1, 1, 1], units=10).run()
    check(sim)


def test_the_rule_refuses_what_it_cannot_answer():
    rz = PostedRendezvous(1, 5.0)
    with pytest.raises(RuntimeError, match="answers no request"):
        rz.receive(Message(Kind.ACK, 2, 7), 0.0)
    rz.ask(2, 0.0)
    with pytest.raises(RuntimeError, match="outstanding"):
        rz.ask(3, 0.0)
    with pytest.raises(ValueError, match="max_flights"):
        PostedRendezvous(0, 1.0, max_flights=0)
    with pytest.raises(ValueError, match="not a message"):
        rz.receive(Message(Kind.GO, 2, 1), 0.0)


@pytest.mark.parametrize("room", [True, False])
def test_crossed_requests_end_the_higher_ranks_own_whether_it_accepts_or_not(room):
    """Ranks 1 and 2 ask each other. The lower rank's request is the one answered: rank 2 accepts it when it has
    room, else answers BUSY; either way rank 2's own request ends, since rank 1 drops it (no answer ever comes)."""
    low, high = PostedRendezvous(1, 60.0, max_flights=2), PostedRendezvous(2, 60.0, max_flights=2)
    req_low, req_high = low.ask(2, 0.0), high.ask(1, 0.0)
    if not room:  # two exchanges in flight besides (accepted after it asked): no room
        high.flights.update({3: _flight(3), 4: _flight(4)})
    out = high.receive(Message(Kind.REQ, 1, req_low.rid), 0.1)
    assert out.ended == ("superseded", 1) and high.request is None
    assert [m.kind for m in out.send] == ([Kind.ACK] if room else [Kind.BUSY])
    assert low.receive(Message(Kind.REQ, 2, req_high.rid), 0.1).send == []  # dropped
    out = low.receive(Message(out.send[0].kind, 2, req_low.rid), 0.2)
    assert low.request is None and (out.post is not None) == room


def _flight(partner):
    from communities.core.posted import Flight
    return Flight(partner, partner, 1, 0, 0)


def test_a_request_to_a_rank_given_up_on_is_not_accepted_until_its_answer():
    rz = PostedRendezvous(1, 1.0)
    rz.ask(2, 0.0)
    assert rz.tick(5.0).ended == ("timeout", 2)
    out = rz.receive(Message(Kind.REQ, 2, 9), 5.0)
    assert [m.kind for m in out.send] == [Kind.BUSY] and out.post is None  # its old ACK may still commit us
    out = rz.receive(Message(Kind.ACK, 2, 1), 6.0)  # it comes: honoured
    assert out.post is not None and out.post.partner == 2 and 2 in rz.flights
    with pytest.raises(RuntimeError, match="in flight with it"):
        rz.ask(2, 6.0)
    rz.merged(2)
    assert rz.settled


# ---------------------------------------------------------------- the displacement merge


@pytest.mark.parametrize("rule,alpha,flights", [("constant", 0.5, 2), ("constant", 0.3, 3), ("constant", 0.1, 4),
                                                ("swap", 0.5, 1), ("clock", 0.5, 1), ("clock", 0.25, 2)])
def test_overlapping_merges_add_up_to_at_most_one_step(rule, alpha, flights):
    assert flights_for(merge.max_coefficient(rule, alpha)) == flights


def test_overlapping_displacements_within_the_bound_stay_between_the_partners():
    """Two merges at a = 0.5 from the same posted weights land on the partners' mean (no overshoot); four
    would push the rank past them (why the cap)."""
    mine = torch.zeros(3, dtype=torch.float64)
    partners = [torch.ones(3, dtype=torch.float64), 3 * torch.ones(3, dtype=torch.float64)]
    w = mine.clone()
    for p in partners:
        merge.displace_(w, p, mine.clone(), 0.5)
    assert torch.allclose(w, (partners[0] + partners[1]) / 2)
    for p in partners:
        merge.displace_(w, p, mine.clone(), 0.5)
    assert float(w[0]) > max(float(p[0]) for p in partners)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), a=st.floats(0.0, 1.0), drift=st.floats(0.0, 2.0))
def test_displacement_conserves_the_pair_sum_whatever_was_trained_meanwhile(seed, a, drift):
    g = torch.Generator().manual_seed(seed)
    wa, wb = torch.randn(50, generator=g, dtype=torch.float64), torch.randn(50, generator=g, dtype=torch.float64)
    sent_a, sent_b = wa.clone(), wb.clone()  # the copies posted
    wa += drift * torch.randn(50, generator=g, dtype=torch.float64)  # both train on before the halves arrive
    wb += drift * torch.randn(50, generator=g, dtype=torch.float64)
    before = wa + wb
    da = merge.displace_(wa, sent_b.clone(), sent_a.clone(), a)
    db = merge.displace_(wb, sent_a.clone(), sent_b.clone(), a)
    assert torch.allclose(wa + wb, before, atol=1e-12)
    assert da == pytest.approx(db) and da == pytest.approx(float(torch.dist(sent_a, sent_b)))


def test_displacement_without_training_meanwhile_is_the_interpolation():
    g = torch.Generator().manual_seed(0)
    w, theirs = torch.randn(100, generator=g), torch.randn(100, generator=g)
    expected = w.clone()
    merge.interpolate_(expected, theirs, 0.3)
    merge.displace_(w, theirs, w.clone(), 0.3)
    assert torch.allclose(w, expected, atol=1e-6)


def test_lr0_posted_gossip_on_a_ring_of_pairs_converges_to_the_mean():
    """Repeated displacement merges of random pairs with nothing trained: the spread shrinks to the mean."""
    rng = np.random.default_rng(0)
    w = [torch.randn(20, dtype=torch.float64) for _ in range(8)]
    mean0 = torch.stack(w).mean(0)
    for _ in range(300):
        i, j = rng.choice(8, size=2, replace=False)
        si, sj = w[i].clone(), w[j].clone()
        merge.displace_(w[i], sj.clone(), si.clone(), 0.5)
        merge.displace_(w[j], si, sj, 0.5)
    assert torch.allclose(torch.stack(w).mean(0), mean0, atol=1e-12)
    assert max(float(torch.dist(x, mean0)) for x in w) < 1e-6


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize("raw,key", [
    ({"comm": {"exchange": "posted"}}, "comm.exchange='posted' is refused with protocol='virtual_clock'"),
    ({"protocol": "async", "comm": {"exchange": "posted"}, "merge": {"optimizer_state": "average"}},
     "optimizer_state='average'"),
    ({"protocol": "async", "comm": {"exchange": "posted"}, "merge": {"partner_policy": "least_recent"}},
     "least_recent"),
    ({"protocol": "async", "comm": {"exchange": "posted"}, "merge": {"outer": {"enabled": True}}},
     "merge.outer.enabled"),
    ({"protocol": "async", "comm": {"exchange": "posted"}, "examples": {"pass_hard": True, "track": True}},
     "pass_hard"),
])
def test_what_a_posted_exchange_cannot_carry_is_refused_by_name(raw, key):
    with pytest.raises(ConfigError, match=key.replace("(", r"\(")):
        config_mod.from_dict(raw)


def test_a_posted_async_config_is_accepted():
    cfg = config_mod.from_dict({"protocol": "async", "comm": {"exchange": "posted"},
                                "train": {"after_budget": "train"}})
    assert cfg.comm.exchange == "posted"
