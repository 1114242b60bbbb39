"""Surviving a lost rank under ``protocol: async`` (``comm.fault_tolerance: shrink``): no rollback, stated rules.

The ranks of an async run share no point in time they could roll back to, so the survivors go on from where
each one is. The first survivor to touch the dead rank revokes the communicator, every other survivor's next
MPI call (a poll between batches included) fails, and each survivor, wherever it was:

1. **shrinks** the communicator with the others and agrees on who is left (``World.recover``);
2. **settles the exchange it was in**. An exchange cut by the failure is void on this side: the weights are
   restored from the copy taken before it (``ExchangeRecord``), so no half-received buffer is merged. The
   survivors then compare their last exchanges (one Allgather on the new communicator): a pair of survivors
   whose exchange completed on one side only (the revoke reached the other side first) is made void on the
   side that merged, by subtracting the merge's displacement (``ExchangeRecord``: the last few are kept, as
   that side may have gone on to another exchange). So with nothing trained (lr 0) the survivors' mean is
   conserved through any loss.
3. **starts the pairing over**: every control message of the revoked communicator is void, so every survivor
   drops its own request, an offer it holds and every other rank's pending request (a lost rank's among
   them), resets the message counts the drain balances, re-posts the ``Ibarrier`` s it had posted (in the
   order it posted them) and re-sends a stop it had sent;
4. **leaves the lost ranks out**: of the partner draws (``Mixer.unavailable``) and of its gossip signature
   table's clustering, where a lost rank keeps its last row known (rows that only the lost rank held were
   never spread and are not needed: their owners send them again);
5. goes on from the **last unit it logged** (a unit cut by the failure is trained again from its start).

The writer's loss is handled as under the virtual clock (``survival.Survival._new_writer``); uncommitted
checkpoint directories are discarded by the writer, and rows a final gather had already delivered before a
loss are written once (``RunLog`` skips what it already wrote).
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from typing import Callable, Iterator, List, Tuple

import numpy as np
import torch

from ...core.posted import MAX_FLIGHTS
from ...manifest import COMPLETE
from ...runtime.comm import RankLost
from .survival import Survival

log = logging.getLogger(__name__)

NO_EXCHANGE = (-1, -1, -1, 0)  # partner, initiator, request id, merged


class ExchangeRecord:
    """This rank's exchanges as the settling after a loss needs them: the last one (with whom, which, whether it
    merged here), and the displacements of the last few that merged here.

    Several are kept because a rank may complete an exchange (its partner's half arrived), start the next and
    only then meet the revoke, while the revoke reached its partner before the same exchange's last bytes did.
    Subtracting such a merge's displacement later still restores the survivors' sum exactly: every merge since
    conserved its own pair's sum. The history holds at most ``HISTORY_BYTES`` of displacements (at least one).
    """

    HISTORY_BYTES = 256 << 20

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self.last = NO_EXCHANGE
        self.keep = max(1, min(8, self.HISTORY_BYTES // max(flat.numel() * flat.element_size(), 1)))
        self.merged: "OrderedDict[Tuple[int, int, int], torch.Tensor]" = OrderedDict()  # (partner, initiator, rid)

    @contextlib.contextmanager
    def around(self, partner: int, initiator: int, rid: int) -> Iterator[None]:
        """An exchange: cut by a loss, the weights are restored; completed, its displacement is kept."""
        before = self.flat.detach().clone()
        self.last = (partner, initiator, rid, 0)
        try:
            yield
        except RankLost:
            self.flat.copy_(before)  # no half-received (half-merged, when chunked) buffer stays
            raise
        self.posted((partner, initiator, rid), self.flat.detach() - before)
        self.last = (partner, initiator, rid, 1)

    def posted(self, key: Tuple[int, int, int], displacement: torch.Tensor) -> None:
        """A merge done here (a blocking exchange's, or a posted one's when both halves arrived): kept to undo."""
        self.merged[key] = displacement
        while len(self.merged) > self.keep:
            self.merged.popitem(last=False)

    def row(self) -> np.ndarray:
        return np.asarray(self.last, dtype=np.float64)

    def settle(self, rows: np.ndarray, rank: int, alive: np.ndarray) -> List[int]:
        """After the shrink, with every survivor's ``row`` (logical rank -> its last exchange): undo each merge
        of this rank whose surviving partner's side of it was cut. Returns those partners."""
        undone = []
        for p in np.flatnonzero(alive):
            partner, initiator, rid, merged = (int(x) for x in rows[p])
            if p == rank or partner != rank or merged:
                continue
            if self.undo(int(p), initiator, rid):
                undone.append(int(p))
        return undone

    def undo(self, partner: int, initiator: int, rid: int) -> bool:
        """Take back this rank's merge of exchange (initiator, rid) with ``partner``, if it merged one."""
        displacement = self.merged.pop((partner, initiator, rid), None)
        if displacement is None:
            return False
        self.flat.sub_(displacement)
        return True


class PostedRecord(ExchangeRecord):
    """``ExchangeRecord`` for a mixer with posted exchanges too (a population's, between processes): its row also
    names the exchanges this side committed to and has not merged (``pending``: (partner, initiator, rid)).

    After a loss each such exchange is void: the survivors drop their halves in flight, and a partner that did
    merge it (this side's half had reached it) undoes its displacement when it reads this row."""

    FLIGHTS = MAX_FLIGHTS + 1  # (a late answer honoured may add one to the cap)

    def __init__(self, flat: torch.Tensor, pending: Callable[[], List[Tuple[int, int, int]]]):
        super().__init__(flat)
        self.pending = pending

    def row(self) -> np.ndarray:
        out = np.full(4 + 3 * self.FLIGHTS, -1.0)
        out[:4] = self.last
        for k, flight in enumerate(self.pending()[: self.FLIGHTS]):
            out[4 + 3 * k: 7 + 3 * k] = flight
        return out

    def settle(self, rows: np.ndarray, rank: int, alive: np.ndarray) -> List[int]:
        undone = super().settle(rows[:, :4], rank, alive)
        for p in np.flatnonzero(alive):
            if p == rank:
                continue
            for partner, initiator, rid in rows[p, 4:].reshape(-1, 3).astype(np.int64).tolist():
                if partner != rank:
                    continue
                if self.undo(int(p), initiator, rid):
                    undone.append(int(p))
        return undone


class AsyncSurvival(Survival):
    """``Survival`` for ``protocol: async``: the survivors settle and go on; nothing is rolled back."""

    def __init__(self, world, parts, *, replica, lost_shard: str, rewind, log_lost, take_over, mixer, logged_t,
                 run_dir, drop_rows: Callable[[int], None] = lambda t: None,
                 on_shrink: Callable[[str], None] = lambda stage: None, view=None):
        super().__init__(world, parts, replica=replica, lost_shard=lost_shard, rewind=rewind, log_lost=log_lost,
                         take_over=take_over, on_shrink=on_shrink)
        self.mixer, self._logged_t, self.run_dir, self._drop_rows = mixer, logged_t, run_dir, drop_rows
        # the ranks the mixer's exchanges name (data-parallel groups: the groups, whose leads exchange), in which
        # the exchange rows are gathered and settled
        self.view = world if view is None else view
        self.record = mixer.cut = mixer.make_record(replica.flat)

    def remember(self, t: int) -> None:
        """No copies: an async run is never rolled back."""

    def recover(self, exc: RankLost) -> int:
        detected = time.time()
        world = self.world
        writer = world.lead
        log.debug(f"communities: rank {world.rank}: a peer failed ({exc}); shrinking to the survivors")
        lost: List[int] = []
        t = self._logged_t()
        while True:
            try:
                self.on_shrink("before")
                lost += world.recover()
                self.on_shrink("after")
                rows = self.view.allgather(self.record.row())  # every survivor's last exchange (after on_shrink)
                # a population's replicas train together: they go on from the same unit (the earliest logged)
                t = world.together(("go on from", len(lost)), t, lambda units: [min(units)] * len(units))
                if not world.alive[writer]:
                    self._new_writer(t, sorted(lost), writer)
                break
            except RankLost as again:
                log.warning(f"communities: rank {world.rank}: another failure while recovering ({again})")
        self._drop_rows(t)  # (a replica that had logged a later unit trains it again)
        undone = self.record.settle(rows, self.view.rank, self.view.alive)
        if undone:
            who = "rank" if self.view is world else "group"
            log.warning(f"communities: {who} {self.view.rank}: its exchange with {who}{'s' if len(undone) > 1 else ''} "
                        f"{', '.join(map(str, undone))} completed on this side only when a rank was lost; undone")
        self.mixer.after_loss()
        self._note(sorted(lost), t, detected, writer, f"(async: each from its own unit; the lead's t={t})",
                   undone=undone)
        return t

    def _tidy(self, t: int) -> None:
        """The lead: a checkpoint cut by the loss (rank files, no marker) is removed; the last complete one stays.
        Nothing else is rolled back."""
        import shutil

        for d in self.run_dir.checkpoints.glob("u*"):
            if d.is_dir() and not (d / COMPLETE).exists():
                shutil.rmtree(d, ignore_errors=True)
