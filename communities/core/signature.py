"""Random-projection signatures of a flat weight vector.

A signature is ``S (w - w0)``: a seeded, fixed linear map of the drift from the
shared initialisation to d dimensions. It is never a dense P x d matrix.

``countsketch``: every parameter gets its own bucket and sign, with no P-sized
table. The flat buffer is viewed as (rows, m); row r is rotated by a seeded shift
``s_r`` so that parameter (r, c) lands at position ``q = (c + s_r) mod m`` of an
m-wide accumulator, with sign ``row_sign[r] * col_sign[q]`` and bucket ``bucket[q]``.
Parameters in different rows therefore collide only by chance (probability ~1/d),
as in a true count-sketch, so ``E<Sx, Sy> = <x, y>`` and the distortion follows JL
even for structured drifts (a low-rank update of one layer). A plain per-column
bucket would not: every row of a column would share its bucket, and a rank-1
drift would be sketched by a single random scalar (squared-norm ratios 0.56-1.35
at d = 256 against the 0.09 spread JL predicts). The cost is one read of the
weights plus one in-cache add per row; the extra memory is O(P / m + m).

``gaussian``: ``x @ G / sqrt(d)`` with G regenerated chunk by chunk from the seed,
never stored; costs P x d random draws, so it is meant for small models.

Linearity gives ``S(w - w0) = S w - S w0``: the sketch of w0 is computed once and
the drift itself is never materialised.
"""
from __future__ import annotations

import math

import numpy as np
import torch

COLUMNS = 1 << 16  # m: the width of the (rows, m) view; 64 Ki float32 rows keep the accumulator in L2


def _generator(seed: int, stream: int, device="cpu") -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed((int(seed) * 1_000_003 + stream * 7919) % (2**63 - 1))
    return g


def _signs(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (n,), generator=g, dtype=torch.int8).float().mul_(2).sub_(1)


class CountSketch:
    """Seeded count-sketch of a flat vector of ``n`` entries to ``dim`` buckets."""

    def __init__(self, n: int, dim: int, seed: int, *, device="cpu", dtype=torch.float32, columns: int = COLUMNS):
        if dim < 2:
            raise ValueError(f"signature dim must be >= 2, got {dim}")
        self.n, self.dim = int(n), int(dim)
        self.m = int(min(columns, max(n, 1)))
        self.rows = self.n // self.m
        self.tail = self.n - self.rows * self.m
        g = _generator(seed, 1)
        self.row_sign = _signs(self.rows + 1, g)
        self.row_shift = torch.randint(0, self.m, (self.rows + 1,), generator=g)
        self.col_sign = _signs(self.m, g).to(device=device, dtype=dtype)
        self.bucket = torch.randint(0, self.dim, (self.m,), generator=g).to(device)
        self._rows = list(zip(self.row_shift.tolist(), self.row_sign.tolist()))  # Python scalars for the loop

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        """Sketch of ``flat`` (length n): a float64 CPU vector of length dim."""
        if flat.numel() != self.n:
            raise ValueError(f"signature built for {self.n} entries, got {flat.numel()}")
        flat, m = flat.detach(), self.m
        # Row r is added at offset s_r of a 2m-wide accumulator; folding its halves is the rotation.
        acc = torch.zeros(2 * m, dtype=flat.dtype, device=flat.device)
        body = flat[: self.rows * m].view(self.rows, m)
        for r, (shift, sign) in enumerate(self._rows[: self.rows]):
            acc[shift: shift + m].add_(body[r], alpha=sign)
        if self.tail:
            shift, sign = self._rows[self.rows]
            acc[shift: shift + self.tail].add_(flat[self.rows * m:], alpha=sign)
        y = (acc[:m] + acc[m:]).mul_(self.col_sign).double()
        out = torch.zeros(self.dim, dtype=torch.float64, device=flat.device)
        out.index_add_(0, self.bucket, y)
        return out.cpu()

    def many(self, flats: torch.Tensor, block: int = 16) -> torch.Tensor:
        """Sketches of the rows of ``flats`` (R, n), ``block`` rows at a time: (R, dim) float64 on the CPU, each
        row the bits ``self(row)`` gives (the same adds, in the same order, on (block, m) slices)."""
        flats, m = _check_rows(flats, self.n), self.m
        out = torch.zeros(len(flats), self.dim, dtype=torch.float64, device=flats.device)
        for lo in range(0, len(flats), block):
            part = flats[lo: lo + block]
            acc = torch.zeros(len(part), 2 * m, dtype=part.dtype, device=part.device)
            body = part[:, : self.rows * m].reshape(len(part), self.rows, m)
            for r, (shift, sign) in enumerate(self._rows[: self.rows]):
                acc[:, shift: shift + m].add_(body[:, r], alpha=sign)
            if self.tail:
                shift, sign = self._rows[self.rows]
                acc[:, shift: shift + self.tail].add_(part[:, self.rows * m:], alpha=sign)
            y = (acc[:, :m] + acc[:, m:]).mul_(self.col_sign).double()
            out[lo: lo + block].index_add_(1, self.bucket, y)
        return out.cpu()


class GaussianSketch:
    """``x @ G / sqrt(d)`` with G (n x d) regenerated in chunks from the seed."""

    def __init__(self, n: int, dim: int, seed: int, *, device="cpu", dtype=torch.float32, chunk: int = 4096):
        if dim < 2:
            raise ValueError(f"signature dim must be >= 2, got {dim}")
        self.n, self.dim, self.seed, self.chunk = int(n), int(dim), int(seed), int(chunk)
        self.device, self.dtype = device, dtype

    def __call__(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.numel() != self.n:
            raise ValueError(f"signature built for {self.n} entries, got {flat.numel()}")
        flat = flat.detach()
        out = torch.zeros(self.dim, dtype=torch.float64, device=flat.device)
        g = _generator(self.seed, 2)
        for lo in range(0, self.n, self.chunk):
            hi = min(self.n, lo + self.chunk)
            G = torch.randn(hi - lo, self.dim, generator=g, dtype=self.dtype).to(flat.device)
            out += (flat[lo:hi] @ G).double()
        return (out / math.sqrt(self.dim)).cpu()

    def many(self, flats: torch.Tensor, *, matmul: bool = False) -> torch.Tensor:
        """Sketches of the rows of ``flats`` (R, n): (R, dim) float64 on the CPU. Each chunk of G is drawn once for
        all rows (the draws, P x d of them, are the cost), then applied to each row as ``self(row)`` applies it:
        the same bits. ``matmul``: one (R, chunk) x (chunk, d) product per chunk instead, which sums in another
        order (the bits may differ from ``self(row)`` in the last places)."""
        flats = _check_rows(flats, self.n)
        out = torch.zeros(len(flats), self.dim, dtype=torch.float64, device=flats.device)
        g = _generator(self.seed, 2)
        for lo in range(0, self.n, self.chunk):
            hi = min(self.n, lo + self.chunk)
            G = torch.randn(hi - lo, self.dim, generator=g, dtype=self.dtype).to(flats.device)
            if matmul:
                out += (flats[:, lo:hi] @ G).double()
                continue
            for r in range(len(flats)):
                out[r] += (flats[r, lo:hi] @ G).double()
        return (out / math.sqrt(self.dim)).cpu()


def _check_rows(flats: torch.Tensor, n: int) -> torch.Tensor:
    if flats.ndim != 2 or flats.shape[1] != n:
        raise ValueError(f"signature built for rows of {n} entries, got shape {tuple(flats.shape)}")
    return flats.detach()


def make_sketch(kind: str, n: int, dim: int, seed: int, device="cpu", *, dtype=torch.float32):
    if kind == "countsketch":
        return CountSketch(n, dim, seed, device=device, dtype=dtype)
    if kind == "gaussian":
        return GaussianSketch(n, dim, seed, device=device, dtype=dtype)
    raise ValueError(f"unknown signature kind {kind!r}; expected countsketch or gaussian")


class Signer:
    """Signature of the drift ``w - w0`` by linearity: ``S w - S w0`` with ``S w0`` cached."""

    def __init__(self, sketch, reference: np.ndarray):
        self.sketch = sketch
        self.reference = np.asarray(reference, dtype=np.float64)

    def __call__(self, flat: torch.Tensor) -> np.ndarray:
        return (self.sketch(flat).numpy() - self.reference).astype(np.float32)

    def many(self, flats: torch.Tensor) -> np.ndarray:
        """The signatures of the rows of ``flats`` (R, n), (R, d): a process's replicas signed at once, each row
        the bits ``self(row)`` gives."""
        return (self.sketch.many(flats).numpy() - self.reference).astype(np.float32)


def dispersion(signatures: np.ndarray) -> float:
    """Mean squared distance to the centroid, relative to the mean squared norm.

    0 means every rank holds the same drift (consensus); about 1 means the drifts
    are unrelated. Scale-free, so one ``tol`` fits any model.
    """
    S = np.asarray(signatures, dtype=np.float64)
    centroid = S.mean(axis=0)
    spread = np.mean(np.sum((S - centroid) ** 2, axis=1))
    scale = np.mean(np.sum(S**2, axis=1))
    return float(spread / scale) if scale > 0 else 0.0


def community_dispersion(signatures: np.ndarray, labels: np.ndarray) -> float:
    """The largest ``dispersion`` inside one community (a community of one rank counts 0).

    Once the communities are frozen (consensus.mode), the ranks settle on one model per
    community, so consensus is reached when every community is calm, not the world.
    """
    S = np.asarray(signatures, dtype=np.float64)
    labels = np.asarray(labels)
    worst = 0.0
    for c in np.unique(labels):
        members = labels == c
        if members.sum() >= 2:
            worst = max(worst, dispersion(S[members]))
    return worst
