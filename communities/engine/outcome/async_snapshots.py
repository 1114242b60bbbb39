"""The consensus model over wall time, without a collective in the loop (``protocol: async``).

Under the asynchronous protocol ranks are at different units at any moment, so
"the consensus at unit t" has no meaning and evaluating it mid-run would need a
collective that makes fast ranks wait. Instead each rank keeps a copy of its
weights every ``output.snapshot_seconds`` of its own wall clock (all ranks start
the loop together), and at the end the ranks average snapshot k with one
Allreduce each: the consensus model at wall time ``k * every``, whose test
accuracy gives ``consensus.jsonl`` rows with a ``wall`` field (what ``compare``
reads as wall-clock to target). At most ``limit`` snapshots are kept: past that
every other one is dropped and the interval doubles, identically on every rank.
"""
from __future__ import annotations

from typing import List

import torch

from ...runtime.view import WorldView


class WallSnapshots:
    """Copies of one rank's weights at wall times 0, every, 2 every, ..."""

    def __init__(self, every: float, limit: int = 64):
        self.every, self.limit = float(every), int(limit)
        self.flats: List[torch.Tensor] = []
        self.units: List[int] = []

    def maybe(self, elapsed: float, flat: torch.Tensor, t: int) -> None:
        """Take the snapshots due by ``elapsed`` seconds (this rank's weights now stand for each)."""
        while self.every > 0 and len(self.flats) * self.every <= elapsed:
            self.flats.append(flat.detach().clone())
            self.units.append(int(t))
            if len(self.flats) > self.limit:
                self.flats, self.units = self.flats[::2], self.units[::2]
                self.every *= 2

    def curve(self, world: WorldView, evaluate) -> List[dict]:
        """Every rank: the consensus of each snapshot index that all ranks hold, evaluated (collectives)."""
        count = int(world.allreduce_scalar(float(len(self.flats)), "min"))
        rows = []
        for k in range(count):
            mean = self.flats[k].clone()
            with world.monitoring():
                world.allreduce_sum_(mean)
                units = world.allreduce_scalar(float(self.units[k]))
            mean.div_(world.n_alive)  # (the ranks alive: a lost rank's snapshots are gone with it)
            # the same bits on every replica of a population: scored once per process
            acc, loss = world.shared(("snapshot", k), lambda mean=mean: evaluate(mean))
            rows.append({"t": int(round(units / world.n_alive)), "wall": k * self.every, "test_acc": acc,
                         "test_loss": loss})
        return rows

    def state_dict(self) -> dict:
        return {"every": self.every, "flats": [f.cpu() for f in self.flats], "units": list(self.units)}

    def load_state_dict(self, state: dict) -> None:
        self.every = float(state["every"])
        self.flats = [f.clone() for f in state["flats"]]
        self.units = [int(u) for u in state["units"]]

