"""What every strategy is: the mixer's operations it may call (``Mixing``), and the base that does nothing
(``isolated``)."""
from __future__ import annotations

from typing import Optional, Protocol

import numpy as np
import torch

from ...config import Config
from ...core.clustering import Communities
from ...core.partners import Law
from ...core.protocol import RunningDigest
from ...results import MergeRow
from ...runtime.view import WorldView
from ..replica.replica import Replica
from ..timer import Timer


class Mixing(Protocol):
    """What a strategy may ask of the mixer: what it reads, the operations that combine ranks, and where its own
    merge events go. ``mixer.Mixer`` (and the asynchronous one) provide it."""

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> WorldView: ...

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
