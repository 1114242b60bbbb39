"""Data-parallel groups under ``protocol: async`` (a population whose groups each lie inside one process).

A group is one model: its members average their gradients at every step, so they stay equal. What the group
does between units depends on the messages it receives, which only its lead receives (``runtime/group_async``),
so the lead runs the asynchronous mixer for the group (``GroupLeadMixer``: requests, posted halves, merges in
memory with the process's other groups) and its members follow (``GroupFollowerMixer``): at the end of every
unit, after the lead's mixing, one small signal inside the group says what changed (the weights, the optimizer
state cleared, pbt's values), then only what changed is copied from the lead, so every member holds the lead's
state before its next step. The members take part in what the process decides as one (a stop, training on,
the barriers of the end), and exchange nothing themselves. Serving happens at unit boundaries only: a merge in
the middle of a unit would leave the members' steps on other weights than the lead's.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np

from ...errors import StopReason
from ...results import Event, MergeRow
from .async_population import PopulationMixer
from .mixer import Mixer


def sync_group(replica, signal: Optional[np.ndarray]) -> None:
    """The lead's state to its members (every member of the group calls it at the same point): ``signal`` (the
    lead's; None on a member) says whether the weights changed, the optimizer state was cleared, pbt's values
    changed; then only those travel."""
    group = replica.group
    intra, lead = group.intra, group.lead
    flags = intra.bcast_array(signal, (3,), np.float64, lead)
    if flags[0]:
        intra.bcast_(replica.flat, lead)
    if flags[1] and signal is None:
        replica.opt.state.clear()
    hyper = replica.hyper
    if flags[2] and hyper is not None:
        values = intra.bcast_array(hyper.values if signal is not None else None, hyper.values.shape, np.float64,
                                   lead)
        if signal is None:
            hyper.values = np.array(values, dtype=np.float64)
            hyper.apply(replica.opt)


class GroupLeadMixer(PopulationMixer):
    """The asynchronous mixer of a group, run by its lead; its members follow at each unit's end."""

    def __init__(self, cfg, world, timer, **parts):
        super().__init__(cfg, world, timer, **parts)
        self._mark = 0  # merge events up to here were told to the members

    @property
    def between_batches(self) -> Optional[Callable[[], None]]:
        return None  # (serving between batches would move the lead off its members mid-unit)

    def _after_step(self, restored: bool = False) -> None:
        """``restored``: the lead's weights changed outside a merge row (the settling after a loss)."""
        rows = self.events_since(self._mark)
        self._mark += len(rows)
        mc = self.cfg.merge
        moved = restored or any(r.event in (Event.MERGE, Event.RESET) and r.a for r in rows)
        cleared = any(r.event == Event.RESET or (r.event == Event.MERGE and mc.optimizer_state == "reset")
                      for r in rows)
        adopted = any(r.event == Event.ADOPT for r in rows)
        sync_group(self.replica, np.array([moved, cleared, adopted], dtype=np.float64))

    def late_events(self) -> List[MergeRow]:
        self._mark = 0
        return super().late_events()

    def after_loss(self) -> None:
        """After the settling (which may have restored or undone a merge on the lead alone): the members take the
        lead's state again, so the group stays one model."""
        super().after_loss()
        self._after_step(restored=True)

    def drain(self) -> None:
        super().drain()
        self._after_step()  # what the lead merged while the others finished


class GroupFollowerMixer(Mixer):
    """A group member under async: it follows its lead (``sync_group``) and joins what the process decides."""

    def __init__(self, cfg, world, timer, *, replica, agreement, **parts):
        super().__init__(cfg, world, timer, replica=replica, agreement=agreement)
        self.base = world.base  # the replica's own world: what the process shares, its barriers
        self.snapshots = parts.get("snapshots")  # (as many as the lead takes: the curve averages the leads')
        self.t = 0
        self._budgets_done = None
        self._barrier = None

    def _step(self, t: int) -> None:
        self.t = t
        self.base.together(("async pairs", t), (-1, -1, 0), lambda draws: [[]] * len(draws))
        sync_group(self.replica, None)
        if self.snapshots is not None:
            self.snapshots.maybe(self.timer.elapsed(), self.replica.flat, t)

    def stop_reason(self, t: int, at_round: bool, signal: bool) -> Optional[StopReason]:
        flags, budget = self.base.flags, self.cfg.train.wall_budget
        if signal:
            flags.add("stop")

        def decide() -> Optional[StopReason]:
            if "stop" in flags:
                return StopReason.SIGNAL
            return StopReason.BUDGET if budget is not None and self.timer.elapsed() >= budget else None
        return self.base.shared(("async stop", t), decide)

    def train_on(self) -> bool:
        if self.cfg.train.after_budget != "train":
            return False
        if self._budgets_done is None:
            self._budgets_done = self.base.ibarrier()
        barrier = self._budgets_done
        return self.base.shared(("train on", self.t), lambda: not barrier.Test())

    def make_record(self, flat):
        from ..state.async_survival import PostedRecord

        # a member exchanges nothing (its row says so), but its row has the shape of the rows of the process's other
        # replicas, whose mixers post exchanges (PostedRecord): the settling gathers them as one block
        return PostedRecord(flat, lambda: [])

    def after_loss(self) -> None:
        """The barriers posted so far, posted again on the new communicator, in their order (as its lead does)."""
        if self._budgets_done is not None:
            self._budgets_done = self.base.ibarrier()
        if self._barrier is not None:
            self._barrier = self.base.ibarrier()
        sync_group(self.replica, None)  # (the lead's state after the settling: GroupLeadMixer.after_loss)

    def drain(self) -> None:
        """The end's barriers and count exchange, as the lead posts them; then the lead's final state."""
        if self.cfg.train.after_budget == "train" and self._budgets_done is None:
            self._budgets_done = self.base.ibarrier()
        if self._barrier is None:
            self._barrier = self.base.ibarrier()
        pause = 50e-6
        with self.timer("idle"):
            while not self._barrier.Test():
                self.base.pause(pause)
                pause = min(2 * pause, 2e-3)
            if self._budgets_done is not None:
                self._budgets_done.Wait()
        self.base.alltoall_counts(np.zeros(self.base.size, dtype=np.int64))
        sync_group(self.replica, None)
