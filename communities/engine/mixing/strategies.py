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

from typing import Dict, Type

from ...config import Config
from .averaging import Allreduce, DiLoCo, LocalSGD
from .gossip import Community, Gossip, Ring
from .ifca import IFCA, Oracle
from .strategy import Strategy

STRATEGIES: Dict[str, Type[Strategy]] = {s.name: s for s in (Community, Gossip, Ring, Strategy, LocalSGD, DiLoCo,
                                                             Allreduce, IFCA, Oracle)}


def make(cfg: Config, n: int) -> Strategy:
    """The strategy named by ``cfg.strategy``."""
    try:
        return STRATEGIES[cfg.strategy](cfg, n)
    except KeyError:
        raise ValueError(f"strategy={cfg.strategy!r} is not one of {sorted(STRATEGIES)}") from None
