"""A replica as a member of its data-parallel group (``train.group_size`` > 1): what it shares with its members.

The members of a group average their gradients at every step and take the same number of steps, so they stay
equal: the group is one model trained on their shards. What a group tells partners at a merge is the group's,
the same on every member: its samples in all, its members' mean training loss, whether any member diverged.
BatchNorm's running statistics follow each member's own batches, so at the end of every unit the members take
their lead's.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, List, Optional

import numpy as np
import torch

from ...workload import models, train
from ..timer import Timer

if TYPE_CHECKING:
    from ...runtime.groups import GroupWorld


class GroupMember:
    """This replica's side of its group: the calls inside it, and the figures it tells partners."""

    def __init__(self, groups: "GroupWorld", *, shard_sizes: List[int], train_cfg, timer: Timer):
        self.intra, self.timer = groups.intra, timer
        self.size = groups.layout.size
        self.lead = groups.lead_member  # the lead's place in the group: whose buffers and initial weights count
        self._groups = groups
        self.owner, self.owners = groups.rank, groups.size  # the group, and how many: who owns pbt values
        # an epoch unit: every replica takes the longest shard's steps, as a per-step collective needs
        self.steps: Optional[int] = (train.lockstep_steps(shard_sizes, train_cfg.batch_size)
                                     if train_cfg.unit == "epoch" else None)
        self.samples = 0  # the group's samples in all (merge.rule clock)
        self.loss = float("nan")  # its members' mean recent training loss (merge.rule loss)

    def refresh(self) -> None:
        """After a lost member (comm.fault_tolerance shrink): the calls inside the group rebuilt, the gradient
        averaged over the members alive, a new lead where the lead was lost."""
        groups = self._groups
        self.intra = groups.intra
        base, members = groups.base, groups.layout.members(groups.rank)
        self.size = sum(1 for r in members if base.alive[r])
        self.lead = groups.lead_member

    def share_initial(self, flat: torch.Tensor) -> None:
        """A group is one model: its members start from their lead's weights (model.init other than shared)."""
        self.intra.bcast_(flat, self.lead)

    def gradients(self, model: torch.nn.Module) -> Callable[[], None]:
        """The flat gradient averaged over the group between backward and the optimizer step (every step)."""
        intra, timer, size = self.intra, self.timer, self.size
        flat_grad = models.bind_flat_grad_(model)

        def average() -> None:
            with timer("exchange"), timer.collective("group_gradients"):  # waiting on members: idle (settle)
                intra.allreduce_sum_(flat_grad)
            flat_grad.div_(size)
        return average

    def unit_end(self, samples: int, loss: float, diverged: bool, buffers: Optional[torch.Tensor]) -> bool:
        """The end of a unit: the group's figures (one Allreduce of four values) and its lead's ``buffers``;
        returns whether any member diverged."""
        with self.timer("exchange"), self.timer.collective("group_unit_end"):
            got = self.intra.allreduce_array(np.array([samples, loss, float(diverged), 1.0]))
            if buffers is not None and buffers.numel():
                self.intra.bcast_(buffers, self.lead)
        self.samples += int(got[0])
        self.loss = float(got[1] / got[3])
        return bool(got[2] > 0)

    def sum(self, values: np.ndarray) -> np.ndarray:
        """Elementwise sums over the group's members (a float64 copy): evidence every member gathered."""
        return self.intra.allreduce_array(values)

    def mean(self, value: float) -> float:
        """The mean of ``value`` over the group's members: what a group tells partners (a pbt score)."""
        got = self.intra.allreduce_array(np.array([value, 1.0]))
        return float(got[0] / got[1])

    def state_dict(self) -> dict:
        return {"samples": self.samples, "loss": self.loss}

    def load_state_dict(self, state: dict) -> None:
        self.samples, self.loss = int(state["samples"]), float(state["loss"])
        if not math.isfinite(self.loss):
            self.loss = float("nan")
