"""What every view of the job shares, whatever carries its messages: the logical ranks, and the calls built
from a view's own primitives.

``World`` (one replica per MPI process) and a population's ``ReplicaWorld`` (many per process,
``population.py``) each provide the primitives (``allgather``, ``allreduce_sum_``, ``allreduce_array``,
``bcast_array``, ``sendrecv_array`` and ``_swap_arrays``); the calls below are the same for both, and so is the
byte model they count by (``count``: ``traffic.wire_bytes`` over the ranks alive).
"""
from __future__ import annotations

import socket
import time
from typing import List, Optional

import numpy as np
import torch

from .membership import Membership, RanksAlive
from .tags import Tag
from .traffic import Call, Traffic, wire_bytes


class LogicalRanks(Traffic, RanksAlive):
    """The logical ranks of a job (``membership``) and the calls every view builds the same way."""

    rank: int
    membership: Membership

    # ---------------------------------------------------------------- who

    @property
    def lead(self) -> int:
        """The lowest logical rank alive: the writer of the run directory and the root of every gather.

        Rank 0 while it lives; when it is lost (``comm.fault_tolerance: shrink``) the lowest survivor takes
        over, so no rank is special.
        """
        return self.membership.lead

    @property
    def leads(self) -> bool:
        """Whether this rank is the lead (``lead``)."""
        return self.rank == self.membership.lead

    def turn_seconds(self) -> float:
        """Seconds this rank has waited while other replicas of its process ran (a population's: one replica per
        process never waits for a turn)."""
        return 0.0

    def waited_seconds(self) -> float:
        """Seconds this rank's process has waited on other processes in a population's collectives and exchanges,
        and its replicas with it (0 with one replica per process, whose waits its own timer sees)."""
        return 0.0

    def root(self, root: Optional[int]) -> int:
        """A collective's root: ``root``, or the lead when None."""
        return self.membership.lead if root is None else int(root)

    def across_processes(self, group_size: int):
        """The in-place sum over the processes a group of ``group_size`` replicas spans, for a population's stacked
        step (None: one replica per process has nothing to stack; ``ReplicaWorld`` overrides it)."""
        return None

    @property
    def process_block(self) -> List[int]:
        """The logical ranks this rank's MPI process hosts (itself; a population's replicas: its block)."""
        return [int(self.rank)]

    @property
    def flags(self) -> set:
        """What the ranks of this process have heard, shared by them (protocol async: a stop)."""
        got = self.__dict__.get("_flags")
        if got is None:
            got = self.__dict__["_flags"] = set()
        return got

    process_idle = 0.0  # a population's process: seconds its hub waited on other processes (population.Hub)

    def pause(self, seconds: float) -> None:
        """Wait while polling (protocol async): sleep (a population's replica lets the others run instead)."""
        time.sleep(seconds)

    def count_sent(self, nbytes: int) -> None:
        """Training bytes of a collective over every replica that the caller did not make through this view."""
        self._sent(nbytes)

    def of_ranks(self, per_rank: np.ndarray) -> np.ndarray:
        """A per-replica array as this view's ranks see it: itself (``groups.GroupWorld`` keeps each group's lead's)."""
        return per_rank

    def hostnames(self) -> List[str]:
        """Every rank's host name."""
        return self.allgather_text(socket.gethostname(), width=64)

    # ---------------------------------------------------------------- what a view provides

    def allgather_text(self, text: str, width: int = 512) -> List[str]:
        raise NotImplementedError

    def allreduce_sum_(self, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def allreduce_array(self, values: np.ndarray, op: str = "sum", what: str = "Allreduce") -> np.ndarray:
        raise NotImplementedError

    def bcast_array(self, arr: Optional[np.ndarray], shape, dtype, root: Optional[int] = None,
                    what: str = "Bcast") -> np.ndarray:
        raise NotImplementedError

    def sendrecv_array(self, send: np.ndarray, peer: int, tag: int = 0) -> np.ndarray:
        raise NotImplementedError

    def _swap_arrays(self, send: np.ndarray, recv: np.ndarray, peer: int, tag: int) -> None:
        """One blocking exchange of two contiguous buffers (their sizes may differ) with ``peer``; not counted."""
        raise NotImplementedError

    # ---------------------------------------------------------------- built from them

    def allreduce_mean_(self, t: torch.Tensor) -> torch.Tensor:
        """In-place mean over the ranks alive."""
        self.allreduce_sum_(t)
        return t.div_(self.n_alive)

    def allreduce_scalar(self, value: float, op: str = "sum") -> float:
        return float(self.allreduce_array(np.array([value], dtype=np.float64), op, what="Allreduce of a scalar")[0])

    def bcast_text(self, text: Optional[str], root: Optional[int] = None) -> str:
        """Broadcast UTF-8 text as a length-prefixed byte buffer (no pickle); from the lead by default."""
        root = self.root(root)
        data = text.encode() if self.rank == root and text is not None else b""
        what = "Bcast of text"
        n = self.bcast_array(np.array([len(data)], dtype=np.int64), (1,), np.int64, root, what)
        buf = self.bcast_array(np.frombuffer(data, dtype=np.uint8).copy(), (int(n[0]),), np.uint8, root, what)
        return bytes(buf).decode()

    def sendrecv_vector(self, send: np.ndarray, peer: int, tag: int) -> np.ndarray:
        """Exchange float64 vectors whose lengths differ: the lengths first, then one exchange."""
        send = np.ascontiguousarray(send, dtype=np.float64).reshape(-1)
        n = self.sendrecv_array(np.array([send.size], dtype=np.int64), peer, tag=Tag.VECTOR_SIZE)
        recv = np.empty(int(n[0]), dtype=np.float64)
        self._swap_arrays(send, recv, peer, tag)
        self.bytes_sent += send.nbytes
        return recv

    # ---------------------------------------------------------------- the byte model (``traffic.wire_bytes``)

    def count(self, call: Call, nbytes: int, *, root: bool = False, control: bool = False,
              n: Optional[int] = None) -> None:
        """Count what this rank sends in ``call`` of ``nbytes`` over the ranks alive (or ``n`` of them: a group's):
        training traffic, or ``control``. Every view counts its collectives here, by one model."""
        sent = wire_bytes(call, nbytes, self.n_alive if n is None else n, root=root)
        if control:
            self.bytes_control += sent
        else:
            self._sent(sent)
