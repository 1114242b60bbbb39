"""Data-parallel groups (``train.group_size``): G consecutive replicas train one model on G shards.

Replica r belongs to group ``r // G`` as member ``r % G``. The members average their gradients at every
step, so they hold the same weights; the algorithm (signatures, communities, partner draws, merges,
consensus) acts on groups, each represented by its *lead*: its lowest member alive. These are the layout's
rules as functions of integers and masks; what crosses MPI is ``runtime/groups.py``'s.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class GroupLayout:
    """``replicas`` replicas in consecutive groups of ``size``."""

    replicas: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"train.group_size={self.size} must be at least 1")
        if self.replicas % self.size:
            raise ValueError(f"train.group_size={self.size} must divide world_size={self.replicas}")

    @property
    def groups(self) -> int:
        return self.replicas // self.size

    def group_of(self, replica: int) -> int:
        return int(replica) // self.size

    def member_of(self, replica: int) -> int:
        return int(replica) % self.size

    def members(self, group: int) -> List[int]:
        """The replicas of ``group``, in rank order."""
        return list(range(group * self.size, (group + 1) * self.size))

    def lead(self, group: int, alive: Optional[np.ndarray] = None) -> int:
        """The group's lead: its lowest replica alive (``alive``: (replicas,) bool; None: all are)."""
        for r in self.members(group):
            if alive is None or alive[r]:
                return r
        raise ValueError(f"group {group} has no replica alive")

    def leads(self, alive: Optional[np.ndarray] = None) -> np.ndarray:
        """(groups,) the lead replica of every group with a replica alive (a group with none: -1)."""
        out = np.full(self.groups, -1, dtype=np.int64)
        for g in range(self.groups):
            members = self.members(g)
            live = [r for r in members if alive is None or alive[r]]
            if live:
                out[g] = live[0]
        return out

    def group_alive(self, alive: Optional[np.ndarray] = None) -> np.ndarray:
        """(groups,) bool: which groups have a replica alive."""
        if alive is None:
            return np.ones(self.groups, dtype=bool)
        return np.asarray(np.asarray(alive, dtype=bool).reshape(self.groups, self.size).any(axis=1))

    def of_groups(self, per_replica: np.ndarray) -> np.ndarray:
        """A per-replica array as the groups see it: each group's lead's entry (the first member's)."""
        arr = np.asarray(per_replica)
        if arr.shape[0] != self.replicas:
            raise ValueError(f"{arr.shape[0]} rows for {self.replicas} replicas")
        return arr[:: self.size]

    def spans_processes(self, processes: int) -> bool:
        """Whether a group's members sit on more than one process."""
        return processes > 0 and self.size > self.replicas // max(processes, 1)


def tree_sum_rows(rows: torch.Tensor, size: int) -> torch.Tensor:
    """The sum over each consecutive block of ``size`` rows of a (R, ...) tensor, as a pairwise tree in member
    order (``placement.tree_sum``'s order), returned as (R / size, ...)."""
    R = rows.shape[0]
    level = rows.reshape(R // size, size, *rows.shape[1:])
    while level.shape[1] > 1:
        n = level.shape[1]
        paired = level[:, 0: n - 1: 2] + level[:, 1: n: 2]
        if n % 2:
            paired = torch.cat([paired, level[:, n - 1: n]], dim=1)
        level = paired
    return level[:, 0]


def tree_mean_rows(rows: torch.Tensor, size: int) -> torch.Tensor:
    """``tree_sum_rows`` divided by ``size``: each group's mean gradient, as its members' Allreduce gives it."""
    return tree_sum_rows(rows, size) / size
