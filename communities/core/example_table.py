"""Per-example bookkeeping of one rank's shard: confidence, retirement, visited sets, moving examples.

Pure numpy (torch only to accept tensors and to hand back a checkpointable
state dict); no MPI. An :class:`ExampleTable` has one *row* per training example
currently on this rank. Row indices are local and change when rows are removed
or appended; ``ids`` (the index into the shared training set) are global and
travel with the example.

Per row:

=============  ========  ==================================================================
field          dtype     meaning
=============  ========  ==================================================================
ids            int64     global id (index into the shared training set), unique in a table
labels         int64     the true label
confidence     float32   EMA of the model's probability of the true label; NaN until evaluated
status         int8      ACTIVE=0, RESERVE=1, RETIRED=2
high_streak    int32     consecutive *checks* with confidence > tau_retire
reserve_age    int32     retirement steps spent in the reserve (since entering it)
forgets        int32     forgetting events of this example (RESERVE/RETIRED -> ACTIVE)
evaluated      bool      confidence updated since the last ``step_retirement`` (local only)
sampled        bool      drawn by ``sample_reserve`` since the last ``step_retirement`` (local)
visited        (n, V)    the ranks that have trained on the example (see *Visited sets*)
=============  ========  ==================================================================

Retirement (``step_retirement``, once per evaluation)
------------------------------------------------------
The engine, each evaluation period: ``rows = table.training_rows(rho, rng)``
(ACTIVE plus a Bernoulli(rho) sample of RESERVE), trains and evaluates,
``table.update_confidence(rows, p_true, ema)``, then
``table.step_retirement(tau, M, R, rho, rng)``. "high" means ``confidence > tau``
(strictly); anything else, ``confidence <= tau``, is "low". A *check* of a row is:

* an evaluated ACTIVE row: always;
* an evaluated RESERVE/RETIRED row that a sampler drew this period: always;
* an evaluated RESERVE/RETIRED row that no sampler drew (the engine evaluated
  more than the sample, e.g. the whole shard): with probability ``rho``, one
  ``rng.random()`` per such row in row order.

So reserve rows are checked at rate rho either way, never rho**2. Rows not
evaluated since the last step are not checked: their state, streak and
confidence stay as they are. A step then, in this order:

1. every row that is RESERVE at the start of the step: ``reserve_age += 1``;
2. every checked row: high -> ``high_streak += 1``, low -> ``high_streak = 0``;
3. checked ACTIVE with ``high_streak >= M`` -> RESERVE, ``reserve_age = 0``;
4. checked RESERVE, high, ``reserve_age >= R`` -> RETIRED (it was RESERVE for
   R steps; a row that entered the reserve at step s retires at the first check
   from step s + R on);
5. checked RESERVE or RETIRED, low -> ACTIVE, ``high_streak = reserve_age = 0``,
   ``forgets += 1`` and ``forgetting_events += 1`` (a forgetting event, Toneva
   et al. 2019: learnt data the model has lost again);
6. ``evaluated`` and ``sampled`` are cleared.

RETIRED rows are never trained on; they are checked only when the engine
evaluates them (``evaluation_rows`` samples them at rate rho, or a forward pass
over the whole shard). Everything is deterministic given the Generator.

Visited sets
------------
``world <= 1024`` (or ``visited="bitset"``): a bitset, ``ceil(world / 64)``
uint64 words per row, bit ``r % 64`` of word ``r // 64`` for rank r. Exact.

``world > 1024`` (or ``visited="recent"``): ``1 + K`` int64 words per row
(K = ``capacity``, default 16): word 0 a distinct-visitor count saturating at
``world``, words 1..K the K most recently marked ranks, most recent first,
-1 for an empty slot (an LRU list: marking a rank already listed moves it to
the front and does not count). What is lost: a rank that fell off the list is
forgotten, so ``has_visited`` can answer False for it (never a false True), and
if it trains on the example again it is counted a second time: the count is
exact while an example has had at most K distinct visitors or no evicted rank
came back, and otherwise an over-count. ``all_visited`` (count >= world) can
therefore say True early; ``visited_count`` is an upper bound on the distinct
visitors. With random partners among N > 1024 ranks, a given evicted rank
comes back with probability ~ 1/N per move. Memory per row is fixed, 8 (1 + K)
bytes (136 for K = 16, versus 128 for the 1024-rank bitset).

Packets (moving examples between partners)
------------------------------------------
``pack`` writes two flat native buffers, float32 and int64. Every block has
``n_max >= n`` slots; slots ``n..n_max-1`` are zero (padding), so two partners
can exchange equal-size buffers with one Sendrecv each after agreeing on
``n_max = max(n_a, n_b)`` (exchange the counts first, e.g.
``comm.sendrecv_array(np.array([n]))``; or ``pad`` an existing packet).

int64 buffer, ``HEADER + n_max * (6 + V)`` entries::

    [0] MAGIC            [4] feature_numel   [8]  capacity K (0 for bitset)
    [1] VERSION          [5] world           [9]  len(floats buffer)
    [2] n                [6] visited form    [10] len(ints buffer)
    [3] n_max            [7] V (words/row)   [11] crc32 of floats payload then ints payload
    then blocks of n_max: labels | ids | status | high_streak | reserve_age | forgets
    then n_max * V visited words (row-major; bitset words reinterpreted as int64)

float32 buffer, ``n_max * (feature_numel + 1)`` entries::

    n_max * feature_numel features (row-major, each example flattened) | n_max confidences

``unpack`` re-derives every size from its own arguments and rejects (ValueError)
anything inconsistent: magic, version, world, visited form, feature size, buffer
lengths, checksum, non-zero padding, duplicate or negative ids, unknown status,
confidence outside [0, 1] (NaN allowed: never evaluated), non-finite features,
invalid visited words. Features travel as float32 (integers above 2**24 or
float64 features lose precision). Buffers are native-endian: both ends must
share a byte order.

Hand over::

    rows = table.hardest(fraction=0.1, prefer=peer)
    theirs = comm.sendrecv_array(np.array([len(rows)], dtype=np.int64), peer)
    n_max = max(len(rows), int(theirs[0]))       # validate theirs[0] against a cap first
    floats, ints = table.pack(rows, x, n_max=n_max)
    rf, ri = comm.sendrecv_array(floats, peer), comm.sendrecv_array(ints, peer)
    x_in, y_in, incoming = unpack(rf, ri, x.shape[1:], world_size)
    keep = table.remove(rows); x = x[keep]
    table.append(incoming); x = concatenate(x, x_in)   # rows of x stay aligned with the table
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch

ACTIVE, RESERVE, RETIRED = 0, 1, 2
STATUS_NAMES = ("active", "reserve", "retired")

BITSET, RECENT = 0, 1  # visited form codes, as written in packets and state dicts
FORM_NAMES = {"bitset": BITSET, "recent": RECENT}
BITSET_MAX_WORLD = 1024
RECENT_CAPACITY = 16

MAGIC = 0x434F4D4D45584D31  # "COMMEXM1"
VERSION = 1
HEADER = 12
_INT_FIELDS = ("labels", "ids", "status", "high_streak", "reserve_age", "forgets")
_INT32_MAX = np.iinfo(np.int32).max
STATE_VERSION = 1


# ----------------------------------------------------------------------------- visited sets

@dataclass(frozen=True)
class VisitedForm:
    """How a table stores visited sets: ``kind`` BITSET or RECENT, for ``world`` ranks."""

    kind: int
    world: int
    capacity: int  # K for RECENT, 0 for BITSET

    @property
    def width(self) -> int:
        """Words per row (``V`` in the packet layout)."""
        return (self.world + 63) // 64 if self.kind == BITSET else 1 + self.capacity

    @property
    def dtype(self):
        return np.uint64 if self.kind == BITSET else np.int64

    def empty(self, n: int) -> np.ndarray:
        if self.kind == BITSET:
            return np.zeros((n, self.width), dtype=np.uint64)
        out = np.full((n, self.width), -1, dtype=np.int64)
        out[:, 0] = 0
        return out

    def mark(self, words: np.ndarray, rows: np.ndarray, rank: int) -> None:
        rows = np.unique(rows)
        if rows.size == 0:
            return
        if self.kind == BITSET:
            w, b = divmod(rank, 64)
            words[rows, w] |= np.uint64(1) << np.uint64(b)
            return
        K = self.capacity
        R = words[rows, 1:]
        present = R == rank
        has = present.any(axis=1)
        new = np.empty_like(R)
        new[:, 0] = rank
        fresh = ~has
        new[fresh, 1:] = R[fresh, :-1]
        if has.any():  # move to the front, keep the others' order
            Rh = R[has]
            new[has, 1:] = Rh[~present[has]].reshape(Rh.shape[0], K - 1)
        count = words[rows, 0]
        count[fresh] = np.minimum(count[fresh] + 1, self.world)
        words[rows, 0] = count
        words[rows, 1:] = new

    def count(self, words: np.ndarray, rows: np.ndarray) -> np.ndarray:
        if self.kind == BITSET:
            return _popcount_rows(words[rows])
        return words[rows, 0].astype(np.int64)

    def has(self, words: np.ndarray, rows: np.ndarray, rank: int) -> np.ndarray:
        if self.kind == BITSET:
            w, b = divmod(rank, 64)
            return ((words[rows, w] >> np.uint64(b)) & np.uint64(1)).astype(bool)
        return (words[rows, 1:] == rank).any(axis=1)

    def to_int64(self, words: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(words).view(np.int64)

    def from_int64(self, raw: np.ndarray, what: str) -> np.ndarray:
        """Validate (n, V) int64 words from outside; returns this form's storage (a copy)."""
        raw = np.asarray(raw)
        if raw.dtype != np.int64 or raw.ndim != 2 or raw.shape[1] != self.width:
            raise ValueError(f"{what}: visited words must be int64 of shape (n, {self.width}), "
                             f"got {raw.dtype} {raw.shape}")
        if self.kind == BITSET:
            words = np.ascontiguousarray(raw).view(np.uint64).copy()
            spare = self.width * 64 - self.world
            if spare and words.size:
                mask = ~((np.uint64(1) << np.uint64(64 - spare)) - np.uint64(1))
                if (words[:, -1] & mask).any():
                    raise ValueError(f"{what}: visited bits set for ranks >= world={self.world}")
            return words
        words = raw.copy()
        if words.size == 0:
            return words
        ids, count = words[:, 1:], words[:, 0]
        if ((ids < -1) | (ids >= self.world)).any():
            raise ValueError(f"{what}: visited rank ids outside [-1, {self.world})")
        empty = ids < 0
        if (empty[:, :-1] & ~empty[:, 1:]).any():
            raise ValueError(f"{what}: visited list has a rank after an empty slot")
        s = np.sort(ids, axis=1)
        if ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any():
            raise ValueError(f"{what}: a rank appears twice in a visited list")
        listed = (~empty).sum(axis=1)
        if (count < listed).any() or (count > self.world).any():
            raise ValueError(f"{what}: visited count outside [listed ranks, world={self.world}]")
        return words


def visited_form(world: int, visited: str = "auto", capacity: int = RECENT_CAPACITY) -> VisitedForm:
    """The form a table for ``world`` ranks uses: ``auto`` is a bitset up to 1024 ranks, ``recent`` above."""
    world = int(world)
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if visited == "auto":
        visited = "bitset" if world <= BITSET_MAX_WORLD else "recent"
    if visited not in FORM_NAMES:
        raise ValueError(f"visited={visited!r} is not one of ('auto', 'bitset', 'recent')")
    if visited == "bitset":
        return VisitedForm(BITSET, world, 0)
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"visited capacity must be >= 1, got {capacity}")
    return VisitedForm(RECENT, world, capacity)


def _popcount_rows(words: np.ndarray) -> np.ndarray:
    words = np.ascontiguousarray(words, dtype=np.uint64)
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words).sum(axis=1, dtype=np.int64)
    return np.unpackbits(words.view(np.uint8), axis=1).sum(axis=1, dtype=np.int64)


# ----------------------------------------------------------------------------- helpers

def _numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _rng_check(rho: float, rng) -> float:
    rho = float(rho)
    if not 0.0 <= rho <= 1.0:
        raise ValueError(f"rho must be in [0, 1], got {rho}")
    if rng is not None and not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    return rho


def _bernoulli(candidates: np.ndarray, rho: float, rng) -> np.ndarray:
    """The candidates (in order) kept with probability rho: one ``rng.random()`` per candidate."""
    if rho >= 1.0 or candidates.size == 0:
        return candidates
    if rho <= 0.0:
        return candidates[:0]
    if rng is None:
        raise ValueError("sampling with rho < 1 needs a numpy Generator (rng)")
    return candidates[rng.random(candidates.size) < rho]


def example_bytes(feature_numel: int, world: int, visited: str = "auto", capacity: int = RECENT_CAPACITY) -> int:
    """Bytes one example adds to a packet (for ``hardest(byte_cap=..., bytes_per_example=...)``)."""
    form = visited_form(world, visited, capacity)
    return 4 * (int(feature_numel) + 1) + 8 * (len(_INT_FIELDS) + form.width)


def packet_sizes(n_examples: int, feature_numel: int, world: int, visited: str = "auto",
                 capacity: int = RECENT_CAPACITY) -> Tuple[int, int]:
    """(len of the float32 buffer, len of the int64 buffer) of a packet with ``n_examples`` slots."""
    n, f = int(n_examples), int(feature_numel)
    if n < 0 or f < 0:
        raise ValueError(f"n_examples and feature_numel must be >= 0, got {n}, {f}")
    form = visited_form(world, visited, capacity)
    return n * (f + 1), HEADER + n * (len(_INT_FIELDS) + form.width)


def _selection_limit(candidates: int, count: Optional[int], fraction: Optional[float], byte_cap: Optional[int],
                     bytes_per_example: Optional[int]) -> int:
    """How many of ``candidates`` rows ``ExampleTable.hardest`` returns: the smallest of each limit given."""
    limit = candidates
    if count is not None:
        if int(count) < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        limit = min(limit, int(count))
    if fraction is not None:
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in [0, 1], got {fraction}")
        limit = min(limit, int(math.floor(float(fraction) * candidates)))
    if byte_cap is not None:
        if bytes_per_example is None or int(bytes_per_example) <= 0:
            raise ValueError("byte_cap needs bytes_per_example > 0 (see examples.example_bytes)")
        limit = min(limit, max(0, int(byte_cap)) // int(bytes_per_example))
    return limit


def _checksum(floats_payload: np.ndarray, ints_payload: np.ndarray) -> int:
    c = zlib.crc32(np.ascontiguousarray(floats_payload).tobytes())
    return zlib.crc32(np.ascontiguousarray(ints_payload).tobytes(), c)


# ----------------------------------------------------------------------------- the table

class ExampleTable:
    """The examples currently on one rank, one row each (see the module docstring)."""

    def __init__(self, ids, labels, world: int, *, visited: str = "auto", capacity: int = RECENT_CAPACITY):
        ids = np.array(_numpy(ids), dtype=np.int64).reshape(-1)
        labels = np.array(_numpy(labels), dtype=np.int64).reshape(-1)
        if labels.shape != ids.shape:
            raise ValueError(f"{ids.size} ids but {labels.size} labels")
        if (ids < 0).any():
            raise ValueError("example ids must be >= 0")
        if np.unique(ids).size != ids.size:
            raise ValueError("example ids must be unique within a table")
        self.form = visited_form(world, visited, capacity)
        n = ids.size
        self.ids, self.labels = ids, labels
        self.confidence = np.full(n, np.nan, dtype=np.float32)
        self.status = np.zeros(n, dtype=np.int8)
        self.high_streak = np.zeros(n, dtype=np.int32)
        self.reserve_age = np.zeros(n, dtype=np.int32)
        self.forgets = np.zeros(n, dtype=np.int32)
        self.evaluated = np.zeros(n, dtype=bool)
        self.sampled = np.zeros(n, dtype=bool)
        self.visited = self.form.empty(n)
        self.forgetting_events = 0

    _ROW_FIELDS = ("ids", "labels", "confidence", "status", "high_streak", "reserve_age", "forgets",
                   "evaluated", "sampled", "visited")

    @property
    def world(self) -> int:
        return self.form.world

    def __len__(self) -> int:
        return int(self.ids.size)

    def __repr__(self) -> str:
        c = self.counts()
        kind = "bitset" if self.form.kind == BITSET else f"recent{self.form.capacity}"
        return (f"ExampleTable(n={len(self)}, active={c['active']}, reserve={c['reserve']}, "
                f"retired={c['retired']}, world={self.world}, visited={kind})")

    def _rows(self, rows, unique: bool = False) -> np.ndarray:
        r = _numpy(rows)
        if r.dtype == bool:
            if r.shape != (len(self),):
                raise ValueError(f"boolean row mask must have shape ({len(self)},), got {r.shape}")
            return np.flatnonzero(r)
        r = np.asarray(r).reshape(-1)
        if r.size and not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"rows must be integers, got {r.dtype}")
        r = r.astype(np.int64)
        if r.size and (r.min() < 0 or r.max() >= len(self)):
            raise ValueError(f"rows out of range [0, {len(self)})")
        if unique and np.unique(r).size != r.size:
            raise ValueError("rows must not repeat")
        return r

    def _rank(self, rank: int) -> int:
        rank = int(rank)
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} outside [0, {self.world})")
        return rank

    # ------------------------------------------------------------------ confidence

    def update_confidence(self, rows, p_true, ema: float) -> None:
        """``c <- p`` if c is NaN (first evaluation), else ``c <- ema * c + (1 - ema) * p``; marks rows evaluated.

        ``ema`` in [0, 1) is the weight of the history (0: the last value only).
        Computed in float64, stored as float32. ``p_true`` must lie in [0, 1].
        """
        rows = self._rows(rows, unique=True)
        p = np.asarray(_numpy(p_true), dtype=np.float64).reshape(-1)
        if p.shape != rows.shape:
            raise ValueError(f"{rows.size} rows but {p.size} probabilities")
        if not (np.isfinite(p).all() and (p >= 0).all() and (p <= 1).all()):
            raise ValueError("p_true must be finite probabilities in [0, 1]")
        ema = float(ema)
        if not 0.0 <= ema < 1.0:
            raise ValueError(f"ema must be in [0, 1), got {ema}")
        old = self.confidence[rows].astype(np.float64)
        new = np.where(np.isnan(old), p, ema * old + (1.0 - ema) * p)
        self.confidence[rows] = new.astype(np.float32)
        self.evaluated[rows] = True

    # ------------------------------------------------------------------ retirement

    def sample_reserve(self, rho: float, rng: Optional[np.random.Generator],
                       include_retired: bool = False) -> np.ndarray:
        """RESERVE rows (and RETIRED ones if asked), each kept with probability rho; marks them sampled.

        One ``rng.random()`` per candidate row, in row order. Sorted rows.
        """
        rho = _rng_check(rho, rng)
        cand = self.status == RESERVE
        if include_retired:
            cand |= self.status == RETIRED
        picked = _bernoulli(np.flatnonzero(cand), rho, rng)
        self.sampled[picked] = True
        return picked

    def training_rows(self, rho: float, rng: Optional[np.random.Generator]) -> np.ndarray:
        """ACTIVE rows plus ``sample_reserve(rho, rng)``, sorted: what to train on this period.

        Call one sampler once per evaluation period: the samples of repeated
        calls accumulate (all of them count as drawn until ``step_retirement``).
        """
        picked = self.sample_reserve(rho, rng)
        return np.union1d(np.flatnonzero(self.status == ACTIVE), picked).astype(np.int64)

    def evaluation_rows(self, rho: float, rng: Optional[np.random.Generator]) -> np.ndarray:
        """ACTIVE rows plus a rho-sample of RESERVE and RETIRED rows: what to evaluate to check them all."""
        picked = self.sample_reserve(rho, rng, include_retired=True)
        return np.union1d(np.flatnonzero(self.status == ACTIVE), picked).astype(np.int64)

    def step_retirement(self, tau_retire: float, patience_M: int, reserve_rounds_R: int, rho: float = 1.0,
                        rng: Optional[np.random.Generator] = None) -> Dict[str, int]:
        """One retirement step (see the module docstring for the exact rules); returns transition counts.

        ``rho`` and ``rng`` only thin the checks of evaluated RESERVE/RETIRED rows
        that no sampler drew this period.
        """
        tau = float(tau_retire)
        M, R = int(patience_M), int(reserve_rounds_R)
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau_retire must be in [0, 1], got {tau}")
        if M < 1 or R < 0:
            raise ValueError(f"need patience_M >= 1 and reserve_rounds_R >= 0, got {M}, {R}")
        rho = _rng_check(rho, rng)
        st = self.status.copy()
        ev = self.evaluated
        high = self.confidence > tau  # NaN compares False: never high
        parked = st != ACTIVE

        self.reserve_age[st == RESERVE] += 1
        checked = ev & ~parked
        checked |= ev & parked & self.sampled
        extra = _bernoulli(np.flatnonzero(ev & parked & ~self.sampled), rho, rng)
        checked[extra] = True

        self.high_streak[checked & high] += 1
        self.high_streak[checked & ~high] = 0
        promote = checked & (st == ACTIVE) & (self.high_streak >= M)
        retire = checked & (st == RESERVE) & high & (self.reserve_age >= R)
        forget = checked & parked & ~high

        self.status[promote] = RESERVE
        self.reserve_age[promote] = 0
        self.status[retire] = RETIRED
        self.status[forget] = ACTIVE
        self.high_streak[forget] = 0
        self.reserve_age[forget] = 0
        self.forgets[forget] += 1
        n_forget = int(forget.sum())
        self.forgetting_events += n_forget
        self.evaluated[:] = False
        self.sampled[:] = False
        return {"checked": int(checked.sum()), "promoted": int(promote.sum()), "retired": int(retire.sum()),
                "forgotten": n_forget}

    # ------------------------------------------------------------------ visited sets

    def mark_visited(self, rows, rank: int) -> None:
        """Record that ``rank`` trained on these rows."""
        self.form.mark(self.visited, self._rows(rows), self._rank(rank))

    def visited_count(self, rows=None) -> np.ndarray:
        """Distinct ranks that trained on each row (an upper bound in the ``recent`` form)."""
        rows = np.arange(len(self)) if rows is None else self._rows(rows)
        return self.form.count(self.visited, rows)

    def has_visited(self, rows, rank: int) -> np.ndarray:
        """Whether ``rank`` trained on each row (``recent`` form: False for ranks fallen off the list)."""
        return self.form.has(self.visited, self._rows(rows), self._rank(rank))

    def all_visited(self, rows=None) -> np.ndarray:
        """Whether every rank of the world trained on each row (``recent``: may be True early)."""
        return self.visited_count(rows) >= self.world

    # ------------------------------------------------------------------ selection and logs

    def hardest(self, count: Optional[int] = None, fraction: Optional[float] = None, byte_cap: Optional[int] = None,
                bytes_per_example: Optional[int] = None, prefer: Optional[int] = None) -> np.ndarray:
        """Rows of the lowest-confidence ACTIVE examples, hardest first; ties by id.

        Only evaluated rows (finite confidence) are candidates. The number
        returned is the smallest of ``count``, ``floor(fraction * candidates)``
        and ``byte_cap // bytes_per_example`` (see ``example_bytes``), each if
        given. ``prefer=rank`` puts the rows that rank has not visited ahead of
        those it has (each group hardest first): hand a partner data it has not
        seen yet.
        """
        cand = np.flatnonzero((self.status == ACTIVE) & np.isfinite(self.confidence))
        limit = _selection_limit(cand.size, count, fraction, byte_cap, bytes_per_example)
        keys = [self.ids[cand], self.confidence[cand]]
        if prefer is not None:
            keys.append(self.has_visited(cand, prefer).astype(np.int8))
        order = np.lexsort(tuple(keys))
        return cand[order][:limit].astype(np.int64)

    def quantiles(self, q: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9)) -> Dict[str, float]:
        """Quantiles of the evaluated rows' confidence, keyed ``q10``, ``q25``, ...; NaN when none is evaluated."""
        c = self.confidence[np.isfinite(self.confidence)].astype(np.float64)
        out = {}
        for qq in q:
            key = f"q{100 * float(qq):g}".replace(".", "_")
            out[key] = float(np.quantile(c, float(qq))) if c.size else float("nan")
        return out

    def counts(self) -> Dict[str, int]:
        """Rows per status, the total, and the forgetting events so far (for the results log)."""
        out = {name: int((self.status == code).sum()) for code, name in enumerate(STATUS_NAMES)}
        out["total"] = len(self)
        out["forgetting_events"] = int(self.forgetting_events)
        return out

    def hard_rows(self, tau_hard: float) -> np.ndarray:
        """Rows every rank has trained on whose confidence is still below ``tau_hard``."""
        return np.flatnonzero(self.all_visited() & (self.confidence < float(tau_hard)))

    def globally_hard(self, tau_hard: float) -> np.ndarray:
        """Sorted ids of ``hard_rows``."""
        return np.sort(self.ids[self.hard_rows(tau_hard)])

    # ------------------------------------------------------------------ moving rows

    def take(self, rows) -> "ExampleTable":
        """A new table of these rows (copies), in the given order."""
        rows = self._rows(rows, unique=True)
        out = ExampleTable.__new__(ExampleTable)
        out.form = self.form
        for f in self._ROW_FIELDS:
            setattr(out, f, getattr(self, f)[rows].copy())
        out.forgetting_events = 0
        return out

    def remove(self, rows) -> np.ndarray:
        """Drop these rows; returns the old row indices kept, in order (index the features with it)."""
        rows = self._rows(rows)
        keep = np.ones(len(self), dtype=bool)
        keep[rows] = False
        kept = np.flatnonzero(keep)
        for f in self._ROW_FIELDS:
            setattr(self, f, getattr(self, f)[kept])
        return kept

    def append(self, other: "ExampleTable") -> np.ndarray:
        """Add another table's rows at the end; returns their new row indices. Ids must not collide."""
        if not isinstance(other, ExampleTable):
            raise ValueError(f"append needs an ExampleTable, got {type(other).__name__}")
        if other.form != self.form:
            raise ValueError(f"visited form mismatch: {other.form} vs {self.form}")
        if np.intersect1d(self.ids, other.ids).size:
            raise ValueError("appended examples are already in this table (duplicate ids)")
        start = len(self)
        for f in self._ROW_FIELDS:
            setattr(self, f, np.concatenate([getattr(self, f), getattr(other, f)]))
        return np.arange(start, len(self), dtype=np.int64)

    def pack(self, rows, x, n_max: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
        """(float32 buffer, int64 buffer) of these rows; ``x`` holds the features of every row (x[i] <-> row i)."""
        rows = self._rows(rows, unique=True)
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else np.shape(x)
        if len(shape) < 1 or shape[0] != len(self):
            raise ValueError(f"x must have one entry per table row ({len(self)}), got shape {shape}")
        numel = int(np.prod(shape[1:], dtype=np.int64))
        if isinstance(x, torch.Tensor):  # index on the tensor's device, move only the chosen rows
            chosen = x.detach()[torch.from_numpy(rows).to(x.device)].to("cpu", torch.float32).numpy()
        else:
            chosen = np.asarray(x)[rows]
        feat = np.ascontiguousarray(chosen, dtype=np.float32).reshape(rows.size, numel)
        fields = {f: getattr(self, f)[rows] for f in _INT_FIELDS}
        return _build(fields, self.confidence[rows], feat, self.form.to_int64(self.visited[rows]), self.form,
                      feature_numel=numel, n_max=rows.size if n_max is None else n_max)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Tensors and plain ints only: loads with ``torch.load(weights_only=True)`` (``table_state``)."""
        return table_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Replace this table's contents with a ``state_dict()``; ValueError on anything inconsistent."""
        other = table_from_state(state)
        self.form = other.form
        for f in self._ROW_FIELDS + ("forgetting_events",):
            setattr(self, f, getattr(other, f))

    @classmethod
    def from_state_dict(cls, state: dict) -> "ExampleTable":
        return table_from_state(state)


# --------------------------------------------------------------------------- checkpoints


def table_state(table: ExampleTable) -> dict:
    """A table's checkpoint: tensors and plain ints only (``torch.load(weights_only=True)`` reads it)."""
    state: Dict[str, object] = {"version": STATE_VERSION, "world": table.world, "form": table.form.kind,
                                "capacity": table.form.capacity, "forgetting_events": int(table.forgetting_events)}
    for f in ExampleTable._ROW_FIELDS:
        a = getattr(table, f)
        if f == "visited":
            a = table.form.to_int64(a)
        state[f] = torch.from_numpy(np.array(a, copy=True))
    return state


def table_from_state(state: dict) -> ExampleTable:
    """The table a ``table_state`` holds; ValueError on anything inconsistent."""
    missing = [k for k in ("version", "world", "form", "capacity", "forgetting_events") + ExampleTable._ROW_FIELDS
               if k not in state]
    if missing:
        raise ValueError(f"example table state lacks {missing}")
    if int(state["version"]) != STATE_VERSION:
        raise ValueError(f"example table state version {state['version']}, expected {STATE_VERSION}")
    kind = int(state["form"])
    if kind not in (BITSET, RECENT):
        raise ValueError(f"unknown visited form {kind}")
    out = ExampleTable(state["ids"], state["labels"], int(state["world"]),
                       visited="bitset" if kind == BITSET else "recent", capacity=max(1, int(state["capacity"])))
    if kind == BITSET and int(state["capacity"]) != 0:
        raise ValueError("bitset state with a non-zero capacity")
    n = len(out)
    dtypes = {"confidence": np.float32, "status": np.int8, "high_streak": np.int32, "reserve_age": np.int32,
              "forgets": np.int32, "evaluated": bool, "sampled": bool}
    for f, dt in dtypes.items():
        a = np.array(_numpy(state[f]), dtype=dt).reshape(-1)
        if a.size != n:
            raise ValueError(f"example table state: {f} has {a.size} entries, ids {n}")
        setattr(out, f, a)
    _check_rows(out.status.astype(np.int64), out.high_streak, out.reserve_age, out.forgets, out.confidence,
                what="example table state")
    out.visited = out.form.from_int64(np.array(_numpy(state["visited"]), dtype=np.int64).reshape(n, -1)
                                      if n else np.zeros((0, out.form.width), np.int64), "example table state")
    out.forgetting_events = int(state["forgetting_events"])
    return out


def _check_rows(status, high_streak, reserve_age, forgets, confidence, *, what: str) -> None:
    if not np.isin(status, (ACTIVE, RESERVE, RETIRED)).all():
        raise ValueError(f"{what}: status outside {{0, 1, 2}}")
    for name, a in (("high_streak", high_streak), ("reserve_age", reserve_age), ("forgets", forgets)):
        a = np.asarray(a)
        if a.size and (a.min() < 0 or a.max() > _INT32_MAX):
            raise ValueError(f"{what}: {name} outside [0, 2**31)")
    c = np.asarray(confidence)
    ok = np.isnan(c) | ((c >= 0) & (c <= 1))
    if not ok.all():
        raise ValueError(f"{what}: confidence outside [0, 1] (NaN allowed)")


# ----------------------------------------------------------------------------- packets

def _build(fields: dict, confidence: np.ndarray, feat: np.ndarray, visited_i64: np.ndarray, form: VisitedForm,
           *, feature_numel: int, n_max: int) -> Tuple[np.ndarray, np.ndarray]:
    n = int(confidence.size)
    n_max = int(n_max)
    if n_max < n:
        raise ValueError(f"n_max={n_max} is smaller than the {n} examples packed")
    V = form.width
    n_floats, n_ints = n_max * (feature_numel + 1), HEADER + n_max * (len(_INT_FIELDS) + V)
    floats = np.zeros(n_floats, dtype=np.float32)
    ints = np.zeros(n_ints, dtype=np.int64)
    floats[: n * feature_numel] = feat.reshape(-1)
    floats[n_max * feature_numel : n_max * feature_numel + n] = confidence
    for k, f in enumerate(_INT_FIELDS):
        ints[HEADER + k * n_max : HEADER + k * n_max + n] = fields[f]
    vo = HEADER + len(_INT_FIELDS) * n_max
    ints[vo : vo + n * V] = visited_i64.reshape(-1)
    ints[:HEADER - 1] = [MAGIC, VERSION, n, n_max, feature_numel, form.world, form.kind, V, form.capacity,
                         n_floats, n_ints]
    ints[HEADER - 1] = _checksum(floats, ints[HEADER:])
    return floats, ints


def _parse(floats, ints, form: Optional[VisitedForm], feature_numel: Optional[int]):
    """Header checks and the raw blocks of a packet; ValueError on any inconsistency."""
    floats, ints = _numpy(floats), _numpy(ints)
    if not (isinstance(floats, np.ndarray) and floats.dtype == np.float32 and floats.ndim == 1):
        raise ValueError(f"packet floats must be a 1-D float32 array, got {getattr(floats, 'dtype', type(floats))}")
    if not (isinstance(ints, np.ndarray) and ints.dtype == np.int64 and ints.ndim == 1):
        raise ValueError(f"packet ints must be a 1-D int64 array, got {getattr(ints, 'dtype', type(ints))}")
    if ints.size < HEADER:
        raise ValueError(f"packet int buffer has {ints.size} entries, less than the {HEADER}-entry header")
    magic, version, n, n_max, f, world, kind, V, cap, nf, ni, crc = (int(v) for v in ints[:HEADER])
    if magic != MAGIC:
        raise ValueError("not an example packet (bad magic number)")
    if version != VERSION:
        raise ValueError(f"example packet version {version}, expected {VERSION}")
    if form is None:
        if kind not in (BITSET, RECENT) or world < 1 or (kind == RECENT and cap < 1):
            raise ValueError(f"packet header has an invalid visited form ({kind}, world={world}, capacity={cap})")
        form = VisitedForm(kind, world, cap if kind == RECENT else 0)
    if (world, kind, cap) != (form.world, form.kind, form.capacity):
        raise ValueError(f"packet is for world={world}, visited form {kind}, capacity {cap}; "
                         f"expected world={form.world}, form {form.kind}, capacity {form.capacity}")
    if V != form.width:
        raise ValueError(f"packet has {V} visited words per example, expected {form.width}")
    if feature_numel is not None and f != feature_numel:
        raise ValueError(f"packet has {f} feature values per example, expected {feature_numel}")
    if not (0 <= n <= n_max <= ints.size) or f < 0:
        raise ValueError(f"packet header counts are invalid (n={n}, n_max={n_max}, feature_numel={f})")
    want_f, want_i = n_max * (f + 1), HEADER + n_max * (len(_INT_FIELDS) + V)
    if (nf, ni) != (want_f, want_i) or (floats.size, ints.size) != (want_f, want_i):
        raise ValueError(f"packet buffers have ({floats.size}, {ints.size}) entries, header says ({nf}, {ni}), "
                         f"the layout needs ({want_f}, {want_i})")
    if _checksum(floats, ints[HEADER:]) != crc:
        raise ValueError("example packet checksum mismatch (corrupted in transit)")
    feat_all = floats[: n_max * f].reshape(n_max, f)
    conf_all = floats[n_max * f :]
    blocks = {fld: ints[HEADER + k * n_max : HEADER + (k + 1) * n_max] for k, fld in enumerate(_INT_FIELDS)}
    vo = HEADER + len(_INT_FIELDS) * n_max
    vis_all = ints[vo:].reshape(n_max, V)
    padding = [feat_all[n:], conf_all[n:], vis_all[n:]] + [b[n:] for b in blocks.values()]
    if any(p.any() for p in padding):
        raise ValueError("example packet padding is not zero")
    return form, n, f, feat_all[:n], conf_all[:n], {k: b[:n] for k, b in blocks.items()}, vis_all[:n]


def unpack(floats, ints, feature_shape, world: int, visited: str = "auto", *, capacity: int = RECENT_CAPACITY,
           n_total: Optional[int] = None, n_classes: Optional[int] = None):
    """Validate a peer's packet and return ``(x, y, table)``: features (n, *feature_shape) float32, labels, rows.

    ``world``, ``visited`` and ``capacity`` must match the sender's table;
    ``n_total`` / ``n_classes`` bound ids and labels when given. The returned
    table's rows arrive neither evaluated nor sampled. Never trusts the peer:
    every inconsistency is a ValueError.
    """
    shape = tuple(int(s) for s in feature_shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"feature_shape must be non-negative, got {shape}")
    numel = int(np.prod(shape, dtype=np.int64))
    form, n, _, feat, conf, blocks, vis = _parse(floats, ints, visited_form(world, visited, capacity), numel)
    ids, labels = blocks["ids"], blocks["labels"]
    if (ids < 0).any() or (n_total is not None and (ids >= int(n_total)).any()):
        raise ValueError(f"example packet has ids outside [0, {n_total if n_total is not None else 'inf'})")
    if np.unique(ids).size != ids.size:
        raise ValueError("example packet repeats an id")
    if (labels < 0).any() or (n_classes is not None and (labels >= int(n_classes)).any()):
        raise ValueError(f"example packet has labels outside [0, {n_classes if n_classes is not None else 'inf'})")
    _check_rows(blocks["status"], blocks["high_streak"], blocks["reserve_age"], blocks["forgets"], conf,
                what="example packet")
    if not np.isfinite(feat).all():
        raise ValueError("example packet has non-finite features")
    words = form.from_int64(vis, "example packet")
    table = ExampleTable(ids, labels, form.world, visited="bitset" if form.kind == BITSET else "recent",
                         capacity=max(1, form.capacity))
    table.confidence = conf.copy()
    table.status = blocks["status"].astype(np.int8)
    table.high_streak = blocks["high_streak"].astype(np.int32)
    table.reserve_age = blocks["reserve_age"].astype(np.int32)
    table.forgets = blocks["forgets"].astype(np.int32)
    table.visited = words
    return feat.reshape((n,) + shape).copy(), labels.copy(), table
