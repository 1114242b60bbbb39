"""IFCA (Ghosh et al. 2020), the clustered federated learning baseline, in the same engine: k shared models.

Every ``merge.period`` units each rank scores the k models on its own shard,
takes the one with the lowest loss, trains it for the period, and the ranks that
took the same model average it. Model 0 starts from the run's shared
initialisation, models 1..k-1 from their own seeded ones (IFCA needs distinct
starts, else every rank takes model 0).

The average is one *masked* Allreduce: a (k, P) buffer holding this rank's
trained model in the slot of its pick and zeros elsewhere, summed over the world
with the k pick counts. It equals what a Comm.Split by pick and an Allreduce
inside would give (adding zeros is exact), and every rank leaves it holding all
k models: a model nobody took keeps its weights, which every rank holds alike.
Why not the split: the ranks would then need the other groups' models too (k
broadcasts, k times one model's bytes, as this costs), and a communicator built
per step; one collective does both. The bytes are counted as training traffic.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

import numpy as np
import torch

from ..results import Event, MergeRow
from ..workload import models
from .strategies import Strategy

if TYPE_CHECKING:
    from .mixer import Mixer
    from .replica import Replica


class IFCA(Strategy):
    """k shared models; each rank trains the one that fits its shard best; the ranks that picked one average it."""

    name = "ifca"

    def __init__(self, cfg, n: int):
        super().__init__(cfg, n)
        self.k = cfg.ifca.k
        self.models = torch.zeros(0)  # (k, P): the shared models, the same on every rank after each average
        self.pick = 0  # the model this rank trains

    def prepare(self, mixer: "Mixer") -> None:
        r = mixer.replica
        models_ = torch.empty((self.k, r.flat.numel()), dtype=r.flat.dtype, device=r.flat.device)
        models_[0].copy_(r.flat)  # the run's shared initialisation
        if mixer.world.rank == 0:
            with torch.random.fork_rng(devices=[]):  # leave this rank's RNG (dropout) as it was
                for j in range(1, self.k):
                    torch.manual_seed(self.cfg.seed * 7919 + 1_000_003 * j)
                    m = models.build(self.cfg.model, r.dataset.input_shape, r.dataset.n_classes)
                    flat, _ = models.flatten_(m)
                    models_[j].copy_(flat.to(r.flat.device))
        mixer.world.bcast_(models_.view(-1), root=0)
        self.models = models_
        self.choose(r)

    def losses(self, replica: "Replica") -> List[float]:
        """Each shared model's loss on this rank's training shard."""
        return [replica.evaluate_on(replica.x, replica.y, self.models[j])[1] for j in range(self.k)]

    def choose(self, replica: "Replica") -> int:
        """Take the model with the lowest loss on the shard (the first on ties) into this rank's weights."""
        losses = np.asarray(self.losses(replica), dtype=np.float64)
        losses[~np.isfinite(losses)] = np.inf
        pick = int(np.argmin(losses))
        if pick != self.pick:
            replica.opt.state.clear()  # momentum of another model
        self.pick = pick
        replica.flat.copy_(self.models[pick])
        return pick

    def mix(self, t: int, mixer: "Mixer") -> None:
        if t % self.cfg.merge.period:
            return
        r, world = mixer.replica, mixer.world
        sent0 = world.bytes_sent
        with mixer.timer("exchange"):
            before = r.flat.clone()
            total = torch.zeros_like(self.models)
            counts = np.zeros(self.k)
            if r.keep:
                total[self.pick].copy_(r.flat)
                counts[self.pick] = 1.0
            with mixer.timer.collective("ifca_average"):
                world.allreduce_sum_(total.view(-1))
                counts = world.allreduce_array(counts)
            for j in range(self.k):
                if counts[j] > 0:
                    self.models[j].copy_(total[j].div_(counts[j]))
        with mixer.timer("eval"):
            self.choose(r)
        update = float(torch.dist(r.flat, before))
        mixer._events.append(MergeRow(t, mixer.rank, -1, -1, 1.0, update, float("nan"), world.bytes_sent - sent0,
                                      int(Event.AVERAGE)))

    def state_dict(self) -> dict:
        return {**super().state_dict(), "models": self.models.detach().cpu().clone(), "pick": self.pick}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.models.copy_(state["models"].to(self.models.device))
        self.pick = int(state["pick"])
