"""Consensus: when the ranks have settled, and the model they settled on.

Every rank takes the same decision from the same gathered data: after the
partner law has finished annealing, the signatures' dispersion must stay under
``consensus.tol`` for ``consensus.patience`` rounds (and, with
``consensus.update_tol``, the merges' mean update norm relative to the mean
weight norm must be under it too). The consensus model is the Allreduce mean of
the ranks that count (``Replica.keep``); evaluating it along the way is
monitoring traffic, counted apart from training bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from ...config import Config
from ...results import MergeRow, finite_or_none
from ...runtime.view import WorldView
from ..replica.replica import Replica
from ..rounds.signature_rounds import RoundResult
from ..timer import Timer
from .async_snapshots import WallSnapshots


@dataclass(frozen=True)
class Decision:
    """A round's consensus verdict, the same on every rank."""

    reached: bool  # calm for ``patience`` rounds
    stop: bool  # reached, and consensus.stop asks to end the run there
    update: Optional[float]  # mean merge update norm since the last round (None: no rank merged)
    relative_update: Optional[float]  # that over the mean weight norm


class Consensus:
    """Patience, merge activity and the consensus model of one rank."""

    def __init__(self, cfg: Config, world: WorldView, timer: Timer, *, replica: Replica):
        self.cfg, self.world, self.timer, self.replica = cfg, world, timer, replica
        self.calm_rounds = 0
        self.reached_t: Optional[int] = None
        self.updates: List[float] = []  # update norms of this rank's merges since the last round

    def record(self, events: Sequence[MergeRow]) -> None:
        """The merge events of a unit: their update norms say whether the ranks still move."""
        self.updates.extend(e.update_norm for e in events if e.counts_as_update)

    def observe(self, rnd: RoundResult, annealed: bool, dispersion: Optional[float] = None) -> Decision:
        """Decide from the round's dispersion and the merges since the last round (a collective).

        ``dispersion`` replaces the round's (frozen communities: the largest inside one community).
        """
        cc = self.cfg.consensus
        update, relative_update = self._merge_activity()
        disp = rnd.dispersion if dispersion is None else dispersion
        calm = annealed and math.isfinite(disp) and disp < cc.tol
        if calm and cc.update_tol is not None and relative_update is not None:
            calm = relative_update < cc.update_tol
        self.calm_rounds = self.calm_rounds + 1 if calm else 0
        reached = self.calm_rounds >= cc.patience
        if reached and self.reached_t is None:
            self.reached_t = rnd.t
        return Decision(reached, reached and cc.stop, update, relative_update)

    def _merge_activity(self) -> Tuple[Optional[float], Optional[float]]:
        """(mean merge update norm since the last round, that over the mean weight norm), the same on every rank."""
        row = np.array([sum(self.updates), len(self.updates), float(self.replica.flat.norm())], dtype=np.float64)
        self.updates = []
        with self.timer("idle"), self.world.monitoring():
            g = self.world.allgather(row)[self.world.alive]
        count = g[:, 1].sum()
        if count == 0:
            return None, None
        mean = float(g[:, 0].sum() / count)
        norms = g[np.isfinite(g[:, 2]), 2]
        scale = float(norms.mean()) if norms.size else 0.0
        return finite_or_none(mean), (finite_or_none(mean / scale) if scale > 0 else None)

    def evaluate_due(self, t: int) -> Optional[dict]:
        """Every ``output.consensus_every`` units: the consensus model's test accuracy (a consensus.jsonl row);
        with local test data also its mean accuracy over the ranks' local test data (``local_acc``)."""
        every = self.cfg.output.consensus_every or self.cfg.train.eval_every
        if t % every:
            return None
        with self.timer("eval"), self.world.monitoring():
            mean = self.model()  # the same bits on every rank: scored once per process (a population)
            acc, loss = self.world.shared(("consensus evaluation", t), lambda: self.replica.evaluate(mean))
            row = {"t": t, "test_acc": acc, "test_loss": loss}
            if self.replica.has_local_test:  # every replica's own local data (with groups too: the replica's world)
                local_acc, _ = self.replica.evaluate_local(mean)
                own = self.replica.world
                row["local_acc"] = own.allreduce_scalar(local_acc) / own.n_alive
        return row

    def model(self) -> torch.Tensor:
        """The consensus weights: the mean over the ranks that count (a collective)."""
        return self.replica.masked_mean()

    def curve(self) -> List[dict]:
        """The consensus over wall time, evaluated at the end (a collective): none under the virtual clock,
        whose consensus.jsonl rows are taken during the run."""
        return []

    def state_dict(self) -> dict:
        return {"calm_rounds": self.calm_rounds, "reached_t": self.reached_t, "updates": list(self.updates)}

    def load_state_dict(self, state: dict) -> None:
        self.calm_rounds, self.reached_t = int(state["calm_rounds"]), state["reached_t"]
        self.updates = list(state["updates"])


class AsyncConsensus(Consensus):
    """Consensus under ``protocol: async``: each rank decides on its own view, with no collective in the loop.

    The dispersion is that of the rank's own signature table and the merge
    activity that of its own merges; a rank whose view has settled stops
    training and serves the others until every rank is done. The consensus
    model is evaluated over wall time from snapshots (``WallSnapshots``).
    """

    def __init__(self, cfg: Config, world: WorldView, timer: Timer, *, replica: Replica):
        super().__init__(cfg, world, timer, replica=replica)
        self.snapshots = WallSnapshots(cfg.output.snapshot_seconds, cfg.output.snapshots_max)

    def _merge_activity(self) -> Tuple[Optional[float], Optional[float]]:
        if not self.updates:
            return None, None
        mean = float(np.mean(self.updates))
        self.updates = []
        scale = float(self.replica.flat.norm())
        return finite_or_none(mean), (finite_or_none(mean / scale) if scale > 0 else None)

    def evaluate_due(self, t: int) -> Optional[dict]:
        return None  # a mid-run evaluation would be a collective: the curve comes from the snapshots

    def curve(self) -> List[dict]:
        with self.timer("eval"):
            return self.snapshots.curve(self.world, self.replica.evaluate)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "snapshots": self.snapshots.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.snapshots.load_state_dict(state["snapshots"])
