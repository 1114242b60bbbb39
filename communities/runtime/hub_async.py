"""A population's asynchronous calls (``protocol: async``): the replicas' messages and the process's barriers.

Under the asynchronous protocol a replica never blocks in a call that another process must answer: it posts
control messages and polls for them, posts the halves of its exchanges and tests them, and waits only by
polling (``pause``: the hub runs the process's other replicas meanwhile, and sleeps only when every one of them
waits). How each call is completed:

- a control message to a replica of the same process goes into that replica's mailbox (no MPI); to another
  process, one ``Isend`` whose tag names the destination replica and whose first number names the source
  (``Iprobe`` on the destination's tag then finds every replica's messages to it in one probe, each source's in
  the order they were sent, as MPI keeps them);
- the halves of a posted exchange cross processes as ``Isend``/``Irecv`` pairs tagged by both replicas and the
  message kind (``Hub._tag``); a pair inside one process never posts (it merges in memory at once,
  ``engine/mixing/async_population.py``);
- a non-blocking barrier is the process's: the k-th ``ibarrier`` of every replica of the process is one MPI
  ``Ibarrier``, posted when the last of them asks for it;
- a failure (``comm.fault_tolerance: shrink``) met by one replica is handed to the hub, which throws it into
  every replica of the process: they recover together.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import torch

from .p2p import _mpi_buffer
from .tags import TAG_KINDS, Tag
from .ulfm import RankLost


@dataclass
class Pause:
    """A replica that polls: resume it after ``seconds`` (or as soon as the others let it run)."""

    seconds: float


@dataclass
class Lost:
    """A replica met a lost peer (``RankLost``): every replica of the process recovers."""

    exc: BaseException


@dataclass
class _Slot:
    """The process's k-th non-blocking barrier: who of its replicas posted it, and its MPI request once all did."""

    posted: Set[int] = field(default_factory=set)
    request: Any = None
    done: bool = False


class HubMail:
    """The process's side of the asynchronous calls: mailboxes, barriers, and flags its replicas share."""

    def __init__(self, hub: Any):  # hub: population.Hub (which imports this module)
        self.hub = hub
        self.boxes: Dict[int, Deque[Tuple[int, np.ndarray]]] = {r: deque() for r in hub.block}
        self.slots: List[_Slot] = []
        self.asked: Dict[int, int] = {r: 0 for r in hub.block}  # ibarriers each replica asked for so far

    def control_tag(self, dst: int) -> int:
        """The network tag of control messages to replica ``dst`` (above every tag ``Hub._tag`` gives)."""
        b = self.hub.placement.per_process
        return control_tag_base(b) + dst % b

    def clear(self) -> None:
        """After a lost process: every message and barrier of the revoked communicator is void."""
        for box in self.boxes.values():
            box.clear()
        self.slots = []
        self.asked = {r: 0 for r in self.hub.block}

    def ibarrier(self, r: int, world: "AsyncCalls") -> "HubBarrier":
        k = self.asked[r]
        self.asked[r] = k + 1
        while len(self.slots) <= k:
            self.slots.append(_Slot())
        slot = self.slots[k]
        slot.posted.add(r)
        if len(slot.posted) == len(self.hub.block):
            with world._mpi("Ibarrier"):
                slot.request = self.hub.world.ibarrier()
        return HubBarrier(slot, world)

    def describe(self) -> List[str]:
        return [f"replica {r} holding {len(box)} control messages" for r, box in sorted(self.boxes.items()) if box]


def control_tag_base(per_process: int) -> int:
    return per_process * per_process * TAG_KINDS


class HubBarrier:
    """A replica's view of the process's non-blocking barrier: complete once every process alive posted it."""

    def __init__(self, slot: _Slot, world: "AsyncCalls"):
        self.slot, self.world = slot, world

    def Test(self) -> bool:
        slot = self.slot
        if not slot.done and slot.request is not None:
            with self.world._mpi("Ibarrier"):
                slot.done = bool(slot.request.request.Test())
        return slot.done

    def Wait(self) -> None:
        pause = 50e-6
        while not self.Test():
            self.world.pause(pause)
            pause = min(2 * pause, 2e-3)


class _Request:
    """A replica's non-blocking send or receive: its ``Test`` hands a lost peer to the hub."""

    def __init__(self, request, world: "AsyncCalls", what: str):
        self.request, self.world, self.what = request, world, what

    def Test(self) -> bool:
        with self.world._mpi(self.what):
            return bool(self.request.Test())

    def Free(self) -> None:
        try:
            self.request.Free()
        except Exception:  # a request of a revoked communicator: gone with it either way
            pass


class AsyncCalls:
    """The asynchronous calls of a replica's world (``population.ReplicaWorld``), completed by its hub."""

    hub: Any  # population.Hub
    rank: int
    bytes_sent: int
    bytes_in_process: int
    _posted: List[Tuple[Any, np.ndarray]]

    @contextlib.contextmanager
    def _mpi(self, what: str) -> Iterator[None]:
        """Around a replica's own MPI call: a lost peer stops every replica of the process (``Lost``)."""
        try:
            with self.hub.world._failures(what):
                yield
        except RankLost as exc:
            self.hub.wait(Lost(exc))  # the hub throws it back into this replica, and into the others
            raise

    def _process(self, replica: int) -> int:
        """The communicator rank of the process that hosts ``replica``."""
        return self.hub.world._p(self.hub.placement.process_of(replica))

    def pause(self, seconds: float) -> None:
        """Let the process's other replicas run; back after about ``seconds`` if they all wait too."""
        self.hub.wait(Pause(float(seconds)))

    # ------------------------------------------------------------ control messages

    def post_ints(self, values: np.ndarray, dest: int, tag: int) -> None:
        if tag != Tag.CONTROL:
            raise ValueError(f"a population posts control messages only (tag {Tag.CONTROL}), not tag {tag}")
        buf = np.ascontiguousarray(values, dtype=np.int64)
        self.bytes_sent += buf.nbytes
        if self.hub.placement.same_process(self.rank, dest):
            self.hub.mail.boxes[dest].append((self.rank, buf.copy()))
            self.bytes_in_process += buf.nbytes
            return
        wire = np.concatenate([np.array([self.rank], dtype=np.int64), buf])
        comm = self.hub.world.comm
        with self._mpi(f"Isend of a control message to replica {dest}"):
            self._posted.append((comm.Isend(wire, dest=self._process(dest), tag=self.hub.mail.control_tag(dest)),
                                 wire))
            if len(self._posted) > 64:
                self._posted = [(r, b) for r, b in self._posted if not r.Test()]

    def poll_ints(self, tag: int, count: int) -> Optional[Tuple[int, np.ndarray]]:
        """(source replica, values) of one control message to this replica, or None (never blocks)."""
        box = self.hub.mail.boxes[self.rank]
        if box:
            return box.popleft()
        return self._probe(None, count)

    def _probe(self, source_process: Optional[int], count: int) -> Optional[Tuple[int, np.ndarray]]:
        world = self.hub.world
        MPI, comm, tag = world.MPI, world.comm, self.hub.mail.control_tag(self.rank)
        status = MPI.Status()
        with self._mpi("Iprobe for control messages"):
            source = MPI.ANY_SOURCE if source_process is None else source_process
            if not comm.Iprobe(source=source, tag=tag, status=status):
                return None
            buf = np.empty(count + 1, dtype=np.int64)
            comm.Recv(buf, source=status.Get_source(), tag=tag)
        return int(buf[0]), buf[1:]

    def recv_ints(self, source: int, tag: int, count: int) -> np.ndarray:
        """The next control message from replica ``source`` (polling; another replica's met meanwhile is kept for
        this replica's next polls, in its order)."""
        box = self.hub.mail.boxes[self.rank]
        pause = 50e-6
        while True:
            for k, (src, values) in enumerate(box):
                if src == source:
                    del box[k]
                    return values
            if not self.hub.placement.same_process(self.rank, source):
                got = self._probe(self._process(source), count)
                if got is not None:
                    if got[0] == source:
                        return got[1]
                    box.append(got)
                    continue
            self.pause(pause)
            pause = min(2 * pause, 2e-3)

    def complete_posts(self) -> None:
        """Every control message this replica posted has left (polling)."""
        pause = 50e-6
        while self._posted:
            with self._mpi("completion of non-blocking sends"):
                self._posted = [(r, b) for r, b in self._posted if not r.Test()]
            if self._posted:
                self.pause(pause)
                pause = min(2 * pause, 2e-3)

    def drop_posts(self) -> None:
        for req, _ in self._posted:
            try:
                req.Free()
            except Exception:  # a request of a revoked communicator: gone with it either way
                pass
        self._posted = []

    def ibarrier(self) -> HubBarrier:
        return self.hub.mail.ibarrier(self.rank, self)

    # ------------------------------------------------------------ posted halves (between processes)

    def isend(self, buf: Any, peer: int, tag: int) -> _Request:
        self.bytes_sent += buf.numel() * buf.element_size() if torch.is_tensor(buf) else buf.nbytes
        what = f"Isend of replica {self.rank} to replica {peer}"
        with self._mpi(what):
            req = self.hub.world.comm.Isend(_mpi_buffer(buf), dest=self._process(peer),
                                            tag=self.hub._tag(tag, self.rank, peer))
        return _Request(req, self, what)

    def irecv(self, buf: Any, peer: int, tag: int) -> _Request:
        what = f"Irecv of replica {self.rank} from replica {peer}"
        with self._mpi(what):
            req = self.hub.world.comm.Irecv(_mpi_buffer(buf), source=self._process(peer),
                                            tag=self.hub._tag(tag, peer, self.rank))
        return _Request(req, self, what)

    def poll_floats(self, peer: int, tag: int) -> Optional[np.ndarray]:
        world = self.hub.world
        MPI, comm = world.MPI, world.comm
        status, net = MPI.Status(), self.hub._tag(tag, peer, self.rank)
        with self._mpi(f"Iprobe for a message from replica {peer}"):
            if not comm.Iprobe(source=self._process(peer), tag=net, status=status):
                return None
            buf = np.empty(status.Get_count(MPI.DOUBLE), dtype=np.float64)
            comm.Recv(buf, source=self._process(peer), tag=net)
        return buf


def sleep_for(paused: Dict[int, float]) -> None:
    """Every replica of the process polls: sleep the shortest pause any of them asked for."""
    if paused:
        time.sleep(min(paused.values()))
