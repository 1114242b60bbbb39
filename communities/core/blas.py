"""Bit-stable dense linear algebra: BLAS on one thread, rows on a 64-byte boundary, so that the same bytes give the
same bits on every rank that runs the same BLAS on the same kind of CPU (clustering's distances, the community
test's principal components)."""
from __future__ import annotations

import numpy as np

_THREADPOOLS: list = []  # a threadpoolctl controller, made on first use


def one_blas_thread():
    """A context that runs BLAS on one thread (a fixed summation order for a given library and CPU)."""
    import contextlib

    if not _THREADPOOLS:
        try:
            from threadpoolctl import ThreadpoolController

            _THREADPOOLS.append(ThreadpoolController())
        except Exception:  # noqa: BLE001 - without threadpoolctl, BLAS keeps its own setting
            _THREADPOOLS.append(None)
    ctl = _THREADPOOLS[0]
    return ctl.limit(limits=1, user_api="blas") if ctl is not None else contextlib.nullcontext()


def aligned(a: np.ndarray) -> np.ndarray:
    """A C-contiguous float64 copy of ``a`` starting on a 64-byte boundary (MKL's results can depend on it)."""
    buf = np.empty(a.size + 8, dtype=np.float64)
    off = (-buf.ctypes.data % 64) // 8
    out = buf[off: off + a.size].reshape(a.shape)
    out[...] = a
    return out
