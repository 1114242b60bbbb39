"""Fault injection (config ``faults``) as one hook object the engine calls at fixed points.

The defences (divergence resets, robust outliers, the watchdog) are only as good
as the faults they were tested against, so the faults are part of the product:
slow and stalled ranks, NaN weights, a Byzantine rank that lies about its
weights. With nothing configured the engine holds ``NoFaults``, whose hooks do
nothing, so the training path carries no fault logic.
"""
from __future__ import annotations

import time

import torch

from ..core import protocol, robust


class NoFaults:
    """Every hook a no-op: what the engine holds unless ``faults`` asks for something."""

    hostile = False

    def during_unit(self, t: int) -> None:
        """Inside the unit's training time: an injected slowdown."""

    def after_unit(self, t: int, flat: torch.Tensor) -> None:
        """After the unit's training: a stall, or weights turned to NaN."""

    def outgoing(self, flat: torch.Tensor) -> torch.Tensor:
        """What this rank shows others: its weights."""
        return flat

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class InjectedFaults(NoFaults):
    """The faults of one rank, from a FaultsConfig; every random draw is keyed by (seed, t, rank)."""

    def __init__(self, cfg, seed: int, rank: int):
        self.cfg, self.seed, self.rank = cfg, int(seed), int(rank)
        self.hostile = cfg.hostile_rank == rank
        self._hostile_rng = torch.Generator().manual_seed(int(seed) * 31 + 7)

    def during_unit(self, t: int) -> None:
        if self.cfg.slow_max > 0:
            time.sleep(self.cfg.slow_max * protocol.rng(self.seed, protocol.Purpose.SLOW, t, self.rank).random())

    def after_unit(self, t: int, flat: torch.Tensor) -> None:
        f = self.cfg
        if f.stall_rank == self.rank and t == f.stall_at:
            time.sleep(f.stall_seconds)
        if f.nan_rank == self.rank and t == f.nan_at:
            flat.fill_(float("nan"))

    def outgoing(self, flat: torch.Tensor) -> torch.Tensor:
        """A simulated Byzantine rank's lie (scaled or random weights), else the weights."""
        if not self.hostile:
            return flat
        return robust.hostile_payload(flat, self.cfg.hostile_kind, self.cfg.hostile_scale, self._hostile_rng)

    def state_dict(self) -> dict:
        return {"hostile_rng": self._hostile_rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._hostile_rng.set_state(state["hostile_rng"])


def make_faults(cfg, seed: int, rank: int) -> NoFaults:
    """``InjectedFaults`` when ``cfg`` (a FaultsConfig) asks for any fault, else ``NoFaults``."""
    asked = (cfg.slow_max > 0 or cfg.stall_rank is not None or cfg.nan_rank is not None
             or cfg.hostile_rank is not None)
    return InjectedFaults(cfg, seed, rank) if asked else NoFaults()
