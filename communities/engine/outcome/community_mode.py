"""``consensus.mode``: whether the communities anneal into one consensus, or freeze into one model each.

Both modes look at one partition, the *candidate*: the communities of signature
round ``consensus.freeze_round`` (default 0, the first: found from the ranks'
drift before any cross-community merge), or ``consensus.k`` of that round's
tree (scipy ``fcluster``, maxclust).

- ``global`` (the default): nothing here acts; the ranks anneal to one consensus.
- ``communities``: the candidate is frozen at once: partners come only from
  inside its communities and the annealing stops. The end delivers one model
  per community (delivery.py).
- ``auto``: the annealing goes on, and a ``MergeProbe`` scores every merge on
  the rank's local validation data, as across or inside the candidate's
  communities; at each later round the ranks allgather what it measured and
  ``core/conflict.py`` decides, the same on every rank from the same bytes,
  whether merges across them hurt. The candidate is frozen when they do (the
  damage of the few cross merges made meanwhile is trained away inside each
  community); otherwise the ranks go on to one consensus.

Once frozen, consensus means every community is calm: the largest signature
dispersion inside one community, in place of the world's.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np
import torch

from ...config import Config
from ...core import clustering, conflict, signature
from ...results import TimeCategory
from ...runtime.view import WorldView
from ..mixing.strategy import Strategy
from ..replica.replica import Replica
from ..rounds.signature_rounds import RoundResult
from ..timer import Timer


class MergeProbe:
    """consensus.mode auto: what each merge did to this rank's model on its local validation data.

    Only the validation examples of classes the partner trains on are scored (``conflict.known_classes``):
    label skew is not conflict. A merge is ``cross`` or ``intra`` by the candidate communities
    (``labels``). The sums since the last round go to the round's allgather.
    """

    def __init__(self, replica: Replica, strategy: Strategy, *, rank: int, group_size: int = 1):
        # ``rank``: this rank as the strategy counts (its group, with train.group_size > 1)
        self.replica, self.strategy, self.rank = replica, strategy, rank
        held = replica.data
        y = held.dataset.y_train
        n_classes = held.dataset.n_classes
        self.known: Optional[torch.Tensor] = None  # a text corpus's: every partner knows every token
        if not held.dataset.sequence:
            counts = np.array(held.label_counts) if held.label_counts is not None else \
                np.array([np.bincount(y[s.indices], minlength=n_classes) for s in held.shards])  # (a sharded reader's)
            if group_size > 1:  # a group knows what any of its members' shards hold
                counts = counts.reshape(-1, group_size, counts.shape[1]).sum(axis=1)
            self.known = torch.as_tensor(conflict.known_classes(counts))  # (N, C)
        self.labels: Optional[np.ndarray] = None  # the candidate communities (set by CommunityMode)
        self.row = conflict.empty()

    def active(self) -> bool:
        """Merges are scored once there is a candidate, until the communities are frozen."""
        return self.labels is not None and self.strategy.frozen_labels() is None

    def merged(self, partner: int, before: torch.Tensor, a: float) -> None:
        """After a merge with ``partner`` (this rank's weights were ``before``, are now merged with weight a)."""
        r, held = self.replica, self.replica.data
        if self.known is None:
            mask = torch.ones(len(held.y_local), dtype=torch.bool, device=held.y_local.device)
        else:
            mask = self.known[partner][held.y_local.cpu()].to(held.y_local.device)
        n = int(mask.sum())
        if n == 0 or a <= 0:
            return  # the partner knows none of this rank's validation classes: nothing to learn from it
        x, y = held.x_local[mask], held.y_local[mask]
        after = r.flat.clone()
        partner_w = before + (after - before) / a  # after = before + a (theirs - before)
        acc_b, loss_b = r.evaluate_on(x, y, before)
        acc_a, loss_a = r.evaluate_on(x, y, after)
        acc_p, loss_p = r.evaluate_on(x, y, partner_w)
        assert self.labels is not None  # (merges are scored only while a candidate is known: ``active``)
        kind = "intra" if self.labels[partner] == self.labels[self.rank] else "cross"
        conflict.record(self.row, kind, examples=n, loss_before=loss_b * n, loss_after=loss_a * n,
                        loss_partner=loss_p * n, correct_before=acc_b * n, correct_after=acc_a * n,
                        correct_partner=acc_p * n)

    def take(self) -> np.ndarray:
        row, self.row = self.row, conflict.empty()
        return row

    def state_dict(self) -> dict:
        return {"row": torch.from_numpy(self.row.copy())}

    def load_state_dict(self, state: dict) -> None:
        self.row = state["row"].numpy().copy()


class CommunityMode:
    """The freeze of ``consensus.mode`` for one rank: when, which communities, and (auto) the evidence."""

    def __init__(self, cfg: Config, world: WorldView, timer: Timer, *, replica: Replica, strategy: Strategy):
        self.cfg, self.world, self.timer, self.strategy = cfg, world, timer, strategy
        self.group = replica.group  # train.group_size > 1: a group's evidence is its members' together
        self.mode = cfg.consensus.mode
        self.candidate: Optional[np.ndarray] = None  # the communities weighed (auto) or frozen (communities)
        self.frozen_round: Optional[int] = None
        self.frozen_t: Optional[int] = None
        self.totals = np.zeros((world.size, conflict.WIDTH))  # auto: every rank's evidence since the first round
        self.verdict: Optional[dict] = None
        self.probe = MergeProbe(replica, strategy, rank=world.rank, group_size=cfg.train.group_size) \
            if self.mode == "auto" else None

    @property
    def frozen(self) -> Optional[np.ndarray]:
        """The frozen communities' labels (None: not frozen), as the strategy holds them."""
        return self.strategy.frozen_labels()

    def observe(self, rnd: RoundResult) -> Optional[dict]:
        """A signature round (after the mixer took its communities): freeze when due; returns round.json's entry."""
        if self.mode == "global":
            return None
        weighed = False
        if self.frozen is None:
            if self.candidate is None:
                if rnd.index >= self.cfg.consensus.freeze_round:
                    k = self.cfg.consensus.k
                    self.candidate = rnd.communities.labels.copy() if k is None else clustering.cut_k(
                        rnd.communities.Z, k, self._rows(rnd) if self.cfg.clustering.refine else None)
                    if self.probe is not None:
                        self.probe.labels = self.candidate
                    if self.mode == "communities":
                        self._freeze(rnd)
            elif self.mode == "auto":
                self._weigh(rnd)
                weighed = True
        info = {"mode": self.mode, "candidate": None if self.candidate is None else self.candidate.tolist(),
                "frozen": self.frozen is not None, "frozen_round": self.frozen_round, "frozen_t": self.frozen_t,
                "frozen_labels": None if self.frozen is None else self.frozen.tolist()}
        if self.mode == "auto":
            info["verdict"] = self.verdict if weighed else None  # null: no evidence weighed at this round
        return info

    def _rows(self, rnd: RoundResult) -> np.ndarray:
        """The round's rows in the clustering's geometry (what its cuts are refined on)."""
        cc = self.cfg.clustering
        return clustering.geometry(rnd.signatures, cc.metric, rnd.communities.distances
                                   if self.cfg.signature.kind == "cka" else None)

    def _weigh(self, rnd: RoundResult) -> None:
        """auto: every rank's evidence since the last round, allgathered; the same verdict everywhere."""
        cc = self.cfg.consensus
        assert self.probe is not None  # (auto)
        with self.timer(TimeCategory.IDLE):
            row = self.probe.take()
            if self.group is not None:  # every member scored the group's merges on its own validation data
                row = self.group.sum(row)
            rows = self.world.allgather(row)
        self.totals += rows
        verdict = conflict.decide(self.totals, cc.auto_harm, cc.auto_min_merges)
        self.verdict = {"round": rnd.index, "t": rnd.t, **verdict.to_dict()}
        if verdict.decision == "freeze":
            self._freeze(rnd)

    def _freeze(self, rnd: RoundResult) -> None:
        assert self.candidate is not None
        self.strategy.freeze(self.candidate)
        self.frozen_round, self.frozen_t = rnd.index, rnd.t

    def dispersion(self, rnd: RoundResult) -> Optional[float]:
        """Once frozen, the consensus rule's dispersion: the largest inside one frozen community."""
        if self.frozen is None:
            return None
        counted = np.isfinite(rnd.signatures).all(axis=1) & ~rnd.outliers
        return signature.community_dispersion(rnd.signatures[counted], self.frozen[counted])

    def summary(self) -> Optional[dict]:
        """summary.json's ``consensus_mode``: the decision and the evidence behind it."""
        if self.mode == "global":
            return None
        out: Dict[str, Any] = {"mode": self.mode,
                               "decision": "communities" if self.frozen is not None else "consensus",
                               "frozen_round": self.frozen_round, "frozen_t": self.frozen_t,
                               "communities": None if self.frozen is None else int(self.frozen.max()) + 1}
        if self.mode == "auto":
            out["evidence"] = {"thresholds": {"auto_harm": self.cfg.consensus.auto_harm,
                                              "auto_min_merges": self.cfg.consensus.auto_min_merges},
                               "last_verdict": self.verdict, "totals": conflict.totals(self.totals)}
        return out

    def state_dict(self) -> dict:
        return {"candidate": None if self.candidate is None else torch.from_numpy(self.candidate.copy()),
                "frozen_round": self.frozen_round, "frozen_t": self.frozen_t,
                "totals": torch.from_numpy(self.totals.copy()), "verdict": self.verdict,
                "probe": None if self.probe is None else self.probe.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.candidate = None if state["candidate"] is None else state["candidate"].numpy().copy()
        self.frozen_round, self.frozen_t = state["frozen_round"], state["frozen_t"]
        self.totals = state["totals"].numpy().copy()
        self.verdict = state["verdict"]
        if self.probe is not None:
            self.probe.load_state_dict(state["probe"])
            self.probe.labels = self.candidate
