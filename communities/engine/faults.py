"""Fault injection (config ``faults``) as one hook object the engine calls at fixed points.

The defences (divergence resets, robust outliers, the watchdog) are only as good
as the faults they were tested against, so the faults are part of the product:
slow and stalled ranks, NaN weights, a Byzantine rank that lies about its
weights, and heterogeneity (a rank persistently slower by a factor, random
per-batch jitter), so that anyone can reproduce a straggler benchmark. With
nothing configured the engine holds ``NoFaults``, whose hooks do nothing, so the
training path carries no fault logic.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import List, Optional

import torch

from ..config import FaultsConfig
from ..core import protocol, robust


class NoFaults:
    """Every hook a no-op: what the engine holds unless ``faults`` asks for something."""

    hostile = False

    def during_unit(self, t: int) -> None:
        """Inside the unit's training time: an injected slowdown."""

    def batch_hook(self, t: int) -> Optional["SlowDown"]:
        """A function to call after each batch of unit t (None: nothing to do)."""
        return None

    def slow_stacked(self, t: int, seconds: float, steps: int) -> None:
        """After a population's stacked unit that took ``seconds`` of compute: the process's slowdown of it."""

    def after_unit(self, t: int, flat: torch.Tensor) -> None:
        """After the unit's training: a stall, or weights turned to NaN."""

    def outgoing(self, flat: torch.Tensor) -> torch.Tensor:
        """What this rank shows others: its weights."""
        return flat

    def in_exchange(self, t: int) -> None:
        """Inside an exchange, after the header swap: a lost rank (faults.kill_in: exchange)."""

    def in_round(self, t: int) -> None:
        """At a signature round, before the gather: a lost rank (faults.kill_in: round)."""

    def in_checkpoint(self, t: int) -> None:
        """Inside a checkpoint, every rank's file written, before the commit: a lost rank (kill_in: checkpoint)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class InjectedFaults(NoFaults):
    """The faults of one rank, from a FaultsConfig; every random draw is keyed by (seed, t, rank)."""

    def __init__(self, cfg: FaultsConfig, seed: int, rank: int, *, block: Optional[List[int]] = None):
        self.cfg, self.seed, self.rank = cfg, int(seed), int(rank)
        # faults.speed acts on a process: a population's replicas all take the slowest factor named in their block
        self.factor = max([float(cfg.speed.get(r, 1.0)) for r in (block or [rank])] + [1.0])
        self.hostile = cfg.hostile_rank == rank
        self._hostile_rng = torch.Generator().manual_seed(int(seed) * 31 + 7)

    def during_unit(self, t: int) -> None:
        if self.cfg.slow_max > 0:
            time.sleep(self.cfg.slow_max * protocol.rng(self.seed, protocol.Purpose.SLOW, t, self.rank).random())

    def batch_hook(self, t: int) -> Optional["SlowDown"]:
        """faults.speed: sleep (factor - 1) x each batch's own time; faults.jitter: a random extra per batch."""
        factor = self.factor
        jitter = float(self.cfg.jitter)
        if factor == 1.0 and jitter == 0.0:
            return None
        return SlowDown(factor, jitter, protocol.rng(self.seed, protocol.Purpose.JITTER, t, self.rank))

    def slow_stacked(self, t: int, seconds: float, steps: int) -> None:
        """faults.speed: (factor - 1) x the stacked unit's compute; faults.jitter: a random extra per step."""
        pause = (self.factor - 1.0) * seconds
        if self.cfg.jitter:
            rng = protocol.rng(self.seed, protocol.Purpose.JITTER, t, self.rank)
            pause += self.cfg.jitter * float(rng.random(max(int(steps), 0)).sum())
        if pause > 0:
            time.sleep(pause)

    def after_unit(self, t: int, flat: torch.Tensor) -> None:
        f = self.cfg
        if f.stall_rank == self.rank and t == f.stall_at:
            time.sleep(f.stall_seconds)
        if f.nan_rank == self.rank and t == f.nan_at:
            flat.fill_(float("nan"))
        self._kill(t, "train")

    def in_exchange(self, t: int) -> None:
        self._kill(t, "exchange")

    def in_round(self, t: int) -> None:
        self._kill(t, "round")

    def in_checkpoint(self, t: int) -> None:
        self._kill(t, "checkpoint")

    def _kill(self, t: int, where: str) -> None:
        """faults.kill: this process ends itself with SIGKILL (no handler, no flush, no MPI_Finalize)."""
        at = self.cfg.kill.get(self.rank)
        if at is None or t < at or self.cfg.kill_in != where:
            return
        sys.stderr.write(f"communities: faults: rank {self.rank} sends itself SIGKILL at t={t} ({where}; "
                         f"wall {time.time():.3f})\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def outgoing(self, flat: torch.Tensor) -> torch.Tensor:
        """A simulated Byzantine rank's lie (scaled or random weights), else the weights."""
        if not self.hostile:
            return flat
        return robust.hostile_payload(flat, self.cfg.hostile_kind, self.cfg.hostile_scale, self._hostile_rng)

    def state_dict(self) -> dict:
        return {"hostile_rng": self._hostile_rng.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self._hostile_rng.set_state(state["hostile_rng"])


class SlowDown:
    """Called after each batch: stretches the batch's own compute time by ``factor``, plus jitter."""

    def __init__(self, factor: float, jitter: float, rng):
        self.factor, self.jitter, self.rng = factor, jitter, rng
        self.mark = time.perf_counter()  # when the current batch's compute started

    def restart(self) -> None:
        """The next batch's compute starts now (after whatever ran between batches)."""
        self.mark = time.perf_counter()

    def __call__(self, step: int) -> None:
        pause = (self.factor - 1.0) * (time.perf_counter() - self.mark)
        if self.jitter:
            pause += self.jitter * self.rng.random()
        time.sleep(pause)
        self.restart()


def make_faults(cfg: FaultsConfig, seed: int, rank: int, *, block: Optional[List[int]] = None) -> NoFaults:
    """``InjectedFaults`` when ``cfg`` (a FaultsConfig) asks for any fault, else ``NoFaults``. ``block``: the
    ranks this rank's process hosts (a population's replicas): faults.speed slows the whole process."""
    asked = (cfg.slow_max > 0 or cfg.stall_rank is not None or cfg.nan_rank is not None
             or cfg.hostile_rank is not None or bool(cfg.speed) or cfg.jitter > 0 or bool(cfg.kill))
    return InjectedFaults(cfg, seed, rank, block=block) if asked else NoFaults()
