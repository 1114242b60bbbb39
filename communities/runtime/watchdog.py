"""The hang watchdog: a blocking MPI call that outlasts ``comm.timeout`` aborts the job, naming who is late.

``Watchdog`` watches the call in progress from a daemon thread, ``RollCall`` finds out which ranks have not
arrived at a collective, ``WatchedRequest`` puts a non-blocking collective's ``Wait`` under the same watch.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ..errors import EXIT_WATCHDOG
from .launcher import mpi


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
        MPI = mpi()
        self.MPI = MPI
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        usable = self.size > 1 and MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.comm = comm.Dup() if usable else None  # a collective (every rank constructs its World together)
        self.count = 0
        self.doing: Callable[[], Optional[str]] = lambda: None  # what this rank waits in (the watchdog sets it)
        self._sends: List[Tuple[Any, np.ndarray]] = []  # (request, buffer)
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

    def __init__(self, rank: int, timeout: float, abort: Callable[[int], None], *,
                 roll: Optional[RollCall] = None):
        self.rank, self.timeout, self._abort, self.roll = rank, float(timeout), abort, roll
        self.context = ""  # set by the engine, e.g. "t=12"
        self._since = 0.0
        self._what: Optional[str] = None
        self._seq: Optional[int] = None
        self._stop = threading.Event()
        # comm.fault_tolerance shrink: turns a process failure into RankLost (``ulfm.lost_peer``)
        self.translate: Optional[Callable[[BaseException, str], None]] = None
        if roll is not None:
            roll.doing = lambda: self._what
        if self.timeout > 0:
            threading.Thread(target=self._watch, name="communities-watchdog", daemon=True).start()

    @contextmanager
    def waiting(self, what: str, seq: Optional[int] = None) -> Iterator[None]:
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
                self._abort(EXIT_WATCHDOG)
                return


class WatchedRequest:
    """A non-blocking collective's request whose ``Wait`` the watchdog watches (and the roll call can place).

    ``world`` is asked for its watchdog at the ``Wait``: the one armed then (``World.set_timeout`` re-arms it).
    """

    def __init__(self, request, world, what: str, *, seq: int):
        self.request, self.world, self.what, self.seq = request, world, what, seq

    def Wait(self) -> None:
        with self.world.watchdog.waiting(self.what, self.seq):
            self.request.Wait()

