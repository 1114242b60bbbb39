"""A population's replicas trained and scored as one stacked model (``train.vectorize``), from the replica's side.

Every replica of the process hands its part to ``world.together``; the first builds the process's
``StackedTrainer`` (once: ``world.shared``), which trains or scores them all in one ``torch.func.vmap``. The call
is waited for as idle, and each replica's share of its seconds is then counted as training or evaluation.
"""
from __future__ import annotations

import time
from typing import Any, List, Optional, Tuple

import torch

from ...runtime.traffic import Call, wire_bytes
from ...workload import train, vectorized
from ...workload.vectorized import StackedTrainer


def group_size(cfg, replicas: int) -> int:
    """The replicas that average their gradients at every step: a data-parallel group, or every replica
    (strategy allreduce), or 1."""
    return replicas if cfg.strategy == "allreduce" else cfg.train.group_size


def train_together(replica: Any, t: int, steps: Optional[int]) -> train.UnitResult:
    """Unit t of ``replica``, trained with the process's other replicas as one stacked model. Replicas that average
    their gradients at every step (a data-parallel group, or every replica under strategy allreduce) do it as rows
    of the stacked step, across processes through the process's world where the group spans several; the bytes
    are counted as the replicas' own Allreduces would count them."""
    r, cfg = replica, replica.cfg
    member = vectorized.Member(r.model, r.opt, r.flat, r.data.x, r.data.y, r.rank)
    size = group_size(cfg, r.world.size)
    across = r.world.across_processes(size) if size > 1 else None

    def step(members: List[vectorized.Member]) -> list:
        start = time.perf_counter()
        out = vectorized.train_members(trainer(r, len(members)), members, cfg.seed, t, steps, group_size=size,
                                       across=across)
        # faults.speed / jitter act on the process: its stacked unit is slowed, and counted as training
        r.faults.slow_stacked(t, time.perf_counter() - start, max((res.steps for res, _ in out), default=0))
        share = (time.perf_counter() - start) / max(len(members), 1)
        return [(res, share) for res, _ in out]

    with r.timer("idle"):
        res, seconds = r.world.together(("train", t), member, step)
    r.timer.reassign(seconds, "idle", "train")
    if size > 1:  # the gradient averages, done as rows of the stacked step
        averaged = res.steps * wire_bytes(Call.ALLREDUCE, r.n_params * r.flat.element_size(), size)
        if cfg.strategy == "allreduce":
            r.world.count_sent(averaged)  # as the replica's own Allreduces over the world count
        else:
            r.world.count_in_group(averaged)
    return res


def trainer(replica: Any, count: int) -> StackedTrainer:
    """The process's stacked model for ``count`` replicas (built once, by the first replica that asks): on the
    process's block of replica rows (``block.py``), which it then trains in place, where it has ``count`` rows."""
    r = replica
    rows = r.rows if r.rows is not None and r.rows.shape[0] == count else None
    return r.world.shared(("stacked trainer", count), lambda: StackedTrainer(
        r.model, torch.zeros((count, r.n_params), dtype=r.flat.dtype) if rows is None else rows, r.cfg.train,
        name=r.cfg.model.name))


def evaluate_together(replica: Any, t: int, m: Optional[int]) -> Tuple[float, float]:
    """``replica``'s (accuracy, loss) on the shared test split, scored with the process's other replicas as one
    stacked model; its share of the seconds is counted as evaluation."""
    r = replica

    def score(flats: List[torch.Tensor]) -> list:
        start = time.perf_counter()
        res = trainer(r, len(flats)).evaluate(flats, r.data.x_test[:m], r.data.y_test[:m])
        share = (time.perf_counter() - start) / max(len(flats), 1)
        return [(x, share) for x in res]

    with r.timer("idle"):
        res, seconds = r.world.together(("eval", t), r.flat, score)
    r.timer.reassign(seconds, "idle", "eval")
    return res
