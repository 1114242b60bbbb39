"""Populations: N logical replicas on P MPI processes, each replica the same per-rank engine as a greenlet.

A process hosts a contiguous block of N/P replicas (``core.placement``). Each
replica runs the unchanged engine against a ``ReplicaWorld``: the ``World``
interface with the replica's logical rank and the world size N. Its blocking
calls do not reach MPI; they hand an operation to the process's ``Hub`` and
switch to it (``greenlet``: cooperative, one replica runs at a time, in a fixed
order, so a run is deterministic). The hub:

- completes a point-to-point exchange between two replicas of the process by
  copying the two buffers (no MPI; the bytes are counted as ``bytes_in_process``);
- posts one between processes as a non-blocking ``Isend``/``Irecv`` pair whose
  tag names both replicas, so the process can go on running its other replicas
  while it is in flight (two replicas blocked in each other's process cannot
  deadlock: every replica still waits in exactly the calls it would wait in as
  a process of its own, and the engine's exchange order is deadlock-free);
- runs a collective once every replica of the process has entered it: inside
  the process a pairwise tree in rank order (``placement.tree_sum``), across
  processes one MPI collective of the process's block. For N and P powers of
  two the sums have the bits of an MPI Allreduce over N processes.

Everything a replica computes is its own (its torch RNG is swapped in and out
with it), so placement changes no result. Work the replicas of a process would
all repeat on the same inputs (the exchange list of a unit, a round's
clustering, the dataset) is computed once: ``shared``.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Hashable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..core.groups import GroupLayout
from ..core.placement import Placement, tree_sum
from ..errors import ConfigError, Disagreement
from . import hub_ops as ops_
from .hub_async import AsyncCalls, HubMail, Lost, Pause, control_tag_base, sleep_for
from .hub_groups import GroupCalls, GroupOp, HubGroup, color_means
from .hub_ops import Collective
from .logical import LogicalRanks
from .membership import Membership
from .tags import TAG_KINDS
from .traffic import Call
from .ulfm import RankLost, waitsome

_START = object()  # what a replica is first resumed with: nothing (its greenlet starts)



# ---------------------------------------------------------------- what a replica waits on


@dataclass
class Exchange:
    """A replica's blocking Sendrecv with ``peer``: its send buffer and where the peer's bytes go."""

    peer: int
    tag: int
    send: np.ndarray
    recv: np.ndarray
    requests: List[Any] = field(default_factory=list)  # between processes: the Irecv and Isend in flight


class Hub:
    """One process's scheduler of its replicas: runs them one at a time and completes what they wait on."""

    def __init__(self, world, replicas: int):
        self.world = world  # the process's own World (real MPI between processes)
        self.placement = Placement(replicas, world.size)
        self.block = self.placement.block(world.rank)
        self.block_set = frozenset(self.block)
        b = self.placement.per_process
        if control_tag_base(b) + b > world.tag_limit:
            raise ConfigError(f"world_size={replicas} on {world.size} processes puts {b} replicas in each, more "
                              f"than this MPI's tags can name pairwise (MPI_TAG_UB {world.tag_limit}): start more "
                              f"processes")
        self.memo: Dict[Hashable, Any] = {}
        self._timeout_set: Optional[float] = None
        self._glets: Dict[int, Any] = {}
        self._rng: Dict[int, torch.Tensor] = {}
        self._main: Any = None
        self._p2p: Dict[int, Exchange] = {}  # waiting for a partner in this process
        self._network: Dict[int, Exchange] = {}  # in flight between processes
        self._collective: Dict[int, Collective] = {}
        self.groups: Optional[GroupCalls] = None  # train.group_size > 1: the calls inside groups (hub_groups.py)
        self._worlds: Dict[int, "ReplicaWorld"] = {}
        self.membership = Membership(replicas)  # the replicas alive: a lost process takes its block with it
        self.mail = HubMail(self)
        self.flags: set = set()  # protocol async: control messages, barriers (hub_async.py)
        self._paused: Dict[int, float] = {}  # protocol async: replicas that poll, and for how long they pause
        self.idle_s = 0.0  # seconds no replica could run: waiting on other processes (the process's idle time)
        self.epoch = 0  # recoveries so far (``shared`` keys: the exchange list of unit t depends on who is alive)
        self.clock = Clock(self.block)  # where the process's time goes (engine/timer.py)

    # ------------------------------------------------------------ the schedule

    def run(self, target: Callable[["ReplicaWorld"], Any]) -> List[Any]:
        """Run ``target(world)`` for every replica of this process; their results in rank order.

        An exception in any replica is raised here at once (the process then fails as a rank would).
        """
        import greenlet

        self._main = greenlet.getcurrent()
        start = torch.get_rng_state()
        self._glets = {}
        for r in self.block:
            w = self._worlds[r] = ReplicaWorld(self, r)
            self._glets[r] = greenlet.greenlet(lambda w=w: target(w))
            self._rng[r] = start.clone()
        results: Dict[int, Any] = {}
        ready: Deque[Tuple[int, Any]] = deque((r, _START) for r in self.block)
        try:
            while len(results) < len(self.block):
                try:
                    self._schedule(ready, results)
                except RankLost as exc:  # a peer process was lost (comm.fault_tolerance shrink)
                    ready = self._lost(exc, results)
        finally:
            torch.set_rng_state(start)
            self._glets = {}
        return [results[r] for r in self.block]

    def _schedule(self, ready: Deque[Tuple[int, Any]], results: Dict[int, Any]) -> None:
        """Resume the replicas that can go on; when all wait, complete what they wait on (one step of ``run``)."""
        while ready:
            r, value = ready.popleft()
            out = self._resume(r, value)
            if self._glets[r].dead:
                results[r] = out
            else:
                ready.extend(self._post(r, out))
        if len(results) == len(self.block):
            return
        start = time.perf_counter()
        if len(self._collective) + len(results) == len(self.block) and self._collective:
            local = all(isinstance(op, ops_.IN_PROCESS) for op in self._collective.values())
            ready.extend(self._run_collective(results))
            if local:
                return  # (work done in the process, not a wait)
        elif self._paused:  # (protocol async) nobody can go on but by polling: let them poll again
            sleep_for(self._paused)
            ready.extend((r, None) for r in sorted(self._paused))
            self._paused = {}
        elif self._network:
            ready.extend(self._wait_network())
        else:
            raise RuntimeError(f"replicas of process {self.world.rank} wait on each other: "
                               f"{_waiting_on(self, results)}")
        self.idle_s += time.perf_counter() - start

    def _lost(self, exc: RankLost, results: Dict[int, Any]) -> Deque[Tuple[int, Any]]:
        """A peer process was lost: what each replica waited on is void; each gets the ``RankLost`` to recover."""
        for q in (q for op in self._network.values() for q in op.requests):
            try:
                q.Free()
            except Exception:  # a request of the revoked communicator: gone with it either way
                pass
        self._p2p, self._network, self._collective, self._paused = {}, {}, {}, {}
        self.groups = self.groups and self.groups.cleared()
        self.mail.clear()
        for w in self._worlds.values():
            w.drop_posts()
        return deque((r, _Throw(exc)) for r in self.block if r not in results)

    def _resume(self, r: int, value: Any) -> Any:
        torch.set_rng_state(self._rng[r])
        try:
            with self.clock.running(r):
                if isinstance(value, _Throw):
                    return self._glets[r].throw(value.exc)
                return self._glets[r].switch() if value is _START else self._glets[r].switch(value)
        finally:
            self._rng[r] = torch.get_rng_state()

    def wait(self, op) -> Any:
        """Called by the running replica: hand ``op`` to the hub and sleep until it is complete."""
        return self._main.switch(op)

    # ------------------------------------------------------------ point to point

    def _post(self, r: int, op) -> List[Tuple[int, Any]]:
        if isinstance(op, Collective):
            self._collective[r] = op
            return []
        if isinstance(op, Pause):
            self._paused[r] = op.seconds
            return []
        if isinstance(op, Lost):
            raise op.exc
        if isinstance(op, GroupOp):
            assert self.groups is not None  # (set up by ``intra_group``, a collective before any group call)
            return self.groups.post(r, op)
        if not isinstance(op, Exchange):
            raise TypeError(f"replica {r} handed the hub {op!r}")
        if not self.placement.same_process(r, op.peer):
            self._send_network(r, op)
            return []
        other = self._p2p.get(op.peer)
        if other is None or other.peer != r:
            self._p2p[r] = op
            return []
        if other.tag != op.tag or other.send.nbytes != op.recv.nbytes or other.recv.nbytes != op.send.nbytes:
            raise Disagreement(f"replicas {r} and {op.peer} exchange different messages (tags {op.tag} and "
                               f"{other.tag}, {op.send.nbytes} and {other.send.nbytes} bytes)")
        del self._p2p[op.peer]
        np.copyto(op.recv.reshape(-1).view(np.uint8), other.send.reshape(-1).view(np.uint8))
        np.copyto(other.recv.reshape(-1).view(np.uint8), op.send.reshape(-1).view(np.uint8))
        return sorted([(r, None), (op.peer, None)])

    def _tag(self, kind: int, src: int, dst: int) -> int:
        b = self.placement.per_process
        return ((src % b) * b + dst % b) * TAG_KINDS + int(kind)

    def _send_network(self, r: int, op: Exchange) -> None:
        comm, proc = self.world.comm, self.world._p(self.placement.process_of(op.peer))
        with self.world._failures(f"Isend/Irecv of replica {r} with replica {op.peer}"):
            op.requests = [comm.Irecv(op.recv, source=proc, tag=self._tag(op.tag, op.peer, r)),
                           comm.Isend(op.send, dest=proc, tag=self._tag(op.tag, r, op.peer))]
        self._network[r] = op

    def _wait_network(self) -> List[Tuple[int, Any]]:
        """Wait until some exchange between processes completes; the replicas whose both halves did, to resume.

        (mpi4py turns a completed request into ``REQUEST_NULL`` in place.)"""
        MPI = self.world.MPI
        requests = [q for op in self._network.values() for q in op.requests if q != MPI.REQUEST_NULL]
        if requests:
            what = f"Sendrecv of replicas {sorted(self._network)[:8]} with other processes"
            with self.world.watchdog.waiting(what), self.clock.waiting():
                waitsome(MPI, requests)
        done = sorted(r for r, op in self._network.items() if all(q == MPI.REQUEST_NULL for q in op.requests))
        for r in done:
            del self._network[r]
        return [(r, None) for r in done]

    # ------------------------------------------------------------ collectives

    def _run_collective(self, finished: Dict[int, Any]) -> List[Tuple[int, Any]]:
        if finished:
            raise RuntimeError(f"replicas of process {self.world.rank} finished while others wait in a collective: "
                               f"{_waiting_on(self, finished)}")
        ops = [self._collective[r] for r in self.block]
        kinds = {type(op) for op in ops}
        if len(kinds) > 1:
            raise Disagreement(f"the replicas of process {self.world.rank} entered different collectives: "
                               f"{_waiting_on(self, {})}")
        self._collective = {}
        complete = _COMPLETE[type(ops[0])]
        with self.clock.together() if isinstance(ops[0], ops_.Together) else self.clock.waiting():
            results = complete(self, ops)
        return list(zip(self.block, results))

    def _c_allgather(self, ops: Sequence[ops_.Gather]) -> List[Any]:
        block = np.stack([np.ascontiguousarray(op.row) for op in ops])
        w = self.world
        out = np.empty((w.n_alive,) + block.shape, dtype=block.dtype)
        with w.collective(ops[0].what):
            w.comm.Allgather(block, out)
        out = w.membership.spread(out).reshape((self.placement.replicas,) + block.shape[1:])  # (lost: zeros)
        out.setflags(write=False)  # one array for every replica of the process: read it, do not change it
        return [out] * len(ops)

    def _c_allgather_text(self, ops: List[ops_.GatherText]) -> List[Any]:
        rows = self._c_allgather(ops)[0]
        texts = tuple(bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows)
        return [texts] * len(ops)

    def _c_agree(self, ops: List[ops_.Agree]) -> List[Any]:
        """The replicas whose digest differs from the lead's (found once for the process)."""
        rows = self._c_allgather(ops)[0]
        alive = self.membership.alive
        bad = np.flatnonzero((rows != rows[self.membership.lead]).any(axis=1) & alive).tolist()
        return [bad] * len(ops)

    def _c_recover(self, ops: List[ops_.Recover]) -> List[Any]:
        """Shrink the processes' communicator to the survivors; a lost process is the loss of its block of
        replicas. Every replica world of this process learns the same membership."""
        lost_processes = self.world.recover()
        lost = sorted(r for p in lost_processes for r in self.placement.block(p))
        members = [int(r) for r in self.membership.members if r not in set(lost)]
        self.membership = Membership(self.placement.replicas, members)
        self.epoch += 1
        for w in self._worlds.values():
            w.membership = Membership(self.placement.replicas, members)
        return [lost] * len(ops)

    def _c_sum_tensor(self, ops: List[ops_.SumTensor]) -> List[Any]:
        values = [op.tensor for op in ops]
        total = tree_sum(values)
        self.world.allreduce_sum_(total)
        for v in values:
            v.copy_(total)
        return [v for v in values]

    def _c_reduce_array(self, ops: List[ops_.ReduceArray]) -> List[Any]:
        arrays = [np.asarray(op.values, dtype=np.float64) for op in ops]
        if ops[0].op == "sum":
            local = tree_sum([torch.from_numpy(a) for a in arrays]).numpy()
        else:
            local = (np.maximum if ops[0].op == "max" else np.minimum).reduce(np.stack(arrays))
        total = self.world.allreduce_array(local, ops[0].op, what=ops[0].what)
        return [total.copy() for _ in ops]

    def _c_group_mean(self, ops: List[ops_.ColorMean]) -> List[Any]:
        """Each replica's tensor becomes the mean over the replicas of its color (``hub_groups.color_means``)."""
        return color_means(self.world, ops)

    def _c_together(self, ops: List[ops_.Together]) -> List[Any]:
        """Work the replicas of the process do as one (no MPI): ``compute(items)``, one result per replica."""
        compute = ops[0].compute
        out = list(compute([op.item for op in ops]))
        if len(out) != len(ops):
            raise RuntimeError(f"{ops[0].what}: {len(out)} results for {len(ops)} replicas")
        return out

    def _c_groups(self, ops: List[ops_.SetUpGroups]) -> List[Any]:
        """The run's data-parallel groups, set up once for the process (``GroupCalls.set_up``)."""
        self.groups = self.groups or GroupCalls.set_up(self, ops[0].layout)
        return [None] * len(ops)

    def _c_barrier(self, ops: List[ops_.Barrier]) -> List[Any]:
        self.world.barrier(ops[0].what)
        return [None] * len(ops)

    def _c_local_rank(self, ops: List[ops_.LocalRank]) -> List[Any]:
        return [self.world.local_rank] * len(ops)

    # ------------------------------------------------------------ what every replica shares

    def shared(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per process for ``key``: the same object for every replica (read it, do not change it)."""
        key = (self.epoch, key)  # after a loss, what was computed for the larger membership is computed again
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def set_timeout(self, timeout: float) -> None:
        if self._timeout_set != timeout:
            self._timeout_set = timeout
            self.world.set_timeout(timeout)


def _waiting_on(hub: Hub, results: Dict[int, Any]) -> str:
    """What each replica of ``hub`` waits in, or that it finished (for an error that shows a stuck schedule)."""
    parts = [f"replica {r} in {c.what}" for r, c in sorted(hub._collective.items())]
    parts += [f"replica {r} in a Sendrecv with replica {x.peer}" for r, x in sorted(hub._p2p.items())]
    parts += hub.groups.describe() if hub.groups is not None else []
    parts += [f"replica {r} polling" for r in sorted(hub._paused)] + hub.mail.describe()
    parts += [f"replica {r} finished" for r in sorted(results)]
    return "; ".join(parts)


class Clock:
    """Where a process's time goes, for the replicas' timers (engine/timer.py): each replica's turns (the others'
    running time while it waited), and the process's waits on other processes."""

    def __init__(self, block: range):
        self.ran = 0.0  # seconds any replica of the process ran, in all
        self.turns: Dict[int, float] = {r: 0.0 for r in block}
        self._ran_when_left: Dict[int, float] = {}
        self.waited = 0.0  # seconds in collectives and exchanges between processes

    @contextlib.contextmanager
    def running(self, r: int) -> Iterator[None]:
        """Replica ``r`` runs: what the others ran since it left is its turn."""
        self.turns[r] += self.ran - self._ran_when_left.get(r, self.ran)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.ran += time.perf_counter() - start
            self._ran_when_left[r] = self.ran

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The process waits on (or exchanges with) other processes."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.waited += time.perf_counter() - start

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Work every replica does as one (a stacked step): each one's share is its own, the rest its turn."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent, n = time.perf_counter() - start, len(self.turns)
            for r in self.turns:
                self.turns[r] += spent * (n - 1) / n


@dataclass
class _Throw:
    """What a waiting replica is resumed with when a peer process was lost: the exception to raise in it."""

    exc: BaseException


class _QuietWatchdog:
    """A replica's watchdog: the hub's process watches the MPI calls; a replica has only a context to show."""

    context = ""

    @contextlib.contextmanager
    def waiting(self, what: str, seq: Optional[int] = None) -> Iterator[None]:
        yield


class _Done:
    """A non-blocking collective that completed when it was posted."""

    def Wait(self) -> None:
        return None

    def Test(self) -> bool:
        return True


class ReplicaWorld(AsyncCalls, LogicalRanks):
    """One replica's view of the job: ``World``'s calls, over N logical replicas, completed by the ``Hub``."""

    shrinks = False
    cuda_aware = False

    def __init__(self, hub: Hub, rank: int):
        LogicalRanks.__init__(self)
        self.hub, self.rank = hub, int(rank)
        self.membership = Membership(hub.placement.replicas)
        self.watchdog = _QuietWatchdog()
        self.processes = hub.placement.processes
        self.process = hub.world.rank
        self._posted = []  # protocol async: this replica's control messages in flight (hub_async.py)

    # ------------------------------------------------------------ who

    @property
    def placement(self) -> Placement:
        return self.hub.placement

    def shared(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        return self.hub.shared(key, compute)

    def turn_seconds(self) -> float:
        return self.hub.clock.turns[self.rank]

    def waited_seconds(self) -> float:
        return self.hub.clock.waited

    def together(self, key: Hashable, item: Any, compute: Callable[[List[Any]], List[Any]]) -> Any:
        """Wait until every replica of the process brings its ``item``; ``compute(items)`` runs once, in rank
        order, and each replica gets its own result (a stacked training step: ``train.vectorize``)."""
        return self.hub.wait(ops_.Together(f"work done together ({key})", item, compute))

    @property
    def local_rank(self) -> int:
        return self.hub.wait(ops_.LocalRank("Comm.Split_type of the ranks on this node"))

    @staticmethod
    def library_version() -> str:
        from . import launcher

        return launcher.library_version()

    # ------------------------------------------------------------ set-up and the end

    def set_timeout(self, timeout: float) -> None:
        self.hub.set_timeout(timeout)

    def collective(self, what: str):
        return contextlib.nullcontext()

    def close(self) -> None:
        """The process's world is closed by the command, once."""

    def abort(self, code: int = 1) -> None:
        self.hub.world.abort(code)

    def enable_shrink(self) -> None:
        """ULFM on the process's own world (once for its replicas): a lost process is the loss of its block."""
        if not self.hub.world.shrinks:
            self.hub.world.enable_shrink()
        self.shrinks = True

    def recover(self) -> List[int]:
        """After ``RankLost``: every replica of the process asks; the hub shrinks the processes once."""
        return self.hub.wait(ops_.Recover("Shrink to the surviving processes"))

    def set_membership(self, members: List[int], size: int) -> None:
        raise ConfigError(f"this run directory was left by the survivors of a lost rank ({len(members)} of {size} "
                          "replicas); resume it with one process per surviving replica")

    @property
    def process_idle(self) -> float:  # type: ignore[override]
        return self.hub.idle_s

    @property
    def process_block(self) -> List[int]:
        return list(self.hub.block)

    def process_heads(self) -> List[int]:
        """The first replica alive of every other process (each hears a stop for its whole process)."""
        alive, place = self.alive, self.hub.placement
        firsts = [next((r for r in place.block(p) if alive[r]), None) for p in range(place.processes)]
        return [r for r in firsts if r is not None and r not in self.hub.block_set]

    @property
    def flags(self) -> set:
        """What the replicas of this process have heard, shared by all of them (protocol async: a stop)."""
        return self.hub.flags

    # ------------------------------------------------------------ collectives (counted as World counts them)

    def across_processes(self, group_size: int) -> Optional[Callable[[torch.Tensor], Any]]:
        """For a stacked step run by the hub: the in-place sum of a tensor over the processes that a group of
        ``group_size`` replicas spans (every process for all the replicas; None inside one process)."""
        hub = self.hub
        if group_size <= hub.placement.per_process:
            return None
        if group_size >= self.size:
            return hub.world.allreduce_sum_
        assert hub.groups is not None and hub.groups.comm is not None  # (set up with the groups, at start-up)
        return hub.groups.comm.allreduce_sum_

    def _sent(self, nbytes: int) -> None:
        """Training bytes of a collective, as World counts them; the share that reaches the replica's own
        process, (B - 1) of its N - 1 peers alive, stays in memory (``bytes_in_process``; a lost process takes
        its whole block, so this replica's B are alive)."""
        self.bytes_sent += nbytes
        b, n = self.hub.placement.per_process, self.n_alive
        self.bytes_in_process += nbytes * (b - 1) // max(n - 1, 1)

    def _gather(self, row: np.ndarray, what: str) -> np.ndarray:
        return self.hub.wait(ops_.Gather(what, np.ascontiguousarray(row)))

    def allgather(self, row: np.ndarray) -> np.ndarray:
        row = np.ascontiguousarray(row)
        out = self._gather(row, "Allgather")
        self.count(Call.ALLGATHER, row.nbytes)
        return out

    def allgather_text(self, text: str, width: int = 512) -> List[str]:
        raw = np.frombuffer(text.encode()[:width].ljust(width, b"\0"), dtype=np.uint8)
        texts = self.hub.wait(ops_.GatherText("Allgather of text", raw))
        self.count(Call.ALLGATHER, width, control=True)
        return list(texts)

    def iallgather(self, row: np.ndarray, what: str = "Iallgather"):
        """Completed at once (every replica of the process posts it at the same point): (request, out, row)."""
        row = np.array(row, copy=True, order="C")
        out = self._gather(row, what)
        self.count(Call.ALLGATHER, row.nbytes)
        return _Done(), out, row

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("a population's Allreduce needs a contiguous CPU tensor")
        self.hub.wait(ops_.SumTensor("Allreduce", t))
        self.count(Call.ALLREDUCE, t.numel() * t.element_size())
        return t

    def allreduce_array(self, values: np.ndarray, op: str = "sum", what: str = "Allreduce") -> np.ndarray:
        if op not in ("sum", "max", "min"):
            raise KeyError(op)
        buf = np.array(values, dtype=np.float64, copy=True)
        out = self.hub.wait(ops_.ReduceArray(what, buf, op))
        self.count(Call.ALLREDUCE, buf.nbytes, control=True)
        return out

    def alltoall_counts(self, counts: np.ndarray) -> np.ndarray:
        send = np.ascontiguousarray(counts, dtype=np.int64)
        table = self._gather(send, "Alltoall of counts")
        self.count(Call.ALLTOALL, send.itemsize, control=True)
        return np.ascontiguousarray(table[:, self.rank])

    def bcast_(self, t: torch.Tensor, root: Optional[int] = None) -> torch.Tensor:
        root = self.root(root)
        self.hub.wait(ops_.BcastTensor(f"Bcast from rank {root}", t, root))
        self.count(Call.BCAST, t.numel() * t.element_size(), root=self.rank == root, control=True)
        return t

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root: Optional[int] = None,
                    what: str = "Bcast") -> np.ndarray:
        root = self.root(root)
        mine = np.ascontiguousarray(arr, dtype=dtype) if self.rank == root else None
        shape = tuple(int(k) for k in np.atleast_1d(shape))
        out = self.hub.wait(ops_.BcastArray(what, mine, shape, dtype, root))
        self.count(Call.BCAST, out.nbytes, root=self.rank == root, control=True)
        return out

    def gather_rows(self, rows: np.ndarray, root: Optional[int] = None) -> Optional[List[np.ndarray]]:
        root = self.root(root)
        rows = np.ascontiguousarray(rows, dtype=np.float64)
        self.count(Call.GATHERV, rows.nbytes, root=self.rank == root, control=True)
        return self.hub.wait(ops_.GatherRows(f"Gatherv of log rows to rank {root}", rows, root))

    def agree(self, digest: bytes, what: str) -> None:
        row = np.frombuffer(digest.ljust(16, b"\0")[:16], dtype=np.uint8)
        bad = self.hub.wait(ops_.Agree(f"Allgather of digests ({what})", row))
        self.count(Call.ALLGATHER, row.nbytes)
        if bad:
            raise Disagreement(f"ranks {bad} disagree with rank 0 on {what}")

    def group_mean_(self, t: torch.Tensor, color: int, counts: bool = True) -> int:
        n, members = self.hub.wait(ops_.ColorMean("Allreduce inside a group of replicas", t, int(color),
                                                  bool(counts)))
        # as World's Split counts it: the tensor's Allreduce and the count's (float64), over the color's replicas
        self.count(Call.ALLREDUCE, t.numel() * t.element_size(), n=members)
        self.count(Call.ALLREDUCE, 8, n=members)
        return n

    def split(self, color: int):
        raise NotImplementedError("a population has no communicator per color: use group_mean_")

    def intra_group(self, layout: GroupLayout) -> "HubGroup":
        """This replica's data-parallel group, completed by the hub (a collective: every replica calls it)."""
        self.hub.wait(ops_.SetUpGroups("set-up of the data-parallel groups", layout))
        return HubGroup(self, layout)

    def barrier(self, what: str = "Barrier") -> None:
        self.hub.wait(ops_.Barrier(what))

    # ------------------------------------------------------------ point to point

    def _swap_arrays(self, send: np.ndarray, recv: np.ndarray, peer: int, tag: int) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"replica {self.rank} cannot exchange with rank {peer}")
        self.hub.wait(Exchange(int(peer), int(tag), send, recv))
        if self.hub.placement.same_process(self.rank, peer):
            self.bytes_in_process += send.nbytes

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("sendrecv needs contiguous tensors")
        self._swap_arrays(send.detach().numpy(), recv.detach().numpy(), peer, tag)
        self.bytes_sent += send.numel() * send.element_size()

    def sendrecv_array(self, send: np.ndarray, peer: int, tag: int = 0) -> np.ndarray:
        send = np.ascontiguousarray(send)
        recv = np.empty_like(send)
        self._swap_arrays(send, recv, peer, tag)
        self.bytes_sent += send.nbytes
        return recv


def bcast_tensor_of(hub: Hub, ops: List[ops_.BcastTensor]) -> List[Any]:
    """A hub's Bcast of a tensor: from the root replica's process to every process, then to every replica here."""
    root = ops[0].root
    values = [op.tensor for op in ops]
    mine = values[hub.block.index(root)] if root in hub.block else values[0]
    buf = mine.detach().clone()
    hub.world.bcast_(buf, root=hub.placement.process_of(root))
    for v in values:
        v.copy_(buf)
    return values


def bcast_array_of(hub: Hub, ops: List[ops_.BcastArray]) -> List[Any]:
    """A hub's Bcast of an array: from the root replica's process to every process, a copy for every replica."""
    root = ops[0].root
    arr = ops[hub.block.index(root)].arr if root in hub.block else None
    got = hub.world.bcast_array(arr, ops[0].shape, ops[0].dtype, root=hub.placement.process_of(root),
                                what=ops[0].what)
    return [got.copy() for _ in ops]


def gather_rows_of(hub: Hub, ops: List[ops_.GatherRows]) -> List[Any]:
    """A hub's Gatherv of log rows: every replica's block, at the root replica (one per replica, rank order)."""
    root = ops[0].root
    rows = [np.ascontiguousarray(op.rows, dtype=np.float64) for op in ops]
    width = rows[0].shape[1] if rows[0].ndim == 2 else 0
    counts = hub.world.allgather(np.array([r.shape[0] if width else 0 for r in rows], dtype=np.int64))
    local = np.concatenate([r.reshape(-1, width) for r in rows]) if width else np.zeros((0, 0))
    blocks = hub.world.gather_rows(local, root=hub.placement.process_of(root))
    out: List[Any] = [None] * len(ops)
    if blocks is not None:
        per: List[np.ndarray] = []
        for p, block in enumerate(blocks):
            offsets = np.concatenate([[0], np.cumsum(counts[p])])
            for k in range(len(counts[p])):
                per.append(block[offsets[k]: offsets[k + 1]] if width else np.zeros((0, 0)))
        out[hub.block.index(root)] = per
    return out


# how the hub completes each kind of collective (``Hub._run_collective``)
_COMPLETE: Dict[type, Callable[[Hub, List[Any]], List[Any]]] = {
    ops_.Gather: Hub._c_allgather, ops_.GatherText: Hub._c_allgather_text, ops_.Agree: Hub._c_agree,
    ops_.SumTensor: Hub._c_sum_tensor, ops_.ReduceArray: Hub._c_reduce_array,
    ops_.BcastTensor: bcast_tensor_of, ops_.BcastArray: bcast_array_of, ops_.GatherRows: gather_rows_of,
    ops_.ColorMean: Hub._c_group_mean, ops_.Together: Hub._c_together, ops_.SetUpGroups: Hub._c_groups,
    ops_.Barrier: Hub._c_barrier, ops_.LocalRank: Hub._c_local_rank, ops_.Recover: Hub._c_recover,
}


def run_population(world, replicas: int, target: Callable[[Any], Any]) -> List[Any]:
    """Run ``target(replica_world)`` for this process's block of ``replicas``; returns their results."""
    return Hub(world, replicas).run(target)
