"""The asynchronous mixer (``protocol: async``): every rank at its own pace, merges served between batches.

A rank trains its units without waiting for anyone. When its merge timer fires
(K ~ 1 + Poisson(lambda - 1) of its *own* units) it draws a partner from its own
current law and sends a small request; the partner serves it at its next batch
boundary ("W2 pauses"), and the pair does the same symmetric exchange and merge
rule as under the virtual clock, so an exchange still conserves the mean. Who
may serve whom is ``core/rendezvous.py``'s rule, which cannot deadlock. The
exchange also carries signatures: each rank keeps a versioned table of everyone's
(``core/gossip_table.py``) and passes on what it knows that its partner does not.

Polling uses ``Iprobe`` between batches and in the waits, so the default MPI
thread level suffices. A done rank serves until every rank is done (a polled
``Ibarrier``), or under ``train.after_budget: train`` first trains on, unit by
unit, until every rank has finished its budget (another polled ``Ibarrier``);
then the control messages still in flight are drained (their counts are
exchanged with one ``Alltoall``), and the run ends as under the virtual clock.
"""
from __future__ import annotations

import logging
import math
import time
from contextlib import nullcontext
from typing import Any, Callable, Optional, Tuple

import numpy as np

from ...core import partners, protocol
from ...core.gossip_table import GossipTable
from ...core.protocol import RunningDigest
from ...core.rendezvous import SIGNATURES_ONLY, Exchange, Kind, Message, Outcome, Rendezvous
from ...errors import StopReason
from ...results import Event, MergeRow
from ...runtime.comm import Tag
from ...runtime.view import WorldView
from ..replica.replica import Replica
from ..timer import Timer
from .gossip import Gossip
from .mixer import Mixer

log = logging.getLogger(__name__)

RETRIES = 2  # after a BUSY answer, draw another partner this many times before giving the merge up
CONTROL_WIDTH = 4  # int64 per control message: kind, request id, the sender's unit, flags
POLL_MIN_S, POLL_MAX_S = 50e-6, 2e-3  # back-off between polls while waiting (no busy loop stealing a core)


class AsyncMixer(Mixer):
    """The asynchronous mixer of one rank."""

    def __init__(self, cfg, world: WorldView, timer: Timer, *, replica: Replica, agreement: RunningDigest,
                 table: GossipTable, snapshots=None):
        super().__init__(cfg, world, timer, replica=replica, agreement=agreement)
        self.table, self.snapshots = table, snapshots
        timeout = cfg.comm.timeout if cfg.comm.timeout > 0 else math.inf
        self.rz = Rendezvous(self.rank, timeout)
        self.t = 0  # this rank's unit
        self.next_fire = protocol.merge_interval(cfg.seed, 0, self.rank, self._lam())
        self.sent_to = np.zeros(self.n, dtype=np.int64)  # control messages posted to each rank
        self.got_from = np.zeros(self.n, dtype=np.int64)  # ... and read from each
        self.stop_received = False
        self._stop_sent = False
        self._own_end: Optional[Tuple[str, int]] = None  # how this rank's latest request ended
        self._barrier: Optional[Any] = None  # the Ibarrier of the done phase, once posted
        self._budgets_done: Optional[Any] = None  # train.after_budget train: the Ibarrier "every budget is done"
        self.width = CONTROL_WIDTH  # int64 per control message
        self.cut: Any = None  # comm.fault_tolerance shrink: the last exchange's record (async_survival.py)

    # ------------------------------------------------------------------ what the loop asks

    @property
    def between_batches(self) -> Optional[Callable[[], None]]:
        """Serve requests after every batch."""
        return self.serve

    def _step(self, t: int) -> None:
        """After unit t: serve what waits, then start this rank's merge if its timer fires."""
        self.t = t
        self.serve()
        if t >= self.next_fire:
            self.next_fire = t + protocol.merge_interval(self.cfg.seed, t, self.rank, self._lam())
            self._initiate(t)

    def _lam(self) -> float:
        """merge.lam: this rank's own under pbt (async: no other rank draws this rank's timer)."""
        hyper = self.replica.hyper
        return self.cfg.merge.lam if hyper is None else hyper.get("merge.lam", self.cfg.merge.lam)

    def stop_reason(self, t: int, at_round: bool, signal: bool) -> Optional[StopReason]:
        """A stop asked here (broadcast to every rank, once) or heard from another rank; or the wall budget."""
        if signal and not self._stop_sent:
            self._send_stop(t)
        if signal or self.stop_received:
            return StopReason.SIGNAL
        budget = self.cfg.train.wall_budget
        return StopReason.BUDGET if budget is not None and self.timer.elapsed() >= budget else None

    def _send_stop(self, t: int) -> None:
        for r in np.flatnonzero(self.world.alive):
            if r != self.rank:
                self._post(Message(Kind.STOP, int(r), 0, t))
        self._stop_sent = True

    def after_loss(self) -> None:
        """comm.fault_tolerance shrink: every message of the revoked communicator is void, so the pairing starts
        over (requests and offers dropped, the drain's counts reset), and what was posted is posted again on the
        new one: the Ibarriers, in the order they were, and a stop (engine/state/async_survival.py, rule 3)."""
        rid = self.rz._next_rid  # request ids stay unique over the run (they name exchanges in the settling)
        self.rz = Rendezvous(self.rank, self.rz.timeout)
        self.rz._next_rid = rid
        self.sent_to[:] = 0
        self.got_from[:] = 0
        if self._budgets_done is not None:
            self._budgets_done = self.world.ibarrier()
        if self._barrier is not None:
            self._barrier = self.world.ibarrier()
        if self._stop_sent:
            self._send_stop(self.t)

    def train_on(self) -> bool:
        """train.after_budget train: True while some rank has not finished its budget, so this one, done, trains
        another unit (merging and serving as before). Asked after each unit past the budget; the first call posts
        an Ibarrier that completes once every rank has posted it at its own budget's end."""
        if self.cfg.train.after_budget != "train":
            return False
        if self._budgets_done is None:
            self._budgets_done = self.world.ibarrier()
        return not self._budgets_done.Test()

    def drain(self) -> None:
        """Serve until every rank is done (a polled Ibarrier), then read what is still addressed to this rank.

        Under train.after_budget train a rank stopped early (a signal, the wall budget) posts the budgets'
        Ibarrier here, so that both complete; that one is posted first on every rank, and so completes first.
        A rank posts the done Ibarrier only once it initiates no more merges, so once it completes nobody will
        send a GO (``_poll_once`` drops a held offer then).
        """
        if self.cfg.train.after_budget == "train" and self._budgets_done is None:
            self._budgets_done = self.world.ibarrier()
        if self._barrier is None:
            self._barrier = self.world.ibarrier()
        barrier = self._barrier  # (posted again on the new communicator after a loss: after_loss)
        self._wait(lambda: barrier.Test(), "Ibarrier: every rank done")
        if self._budgets_done is not None:
            self._budgets_done.Wait()  # complete: every rank posted it before the done Ibarrier
        expected = self.world.alltoall_counts(self.sent_to)
        for src in np.flatnonzero(self.got_from < expected):
            for _ in range(int(expected[src] - self.got_from[src])):
                self._stale(int(src), self.world.recv_ints(int(src), Tag.CONTROL, self.width))
        self.got_from[:] = expected
        self._finish_in_flight()
        self.world.complete_posts()

    def _stale(self, src: int, values: np.ndarray) -> None:
        """A control message read after every rank is done: its exchange is over (blocking exchanges)."""

    def _finish_in_flight(self) -> None:
        """Complete what is still posted once every control message is read (nothing, for blocking exchanges)."""

    # ------------------------------------------------------------------ serving

    def serve(self) -> None:
        """Read every control message waiting; then, holding an offer, wait for its GO or NO."""
        self._poll_once()
        if self.rz.offer is not None and self.rz.request is None:
            self._wait(lambda: self.rz.offer is None, "GO or NO after an ACK")

    def _poll_once(self) -> None:
        while True:
            got = self.world.poll_ints(Tag.CONTROL, self.width)
            if got is None:
                break
            src, a = got
            self.got_from[src] += 1
            kind = Kind(int(a[0]))
            if kind == Kind.STOP:
                self.stop_received = True
                self.world.flags.add("stop")  # (a population: heard by the process, every replica of it stops)
                continue
            self._received(Message(kind, src, int(a[1]), int(a[2]), int(a[3])), a[CONTROL_WIDTH:])
        self._after_poll()
        if self.snapshots is not None:
            self.snapshots.maybe(self.timer.elapsed(), self.replica.flat, self.t)

    def _received(self, msg: Message, extra: np.ndarray) -> None:
        """One pairing message (``extra``: what follows its four numbers; nothing here)."""
        self._act(self.rz.receive(msg, time.monotonic(), self.t))

    def _after_poll(self) -> None:
        """Timeouts; and once every rank is done, an offer held is dropped: nobody will send its GO."""
        self._act(self.rz.tick(time.monotonic()))
        if self._barrier is not None and self.rz.offer is not None and self._barrier.Test():
            self.rz.offer = None

    def _wait(self, done, what: str) -> None:
        """Poll (serving) until ``done()``; the time counts as idle."""
        pause = POLL_MIN_S
        with self.timer("idle"):
            while not done():
                self._poll_once()
                if done():
                    break
                self.world.pause(pause)  # (a population: the process's other replicas run meanwhile)
                pause = min(2 * pause, POLL_MAX_S)

    def _act(self, out: Outcome) -> None:
        for m in out.send:
            self._post(m)
        if out.ended is not None:
            self._own_end = out.ended
        if out.exchange is not None:
            self._run_exchange(out.exchange)

    def _post(self, m: Message) -> None:
        self.world.post_ints(self._control(m), m.peer, Tag.CONTROL)
        self.sent_to[m.peer] += 1

    def _control(self, m: Message) -> np.ndarray:
        """A control message on the wire: kind, request id, the sender's unit, flags."""
        return np.array([int(m.kind), m.rid, m.unit, m.flags], dtype=np.int64)

    # ------------------------------------------------------------------ requesting

    def _initiate(self, t: int) -> None:
        """Ask partners drawn from this rank's law until one exchange happens, a BUSY retry limit, or a timeout."""
        tried = np.zeros(self.n, dtype=bool)
        for _ in range(1 + RETRIES):
            target, flags = self._draw(t, tried)
            if target is None:
                return
            self._own_end = None
            self._post(self.rz.ask(target, time.monotonic(), t, flags))
            self._wait(lambda: self.rz.idle, f"an answer from rank {target}")
            reason, partner = self._own_end or ("exchanged", target)
            if reason == "busy":
                tried[partner] = True
                self.record(MergeRow.declined(t, self.rank, partner, Event.BUSY))
                continue
            if reason == "timeout":
                self.record(MergeRow.declined(t, self.rank, partner, Event.TIMEOUT))
                log.info(f"communities: rank {self.rank} at t={t}: rank {partner} did not answer within "
                         f"comm.timeout={self.cfg.comm.timeout:g}s; skipped")
            return

    def _draw(self, t: int, tried: np.ndarray) -> Tuple[Optional[int], int]:
        """This rank's partner at t (not a tried or unavailable one: outliers, lost ranks), and the request's flags."""
        excluded = self.unavailable | tried
        strategy = self.strategy
        assert isinstance(strategy, Gossip)  # (protocol async runs the pairwise strategies: config.py)
        plan = strategy.exchanges(t, np.array([self.rank]), excluded)
        if plan:
            return plan[0][1], 0
        if self.strategy.law(t) is not None:
            return None, 0  # nobody eligible
        # the community law needs a complete signature table: until then, spread signatures with anyone
        p = np.where(excluded, 0.0, partners.uniform_probabilities(self.n, self.rank))
        if not p.sum() > 0:
            return None, 0
        j = partners.draw(p / p.sum(), protocol.rng(self.cfg.seed, protocol.Purpose.PARTNER, t, self.rank))
        return j, SIGNATURES_ONLY

    # ------------------------------------------------------------------ the exchange

    def _run_exchange(self, ex: Exchange) -> None:
        if not ex.flags & SIGNATURES_ONLY:
            with self.cut.around(ex.partner, ex.initiator, ex.rid) if self.cut is not None else nullcontext():
                self.exchange(self.t, ex.partner, ex.initiator, rule_t=min(self.t, ex.partner_unit))
        self._swap_signatures(ex.partner)
        if ex.initiator == self.rank:
            self._own_end = ("exchanged", ex.partner)

    def _swap_signatures(self, partner: int) -> None:
        """Versions first; then each side sends the rows it holds newer than the other's (bounded)."""
        with self.timer("exchange"):
            theirs = self.world.sendrecv_array(self.table.versions, partner, tag=Tag.SIG_VERSIONS)
            cap = self.cfg.signature.gossip_rows
            packet = self.table.pack(self.table.newer_than(theirs, cap))
            incoming = self.world.sendrecv_vector(packet, partner, tag=Tag.SIGNATURES)
            try:
                self.table.merge(incoming)
            except ValueError as exc:
                raise RuntimeError(f"rank {self.rank}: bad signature packet from rank {partner}: {exc}") from exc

    def make_record(self, flat):
        """What this mixer's exchanges leave for the settling after a loss (``async_survival``)."""
        from ..state.async_survival import ExchangeRecord

        return ExchangeRecord(flat)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {**super().state_dict(), "next_fire": self.next_fire}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.next_fire = int(state["next_fire"])
