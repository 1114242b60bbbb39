"""Who merges with whom: one engine, one switch.

``community``: partners drawn from the community law (flat or hierarchical),
after the first signature round; until then ranks train alone so that their
drift reveals their data. ``gossip``: uniform random partners (dpwa, Blot et al.
2016). ``ring``: the ring neighbour, alternating direction. ``isolated``: never.
``local_sgd``: a global Allreduce average every ``merge.period`` units.
``diloco``: the same, with the average taken as a pseudo-gradient for an outer
Nesterov step (Douillard et al. 2023; use AdamW inside). ``allreduce``:
synchronous data parallelism, gradients averaged by Allreduce at every step
(what DDP or Horovod do).

All pairwise strategies share the merge clock, so they fire merges at the same
rate and differ only in the partner they pick.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from . import partners, protocol, schedule
from .clustering import Communities


@dataclass
class Law:
    """The partner law in force: communities of the latest round plus the schedules."""

    kind: str  # flat | hierarchical | uniform | ring
    n: int
    labels: Optional[np.ndarray] = None
    heights: Optional[np.ndarray] = None  # condensed, normalised cophenetic heights
    p_intra: float = 1.0
    p_cross: float = 1.0
    temperature: float = 1.0

    def probabilities(self, i: int) -> np.ndarray:
        if self.kind == "flat":
            return partners.flat_probabilities(self.labels, i, self.p_intra, self.p_cross)
        if self.kind == "hierarchical":
            return partners.hierarchical_probabilities(self.heights, self.n, i, self.temperature)
        return partners.uniform_probabilities(self.n, i)


class Strategy:
    name = "base"
    pairwise = True  # exchanges drawn from the merge clock
    global_period: Optional[int] = None  # units between global averages
    outer = False  # global averages feed an outer optimizer
    sync_gradients = False  # gradient Allreduce at every step

    def __init__(self, cfg, n: int):
        self.cfg, self.n = cfg, n
        self.communities: Optional[Communities] = None
        self._heights: Optional[np.ndarray] = None
        self.bias: Optional[np.ndarray] = None  # (N, N) factors on the law's probabilities (merge.partner_policy)

    def observe(self, communities: Communities) -> None:
        """Take a new signature round's communities into account."""
        self.communities = communities
        self._heights = None

    def law(self, t: int) -> Optional[Law]:
        return Law("uniform", self.n)

    def exchanges(self, t: int, initiators: np.ndarray, excluded: Optional[np.ndarray] = None
                  ) -> List[protocol.Exchange]:
        """Unit t's ordered exchange list; ``excluded`` ranks (robust outliers) neither start nor receive one."""
        law = self.law(t)
        if law is None or len(initiators) == 0:
            return []
        bias = self.bias

        def probabilities(i):
            if bias is None:
                return law.probabilities(i)
            p = law.probabilities(i) * bias[i]
            total = p.sum()
            return p / total if total > 0 else law.probabilities(i)
        if excluded is None or not excluded.any():
            return protocol.exchange_list(initiators, t, self.cfg.seed, probabilities)
        initiators = [i for i in initiators if not excluded[i]]

        def eligible(i):
            p = np.where(excluded, 0.0, probabilities(i))
            total = p.sum()
            return p / total if total > 0 else p

        return protocol.exchange_list(initiators, t, self.cfg.seed, eligible)

    def annealed(self, t: int) -> bool:
        """True once partner choice has reached its final (uniform) law."""
        return True


class CommunityStrategy(Strategy):
    name = "community"

    def law(self, t: int) -> Optional[Law]:
        if self.communities is None:
            return None
        pc = self.cfg.partners
        if pc.law == "flat":
            return Law("flat", self.n, labels=self.communities.labels, p_intra=pc.p_intra,
                       p_cross=schedule.evaluate(pc.p_cross, t))
        if self._heights is None:
            self._heights = partners.cophenetic_heights(self.communities.Z)
        return Law("hierarchical", self.n, heights=self._heights, temperature=schedule.evaluate(pc.temperature, t))

    def annealed(self, t: int) -> bool:
        pc, cc = self.cfg.partners, self.cfg.clustering
        done = schedule.finished(pc.p_cross if pc.law == "flat" else pc.temperature, t)
        if cc.cut == "maxclust":
            done = done and schedule.finished(cc.k, t)
        return done


class GossipStrategy(Strategy):
    name = "gossip"


class RingStrategy(Strategy):
    name = "ring"

    def exchanges(self, t: int, initiators: np.ndarray, excluded: Optional[np.ndarray] = None
                  ) -> List[protocol.Exchange]:
        pairs = [(int(i), partners.ring_partner(int(i), self.n, t)) for i in sorted(initiators)]
        if excluded is not None and excluded.any():
            pairs = [(i, j) for i, j in pairs if not excluded[i] and not excluded[j]]
        return pairs


class IsolatedStrategy(Strategy):
    name = "isolated"
    pairwise = False

    def law(self, t: int) -> Optional[Law]:
        return None


class LocalSGDStrategy(IsolatedStrategy):
    name = "local_sgd"

    def __init__(self, cfg, n: int):
        super().__init__(cfg, n)
        self.global_period = cfg.merge.period


class DiLoCoStrategy(LocalSGDStrategy):
    name = "diloco"
    outer = True


class AllreduceStrategy(IsolatedStrategy):
    name = "allreduce"
    sync_gradients = True


STRATEGIES = {s.name: s for s in (CommunityStrategy, GossipStrategy, RingStrategy, IsolatedStrategy,
                                  LocalSGDStrategy, DiLoCoStrategy, AllreduceStrategy)}


def make(cfg, n: int) -> Strategy:
    try:
        return STRATEGIES[cfg.strategy](cfg, n)
    except KeyError:
        raise ValueError(f"strategy={cfg.strategy!r} is not one of {sorted(STRATEGIES)}") from None
