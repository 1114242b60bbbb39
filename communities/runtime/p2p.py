"""Point-to-point calls between two logical ranks: the partners' exchanges, and the async protocol's messages.

Every message has a ``Tag`` (tags.py) of its own kind. A blocking call is watched (``watchdog``); the bytes sent
count as training traffic (a caller meters them otherwise: ``Traffic.metered``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .logical import LogicalRanks
from .membership import Membership
from .staging import Staging
from .ulfm import waitsome
from .watchdog import Watchdog


class PointToPoint(LogicalRanks):
    """The point-to-point half of ``World``, which sets the attributes below."""

    comm: Any
    MPI: Any
    membership: Membership
    staging: Staging
    watchdog: Watchdog
    _posted: List[Tuple[Any, np.ndarray]]  # non-blocking sends in flight, with their buffers

    def _p(self, rank: int) -> int:
        """The communicator rank of logical ``rank`` (which must be alive)."""
        return self.membership.comm_rank(rank)

    def sendrecv(self, send: torch.Tensor, recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Blocking exchange of two equal-sized contiguous tensors with ``peer``."""
        if not (send.is_contiguous() and recv.is_contiguous()):
            raise ValueError("sendrecv needs contiguous tensors")
        p = self._p(peer)
        with self.staging.buffer(send, "send", recv=False) as s, self.staging.buffer(recv, "recv", send=False) as r:
            with self.watchdog.waiting(f"Sendrecv of weights with rank {peer}"):
                self.comm.Sendrecv(s, dest=p, sendtag=tag, recvbuf=r, source=p, recvtag=tag)
        self.bytes_sent += send.numel() * send.element_size()

    def sendrecv_parts(self, parts: Sequence[torch.Tensor], recv: torch.Tensor, peer: int, tag: int = 0) -> None:
        """Blocking exchange with ``peer``: the bytes of the contiguous ``parts`` back to back go out, the peer's
        land in ``recv`` (laid out the same: both sides send parts of the same sizes).

        One message per part, from where it lies, all in flight at once (one
        round trip): nothing is packed here. Measured on MPICH's shared memory
        against an MPI datatype over the parts' addresses (``MPI.BOTTOM``, one
        message): that ran at 0.1 to 0.45 of a contiguous Sendrecv of as many
        bytes, these messages at 0.8 to 1.0 for a few parts (many small parts
        cost a message each: the caller packs those). Device parts are packed
        into one buffer on ``recv``'s device and go as ``sendrecv`` sends it.
        """
        if not (recv.is_contiguous() and all(t.is_contiguous() for t in parts)):
            raise ValueError("sendrecv_parts needs contiguous tensors")
        views = [t.reshape(-1).view(torch.uint8) for t in parts if t.numel()]
        nbytes = sum(v.numel() for v in views)
        if any(v.device.type != "cpu" for v in views) or recv.device.type != "cpu":
            packed = torch.empty(nbytes, dtype=torch.uint8, device=recv.device)
            torch.cat([v.to(recv.device) for v in views], out=packed)
            self.sendrecv(packed, recv, peer, tag)
            return
        p, into = self._p(peer), recv.reshape(-1).view(torch.uint8).numpy()
        sends = [v.numpy() for v in views]  # held until the requests complete
        requests, offset = [], 0
        with self._failures(f"Isend/Irecv of weights with rank {peer}"):
            for b in sends:
                requests.append(self.comm.Irecv(into[offset: offset + b.nbytes], source=p, tag=tag))
                offset += b.nbytes
            requests += [self.comm.Isend(b, dest=p, tag=tag) for b in sends]
        with self.watchdog.waiting(f"Sendrecv of weights with rank {peer}"):
            while requests:
                waitsome(self.MPI, requests)
                requests = [q for q in requests if q != self.MPI.REQUEST_NULL]
        self.bytes_sent += nbytes

    def sendrecv_array(self, send: np.ndarray, peer: int, tag: int = 0) -> np.ndarray:
        """Exchange a small numeric array of the same shape and dtype with ``peer``."""
        send = np.ascontiguousarray(send)
        recv = np.empty_like(send)
        with self.watchdog.waiting(f"Sendrecv with partner rank {peer}"):
            self.comm.Sendrecv(send, dest=self._p(peer), sendtag=tag, recvbuf=recv, source=self._p(peer), recvtag=tag)
        self.bytes_sent += send.nbytes
        return recv

    def _swap_arrays(self, send: np.ndarray, recv: np.ndarray, peer: int, tag: int) -> None:
        with self.watchdog.waiting(f"Sendrecv with partner rank {peer}"):
            self.comm.Sendrecv(send, dest=self._p(peer), sendtag=tag, recvbuf=recv, source=self._p(peer), recvtag=tag)

    # -- small messages, polled (protocol async)

    @contextmanager
    def _failures(self, what: str) -> Iterator[None]:
        """Around a non-blocking call: a lost peer (comm.fault_tolerance shrink) raises ``RankLost``, as in a wait."""
        try:
            yield
        except Exception as exc:
            if self.watchdog.translate is not None:
                self.watchdog.translate(exc, what)
            raise

    def post_ints(self, values: np.ndarray, dest: int, tag: int) -> None:
        """A non-blocking send of a few int64 to logical rank ``dest``; the buffer is kept until it completes."""
        buf = np.ascontiguousarray(values, dtype=np.int64)
        with self._failures(f"Isend of a control message to rank {dest}"):
            self._posted.append((self.comm.Isend(buf, dest=self._p(dest), tag=tag), buf))
            self.bytes_sent += buf.nbytes
            if len(self._posted) > 64:
                self._posted = [(r, b) for r, b in self._posted if not r.Test()]

    def poll_ints(self, tag: int, count: int) -> Optional[Tuple[int, np.ndarray]]:
        """(logical source, values) of one waiting message of ``count`` int64 with ``tag``, or None (Iprobe: never
        blocks)."""
        status = self.MPI.Status()
        with self._failures("Iprobe for control messages"):
            if not self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=tag, status=status):
                return None
        src = self.membership.logical(status.Get_source())
        return src, self.recv_ints(src, tag, count)

    def recv_ints(self, source: int, tag: int, count: int) -> np.ndarray:
        buf = np.empty(count, dtype=np.int64)
        with self.watchdog.waiting(f"Recv of a control message from rank {source}"):
            self.comm.Recv(buf, source=self._p(source), tag=tag)
        return buf

    def drop_posts(self) -> None:
        """After a shrink: the sends posted on the revoked communicator are void (their requests are freed)."""
        for req, _ in self._posted:
            try:
                req.Free()
            except Exception:  # a revoked request may refuse: it is gone with its communicator either way
                pass
        self._posted = []

    # -- posted halves of an exchange (comm.exchange: posted): started now, tested between batches

    def isend(self, buf: Any, peer: int, tag: int) -> Any:
        """A non-blocking send of a contiguous CPU tensor or array; the caller keeps ``buf`` until it completes."""
        self.bytes_sent += buf.numel() * buf.element_size() if torch.is_tensor(buf) else buf.nbytes
        return self.comm.Isend(_mpi_buffer(buf), dest=self._p(peer), tag=tag)

    def irecv(self, buf: Any, peer: int, tag: int) -> Any:
        """A non-blocking receive into a contiguous CPU tensor or array of the expected size."""
        return self.comm.Irecv(_mpi_buffer(buf), source=self._p(peer), tag=tag)

    def poll_floats(self, peer: int, tag: int) -> Optional[np.ndarray]:
        """A waiting float64 vector of any length from ``peer`` with ``tag``, or None (Iprobe: never blocks)."""
        status = self.MPI.Status()
        if not self.comm.Iprobe(source=self._p(peer), tag=tag, status=status):
            return None
        buf = np.empty(status.Get_count(self.MPI.DOUBLE), dtype=np.float64)
        with self.watchdog.waiting(f"Recv of a probed message from rank {peer}"):
            self.comm.Recv(buf, source=self._p(peer), tag=tag)
        return buf

    def complete_posts(self) -> None:
        """Wait for every non-blocking send still in flight (before finalising, or a collective phase)."""
        with self.watchdog.waiting("completion of non-blocking sends"):
            for req, _ in self._posted:
                req.Wait()
        self._posted = []

    def ibarrier(self) -> "PolledRequest":
        """A non-blocking barrier: ``Test()`` is True once every rank alive has posted it."""
        return PolledRequest(self.comm.Ibarrier(), self, "Ibarrier")


class PolledRequest:
    """A non-blocking collective's request, tested between batches: a lost peer raises ``RankLost``."""

    def __init__(self, request, world: PointToPoint, what: str):
        self.request, self.world, self.what = request, world, what

    def Test(self) -> bool:
        with self.world._failures(self.what):
            return bool(self.request.Test())

    def Wait(self) -> None:
        with self.world.watchdog.waiting(self.what):
            self.request.Wait()


def _mpi_buffer(buf: Any) -> Any:
    """What mpi4py takes for a contiguous CPU tensor (its bytes, by the buffer protocol) or array."""
    if torch.is_tensor(buf):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("posted sends and receives need contiguous CPU tensors")
        return buf.view(-1).view(torch.uint8).numpy()
    if not buf.flags.c_contiguous:
        raise ValueError("posted sends and receives need contiguous arrays")
    return buf
