"""A rank's versioned table of everyone's signatures, spread by gossip (the asynchronous protocol).

Without a collective, each rank learns the others' signatures from the
exchanges it takes part in: partners swap their version vectors, then each
sends the rows it holds newer than the other's, at most ``cap`` of them (its
own first, then the newest). Each rank clusters its own table, so views may
differ for a while; epidemic push-pull spreads a new row to all N ranks in
O(log N) rounds of exchanges. Pure numpy: the engine moves the buffers.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

UNKNOWN = -1  # the version of a row this rank has never heard of


class GossipTable:
    """N rows of d float64 signatures, each with the unit at which its owner computed it."""

    def __init__(self, n: int, dim: int, me: int):
        self.n, self.dim, self.me = int(n), int(dim), int(me)
        self.rows = np.zeros((self.n, self.dim), dtype=np.float64)
        self.versions = np.full(self.n, UNKNOWN, dtype=np.int64)

    def set_own(self, row: np.ndarray, version: int) -> None:
        """This rank's newest signature (computed at its own unit ``version``)."""
        self.rows[self.me] = np.asarray(row, dtype=np.float64)
        self.versions[self.me] = int(version)

    @property
    def known(self) -> np.ndarray:
        """Ranks whose signature this rank holds."""
        return self.versions != UNKNOWN

    def newer_than(self, theirs: np.ndarray, cap: int) -> np.ndarray:
        """Indices of rows to send a partner whose versions are ``theirs``: own row first, then the newest."""
        theirs = np.asarray(theirs, dtype=np.int64)
        if theirs.shape != self.versions.shape:
            raise ValueError(f"a version vector of {theirs.shape} for a table of {self.n} ranks")
        newer = np.flatnonzero(self.versions > theirs)
        if newer.size <= cap:
            return newer
        own = newer[newer == self.me]
        rest = newer[newer != self.me]
        rest = rest[np.argsort(-self.versions[rest], kind="stable")]
        return np.concatenate([own, rest])[:cap]

    def pack(self, idx: np.ndarray) -> np.ndarray:
        """The rows ``idx`` as one float64 buffer: (index, version, d values) per row."""
        idx = np.asarray(idx, dtype=np.int64)
        out = np.empty((idx.size, self.dim + 2), dtype=np.float64)
        out[:, 0] = idx
        out[:, 1] = self.versions[idx]
        out[:, 2:] = self.rows[idx]
        return out.reshape(-1)

    def merge(self, packet: np.ndarray) -> int:
        """Take the partner's rows that are newer than ours; returns how many were new. Validates the packet."""
        block = np.asarray(packet, dtype=np.float64).reshape(-1, self.dim + 2)
        idx, ver = block[:, 0], block[:, 1]
        if not (np.isfinite(idx).all() and np.isfinite(ver).all()) or (idx != np.round(idx)).any() \
                or (idx < 0).any() or (idx >= self.n).any() or (ver < 0).any():
            raise ValueError("a signature packet with rank indices or versions out of range")
        idx, ver = idx.astype(np.int64), ver.astype(np.int64)
        take = ver > self.versions[idx]
        take &= idx != self.me  # nobody knows my signature better than I do
        self.rows[idx[take]] = block[take, 2:]
        self.versions[idx[take]] = ver[take]
        return int(take.sum())

    def view(self) -> Tuple[np.ndarray, np.ndarray]:
        """(the rows this rank knows, their rank indices)."""
        known = np.flatnonzero(self.known)
        return self.rows[known], known

    def state_dict(self) -> dict:
        import torch

        return {"rows": torch.from_numpy(self.rows.copy()), "versions": torch.from_numpy(self.versions.copy())}

    def load_state_dict(self, state: dict) -> None:
        rows, versions = state["rows"].numpy(), state["versions"].numpy()
        if rows.shape != self.rows.shape or versions.shape != self.versions.shape:
            raise ValueError(f"a signature table of {rows.shape}; this run's is {self.rows.shape}")
        self.rows, self.versions = rows.copy(), versions.copy()
