"""Bytes this rank sent, by kind: what the summary reports and a resumed run keeps counting.

``bytes_sent`` is training traffic (merges, signatures, averages that change the weights); the other kinds are
kept apart so that they never inflate it: ``monitoring`` (consensus-model evaluations), ``data`` (training
examples passed between partners) and ``control`` (collectives that only coordinate the ranks: set-up
broadcasts, stop votes and flags, counts, log gathers). ``in_process`` is the part of ``bytes_sent`` that two
replicas of one process swapped in memory (a population: ``population.py``); the rest crossed MPI.
``in_group`` is the part of ``bytes_sent`` that stayed inside a data-parallel group (``train.group_size``: every
step's gradient average, a lead's copies to its members): the fast link's share; what is left crossed between
groups, the traffic the method saves. Counts
follow a simple model of each call (what one rank puts on the wire, ``wire_bytes``), the same on every MPI library
and for every view of the job: one replica per process (``comm.World``) or a population's (``population``), always
over the ranks alive, so the counts agree after a lost rank too.
"""
from __future__ import annotations

import contextlib
import enum
from typing import Iterator


class Call(enum.Enum):
    """A collective, as the byte model sees it."""

    ALLGATHER = "allgather"  # every rank's ``nbytes`` to each other rank
    ALLREDUCE = "allreduce"  # a bandwidth-optimal (ring) reduction of ``nbytes``
    ALLTOALL = "alltoall"  # ``nbytes`` to each other rank (an item each)
    BCAST = "bcast"  # the root's ``nbytes`` to each other rank
    GATHERV = "gatherv"  # the row counts' Allgather (int64), then a non-root's ``nbytes`` to the root


def wire_bytes(call: Call, nbytes: int, n: int, *, root: bool = False) -> int:
    """What one rank sends in ``call`` of ``nbytes`` over ``n`` ranks (``root``: whether it is the call's root)."""
    if call is Call.ALLREDUCE:
        return int(2 * (n - 1) * nbytes // max(n, 1))
    if call in (Call.ALLGATHER, Call.ALLTOALL):
        return int(nbytes * (n - 1))
    if call is Call.BCAST:
        return int(nbytes * (n - 1)) if root else 0
    return 8 * (n - 1) + (0 if root else int(nbytes))  # Call.GATHERV


class Traffic:
    """The byte counters of one rank."""

    COUNTERS = ("bytes_sent", "bytes_monitoring", "bytes_data", "bytes_control", "bytes_in_process", "bytes_in_group")

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.bytes_monitoring = 0
        self.bytes_data = 0
        self.bytes_control = 0
        self.bytes_in_process = 0  # the part of bytes_sent that a population's replicas swapped inside one process
        self.bytes_in_group = 0  # the part of bytes_sent that stayed inside a data-parallel group

    @contextlib.contextmanager
    def metered(self, kind: str) -> Iterator[None]:
        """Count the bytes sent inside the block in ``bytes_<kind>`` (monitoring, data), not ``bytes_sent``."""
        before, inside, grouped = self.bytes_sent, self.bytes_in_process, self.bytes_in_group
        try:
            yield
        finally:
            setattr(self, f"bytes_{kind}", getattr(self, f"bytes_{kind}") + self.bytes_sent - before)
            self.bytes_sent, self.bytes_in_process, self.bytes_in_group = before, inside, grouped

    @contextlib.contextmanager
    def inside_group(self) -> Iterator[None]:
        """The training bytes sent inside the block stayed inside this replica's data-parallel group: they count in
        ``bytes_sent`` as always, and in ``bytes_in_group`` too."""
        before = self.bytes_sent
        try:
            yield
        finally:
            self.bytes_in_group += self.bytes_sent - before

    def _sent(self, nbytes: int) -> None:
        """Training bytes of a collective (a population's replica keeps its process's share apart as well)."""
        self.bytes_sent += nbytes

    def count_in_group(self, nbytes: int) -> None:
        """Training bytes that stayed inside this replica's data-parallel group (``inside_group``, for bytes
        counted rather than sent through this view: a population's stacked step)."""
        self.bytes_sent += nbytes
        self.bytes_in_group += nbytes

    def monitoring(self):
        """Bytes sent inside the block only measure (consensus-model evaluations): not training traffic."""
        return self.metered("monitoring")

    def state_dict(self) -> dict:
        """The byte counters (a resumed run keeps counting where it stopped)."""
        return {key: int(getattr(self, key)) for key in self.COUNTERS}

    def load_state_dict(self, state: dict) -> None:
        for key in self.COUNTERS:
            setattr(self, key, int(state.get(key, 0)))  # (a checkpoint written before a kind was counted: 0)
