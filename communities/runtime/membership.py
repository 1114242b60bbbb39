"""The survivors of a job (``comm.fault_tolerance: shrink``): which logical ranks are alive, and where each sits.

A rank keeps its logical number for the whole job, so that shards, merge clocks and partner laws keep their
meaning after a loss. ``members`` lists the logical ranks alive in the order of the communicator's ranks (a
shrunk communicator keeps the survivors' order), which maps a logical rank to the rank MPI knows it by, and
rows gathered from the survivors back to one row per logical rank. While every rank is alive (``whole``, the
default path) nothing is remapped. Pure bookkeeping: the MPI calls stay in ``comm`` and ``ulfm``.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np


class Membership:
    """The logical ranks alive out of ``size``, in the order of the communicator's ranks."""

    def __init__(self, size: int, members: Sequence[int] = ()):
        self.size = int(size)
        self.members: np.ndarray = (np.asarray(members, dtype=np.int64) if len(members)
                                    else np.arange(self.size, dtype=np.int64))

    @classmethod
    def of_survivors(cls, members: Sequence[int], size: int, processes: int) -> "Membership":
        """A job resumed by the survivors of a larger one: the sorted logical ranks ``members``, one per process."""
        if len(members) != processes:
            raise ValueError(f"{len(members)} survivors need as many ranks; this job has {processes}")
        return cls(size, sorted(int(r) for r in members))

    @property
    def alive(self) -> np.ndarray:
        """(N,) bool: which logical ranks are alive."""
        mask = np.zeros(self.size, dtype=bool)
        mask[self.members] = True
        return mask

    @property
    def n_alive(self) -> int:
        return len(self.members)

    @property
    def lead(self) -> int:
        """The lowest logical rank alive (the members are kept in rank order)."""
        return int(self.members[0])

    @property
    def whole(self) -> bool:
        """True while every logical rank is alive (no remapping anywhere)."""
        return len(self.members) == self.size

    def logical(self, comm_rank: int) -> int:
        """The logical rank of the process at ``comm_rank`` of the communicator."""
        return int(self.members[comm_rank])

    def comm_rank(self, rank: int) -> int:
        """The communicator rank of logical ``rank`` (which must be alive)."""
        if self.whole:
            return rank
        k = int(np.searchsorted(self.members, rank))
        if k == len(self.members) or self.members[k] != rank:
            raise ValueError(f"rank {rank} was lost: no message can go to or come from it")
        return k

    def spread(self, got: np.ndarray) -> np.ndarray:
        """Rows gathered from the survivors, placed at their logical ranks (a lost rank's row: zeros)."""
        if self.whole:
            return got
        out = np.zeros((self.size,) + got.shape[1:], dtype=got.dtype)
        out[self.members] = got
        return out

    def spread_blocks(self, blocks: List[np.ndarray], width: int) -> List[np.ndarray]:
        """Variable-length blocks gathered from the survivors, one per logical rank (a lost rank's: no rows)."""
        if self.whole:
            return blocks
        out = [np.zeros((0, width)) for _ in range(self.size)]
        for r, b in zip(self.members, blocks):
            out[int(r)] = b
        return out

    def keep(self, kept: Sequence[int]) -> List[int]:
        """After a shrink: only the processes at communicator ranks ``kept`` remain; returns the logical ranks lost.

        ``kept`` is the agreed list of survivors (``ulfm.shrink``), in the new communicator's order.
        """
        members = self.members[np.asarray(kept, dtype=np.int64)]
        lost = sorted(set(self.members.tolist()) - set(members.tolist()))
        self.members = members
        return lost


class RanksAlive:
    """Who a view's logical ranks are, read from its ``membership`` (``LogicalRanks`` and a ``GroupWorld``)."""

    membership: Membership

    @property
    def size(self) -> int:
        return self.membership.size

    @property
    def members(self) -> np.ndarray:
        return self.membership.members

    @property
    def alive(self) -> np.ndarray:
        return self.membership.alive

    @property
    def n_alive(self) -> int:
        return self.membership.n_alive

    @property
    def whole(self) -> bool:
        return self.membership.whole
