"""IFCA and its oracle: k shared models, each rank training the one that fits its shard best."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from ...config import Config
from ...core import cluster_start, signature
from ...errors import ConfigError
from ...results import Event, MergeRow
from ...workload import models
from ..replica.replica import Replica
from .strategy import Mixing, Strategy

log = logging.getLogger(__name__)


@dataclass
class KeptStart:
    """``ifca.init: restarts``: the start with the lowest training loss so far."""

    start: int
    models: torch.Tensor  # (k, P) as the start ended
    pick: int  # this rank's pick then


class IFCA(Strategy):
    """IFCA (Ghosh et al. 2020), the clustered federated learning baseline: k shared models.

    Every ``merge.period`` units each rank scores the k models on its own shard,
    takes the one with the lowest loss, trains it for the period, and the ranks
    that took the same model average it (the mixer's ``ifca_average``: one masked
    Allreduce of the (k, P) models, about 2 k P x 4 bytes sent per rank and round
    for float32 weights; training traffic).

    How the k models start (``ifca.init``; W = ``ifca.warmup_units``):

    - ``random``: model 0 is the run's shared initialisation, models 1..k-1 their
      own seeded ones (IFCA needs distinct starts, else every rank takes model 0),
      and the first pick is by loss. Free, but with few ranks per group that
      pick is noise and groups may share one model for good.
    - ``warmup``: units 1..W are local training from the shared initialisation
      (no bytes). Then every rank allgathers a count-sketch of its drift
      (``signature.dim`` float32 values: dim x 4 x (N - 1) bytes sent per rank),
      every rank runs the same seeded k-means on those N rows, and each
      cluster's model is the mean of its members (one ``ifca_average``); each
      rank starts IFCA on its cluster's model. Costs W units of the budget
      without mixing, one small Allgather and one masked Allreduce.
    - ``restarts``: R = ``ifca.restarts`` short random starts of W units each
      (start s = 0..R-1: units sW+1..(s+1)W, fresh seeded models; start 0 is
      ``random``'s), each ending on
      an average and a pick; the mean over ranks of each rank's training loss
      of its pick (one scalar Allreduce) scores the start, and after R x W
      units the start with the lowest score goes on (its models and picks).
      Costs R x W units of the budget, at IFCA's bytes per round throughout.
    """

    name = "ifca"

    def __init__(self, cfg: Config, n: int):
        super().__init__(cfg, n)
        self.k = cfg.ifca.k
        self.models = torch.zeros(0)  # (k, P): the shared models, the same on every rank after each average
        self.pick = 0  # the model this rank trains
        self.init = cfg.ifca.init
        self.start_units = cfg.ifca.warmup_units if self.init != "random" else 0
        self.starts = cfg.ifca.restarts if self.init == "restarts" else 1
        self.start_losses: List[float] = []  # restarts: each finished start's mean training loss
        self.best: Optional[KeptStart] = None  # restarts: the best start so far
        self._last_loss = float("nan")  # this rank's loss of its pick at the last choose

    def prepare(self, mixer: Mixing) -> None:
        r = mixer.replica
        self.models = self.seeded_models(mixer, 0)
        if self.init != "warmup":  # warmup: local training from the shared initialisation first
            self.choose(r)

    def seeded_models(self, mixer: Mixing, start: int) -> torch.Tensor:
        """Start ``start``'s k models, alike on every rank: built on rank 0 from seeds, then broadcast. Start 0's
        model 0 is the run's shared initialisation (this rank's weights now)."""
        r = mixer.replica
        models_ = torch.empty((self.k, r.flat.numel()), dtype=r.flat.dtype, device=r.flat.device)
        if start == 0:
            models_[0].copy_(r.flat)
        if mixer.world.leads:
            with torch.random.fork_rng(devices=[]):  # leave this rank's RNG (dropout) as it was
                for j in range(1 if start == 0 else 0, self.k):
                    torch.manual_seed(self.cfg.seed * 7919 + 1_000_003 * (start * self.k + j))
                    m = models.build(self.cfg.model, r.data.dataset.input_shape, r.data.dataset.n_classes)
                    flat, _ = models.flatten_(m)
                    models_[j].copy_(flat.to(r.flat.device))
        mixer.world.bcast_(models_.view(-1))
        return models_

    def losses(self, replica: Replica) -> List[float]:
        """Each shared model's loss on this rank's training shard."""
        return [replica.evaluate_on(replica.data.x, replica.data.y, self.models[j])[1] for j in range(self.k)]

    def choose(self, replica: Replica) -> int:
        """Take the model with the lowest loss on the shard (the first on ties) into this rank's weights."""
        losses = np.asarray(self.losses(replica), dtype=np.float64)
        losses[~np.isfinite(losses)] = np.inf
        pick = int(np.argmin(losses))
        if pick != self.pick:
            replica.opt.state.clear()  # momentum of another model
        self.pick = pick
        self._last_loss = float(losses[pick])
        replica.flat.copy_(self.models[pick])
        return pick

    def mix(self, t: int, mixer: Mixing) -> None:
        """Every period: the k models averaged by the ranks that trained them, then this rank's pick again
        (under ``ifca.init`` warmup or restarts, the start's own steps first)."""
        if self.init == "warmup" and t <= self.start_units:  # units 1..W: local training
            if t == self.start_units:
                self.assign_by_kmeans(t, mixer)
            return
        end_of_start = self.init == "restarts" and t <= self.start_units * self.starts and t % self.start_units == 0
        if t % self.cfg.merge.period and not end_of_start:
            return
        self.step(t, mixer)
        if end_of_start:
            self.end_start(t, mixer)

    def step(self, t: int, mixer: Mixing) -> None:
        """One IFCA round: the masked average, then this rank's pick by loss."""
        r = mixer.replica
        before = r.flat.clone()
        sent = mixer.ifca_average(self.models, self.pick)
        with mixer.timer("eval"):
            self.choose(r)
        mixer.record(MergeRow.global_average(t, mixer.rank, float(torch.dist(r.flat, before)), sent, Event.AVERAGE))

    def assign_by_kmeans(self, t: int, mixer: Mixing) -> None:
        """warmup: k-means on the allgathered drift sketches assigns each rank its cluster; each cluster's model
        becomes the mean of its members, and each rank goes on from its own cluster's model."""
        r, sc = mixer.replica, self.cfg.signature
        sketch = signature.make_sketch("countsketch", r.flat.numel(), sc.dim, self.cfg.seed, r.flat.device,
                                       dtype=r.flat.dtype)
        sent0 = mixer.world.bytes_sent
        with mixer.timer("signature"):
            row = sketch(r.flat - self.models[0]).cpu().numpy().astype(np.float32)  # drift from the shared start
            rows = mixer.world.allgather(row)
            labels = cluster_start.kmeans_assignment(rows, self.k, self.cfg.seed)
        mixer.agreement.update(labels)
        before = r.flat.clone()
        self.pick = int(labels[mixer.rank])
        sent = mixer.ifca_average(self.models, self.pick) + mixer.world.bytes_sent - sent0
        r.flat.copy_(self.models[self.pick])
        mixer.record(MergeRow.global_average(t, mixer.rank, float(torch.dist(r.flat, before)), sent, Event.AVERAGE))
        if mixer.world.leads:
            log.info("ifca.init=warmup: k-means of the local models after %d units assigns clusters %s",
                     t, labels.tolist())

    def end_start(self, t: int, mixer: Mixing) -> None:
        """restarts: score the start that ends at unit t, keep it if it is the best so far, and begin the next
        start (or, after the last, go on with the best one)."""
        r = mixer.replica
        loss = self._last_loss if np.isfinite(self._last_loss) else np.inf
        score = mixer.world.allreduce_scalar(loss) / mixer.world.size
        self.start_losses.append(score)
        start = len(self.start_losses) - 1
        if cluster_start.lowest_loss(self.start_losses) == start:
            self.best = KeptStart(start, self.models.clone(), self.pick)
        if start + 1 < self.starts:
            self.models = self.seeded_models(mixer, start + 1)
            r.opt.state.clear()  # momentum of the start before
            with mixer.timer("eval"):
                self.choose(r)
            return
        best = self.best
        assert best is not None
        self.models.copy_(best.models)
        self.pick = best.pick
        r.flat.copy_(self.models[self.pick])
        r.opt.state.clear()
        self.best = None
        if mixer.world.leads:
            log.info("ifca.init=restarts: mean training loss per start %s; kept start %d",
                     [round(v, 6) for v in self.start_losses], cluster_start.lowest_loss(self.start_losses))

    def state_dict(self) -> dict:
        state = {**super().state_dict(), "models": self.models.detach().cpu().clone(), "pick": self.pick}
        if self.init == "restarts":  # (absent otherwise: random's checkpoints are unchanged)
            best = self.best
            kept = None if best is None else {"start": best.start, "pick": best.pick,
                                              "models": best.models.detach().cpu().clone()}
            state["restarts"] = {"losses": list(self.start_losses), "last_loss": self._last_loss, "best": kept}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.models.copy_(state["models"].to(self.models.device))
        self.pick = int(state["pick"])
        restarts = state.get("restarts")
        if restarts is not None:
            self.start_losses = [float(v) for v in restarts["losses"]]
            self._last_loss = float(restarts["last_loss"])
            best = restarts["best"]
            self.best = None if best is None else KeptStart(int(best["start"]), best["models"].to(self.models.device),
                                                            int(best["pick"]))


class Oracle(IFCA):
    """Clustered training on the true planted groups: the upper bound any clustered method can reach here.

    IFCA with its assignment fixed to the planted groups (known only because
    they are planted): one model per group, all from the run's shared
    initialisation, each averaged every ``merge.period`` units by its members
    (the same masked Allreduce as IFCA, k = the number of groups); no rank ever
    scores or switches models. Refused when the data has no planted groups.
    """

    name = "oracle"

    def prepare(self, mixer: Mixing) -> None:
        r = mixer.replica
        groups = r.data.groups
        if groups is None:
            raise ConfigError(f"strategy='oracle' trains the planted groups, and data.dataset="
                              f"{self.cfg.data.dataset!r} declares none (plant them: data.partition=label_groups "
                              "or data.shift, or a dataset that declares groups)")
        ids = np.unique(np.asarray(groups))
        self.k = len(ids)
        self.pick = int(np.searchsorted(ids, groups[mixer.rank]))
        self.models = r.flat.detach().reshape(1, -1).repeat(self.k, 1)

    def choose(self, replica: Replica) -> int:
        """The planted group's model, always."""
        replica.flat.copy_(self.models[self.pick])
        return self.pick
