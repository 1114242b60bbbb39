"""A data-parallel group's lead under ``protocol: async`` in a population: the group's asynchronous calls.

Under the virtual clock every member of a group runs the same group-level code and a point-to-point call is the
lead's, whose received bytes the lead broadcasts to its members (``groups.GroupWorld``). Under the asynchronous
protocol what a group does depends on the messages it happens to receive, which only its lead receives, so only
the lead runs the asynchronous mixer, through this view: ranks are groups; every control message, exchange and
posted half goes to and comes from the other groups' leads, and nothing is broadcast inside the group. The
members follow at each unit's end (``engine/mixing/async_groups.py``): a small signal, then the lead's state.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from .groups import GroupWorld


class LeadView:
    """The lead replica's asynchronous calls on behalf of its group (everything else: its ``GroupWorld``)."""

    def __init__(self, groups: GroupWorld):
        self.groups, self.base, self.layout = groups, groups.base, groups.layout

    def __getattr__(self, name: str) -> Any:
        return getattr(self.groups, name)

    def _lead(self, group: int) -> int:
        return self.groups._lead_of(int(group))

    # ------------------------------------------------------------ what the process shares

    def together(self, key, item, compute):
        return self.base.together(key, item, compute)

    def shared(self, key, compute):
        return self.base.shared(key, compute)

    @property
    def flags(self) -> set:
        return self.base.flags

    def pause(self, seconds: float) -> None:
        self.base.pause(seconds)

    @property
    def process_block(self) -> List[int]:
        """The groups whose lead this process hosts."""
        leads = self.groups._lead_rows()
        block = set(self.base.process_block)
        return [g for g, r in enumerate(leads) if r in block]

    def process_heads(self) -> List[int]:
        """The first group alive of every other process (each hears a stop for its whole process)."""
        return sorted({self.layout.group_of(r) for r in self.base.process_heads()})

    # ------------------------------------------------------------ exchanges between leads

    def sendrecv(self, send, recv, peer: int, tag: int = 0) -> None:
        self.base.sendrecv(send, recv, self._lead(peer), tag)

    def sendrecv_array(self, send: np.ndarray, peer: int, tag: int = 0) -> np.ndarray:
        return self.base.sendrecv_array(send, self._lead(peer), tag)

    def sendrecv_vector(self, send: np.ndarray, peer: int, tag: int) -> np.ndarray:
        return self.base.sendrecv_vector(send, self._lead(peer), tag)

    def post_ints(self, values: np.ndarray, dest: int, tag: int) -> None:
        self.base.post_ints(values, self._lead(dest), tag)

    def poll_ints(self, tag: int, count: int) -> Optional[Tuple[int, np.ndarray]]:
        got = self.base.poll_ints(tag, count)
        return None if got is None else (self.layout.group_of(got[0]), got[1])

    def recv_ints(self, source: int, tag: int, count: int) -> np.ndarray:
        return self.base.recv_ints(self._lead(source), tag, count)

    def isend(self, buf, peer: int, tag: int):
        return self.base.isend(buf, self._lead(peer), tag)

    def irecv(self, buf, peer: int, tag: int):
        return self.base.irecv(buf, self._lead(peer), tag)

    def poll_floats(self, peer: int, tag: int) -> Optional[np.ndarray]:
        return self.base.poll_floats(self._lead(peer), tag)

    def ibarrier(self):
        return self.base.ibarrier()

    def complete_posts(self) -> None:
        self.base.complete_posts()

    def drop_posts(self) -> None:
        self.base.drop_posts()

    def alltoall_counts(self, counts: np.ndarray) -> np.ndarray:
        """Control messages sent to each group's lead, and read from each: the replicas' table at the leads."""
        leads = self.groups._lead_rows()
        full = np.zeros(self.base.size, dtype=np.int64)
        full[leads] = counts
        return self.base.alltoall_counts(full)[leads]
