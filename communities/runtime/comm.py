"""The MPI layer's calls: ``World``, this rank's view of the job (mpi4py is used only in ``runtime/``).

Buffer-first: weights, signatures, metrics and metadata cross as contiguous
numeric buffers through the uppercase mpi4py calls (``Sendrecv``, ``Allgather``,
``Allreduce``, ``Gatherv``, ``Bcast``). Nothing received from another rank is
unpickled: the only structured message, the config, crosses as UTF-8 JSON bytes
and is validated on arrival.

Device tensors are staged through pinned host buffers unless the MPI library is
CUDA-aware (``comm.cuda_aware``), in which case the device pointers go to MPI
(``Staging``). Every blocking call is watched (``watchdog``), every collective
counted by the roll call, and bytes are counted per rank and kind (``traffic``).
Calls take logical ranks: after a lost rank (``membership``, ``ulfm``) they map
to the survivors' communicator.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ..errors import Disagreement
from . import launcher, ulfm
from .launcher import mpi
from .membership import Membership
from .p2p import PointToPoint
from .staging import Staging
from .tags import Tag as Tag  # (re-exported: the engine's parts tag their messages from here)
from .traffic import Call
from .ulfm import RankLost as RankLost  # (re-exported: the engine catches it from here)
from .ulfm import ulfm_problem
from .watchdog import RollCall, Watchdog, WatchedRequest


class World(PointToPoint):
    """This rank's view of the MPI world: buffer-first calls, counted and watched, over the ranks alive."""

    def __init__(self, comm=None, cuda_aware: bool = False, timeout: float = 0.0):
        MPI = mpi()
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        # ``rank`` and ``size`` are the job's logical ones (they outlive a lost rank: see ``membership``)
        self.rank: int = self.comm.Get_rank()
        self.membership = Membership(self.comm.Get_size())
        PointToPoint.__init__(self)
        self.staging = Staging(cuda_aware)  # comm.cuda_aware: device tensors go to MPI as they are
        self._local_rank: Optional[int] = None
        self.roll = RollCall(self.comm)
        self._timeout = float(timeout)
        self.watchdog = Watchdog(self.rank, timeout, self.comm.Abort, roll=self.roll)
        self._posted = []
        self.shrinks = False  # comm.fault_tolerance shrink (``enable_shrink``)
        self.processes = self.comm.Get_size()  # MPI processes (a population: fewer than ``size``, population.py)
        self.tag_limit = int(self.comm.Get_attr(MPI.TAG_UB) or 32767)

    # ---------------------------------------------------------------- membership (see membership.py, ulfm.py)

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
        ulfm.enable(self.comm)
        if self.roll.comm is not None:
            self.roll.comm.Free()
            self.roll.comm = None
        self.shrinks = True
        self.watchdog.translate = self._translate

    def _translate(self, exc: BaseException, what: str) -> None:
        ulfm.lost_peer(exc, what, self.rank)

    def recover(self) -> List[int]:
        """After ``RankLost``: revoke, shrink to the survivors, and agree; returns the logical ranks newly lost."""
        self.comm, kept = ulfm.shrink(self.comm)
        self.drop_posts()  # sends posted on the revoked communicator (protocol async's control messages)
        lost = self.membership.keep(kept)
        self.set_timeout(self._timeout)  # the watchdog aborts the new communicator
        return lost

    def set_membership(self, members: List[int], size: int) -> None:
        """A job resumed by the survivors of a larger one: this process is logical rank ``members[rank]``."""
        self.membership = Membership.of_survivors(members, size, self.comm.Get_size())
        self.rank = self.membership.logical(self.comm.Get_rank())
        self.set_timeout(self._timeout)

    @property
    def cuda_aware(self) -> bool:
        return self.staging.cuda_aware

    def shared(self, key, compute):
        """``compute()``: what the replicas of one process compute once for all (``population.Hub.shared``)."""
        return compute()

    def together(self, key, item, compute):
        """``compute([item])[0]``: what a population's replicas of one process do as one (``population``)."""
        return compute([item])[0]

    # ---------------------------------------------------------------- the watchdog

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
        self.watchdog = Watchdog(self.rank, timeout, self.comm.Abort, roll=self.roll)
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
            with self.collective("Comm.Split_type of the ranks on this node"):
                node = self.comm.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
            self._local_rank = node.Get_rank()
            node.Free()
        return self._local_rank

    @staticmethod
    def library_version() -> str:
        """The MPI library's first line of version text (``launcher.library_version``)."""
        return launcher.library_version()

    # ---------------------------------------------------------------- collectives

    def allgather(self, row: np.ndarray) -> np.ndarray:
        """Stack every rank's equal-shaped ``row`` into an (N, ...) array, identical on all ranks."""
        row = np.ascontiguousarray(row)
        out = np.empty((self.n_alive,) + row.shape, dtype=row.dtype)
        with self.collective("Allgather"):
            self.comm.Allgather(row, out)
        self.count(Call.ALLGATHER, row.nbytes)
        return self.membership.spread(out)

    def allgather_text(self, text: str, width: int = 512) -> List[str]:
        """Every rank's short text (truncated to ``width`` bytes) via a fixed-width byte Allgather."""
        raw = text.encode()[:width].ljust(width, b"\0")
        out = np.zeros((self.n_alive, width), dtype=np.uint8)
        with self.collective("Allgather of text"):
            self.comm.Allgather(np.frombuffer(raw, dtype=np.uint8), out)
        self.count(Call.ALLGATHER, width, control=True)
        return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in self.membership.spread(out)]

    def iallgather(self, row: np.ndarray, what: str = "Iallgather"):
        """Start a non-blocking allgather; returns (request, out, row). ``row`` is copied, so the caller may reuse it.

        The request's ``Wait`` is watched like a blocking collective (it completes collective number ``seq``).
        """
        row = np.array(row, copy=True, order="C")
        out = np.empty((self.size,) + row.shape, dtype=row.dtype)
        req = WatchedRequest(self.comm.Iallgather(row, out), self, what, seq=self.roll.enter())
        self.count(Call.ALLGATHER, row.nbytes)
        return req, out, row  # keep ``row`` alive until the request completes

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks of a contiguous tensor."""
        with self.staging.buffer(t, "reduce") as buf, self.collective("Allreduce"):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        self.count(Call.ALLREDUCE, t.numel() * t.element_size())
        return t

    def allreduce_array(self, values: np.ndarray, op: str = "sum", what: str = "Allreduce") -> np.ndarray:
        """Elementwise sum, max or min over ranks of a float64 array (a copy); control traffic."""
        buf = np.array(values, dtype=np.float64, copy=True)
        mpi_op = {"sum": self.MPI.SUM, "max": self.MPI.MAX, "min": self.MPI.MIN}[op]
        with self.collective(what):
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=mpi_op)
        self.count(Call.ALLREDUCE, buf.nbytes, control=True)
        return buf

    def alltoall_counts(self, counts: np.ndarray) -> np.ndarray:
        """Each rank's count for every rank in, each rank's count from every rank out (int64 Alltoall)."""
        full = np.ascontiguousarray(counts, dtype=np.int64)
        send = full if self.whole else np.ascontiguousarray(full[self.members])  # (the survivors' columns)
        recv = np.empty_like(send)
        with self.collective("Alltoall of counts"):
            self.comm.Alltoall(send, recv)
        self.count(Call.ALLTOALL, send.itemsize, control=True)
        return recv if self.whole else self.membership.spread(recv)

    def bcast_(self, t: torch.Tensor, root: Optional[int] = None) -> torch.Tensor:
        root = self.root(root)
        with self.staging.buffer(t, "bcast", send=self.rank == root) as buf, \
                self.collective(f"Bcast from rank {root}"):
            self.comm.Bcast(buf, root=self._p(root))
        self.count(Call.BCAST, t.numel() * t.element_size(), root=self.rank == root, control=True)
        return t

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root: Optional[int] = None,
                    what: str = "Bcast") -> np.ndarray:
        root = self.root(root)
        buf = np.ascontiguousarray(arr, dtype=dtype) if self.rank == root else np.empty(shape, dtype=dtype)
        with self.collective(f"{what} from rank {root}"):
            self.comm.Bcast(buf, root=self._p(root))
        self.count(Call.BCAST, buf.nbytes, root=self.rank == root, control=True)
        return buf

    def gather_rows(self, rows: np.ndarray, root: Optional[int] = None) -> Optional[List[np.ndarray]]:
        """Gatherv of each rank's 2-D float64 block (variable row count) to ``root`` (the lead by default)."""
        root = self.root(root)
        rows = np.ascontiguousarray(rows, dtype=np.float64)
        width = rows.shape[1] if rows.ndim == 2 else 0
        counts = np.empty(self.n_alive, dtype=np.int64)
        with self.collective("Allgather of log sizes"):
            self.comm.Allgather(np.array([rows.size], dtype=np.int64), counts)
        self.count(Call.GATHERV, rows.nbytes, root=self.rank == root, control=True)
        with self.collective(f"Gatherv of log rows to rank {root}"):
            if self.rank == root:
                recv = np.empty(int(counts.sum()), dtype=np.float64)
                displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
                self.comm.Gatherv(rows.reshape(-1), [recv, counts, displs, self.MPI.DOUBLE], root=self._p(root))
                blocks = [recv[d: d + c].reshape(-1, width) if width else recv[d: d + c].reshape(0, 0)
                          for d, c in zip(displs, counts)]
                return self.membership.spread_blocks(blocks, width)
            self.comm.Gatherv(rows.reshape(-1), None, root=self._p(root))
        return None

    def agree(self, digest: bytes, what: str) -> None:
        """Allgather a 16-byte digest; raise naming the ranks that disagree with the lead (rank 0 while alive)."""
        got = self.allgather(np.frombuffer(digest.ljust(16, b"\0")[:16], dtype=np.uint8))
        lead = self.lead
        bad = [int(r) for r in self.members if not np.array_equal(got[r], got[lead])]
        if bad:
            raise Disagreement(f"ranks {bad} disagree with rank {lead} on {what}")

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

    def intra_group(self, layout):
        """This rank's data-parallel group (``runtime/groups.py``): a ``Comm.Split`` of the world by group."""
        from .groups import SubcommGroup

        return SubcommGroup(self, layout)

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
        with w.staging.buffer(t, "reduce") as buf, w.watchdog.waiting(what):
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        w.count(Call.ALLREDUCE, t.numel() * t.element_size(), n=self.size)
        return t

    def allreduce_array(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        """Elementwise sum, max or min over this group of a float64 array (a copy); control traffic."""
        w, MPI = self.world, self.world.MPI
        buf = np.array(values, dtype=np.float64, copy=True)
        with w.watchdog.waiting(f"Allreduce of {buf.size} values inside a group of {self.size} ranks"):
            self.comm.Allreduce(MPI.IN_PLACE, buf, op={"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[op])
        w.count(Call.ALLREDUCE, buf.nbytes, control=True, n=self.size)
        return buf

    def bcast_(self, t: torch.Tensor, root: int) -> torch.Tensor:
        """A contiguous tensor from this group's rank ``root`` to the others (training traffic of the root)."""
        w = self.world
        with w.staging.buffer(t, "bcast", send=self.rank == root) as buf, \
                w.watchdog.waiting(f"Bcast inside a group of {self.size} ranks from its rank {root}"):
            self.comm.Bcast(buf, root=root)
        w.count(Call.BCAST, t.numel() * t.element_size(), root=self.rank == root, n=self.size)
        return t

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root: int) -> np.ndarray:
        """A small array from this group's rank ``root`` to the others."""
        w = self.world
        buf = np.ascontiguousarray(arr, dtype=dtype) if self.rank == root else np.empty(shape, dtype=dtype)
        with w.watchdog.waiting(f"Bcast of {buf.nbytes} bytes inside a group of {self.size} ranks"):
            self.comm.Bcast(buf, root=root)
        w.count(Call.BCAST, buf.nbytes, root=self.rank == root, n=self.size)
        return buf

    def free(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
