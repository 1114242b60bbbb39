"""What a population's replica hands its process's hub when it enters a collective (``population.Hub``): one typed
value per kind of call, with what the replica brings.

The hub completes a collective once every replica of its process has entered it, and only if they all entered
the same kind (``Hub._run_collective`` dispatches on the type). ``what`` names the call for the watchdog and for
an error that shows a stuck schedule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import torch

from ..core.groups import GroupLayout


@dataclass
class Collective:
    """A replica's part of a collective (the base of every kind below)."""

    what: str


@dataclass
class Gather(Collective):
    """Allgather of each replica's equal-shaped ``row``: every replica gets the (N, ...) stack."""

    row: np.ndarray


@dataclass
class GatherText(Gather):
    """Allgather of fixed-width text rows (``row``: UTF-8 bytes padded with NULs): every replica's text."""


@dataclass
class Agree(Gather):
    """Allgather of 16-byte digests (``row``): the replicas alive whose digest differs from the lead's."""


@dataclass
class SumTensor(Collective):
    """In-place sum over every replica of a contiguous CPU tensor."""

    tensor: torch.Tensor


@dataclass
class ReduceArray(Collective):
    """Elementwise ``op`` (sum, max or min) over every replica of a float64 array: a copy for each."""

    values: np.ndarray
    op: str = "sum"


@dataclass
class BcastTensor(Collective):
    """Replica ``root``'s tensor into every replica's, in place."""

    tensor: torch.Tensor
    root: int


@dataclass
class BcastArray(Collective):
    """Replica ``root``'s array (``arr``, None elsewhere) of ``shape`` and ``dtype``: a copy for each replica."""

    arr: Optional[np.ndarray]
    shape: Tuple[int, ...]
    dtype: Any
    root: int


@dataclass
class GatherRows(Collective):
    """Gatherv of each replica's 2-D float64 ``rows`` to replica ``root`` (one block per replica, rank order)."""

    rows: np.ndarray
    root: int


@dataclass
class ColorMean(Collective):
    """``tensor`` becomes the mean over the replicas of ``color`` that ``counts`` (community models)."""

    tensor: torch.Tensor
    color: int
    counts: bool


@dataclass
class Together(Collective):
    """Work the replicas of a process do as one, no MPI: ``compute(items)`` once, one result per replica."""

    item: Any
    compute: Callable[[List[Any]], List[Any]]


@dataclass
class SetUpGroups(Collective):
    """The run's data-parallel groups of ``layout``, set up once for the process."""

    layout: GroupLayout


@dataclass
class Barrier(Collective):
    """Every replica of every process has reached it."""


@dataclass
class LocalRank(Collective):
    """The process's rank among the processes of its node."""


@dataclass
class Recover(Collective):
    """After a lost process: shrink to the survivors (the replicas newly lost, for each)."""


IN_PROCESS = (Together, SetUpGroups, LocalRank)  # kinds completed without waiting on other processes
