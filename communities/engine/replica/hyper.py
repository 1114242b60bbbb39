"""One replica's learnable hyperparameters (``pbt``): their values, where they act, and how they are adopted.

The values live here; where they act is set from here: the optimizer's
``param_groups`` (lr, momentum, weight decay, AdamW's betas: the stacked trainer
reads them there too), the pair's merge weight (``merge.alpha``) and the merge
timer's mean (``merge.lam``). The arithmetic is ``core/pbt.py``'s.
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from ...core import pbt, protocol
from ...errors import ConfigError

if TYPE_CHECKING:
    from ...config import Config

# where each learnable key acts in a torch optimizer's param_groups (betas: one entry of the pair)
_GROUP_KEYS = {"train.lr": ("lr", None), "train.momentum": ("momentum", None),
               "train.weight_decay": ("weight_decay", None), "train.beta1": ("betas", 0), "train.beta2": ("betas", 1)}


def initial(cfg: "Config", replica: int) -> np.ndarray:
    """Replica ``replica``'s first values (``pbt.first_values``: its own draw, or what ``pbt.start`` gives it)."""
    return pbt.first_values(pbt.Space.of(cfg.pbt.params), cfg.seed, replica, cfg.pbt.start.get(int(replica)))


def initial_lams(cfg: "Config", n: int) -> Optional[np.ndarray]:
    """Every replica's first merge.lam under pbt (None: merge.lam is shared); every replica of a process asks."""
    if not cfg.pbt.enabled or "merge.lam" not in cfg.pbt.params:
        return None
    return _initial_lams(cfg.seed, cfg.pbt.model_dump_json(), n).copy()


@functools.lru_cache(maxsize=4)
def _initial_lams(seed: int, pbt_json: str, n: int) -> np.ndarray:
    from ...config import PbtConfig

    pc = PbtConfig.model_validate_json(pbt_json)
    space = pbt.Space.of(pc.params)
    k = space.index("merge.lam")
    lams = np.array([pbt.first_values(space, seed, i, pc.start.get(i))[k] for i in range(n)], dtype=np.float64)
    return lams


class Hyperparameters:
    """The values one replica owns, and when it last adopted new ones."""

    def __init__(self, cfg: "Config", rank: int, n: Optional[int] = None):
        late = [r for r in cfg.pbt.start if n is not None and r >= n]
        if late and n is not None:  # (n again for the type checker)
            raise ConfigError(f"pbt.start names replica {late[0]}, but the run has {n} replicas (0..{n - 1})")
        self.cfg, self.rank = cfg, int(rank)
        self.space = pbt.Space.of(cfg.pbt.params)
        self.values = initial(cfg, rank)
        self.adopted_t = 0  # the unit of the latest adoption (0: the start)

    @property
    def names(self):
        return self.space.names

    def ready(self, t: int) -> bool:
        return t - self.adopted_t >= self.cfg.pbt.ready

    def get(self, name: str, default: float) -> float:
        k = self.space.index(name)
        return float(default) if k is None else float(self.values[k])

    def apply(self, opt: torch.optim.Optimizer) -> None:
        """Set the optimizer's values to this replica's (every param group)."""
        for name, (key, slot) in _GROUP_KEYS.items():
            k = self.space.index(name)
            if k is None:
                continue
            for group in opt.param_groups:
                if key not in group:
                    continue
                if slot is None:
                    group[key] = float(self.values[k])
                else:
                    pair = list(group[key])
                    pair[slot] = float(self.values[k])
                    group[key] = tuple(pair)

    def adopt(self, t: int, theirs: np.ndarray, opt: torch.optim.Optimizer) -> None:
        """Exploit and explore: take ``theirs``, perturbed from this replica's stream for unit t."""
        pc = self.cfg.pbt
        self.values = pbt.explore(self.space, np.asarray(theirs, dtype=np.float64),
                                  protocol.rng(self.cfg.seed, protocol.Purpose.PBT_EXPLORE, t, self.rank),
                                  pc.factors, pc.resample)
        self.adopted_t = int(t)
        self.apply(opt)

    def state_dict(self) -> dict:
        return {"values": torch.from_numpy(self.values.copy()), "adopted_t": self.adopted_t,
                "names": list(self.names)}

    def load_state_dict(self, state: dict, opt: torch.optim.Optimizer) -> None:
        if list(state["names"]) != list(self.names):
            raise ValueError(f"its pbt hyperparameters are {list(state['names'])}; this run's are {list(self.names)}")
        self.values = state["values"].numpy().astype(np.float64).copy()
        self.adopted_t = int(state["adopted_t"])
        self.apply(opt)
