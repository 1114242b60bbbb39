"""Data-parallel groups (``train.group_size`` G > 1): the calls inside a group, and the run as its groups see it.

Two things cross MPI differently once replicas form groups:

- **Inside a group** (``IntraGroup``): every step's gradient average, and the copies a lead hands its members.
  With one replica per process it is a ``Comm.Split`` of the world by group (``SubcommGroup``); in a
  population the process's hub completes it (``population.HubGroup``): a tree in memory when the group lies in
  one process, plus one MPI call among the processes a group spans. Its bytes count as training traffic and as
  ``bytes_in_group``: the fast link's share, kept apart from what crosses between groups.
- **Between groups** (``GroupWorld``): the view the algorithm's parts take (rounds, mixer, consensus, community
  mode, delivery). Its logical rank is the group and its size the number of groups. Every member of a group runs
  the same group-level code on the same weights, so a collective across groups takes each group's *lead's*
  value (gathers keep the leads' rows; sums add the leads' values, the other members adding zeros; max and min
  take every replica's, so a stop flag raised anywhere counts), and a point-to-point exchange with group h is
  the lead's ``Sendrecv`` with h's lead, whose received bytes the lead then broadcasts inside its group: every
  member merges the same bytes and stays equal to its lead.
"""
from __future__ import annotations

from typing import Any, List, Optional, Protocol

import numpy as np
import torch

from ..core.groups import GroupLayout
from .membership import Membership, RanksAlive


class IntraGroup(Protocol):
    """The calls inside one replica's group; every member alive calls each of them, in the same order."""

    layout: GroupLayout
    member: int  # this replica's place in its group (0 .. G-1)

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor: ...

    def allreduce_array(self, values: np.ndarray, op: str = "sum") -> np.ndarray: ...

    def bcast_(self, t: torch.Tensor, root_member: int) -> torch.Tensor: ...

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root_member: int) -> np.ndarray: ...


class SubcommGroup:
    """A replica's group when every replica is an MPI process of its own: a ``Comm.Split`` of the world by group
    (a collective on the world: every rank builds its own)."""

    def __init__(self, world, layout: GroupLayout):
        self.world, self.layout = world, layout
        self.member = layout.member_of(world.rank)
        group = layout.group_of(world.rank)
        # the members alive, in rank order: their places in the split (a lost member's left out: shrink)
        self.places = [layout.member_of(r) for r in layout.members(group) if world.alive[r]]
        self.sub = world.split(group)

    def _root(self, root_member: int) -> int:
        return self.places.index(int(root_member))

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        with self.world.inside_group():
            return self.sub.allreduce_sum_(t)

    def allreduce_array(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        return self.sub.allreduce_array(values, op)

    def bcast_(self, t: torch.Tensor, root_member: int) -> torch.Tensor:
        with self.world.inside_group():
            return self.sub.bcast_(t, self._root(root_member))

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root_member: int) -> np.ndarray:
        with self.world.inside_group():
            return self.sub.bcast_array(arr, shape, dtype, self._root(root_member))

    def revoke(self) -> None:
        """Before a shrink (comm.fault_tolerance shrink): a member blocked in a call inside the group returns."""
        try:
            if self.sub.comm is not None:
                self.sub.comm.Revoke()
        except Exception:  # revoked already, or gone: either way nobody waits in it any more
            pass

    def free(self) -> None:
        """After a shrink: the split of the revoked communicator is given up (it may refuse: gone either way)."""
        try:
            self.sub.free()
        except Exception:
            self.sub.comm = None


class _GroupRows:
    """An ``iallgather`` across groups: completes the world's request, then keeps the leads' rows."""

    def __init__(self, request, full: np.ndarray, *, out: np.ndarray, leads: np.ndarray):
        self.request, self.full, self.out, self.leads = request, full, out, leads

    def Wait(self) -> None:
        self.request.Wait()
        self.out[...] = self.full[self.leads]

    def Test(self) -> bool:
        done = bool(self.request.Test())
        if done:
            self.out[...] = self.full[self.leads]
        return done


class GroupWorld(RanksAlive):
    """The run as its groups see it: logical rank = this replica's group, size = the number of groups.

    Built by every replica (``build_groups``); the group-level parts of the engine take it in place of the
    replica's world. What a replica alone owns (its data, bytes, the log's rows) stays on ``base``.
    """

    shrinks = False

    def __init__(self, base, layout: GroupLayout, intra: IntraGroup):
        self.base, self.layout, self.intra = base, layout, intra
        self.rank = layout.group_of(base.rank)  # the group: what the algorithm calls this rank
        self.member = layout.member_of(base.rank)
        self.membership = Membership(layout.groups)
        self.processes = base.processes
        self.watchdog = base.watchdog

    # ------------------------------------------------------------ who

    @property
    def lead(self) -> int:
        """The group of the run's lead replica (the writer)."""
        return self.layout.group_of(self.base.lead)

    @property
    def leads(self) -> bool:
        """Whether this replica is the run's lead (the writer), as on its own world."""
        return bool(self.base.leads)

    @property
    def leads_group(self) -> bool:
        """Whether this replica is its group's lead: the one whose values count across groups."""
        return self.base.rank == self._lead_of(self.rank)

    def root(self, root: Optional[int]) -> int:
        return self.lead if root is None else int(root)

    def _lead_of(self, group: int) -> int:
        return self.layout.lead(group, None if self.base.whole else self.base.alive)

    def _lead_rows(self) -> np.ndarray:
        return self.layout.leads(None if self.base.whole else self.base.alive)

    def revoke(self) -> None:
        """Before a shrink: the calls inside this replica's group return (a hub's group: nothing to revoke)."""
        if hasattr(self.intra, "revoke"):
            self.intra.revoke()

    def refresh(self) -> None:
        """After a lost process (comm.fault_tolerance shrink, a collective of the survivors): the groups with a
        member alive, each led by its lowest member alive, and the calls inside groups rebuilt on the survivors."""
        alive = self.layout.group_alive(None if self.base.whole else self.base.alive)
        self.membership = Membership(self.layout.groups, np.flatnonzero(alive).tolist())
        old = self.intra
        if hasattr(old, "free"):
            old.free()
        self.intra = self.base.intra_group(self.layout)

    def of_ranks(self, per_replica: np.ndarray) -> np.ndarray:
        """A per-replica array (planted groups, ...) as this view's ranks see it: each group's lead's entry."""
        return self.layout.of_groups(per_replica)

    # ------------------------------------------------------------ what the replica's world does as it is

    def shared(self, key, compute):
        return self.base.shared(key, compute)

    def together(self, key, item, compute):
        return self.base.together(key, item, compute)

    def monitoring(self):
        return self.base.monitoring()

    def metered(self, kind: str):
        return self.base.metered(kind)

    def set_timeout(self, timeout: float) -> None:
        self.base.set_timeout(timeout)

    def agree(self, digest: bytes, what: str) -> None:
        self.base.agree(digest, what)  # every replica: the members must agree as well

    def barrier(self, what: str = "Barrier") -> None:
        self.base.barrier(what)

    def group_mean_(self, t: torch.Tensor, color: int, counts: bool = True) -> int:
        """The mean over the replicas of ``color`` (each group's members alike: the mean over its groups)."""
        return self.base.group_mean_(t, color, counts)

    def hostnames(self) -> List[str]:
        return self.base.hostnames()

    @property
    def local_rank(self) -> int:
        return self.base.local_rank

    @property
    def bytes_sent(self) -> int:
        """What this view counts as sent: the bytes between groups (the replica's, less what stayed in its group)."""
        return self.base.bytes_sent - self.base.bytes_in_group

    @property
    def bytes_data(self) -> int:
        return self.base.bytes_data

    # ------------------------------------------------------------ collectives across groups

    def allgather(self, row: np.ndarray) -> np.ndarray:
        return self.base.allgather(row)[self._lead_rows()]

    def allgather_text(self, text: str, width: int = 512) -> List[str]:
        """Every replica's text, not only the leads' (set-up errors and fingerprints: a member's counts too)."""
        return self.base.allgather_text(text, width)

    def iallgather(self, row: np.ndarray, what: str = "Iallgather"):
        request, full, kept = self.base.iallgather(row, what)
        out = np.empty((self.size,) + full.shape[1:], dtype=full.dtype)
        return _GroupRows(request, full, out=out, leads=self._lead_rows()), out, kept

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        if not self.leads_group:
            t.zero_()
        return self.base.allreduce_sum_(t)

    def allreduce_array(self, values: np.ndarray, op: str = "sum", what: str = "Allreduce") -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if op == "sum" and not self.leads_group:
            values = np.zeros_like(values)
        return self.base.allreduce_array(values, op, what)

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        return float(self.allreduce_array(np.array([value], dtype=np.float64), op, what="Allreduce of a scalar")[0])

    def allreduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        self.allreduce_sum_(t)
        return t.div_(self.n_alive)

    def bcast_(self, t: torch.Tensor, root: Optional[int] = None) -> torch.Tensor:
        return self.base.bcast_(t, root=self._lead_of(self.root(root)))

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root: Optional[int] = None,
                    what: str = "Bcast") -> np.ndarray:
        return self.base.bcast_array(arr, shape, dtype, root=self._lead_of(self.root(root)), what=what)

    def bcast_text(self, text: Optional[str], root: Optional[int] = None) -> str:
        return self.base.bcast_text(text, root=self._lead_of(self.root(root)))

    # ------------------------------------------------------------ point to point: the leads exchange

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """The lead's Sendrecv with group ``peer``'s lead; every member then holds what the lead received."""
        if self.leads_group:
            self.base.sendrecv(send, recv, self._lead_of(peer), tag)
        self.intra.bcast_(recv, self._lead_member())

    def sendrecv_array(self, send: np.ndarray, peer: int, tag: int = 0) -> np.ndarray:
        send = np.ascontiguousarray(send)
        got = self.base.sendrecv_array(send, self._lead_of(peer), tag) if self.leads_group else None
        return self.intra.bcast_array(got, send.shape, send.dtype, self._lead_member())

    def sendrecv_vector(self, send: np.ndarray, peer: int, tag: int) -> np.ndarray:
        got = self.base.sendrecv_vector(send, self._lead_of(peer), tag) if self.leads_group else None
        n = self.intra.bcast_array(None if got is None else np.array([got.size], dtype=np.int64), (1,), np.int64,
                                   self._lead_member())
        return self.intra.bcast_array(got, (int(n[0]),), np.float64, self._lead_member())

    def _lead_member(self) -> int:
        return self.layout.member_of(self._lead_of(self.rank))

    @property
    def lead_member(self) -> int:
        """The place in its group of this group's lead."""
        return self._lead_member()

    def __getattr__(self, name: str) -> Any:
        # what the algorithm does not do across groups: a clear error rather than a silent replica-level call
        raise AttributeError(f"{name!r} is not available across data-parallel groups (train.group_size > 1)")


def build_groups(world, group_size: int) -> Optional[GroupWorld]:
    """The view across groups of ``group_size`` (a collective: every replica builds its own); None for 1."""
    if group_size <= 1:
        return None
    layout = GroupLayout(world.size, group_size)
    return GroupWorld(world, layout, world.intra_group(layout))
