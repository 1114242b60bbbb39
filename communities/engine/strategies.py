"""How ranks combine their work: one strategy object per ``strategy`` value, each doing its own mixing step.

Pairwise strategies share the merge clock, so they fire merges at the same rate
and differ only in the partner they pick:

- ``community``: partners from the community law (flat or hierarchical), after
  the first signature round; until then ranks train alone, so that their drift
  reveals their data;
- ``gossip``: uniform random partners (dpwa; Blot et al. 2016);
- ``ring``: the ring neighbour, alternating direction.

Global strategies average over all ranks:

- ``local_sgd``: an Allreduce mean of the weights every ``merge.period`` units;
- ``diloco``: the same mean taken as a pseudo-gradient for an outer Nesterov
  step (Douillard et al. 2023; use AdamW inside);
- ``allreduce``: synchronous data parallelism, gradients averaged by Allreduce
  at every step (what DDP or Horovod do);
- ``isolated``: nothing while training;
- ``ifca``: k shared models, each rank training the one that fits its shard
  best (Ghosh et al. 2020), averaged by one masked Allreduce; ``ifca.init``
  starts them at random, after a warm-up and k-means, or by restarts;
- ``oracle``: IFCA with the assignment fixed to the true planted groups.

A strategy decides *who* mixes *when*; the mixer (``mixer.py``) owns *how*: the
pairwise exchange, the global average, IFCA's masked average, the gradient
Allreduce. A strategy reaches them only through ``Mixing``, the operations the
mixer offers it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Type, Union

import numpy as np
import torch

from ..config import Config
from ..core import cluster_start, partners, protocol, schedule, signature
from ..core.clustering import Communities
from ..core.partners import Law
from ..core.protocol import RunningDigest
from ..errors import ConfigError
from ..results import Event, MergeRow
from ..runtime.comm import World
from ..workload import models
from . import hyper
from .replica import Replica
from .timer import Timer

log = logging.getLogger(__name__)


class Mixing(Protocol):
    """What a strategy may ask of the mixer: what it reads, the operations that combine ranks, and where its own
    merge events go. ``mixer.Mixer`` (and the asynchronous one) provide it."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> World: ...

    @property
    def replica(self) -> Replica: ...

    @property
    def timer(self) -> Timer: ...

    @property
    def agreement(self) -> RunningDigest: ...

    @property
    def seen_at(self) -> np.ndarray: ...

    @property
    def unavailable(self) -> np.ndarray: ...

    def exchange(self, t: int, partner: int, initiator: int) -> None:
        """Swap weights with ``partner`` and apply the merge rule on both sides."""

    def average(self, t: int) -> None:
        """Every rank takes the Allreduce mean (an outer step on it with an anchor: diloco)."""

    def ifca_average(self, models_: torch.Tensor, pick: int) -> int:
        """Each of the k shared models becomes the mean of the ranks that trained it; returns the bytes sent."""

    def enable_outer(self, anchor: bool = False) -> None:
        """An outer optimizer on merges, or with an anchor on global averages."""

    def sync_gradients(self) -> None:
        """Average the gradients at every training step."""

    def record(self, row: MergeRow) -> None:
        """A merge event of the unit's step."""


class Strategy:
    """``isolated``: ranks train alone. The base of every strategy: each hook does nothing."""

    name = "isolated"

    def __init__(self, cfg: Config, n: int):
        self.cfg, self.n = cfg, n
        self.communities: Optional[Communities] = None

    def prepare(self, mixer: Mixing) -> None:
        """Once, after the replica is built and before the first unit."""

    def mix(self, t: int, mixer: Mixing) -> None:
        """Unit t's mixing step, after every rank trained the unit."""

    def observe(self, communities: Communities, mixer: Mixing, t: int) -> None:
        """A new signature round's communities."""
        self.communities = communities

    def frozen_labels(self) -> Optional[np.ndarray]:
        """The communities frozen by ``consensus.mode`` (None: not frozen; only ``community`` freezes)."""
        return None

    def freeze(self, labels: np.ndarray) -> None:
        raise ValueError(f"strategy={self.name!r} has no communities to freeze (consensus.mode needs 'community')")

    def law(self, t: int) -> Optional[Law]:
        """The partner law in force at t (None: no pairwise partners)."""
        return None

    def annealed(self, t: int) -> bool:
        """True once partner choice has reached its final law (consensus may only be declared then)."""
        return True

    def state_dict(self) -> dict:
        com = self.communities
        if com is None:
            return {"communities": None}
        # The round's condensed distances serve examples.pass_similarity alone, and hold N(N-1)/2 float64: 4 MB
        # at N = 1,024, in every replica's file (4.2 GB a checkpoint). Without that option a file keeps none.
        distances = com.distances if self.cfg.examples.pass_similarity != "none" else np.zeros(0)
        return {"communities": {
            "Z": torch.from_numpy(com.Z.copy()), "labels": torch.from_numpy(com.labels.copy()),
            "cut_height": float(com.cut_height), "distances": torch.from_numpy(np.array(distances, copy=True))}}

    def load_state_dict(self, state: dict) -> None:
        com = state["communities"]
        self.communities = None if com is None else Communities(
            Z=com["Z"].numpy().copy(), labels=com["labels"].numpy().copy(), cut_height=com["cut_height"],
            distances=com["distances"].numpy().copy())


class Gossip(Strategy):
    """Pairwise merges with uniform random partners, fired by the merge clock."""

    name = "gossip"

    def __init__(self, cfg: Config, n: int):
        super().__init__(cfg, n)
        self.clock = protocol.MergeClock(n, cfg.seed, cfg.merge.lam, lams=hyper.initial_lams(cfg, n))
        self._heights: Optional[partners.CopheneticHeights] = None
        # per-row factors on the law (partner_policy: least_recent; an older checkpoint's (N, N) matrix serves as well)
        self.bias: Optional[Union[partners.Staleness, np.ndarray]] = None

    def prepare(self, mixer: Mixing) -> None:
        if self.cfg.merge.outer.enabled:
            mixer.enable_outer()

    def mix(self, t: int, mixer: Mixing) -> None:
        """Every rank derives the same ordered exchange list and performs its own exchanges in list order."""
        # the timers' draws, the list, and each rank's part of it: once for every replica of a process (a population)
        initiators, rearmed = mixer.world.shared(("fire", t), lambda: self._fire(t))
        self.clock.next_fire[initiators] = rearmed  # (where another replica drew them: this clock follows)
        plan, by_rank = mixer.world.shared(("exchanges", t), lambda: self._plan(t, initiators, mixer.unavailable))
        mixer.agreement.update(plan)
        for partner, (initiator, _) in by_rank.get(mixer.rank, ()):
            mixer.exchange(t, partner, initiator)
        every = self.cfg.merge.average_every
        if every and t % every == 0:  # Gossip-PGA: an exact global average besides the merges
            mixer.average(t)

    def _fire(self, t: int) -> tuple:
        """(the ranks whose timer fires at t, their timers re-armed)."""
        due = self.clock.fire(t)
        return due, self.clock.next_fire[due].copy()

    def _plan(self, t: int, initiators: np.ndarray, unavailable: np.ndarray) -> tuple:
        """(unit t's exchange list as an (E, 2) array, {rank: its (partner, exchange) in list order})."""
        if self.cfg.partners.schedule == "hypercube":
            plan = self.hypercube(t, unavailable)
        else:
            plan = self.exchanges(t, initiators, unavailable)
        by_rank: Dict[int, list] = {}
        for i, j in plan:
            by_rank.setdefault(i, []).append((j, (i, j)))
            by_rank.setdefault(j, []).append((i, (i, j)))
        return np.asarray(plan, dtype=np.int64).reshape(-1, 2), by_rank

    def observe(self, communities: Communities, mixer: Mixing, t: int) -> None:
        super().observe(communities, mixer, t)
        self._heights = None
        if self.cfg.merge.partner_policy == "least_recent":
            self.bias = partners.Staleness(mixer.world.allgather(mixer.seen_at), t)
        if self.clock.lams is not None and self.cfg.protocol == "virtual_clock":
            # pbt: each rank's merge.lam as it stands now, learnt by all at once (the timers must stay identical)
            own = self.cfg.merge.lam if mixer.replica.hyper is None else mixer.replica.hyper.get("merge.lam", 0.0)
            self.clock.set_lams(mixer.world.allgather(np.array([own], dtype=np.float64)).reshape(-1))

    def law(self, t: int) -> Optional[Law]:
        return Law("uniform", self.n)

    def groups(self, t: int) -> Optional[List[List[int]]]:
        """partners.schedule hypercube: the groups whose members pair at unit t (gossip: the whole world)."""
        return [list(range(self.n))]

    def hypercube(self, t: int, unavailable: Optional[np.ndarray] = None) -> List[protocol.Exchange]:
        """Unit t's stage of the one-peer hypercube inside each group; pairs touching an unavailable rank
        (a robust outlier, a lost rank) are left out. The pair's lower rank is its initiator."""
        groups = self.groups(t)
        if groups is None:
            return []
        pairs = partners.hypercube_pairs(groups, t)
        if unavailable is not None and unavailable.any():
            pairs = [(i, j) for i, j in pairs if not unavailable[i] and not unavailable[j]]
        return pairs

    def probabilities(self, law: Law) -> Callable[[int], np.ndarray]:
        """P(j | i) under ``law``, weighted by the staleness bias when there is one."""
        bias = self.bias
        if bias is None:
            return law.probabilities

        def biased(i: int) -> np.ndarray:
            p = law.probabilities(i) * bias[i]
            total = p.sum()
            return p / total if total > 0 else law.probabilities(i)
        return biased

    def exchanges(self, t: int, initiators: np.ndarray, excluded: Optional[np.ndarray] = None
                  ) -> List[protocol.Exchange]:
        """Unit t's ordered exchange list; ``excluded`` ranks (robust outliers) neither start nor receive one."""
        law = self.law(t)
        if law is None or len(initiators) == 0:
            return []
        probabilities = self.probabilities(law)
        ranks = [int(i) for i in initiators]
        if excluded is None or not excluded.any():
            rows = law.rows if probabilities == law.probabilities else None  # no staleness bias
            return protocol.exchange_list(ranks, t, self.cfg.seed, probabilities, rows)
        ranks = [i for i in ranks if not excluded[i]]

        def eligible(i: int) -> np.ndarray:
            p = np.where(excluded, 0.0, probabilities(i))
            total = p.sum()
            return p / total if total > 0 else p

        return protocol.exchange_list(ranks, t, self.cfg.seed, eligible)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "clock": torch.from_numpy(self.clock.state()),
                "lams": None if self.clock.lams is None else torch.from_numpy(self.clock.lams.copy()),
                "bias": self._bias_state()}

    def _bias_state(self):
        bias = self.bias
        if bias is None or isinstance(bias, np.ndarray):  # (an older checkpoint's matrix goes on as it came)
            return None if bias is None else torch.from_numpy(bias.copy())
        return {"seen_at": torch.from_numpy(bias.seen_at.copy()), "t": bias.t, "power": bias.power}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._heights = None
        self.clock.load(state["clock"].numpy())
        if state.get("lams") is not None:
            self.clock.set_lams(state["lams"].numpy())
        bias = state["bias"]  # (an older checkpoint's is the (N, N) matrix of factors: its rows serve as well)
        self.bias = None if bias is None else bias.numpy().copy() if isinstance(bias, torch.Tensor) else \
            partners.Staleness(bias["seen_at"].numpy().copy(), bias["t"], bias["power"])


class Community(Gossip):
    """Pairwise merges with partners from the community law of the latest signature round.

    ``freeze`` (consensus.mode communities/auto) ends the annealing: from then on partners come only from
    inside the frozen communities, uniformly, and a rank alone in its community no longer merges.
    """

    name = "community"

    def __init__(self, cfg: Config, n: int):
        super().__init__(cfg, n)
        self.frozen: Optional[np.ndarray] = None  # community labels no cross merge may join any more

    def frozen_labels(self) -> Optional[np.ndarray]:
        return self.frozen

    def freeze(self, labels: np.ndarray) -> None:
        self.frozen = np.asarray(labels, dtype=np.int64).copy()

    def law(self, t: int) -> Optional[Law]:
        if self.frozen is not None:
            return Law("frozen", self.n, labels=self.frozen, p_intra=self.cfg.partners.p_intra, p_cross=0.0)
        if self.communities is None:
            return None
        pc = self.cfg.partners
        if pc.law == "flat":
            return Law("flat", self.n, labels=self.communities.labels, p_intra=pc.p_intra,
                       p_cross=schedule.evaluate(pc.p_cross, t))
        if self._heights is None:
            self._heights = partners.cophenetic_heights(self.communities.Z)
        return Law("hierarchical", self.n, heights=self._heights, temperature=schedule.evaluate(pc.temperature, t))

    def groups(self, t: int) -> Optional[List[List[int]]]:
        """The hypercube's groups at unit t: the communities (frozen, or the latest round's); with probability
        p_cross(t) for the whole unit (one draw every rank makes alike) the whole world, unless frozen."""
        labels = self.frozen if self.frozen is not None else (
            None if self.communities is None else self.communities.labels)
        if labels is None:
            return None
        if self.frozen is None:
            p = schedule.evaluate(self.cfg.partners.p_cross, t) / self.cfg.partners.p_intra
            if protocol.rng(self.cfg.seed, protocol.Purpose.HYPERCUBE, t, 0).random() < p:
                return [list(range(self.n))]
        return [np.flatnonzero(labels == c).tolist() for c in np.unique(labels)]

    def annealed(self, t: int) -> bool:
        if self.frozen is not None:
            return True  # the law is final: no cross merges from here on
        pc, cc = self.cfg.partners, self.cfg.clustering
        done = schedule.finished(pc.p_cross if pc.law == "flat" else pc.temperature, t)
        if cc.cut == "maxclust":
            done = done and schedule.finished(cc.k, t)
        return done

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.frozen is not None:  # (absent while unfrozen: the default run's checkpoints are unchanged)
            state["frozen"] = torch.from_numpy(self.frozen.copy())
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        frozen = state.get("frozen")
        self.frozen = None if frozen is None else frozen.numpy().copy()


class Ring(Gossip):
    """Pairwise merges with the ring neighbour, alternating direction every unit."""

    name = "ring"

    def exchanges(self, t: int, initiators: np.ndarray, excluded: Optional[np.ndarray] = None
                  ) -> List[protocol.Exchange]:
        pairs = [(int(i), partners.ring_partner(int(i), self.n, t)) for i in sorted(initiators)]
        if excluded is not None and excluded.any():
            pairs = [(i, j) for i, j in pairs if not excluded[i] and not excluded[j]]
        return pairs


class LocalSGD(Strategy):
    """Every rank takes the Allreduce mean of the weights every ``merge.period`` units."""

    name = "local_sgd"
    outer = False  # the mean is a pseudo-gradient for an outer step (diloco)

    def prepare(self, mixer: Mixing) -> None:
        if self.outer:
            mixer.enable_outer(anchor=True)

    def mix(self, t: int, mixer: Mixing) -> None:
        if t % self.cfg.merge.period == 0:
            mixer.average(t)


class DiLoCo(LocalSGD):
    """Local SGD whose global mean feeds an outer Nesterov step from the last global weights."""

    name = "diloco"
    outer = True


class Allreduce(Strategy):
    """Synchronous data parallelism: the flat gradient buffer is Allreduce-averaged at every step."""

    name = "allreduce"

    def prepare(self, mixer: Mixing) -> None:
        mixer.sync_gradients()


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
                                       r.flat.dtype)
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


STRATEGIES: Dict[str, Type[Strategy]] = {s.name: s for s in (Community, Gossip, Ring, Strategy, LocalSGD, DiLoCo,
                                                             Allreduce, IFCA, Oracle)}


def make(cfg: Config, n: int) -> Strategy:
    """The strategy named by ``cfg.strategy``."""
    try:
        return STRATEGIES[cfg.strategy](cfg, n)
    except KeyError:
        raise ValueError(f"strategy={cfg.strategy!r} is not one of {sorted(STRATEGIES)}") from None
