"""Signature rounds without a collective (``protocol: async``): each rank clusters its own gossip table.

Every S of its own units a rank signs its weights into its row of the table
(``core/gossip_table.py``); exchanges spread the rows. Once the table holds a row
for every rank, the rank runs the same clustering as under the virtual clock on
its own view. While the partner law waits for its first view (community
gossip), a round whose table was not yet full is tried again at every later
unit, without signing again, until it is (``engine/loop.py``): waiting for the
next multiple of S left a 64-replica population on 4 processes with no merge at
all from unit 5 to 10, where the virtual clock merged from unit 6. Views may
differ between ranks for a while: each is recorded (``views.jsonl``), rank 0's
is written as ``rounds/round_NNNN``, and the summary says how much the views
agreed (ARI against rank 0's view at the same wall time).
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

from ...config import Config
from ...core.gossip_table import GossipTable
from ...core.protocol import RunningDigest
from ...results import TimeCategory
from ...runtime.view import WorldView
from ..replica.replica import Replica
from ..timer import Timer
from .signature_rounds import RoundResult, SignatureRounds


class GossipRounds(SignatureRounds):
    """This rank's view: a versioned table of everyone's signatures, clustered every S own units."""

    agree = False  # views may differ between ranks: nothing to prove

    def __init__(self, cfg: Config, world: WorldView, timer: Timer, *, replica: Replica, agreement: RunningDigest):
        super().__init__(cfg, world, timer, replica=replica, agreement=agreement)
        width = int(np.asarray(self.signature.row(replica)).size)
        self.table = GossipTable(world.size, width, world.rank)
        self.views: List[list] = []  # [round, t, wall, labels...] of every view this rank clustered
        self.view_waiting = False  # signed at a round whose table was not full: cluster once it is

    def late_view_due(self, t: int) -> bool:
        return self.view_waiting and not self.due(t)

    def _gather(self, t: int) -> Optional[np.ndarray]:
        if self.due(t):  # (a late view clusters the rows of the round that signed them: no new row of its own)
            with self.timer(TimeCategory.SIGNATURE):
                self.table.set_own(self.signature.row(self.replica), t)
        known, alive = self.table.known, self.world.alive
        self.view_waiting = not (known | ~alive).all()
        if self.view_waiting:
            return None  # the law needs every rank's signature; exchanges are spreading them
        rows = self.table.rows.copy()
        unknown = ~known  # lost before its row reached this rank: a neutral point (it draws no partner anyway)
        if unknown.any():
            rows[unknown] = rows[known].mean(axis=0)
        return rows

    def run(self, t: int) -> Optional[RoundResult]:
        rnd = super().run(t)
        if rnd is not None:
            self.views.append([rnd.index, rnd.t, self.timer.elapsed(), *rnd.communities.labels.tolist()])
        return rnd

    def drain(self) -> None:
        """No gather is ever in flight."""

    def state_dict(self) -> dict:
        return {**super().state_dict(), "table": self.table.state_dict(),
                "views": [list(map(float, v)) for v in self.views], "view_waiting": self.view_waiting}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.table.load_state_dict(state["table"])
        self.views = [list(v) for v in state["views"]]
        self.view_waiting = bool(state.get("view_waiting", False))  # (a checkpoint from before late views: False)
