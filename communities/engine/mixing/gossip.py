"""The pairwise strategies: ``gossip`` (uniform partners), ``community`` (partners by community), ``ring``.

They share the merge clock, so they fire merges at the same rate and differ only in the partner they draw."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Union

import numpy as np
import torch

from ...config import Config
from ...core import partners, protocol, schedule
from ...core.clustering import Communities
from ...core.partners import Law
from ..replica import hyper
from .strategy import Mixing, Strategy


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
