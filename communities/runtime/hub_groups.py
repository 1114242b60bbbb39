"""A population hub's calls inside data-parallel groups (``train.group_size`` > 1, ``runtime/groups.py``).

The hub (``population.Hub``) runs a process's replicas one at a time; a call inside a group completes once every
member of the group in this process has entered it: a pairwise tree in rank order over those members, and, where
a group spans processes (each then hosts members of that group only), one MPI call among its processes on a
communicator made once at set-up. A group lying inside one process never reaches MPI.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..core.groups import GroupLayout
from ..core.placement import tree_sum
from ..errors import Disagreement
from .hub_ops import ColorMean
from .traffic import Call, wire_bytes


class Within(enum.Enum):
    """A call inside a data-parallel group."""

    SUM = "allreduce"  # a tensor, summed in place
    ARRAY = "array"  # a float64 array, reduced by ``op``
    BCAST = "bcast"  # replica ``root``'s tensor, in place
    BCAST_ARRAY = "bcast array"  # replica ``root``'s array (None elsewhere) of ``shape`` and ``dtype``: a copy each


@dataclass
class GroupOp:
    """A replica's part of a call inside its data-parallel group (``HubGroup``): complete once every member of the
    group in this process has brought its own."""

    group: int
    kind: Within
    what: str
    value: Any  # the tensor (SUM, BCAST), the float64 array (ARRAY), the root's array or None (BCAST_ARRAY)
    root: int = -1
    op: str = "sum"
    shape: Tuple[int, ...] = ()  # BCAST_ARRAY
    dtype: Any = None  # BCAST_ARRAY


class GroupCalls:
    """What the members of each group in one process wait in, and how the hub completes it."""

    def __init__(self, hub: Any, layout: GroupLayout, comm: Any = None):  # hub: population.Hub, which imports this
        self.hub, self.layout = hub, layout
        self.comm = comm  # a group spanning processes: a Subgroup of the processes hosting it (None: inside one)
        self.waiting: Dict[int, Dict[int, GroupOp]] = {}  # group -> its members here waiting in a call

    @classmethod
    def set_up(cls, hub: Any, layout: GroupLayout) -> "GroupCalls":
        """A group spanning processes gets a communicator of its processes (a Comm.Split of the processes)."""
        spans = layout.spans_processes(hub.placement.processes)
        return cls(hub, layout, hub.world.split(layout.group_of(hub.block[0])) if spans else None)

    def cleared(self) -> "GroupCalls":
        """After a lost process: what the members waited in is void."""
        self.waiting = {}
        return self

    def describe(self) -> List[str]:
        return [f"replica {r} in {op.what} (group {g})" for g, ops in sorted(self.waiting.items())
                for r, op in sorted(ops.items())]

    def post(self, r: int, op: GroupOp) -> List[Tuple[int, Any]]:
        """Hold ``op`` until every member of its group in this process has posted its own; then complete them all."""
        waiting = self.waiting.setdefault(op.group, {})
        waiting[r] = op
        alive = self.hub.membership.alive
        local = [m for m in self.layout.members(op.group) if m in self.hub.block_set and alive[m]]
        if len(waiting) < len(local):
            return []
        del self.waiting[op.group]
        ops = [waiting[m] for m in local]
        if len({(o.kind, o.what, o.root, o.op, o.shape) for o in ops}) > 1:
            raise Disagreement(f"the members of group {op.group} entered different calls: "
                               f"{sorted({o.what for o in ops})}")
        return list(zip(local, self._complete(local, ops)))

    def _complete(self, local: List[int], ops: List[GroupOp]) -> List[Any]:
        """A group's call: a tree over its members here, in rank order; one MPI call more where it spans processes."""
        kind, comm = ops[0].kind, self.comm
        if kind is Within.SUM:
            values = [o.value for o in ops]
            total = tree_sum(values)
            if comm is not None:
                comm.allreduce_sum_(total)
            for v in values:
                v.copy_(total)
            return values
        if kind is Within.ARRAY:
            arrays = [np.asarray(o.value, dtype=np.float64) for o in ops]
            if ops[0].op == "sum":
                summed: np.ndarray = tree_sum([torch.from_numpy(a) for a in arrays]).numpy()
            else:
                summed = (np.maximum if ops[0].op == "max" else np.minimum).reduce(np.stack(arrays))
            if comm is not None:
                summed = comm.allreduce_array(summed, ops[0].op)
            return [summed.copy() for _ in ops]
        root = ops[0].root
        here = root in local
        if kind is Within.BCAST:
            tensors: List[torch.Tensor] = [o.value for o in ops]
            buf = tensors[local.index(root)] if here else tensors[0]
            if comm is not None:
                comm.bcast_(buf, self._root(root))
            for v in tensors:
                if v is not buf:
                    v.copy_(buf)
            return list(tensors)
        arr, shape, dtype = (ops[local.index(root)].value if here else None), ops[0].shape, ops[0].dtype
        if comm is not None:
            arr = comm.bcast_array(arr if here else None, shape, dtype, self._root(root))
        return [np.array(arr, dtype=dtype, copy=True) for _ in ops]

    def _root(self, root: int) -> int:
        """The rank, in the group's communicator of processes, of the process that hosts replica ``root``."""
        first = self.hub.placement.process_of(self.layout.members(self.layout.group_of(root))[0])
        return self.hub.placement.process_of(root) - first


class HubGroup:
    """A replica's data-parallel group in a population: its calls are completed by the process's hub (a tree in
    memory over the members here, one MPI call among the processes where the group spans several). Bytes count
    as ``World``'s would, and as ``bytes_in_group``."""

    def __init__(self, world: Any, layout: GroupLayout):
        self.world, self.layout = world, layout
        self.member = layout.member_of(world.rank)
        self.group = layout.group_of(world.rank)

    def _wait(self, kind: Within, what: str, value: Any, *, root: int = -1, op: str = "sum",
              shape: Tuple[int, ...] = (), dtype: Any = None) -> Any:
        return self.world.hub.wait(GroupOp(self.group, kind, what, value, root, op, shape, dtype))

    def _members(self) -> int:
        alive = self.world.alive
        return sum(1 for r in self.layout.members(self.group) if alive[r])

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("a population's Allreduce needs a contiguous CPU tensor")
        self._wait(Within.SUM, "Allreduce inside a data-parallel group", t)
        self.world.count_in_group(wire_bytes(Call.ALLREDUCE, t.numel() * t.element_size(), self._members()))
        return t

    def allreduce_array(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        buf = np.array(values, dtype=np.float64, copy=True)
        out = self._wait(Within.ARRAY, "Allreduce of values inside a data-parallel group", buf, op=op)
        self.world.count(Call.ALLREDUCE, buf.nbytes, control=True, n=self._members())
        return out

    def _root(self, root_member: int) -> int:
        return self.layout.members(self.group)[root_member]

    def bcast_(self, t: torch.Tensor, root_member: int) -> torch.Tensor:
        root = self._root(root_member)
        self._wait(Within.BCAST, "Bcast inside a data-parallel group", t, root=root)
        nbytes = t.numel() * t.element_size()
        self.world.count_in_group(wire_bytes(Call.BCAST, nbytes, self._members(), root=self.world.rank == root))
        return t

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root_member: int) -> np.ndarray:
        root = self._root(root_member)
        shape = tuple(int(k) for k in np.atleast_1d(shape))
        mine = np.ascontiguousarray(arr, dtype=dtype) if self.world.rank == root else None
        out = self._wait(Within.BCAST_ARRAY, "Bcast of values inside a data-parallel group", mine, root=root,
                         shape=shape, dtype=dtype)
        self.world.count_in_group(wire_bytes(Call.BCAST, out.nbytes, self._members(), root=self.world.rank == root))
        return out


def color_means(world, ops: List[ColorMean]) -> List[Any]:
    """A population hub's ``group_mean_`` (community models): each replica's tensor of ``ops`` (the process's
    replicas, each ``(tensor, color, counts)``) becomes the mean over the replicas of its color that count, a tree in
    memory per color then one Allreduce of every color's sum across processes. Each replica gets how many of its
    color counted, and how many replicas alive have its color (the group its bytes are counted over)."""
    colors = world.allgather(np.array([op.color for op in ops], dtype=np.int64)).reshape(-1)
    alive = np.repeat(np.asarray(world.alive, dtype=bool), len(ops))  # (a lost process's rows: zeros, not colors)
    palette = np.unique(colors)
    tensors = [op.tensor for op in ops]
    sums = torch.zeros((len(palette),) + tuple(tensors[0].shape), dtype=tensors[0].dtype)
    counted = np.zeros(len(palette))
    for c, color in enumerate(palette):
        members = [(t if op.counts else torch.zeros_like(t)) for t, op in zip(tensors, ops)
                   if op.color == color]
        if members:
            sums[c].copy_(tree_sum(members))
            counted[c] = sum(1 for op in ops if op.color == color and op.counts)
    world.allreduce_sum_(sums.view(-1))
    counted = world.allreduce_array(counted)
    out = []
    for t, op in zip(tensors, ops):
        c = int(np.searchsorted(palette, op.color))
        t.copy_(sums[c]).div_(max(int(counted[c]), 1))
        out.append((int(counted[c]), int(np.count_nonzero((colors == op.color) & alive))))
    return out
