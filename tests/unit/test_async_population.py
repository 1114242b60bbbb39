"""protocol async with populations: the pairing of pairs inside a process (merged in memory at the unit's end,
``async_population.local_pairs``) and across processes (the posted rule, ``core/posted.py``), checked together in
a discrete-event simulation of P processes whose replicas train in lockstep; and what a population refuses.

Each replica holds one number (its weights, lr 0): an in-process pair averages at once, a pair across processes
merges by displacement when both halves have arrived, so the population's sum must be conserved exactly, every
exchange across processes must be posted and merged by both sides once, and nothing may wait on anything.
"""
from __future__ import annotations

import heapq
import types
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from communities.core.placement import Placement
from communities.core.posted import PostedRendezvous
from communities.core.rendezvous import Message
from communities.engine.mixing.async_population import local_pairs
from communities.refusals import placement_refusal
from tests.helpers.events import EventQueue


class PopulationSim(EventQueue):
    """P processes of B replicas each; a process trains its replicas' units together (a random duration scaled by
    its speed), then each replica reads its messages, tests its halves and, when its timer fires, draws a partner:
    one of its own process joins the unit's in-memory list, another process's gets a posted request."""

    def __init__(self, processes, per, seed, units=8, p_fire=0.8, delay=0.05, speeds=None, max_flights=2):
        self.n = processes * per
        self.place = Placement(self.n, processes)
        super().__init__(np.random.default_rng(seed), delay)
        self.units, self.p_fire = units, p_fire
        self.speeds = speeds or [1.0] * processes
        self.w = self.rng.normal(size=self.n)  # each replica's weights
        self.rz = [PostedRendezvous(r, 1e9, max_flights) for r in range(self.n)]
        self.sent = {}  # (replica, partner) -> the weights it posted
        self.inbox = [[] for _ in range(self.n)]
        self.arrived = {}  # (dst, src) -> the weights src posted, delivered
        self.committed, self.merged = defaultdict(list), defaultdict(list)
        self.local_merges = 0
        self.unit = [0] * processes
        self.idle = [0.0] * processes  # a process never waits: the time it spent waiting on another process

    def act(self, r, out):
        for m in out.send:
            assert not self.place.same_process(r, m.peer)  # a pair inside a process never posts
            self._deliver(r, m.peer, lambda m=m: self.inbox[m.peer].append(Message(m.kind, r, m.rid, m.unit)))
        if out.post is not None:
            f = out.post
            self.committed[(f.initiator, f.rid)].append(r)
            self.sent[(r, f.partner)] = float(self.w[r])
            value = float(self.w[r])
            self._deliver(r, f.partner, lambda: self.arrived.__setitem__((f.partner, r), value))

    def poll(self, r):
        msgs, self.inbox[r] = self.inbox[r], []
        for m in msgs:
            self.act(r, self.rz[r].receive(m, self.now, 0))
        for peer, f in list(self.rz[r].flights.items()):
            if (r, peer) in self.arrived:
                theirs = self.arrived.pop((r, peer))
                self.w[r] += 0.5 * (theirs - self.sent.pop((r, peer)))  # merge.displace_
                self.rz[r].merged(peer)
                self.merged[(f.initiator, f.rid)].append(r)

    def unit_end(self, p):
        block = self.place.block(p)
        draws = []
        for r in block:
            self.poll(r)
            target = -1
            choices = [j for j in range(self.n) if j != r and j not in self.rz[r].flights]
            if self.rng.random() < self.p_fire and choices:
                j = int(self.rng.choice(choices))
                if self.place.same_process(r, j):
                    target = j
                elif self.rz[r].can_ask:
                    self.act(r, types.SimpleNamespace(send=[self.rz[r].ask(j, self.now, 0)], post=None))
            draws.append((r, target, 0))
        for i, j, _ in local_pairs(draws):  # in memory, at once: both sides are here
            self.w[i] = self.w[j] = 0.5 * (self.w[i] + self.w[j])
            self.local_merges += 1
        self.unit[p] += 1
        if self.unit[p] < self.units:
            self.at(self.now + self.speeds[p] * self.rng.uniform(0.05, 0.15), lambda: self.unit_end(p))
        else:
            self.at(self.now + 0.01, lambda: self.serve(p))

    def serve(self, p):
        for r in self.place.block(p):
            self.poll(r)
        if not self.quiet():
            self.at(self.now + 0.01, lambda: self.serve(p))

    def quiet(self):
        return (min(self.unit) >= self.units and not self.in_transit and not any(self.inbox)
                and not self.arrived and all(rz.settled for rz in self.rz))

    def run(self, horizon=10_000.0):
        for p in range(self.place.processes):
            self.at(0.0, lambda p=p: self.unit_end(p))
        while self.events:
            self.now, _, fn = heapq.heappop(self.events)
            assert self.now <= horizon, "the simulation did not settle: a deadlock or a livelock"
            fn()
        return self


def check(sim: PopulationSim, w0: np.ndarray):
    assert sim.quiet()
    for key, ranks in sim.committed.items():
        initiator, _ = key
        assert len(ranks) == 2 and initiator in ranks, (key, ranks)  # both sides committed, once each
        assert sorted(sim.merged[key]) == sorted(ranks), key  # ... and both merged it, once each
        assert not sim.place.same_process(*ranks)
    assert set(sim.merged) == set(sim.committed)
    assert sim.w.sum() == pytest.approx(w0.sum(), abs=1e-9)  # every merge conserved the population's sum


@settings(max_examples=20, deadline=None)
@given(processes=st.integers(1, 4), per=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_pairs_inside_and_across_processes_merge_once_and_conserve_the_sum(processes, per, seed):
    sim = PopulationSim(processes, per, seed)
    w0 = sim.w.copy()
    check(sim.run(), w0)


def test_both_kinds_of_pair_happen_and_a_slow_process_holds_nobody_back():
    """One process 4x slower: every process finishes its units (nobody waits on another's boundary), both kinds
    of pair happen, and the sum is conserved."""
    sim = PopulationSim(3, 4, 7, units=12, speeds=[4.0, 1.0, 1.0])
    w0 = sim.w.copy()
    check(sim.run(), w0)
    assert sim.local_merges > 0 and sim.committed


def test_gossip_inside_and_across_processes_reaches_the_mean():
    """Every timer fires, many units: lr 0 gossip drives every replica to the initial mean."""
    sim = PopulationSim(2, 4, 3, units=40, p_fire=1.0)
    w0 = sim.w.copy()
    check(sim.run(), w0)
    assert np.abs(sim.w - w0.mean()).max() < 1e-3


def test_local_pairs_lists_the_process_pairs_in_initiator_order():
    draws = [(5, 4, 0), (4, -1, 0), (6, 4, 1), (7, 5, 0)]
    assert local_pairs(draws) == [(5, 4, 0), (6, 4, 1), (7, 5, 0)]
    assert local_pairs([(0, -1, 0)]) == []


# ---------------------------------------------------------------- what a population refuses


def _cfg(**kw):
    merge = types.SimpleNamespace(optimizer_state="keep", partner_policy="law", outer=types.SimpleNamespace(
        enabled=False))
    base = dict(world_size=8, protocol="async", device="cpu", merge=merge,
                examples=types.SimpleNamespace(pass_hard=False),
                comm=types.SimpleNamespace(fault_tolerance="abort"), train=types.SimpleNamespace(group_size=1),
                faults=types.SimpleNamespace(kill={}, speed={}, stall_rank=None))
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_groups_under_async_must_lie_inside_a_process():
    groups = types.SimpleNamespace(group_size=2)
    assert placement_refusal(_cfg(train=groups), 2) is None  # 4 replicas a process: 2 groups in each
    for processes in (8, 4):  # a replica per process; a group of 2 over blocks of 2 is fine, of 4 over 2 is not
        why = placement_refusal(_cfg(train=types.SimpleNamespace(group_size=4 if processes == 4 else 2)), processes)
        assert why is not None and "train.group_size" in why and "protocol=async" in why and "inside one process" in why


def test_async_populations_run_and_slow_or_stalled_processes_are_faults_of_a_process():
    assert placement_refusal(_cfg(), 2) is None
    slow = types.SimpleNamespace(kill={}, speed={0: 3.0}, stall_rank=5)
    assert placement_refusal(_cfg(faults=slow), 2) is None
    assert placement_refusal(_cfg(faults=slow, protocol="virtual_clock"), 2) is None


@pytest.mark.parametrize("change, key", [
    (dict(merge=types.SimpleNamespace(optimizer_state="average", partner_policy="law",
                                      outer=types.SimpleNamespace(enabled=False))), "merge.optimizer_state='average'"),
    (dict(merge=types.SimpleNamespace(optimizer_state="keep", partner_policy="least_recent",
                                      outer=types.SimpleNamespace(enabled=False))), "merge.partner_policy"),
    (dict(merge=types.SimpleNamespace(optimizer_state="keep", partner_policy="law",
                                      outer=types.SimpleNamespace(enabled=True))), "merge.outer.enabled"),
    (dict(examples=types.SimpleNamespace(pass_hard=True)), "examples.pass_hard"),
])
def test_what_a_pair_across_processes_cannot_carry_is_refused_by_key(change, key):
    why = placement_refusal(_cfg(**change), 2)
    assert why is not None and key in why and "protocol='async'" in why and "posted exchange" in why
    assert placement_refusal(_cfg(**change), 8) is None  # one replica per process: the blocking exchange
