"""The host copies of device tensors that MPI reads and writes when it is not CUDA-aware."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Iterator, Tuple

import torch


class Staging:
    """What MPI reads and writes for a tensor: its own memory, or a pinned host copy of a device tensor.

    A device tensor goes to MPI as it is only when the library is CUDA-aware (``comm.cuda_aware``); else it
    crosses through a host buffer kept per (slot, size, dtype), so a training loop allocates none after its
    first exchange. One place for that copy, for every call that moves tensors.
    """

    def __init__(self, cuda_aware: bool = False):
        self.cuda_aware = cuda_aware
        self._buffers: Dict[Tuple[str, int, torch.dtype], torch.Tensor] = {}

    def _host(self, t: torch.Tensor, slot: str) -> torch.Tensor:
        key = (slot, t.numel(), t.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self._buffers[key] = buf
        return buf

    @contextmanager
    def buffer(self, t: torch.Tensor, slot: str, send: bool = True, recv: bool = True) -> Iterator[Any]:
        """The buffer to hand MPI for ``t`` inside the block; ``send``: MPI reads ``t``, ``recv``: MPI writes it.

        A staged copy is filled from ``t`` before the block (``send``) and copied back after it (``recv``, only
        when the call returned). A device tensor given to MPI directly waits for its stream first.
        """
        if t.device.type == "cpu":
            yield t.numpy()
        elif self.cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()
            yield t  # CUDA-aware MPI reads __cuda_array_interface__ / DLPack
        else:
            h = self._host(t, slot)
            if send:
                h.copy_(t.reshape(-1))
            yield h.numpy()
            if recv:
                t.reshape(-1).copy_(h)
