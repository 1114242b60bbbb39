"""The asynchronous mixer of a replica in a population (``protocol: async``, several replicas per process).

Processes are asynchronous to each other; the replicas of one process train together (one stacked model under
``train.vectorize``, else one after another), so they reach every unit boundary together. There each replica
serves what waits for it, and a replica whose timer fires draws a partner from its own law:

- **a partner in the same process** merges in memory at once: the process's replicas bring their draws to one
  call (``world.together``), which lists the unit's pairs in initiator order (``local_pairs``); each replica
  walks the list and does the same symmetric exchange as under the virtual clock, the two sides meeting in
  memory (the same total order for all, so no wait forms a cycle). Everything an exchange carries travels:
  optimizer moments, pbt's values, the signature rows the partner lacks;
- **a partner in another process** is a posted exchange (``async_posted.py``, ``core/posted.py``): a request,
  then each side posts its half and trains on; the process never waits for another process's unit boundary.

Decisions that would break the process's lockstep are the process's: a stop (heard by any of its replicas, or
its wall budget), training on past the budget, and stopping on a settled view (all its replicas' views) are
decided once per unit for all its replicas.
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np

from ...core import protocol
from ...core.rendezvous import Exchange, Kind, Message
from ...errors import StopReason
from ..state.async_survival import PostedRecord
from .async_mixer import RETRIES
from .async_posted import PostedMixer

Draw = Tuple[int, int, int]  # (replica, its partner in the process or -1, the request's flags)


def local_pairs(draws: List[Draw]) -> List[Draw]:
    """The unit's exchanges inside one process, in initiator order: (initiator, partner, flags) of every replica
    that drew a partner of the same process. A replica may be in several; each walks them in this order."""
    return [(i, j, f) for i, j, f in sorted(draws) if j >= 0]


class PopulationMixer(PostedMixer):
    """The asynchronous mixer of one replica of a population."""

    def __init__(self, cfg, world, timer, **parts):
        super().__init__(cfg, world, timer, **parts)
        self.local = np.zeros(self.n, dtype=bool)
        self.local[world.process_block] = True  # the replicas of this process

    # ------------------------------------------------------------------ the unit's step

    def _step(self, t: int) -> None:
        """After unit t: serve; a firing timer asks a partner in another process (posted) or pairs in memory."""
        self.t = t
        self.serve()
        self._share_rows()
        target, flags = None, 0
        if t >= self.next_fire:
            self.next_fire = t + protocol.merge_interval(self.cfg.seed, t, self.rank, self._lam())
            busy = np.zeros(self.n, dtype=bool)
            busy[list(self.posted.flights)] = True  # (a pair has at most one exchange in flight)
            target, flags = self._draw(t, busy)
        local = target is not None and bool(self.local[target])
        if target is not None and not local:
            if self.posted.can_ask and not self._draining:
                self._tried[:] = False
                self._retries = RETRIES
                self._post(self.posted.ask(target, time.monotonic(), t, flags))
            else:
                self.next_fire = t + 1  # no room for another exchange in flight: ask again next unit
        draw = (self.rank, int(target) if target is not None and local else -1, int(flags))
        plan = self.world.together(("async pairs", t), draw, lambda draws: [local_pairs(draws)] * len(draws))
        for i, j, f in plan:
            if self.rank in (i, j):
                partner = j if i == self.rank else i
                self._run_exchange(Exchange(partner, i, -(t + 1), partner_unit=t, flags=f))
        self._after_step()

    def _after_step(self) -> None:
        """After the unit's mixing (a group's lead: its members take what it merged, ``async_groups.py``)."""

    def _share_rows(self) -> None:
        """The process's replicas see each other's signature tables at once (they share its memory): each takes
        every row another one holds newer (its own, and what its exchanges brought), so what one replica of the
        process learned from another process, all of them know; gossip spreads the rows across processes."""
        tables = self.world.shared(("gossip tables",), dict)
        tables[self.rank] = self.table
        mine = self.table
        for q, table in tables.items():
            if q != self.rank:
                newer = table.versions > mine.versions
                newer[self.rank] = False  # (its own row is its own: after a loss it may sign an earlier unit again)
                if newer.any():
                    mine.rows[newer] = table.rows[newer]
                    mine.versions[newer] = table.versions[newer]

    def _ask(self, t: int) -> None:
        """A retry after BUSY: partners in other processes only (a pair inside the process merges at the unit's
        end)."""
        busy = self._tried | self.local
        busy[list(self.posted.flights)] = True
        target, flags = self._draw(t, busy)
        if target is not None:
            self._post(self.posted.ask(target, time.monotonic(), t, flags))

    # ------------------------------------------------------------------ what the process decides as one

    def stop_reason(self, t: int, at_round: bool, signal: bool) -> Optional[StopReason]:
        """A stop asked here or heard by any replica of the process, or the wall budget: once for all of them."""
        if signal:
            self.world.flags.add("stop")
            if not self._stop_sent:
                self._send_stop(t)
        budget = self.cfg.train.wall_budget

        def decide() -> Optional[StopReason]:
            if "stop" in self.world.flags:
                return StopReason.SIGNAL
            return StopReason.BUDGET if budget is not None and self.timer.elapsed() >= budget else None
        return self.world.shared(("async stop", t), decide)

    def _send_stop(self, t: int) -> None:
        """One stop to each other process (its first replica alive hears it for all), once per process."""
        self._stop_sent = True

        def send() -> bool:
            for head in self.world.process_heads():  # type: ignore[attr-defined]
                self._post(Message(Kind.STOP, int(head), 0, t))
            return True
        self.world.shared(("stop sent",), send)  # (after a loss: again, once, on the new communicator)

    def train_on(self) -> bool:
        if self.cfg.train.after_budget != "train":
            return False
        if self._budgets_done is None:
            self._budgets_done = self.world.ibarrier()
        barrier = self._budgets_done
        return self.world.shared(("train on", self.t), lambda: not barrier.Test())

    # ------------------------------------------------------------------ a lost process

    def make_record(self, flat):
        return PostedRecord(flat, lambda: [(h.flight.partner, h.flight.initiator, h.flight.rid)
                                           for h in self.halves.values()])

    def after_loss(self) -> None:
        """Every half in flight is void (the settling undid its merge where one side merged); the posted pairing
        starts over like the blocking one."""
        for half in self.halves.values():
            for req in half.requests:
                req.Free()
            if half.sent is not None and half.recv is not None:
                self._spare += [half.sent, half.recv]
        self.halves = {}
        rid = self.posted._next_rid
        self.posted = type(self.posted)(self.rank, self.posted.timeout, max_flights=self.posted.max_flights)
        self.posted._next_rid = rid
        super().after_loss()
