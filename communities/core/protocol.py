"""The virtual-clock pairwise protocol.

Every random decision comes from a generator keyed by ``(seed, purpose, t, i)``,
so every rank computes every other rank's decisions and no negotiation messages
are needed. At unit t the initiators are the ranks whose merge timer fires; each,
in increasing rank order, draws a partner from the current law. The resulting
ordered exchange list is identical on every rank. Each rank performs the
exchanges it appears in, in list order, with blocking Sendrecv: since all ranks
walk the same total order, the first pending exchange of the list can always
proceed, so there is no cycle of waits and no deadlock.
"""
from __future__ import annotations

import functools
import hashlib
from enum import IntEnum
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np


class Purpose(IntEnum):
    """What a random stream decides: distinct decisions draw from distinct streams."""

    TIMER = 1  # a rank's merge timer K
    PARTNER = 2  # an initiator's partner
    SHUFFLE = 3  # the order of a unit's batches
    SLOW = 6  # faults.slow_max: a unit's injected delay
    EX_TRAIN = 7  # examples: the reserve sample trained on in a unit
    EX_EVAL = 8  # examples: the reserve sample evaluated
    EX_STEP = 9  # examples: retirement draws
    JITTER = 10  # faults.jitter: a batch's injected delay
    DP_NOISE = 11  # privacy.noise=seeded: a unit's DP-SGD noise
    PBT_DRAW = 12  # pbt: a replica's first hyperparameters
    PBT_EXPLORE = 13  # pbt: the perturbation of hyperparameters a replica adopts
    HYPERCUBE = 14  # partners.schedule hypercube: whether a unit's stage spans the whole world
    PBT_SELECT = 16  # pbt.selection truncation: which replica of the top a bottom replica adopts from
    COMMUNITY = 15  # clustering.cut auto: the null draws of the community test (core/significance.py)


Exchange = Tuple[int, int]  # (initiator, partner)


def rng(seed: int, purpose: int, t: int, i: int = 0) -> np.random.Generator:
    """A fresh counter-keyed generator: the same key gives the same stream anywhere."""
    return np.random.Generator(np.random.Philox(key=[int(seed), (int(purpose) << 48) | (int(t) << 20) | int(i)]))


class Rekeyed:
    """``rng``'s streams from one generator, re-keyed for each key: the same draws without building a generator
    per key (about 20 us each: a stacked unit's 64 batch shuffles took 2.5 ms, 0.85 ms re-keyed). Each
    call hands back the same generator: use its stream up before the next call."""

    def __init__(self) -> None:
        self._bits = np.random.Philox(key=[0, 0])
        self._gen = np.random.Generator(self._bits)

    def __call__(self, seed: int, purpose: int, t: int, i: int = 0) -> np.random.Generator:
        key = [int(seed), (int(purpose) << 48) | (int(t) << 20) | int(i)]
        if min(key) < 0 or max(key) >= 1 << 64:
            return rng(seed, purpose, t, i)  # (what Philox makes of such a key: its own business)
        self._bits.state = {"bit_generator": "Philox", "state": {"counter": np.zeros(4, np.uint64),
                                                                 "key": np.array(key, dtype=np.uint64)},
                            "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        return self._gen


def merge_interval(seed: int, t: int, i: int, lam: float) -> int:
    """K ~ 1 + Poisson(lam - 1): K >= 1 units until rank i's next merge, mean lam."""
    return 1 + int(rng(seed, Purpose.TIMER, t, i).poisson(max(lam - 1.0, 0.0)))


@functools.lru_cache(maxsize=8)
def _first_fires(n: int, seed: int, lam: float, start: int) -> np.ndarray:
    """Every rank's first merge time (drawn once per process: a population's replicas each hold a clock)."""
    out = np.array([start + merge_interval(seed, start, i, lam) for i in range(n)], dtype=np.int64)
    out.setflags(write=False)
    return out


class MergeClock:
    """The merge timers of all N ranks, held identically by every rank.

    ``lams`` (pbt with merge.lam): each rank's own mean; a rank's new value takes effect when every rank has
    learnt it (``set_lams`` at a signature round), so the clocks stay identical.
    """

    def __init__(self, n: int, seed: int, lam: float, *, start: int = 0, lams: Optional[np.ndarray] = None):
        self.n, self.seed, self.lam = int(n), int(seed), float(lam)
        self.lams = None if lams is None else np.asarray(lams, dtype=np.float64).copy()
        if self.lams is None:
            self.next_fire = _first_fires(self.n, self.seed, self.lam, int(start)).copy()
        else:
            self.next_fire = np.array([int(start) + merge_interval(self.seed, int(start), i, self.lam_of(i))
                                       for i in range(self.n)], dtype=np.int64)

    def lam_of(self, i: int) -> float:
        return self.lam if self.lams is None else float(self.lams[i])

    def set_lams(self, lams: np.ndarray) -> None:
        """Every rank's merge.lam from now on (timers already armed keep their draw)."""
        self.lams = np.asarray(lams, dtype=np.float64).reshape(self.n).copy()

    def fire(self, t: int) -> np.ndarray:
        """Ranks whose timer fires at t (increasing order); their timers are re-armed."""
        due = np.flatnonzero(self.next_fire <= t)
        for i in due:
            self.next_fire[i] = t + merge_interval(self.seed, t, int(i), self.lam_of(int(i)))
        return due

    def state(self) -> np.ndarray:
        return self.next_fire.copy()

    def load(self, next_fire: np.ndarray) -> None:
        self.next_fire = np.asarray(next_fire, dtype=np.int64).copy()


def exchange_list(
    initiators: Sequence[int], t: int, seed: int, probabilities: Callable[[int], np.ndarray],
    rows: Optional[Callable[[List[int]], np.ndarray]] = None, *, block: int = 64,
) -> List[Exchange]:
    """Ordered exchanges of unit t: each initiator (increasing rank) draws its partner (``partners.draw``).

    ``rows(ids)``, where given, is ``np.stack([probabilities(i) for i in ids])`` built at once (``Law.rows``).
    The draws go ``block`` initiators at a time: one (block, N) cumulative sum instead of one per initiator,
    the same bits as ``partners.draw`` row by row (numpy sums and accumulates each row of a C-ordered matrix
    as it does one vector; tested), and never an N x N matrix.
    """
    from .partners import draw_from_cdf

    ids = sorted(int(x) for x in initiators)
    if rows is None:
        def rows(chunk: List[int]) -> np.ndarray:
            return np.stack([np.asarray(probabilities(i), dtype=np.float64) for i in chunk])
    out: List[Exchange] = []
    for lo in range(0, len(ids), block):
        chunk = ids[lo: lo + block]
        cdf = np.cumsum(rows(chunk), axis=1)
        for r, i in enumerate(chunk):
            if not cdf[r, -1] > 0:  # nobody eligible (every other rank excluded)
                continue
            j = draw_from_cdf(cdf[r], rng(seed, Purpose.PARTNER, t, i))
            if j != i:
                out.append((i, j))
    return out


def my_exchanges(exchanges: Sequence[Exchange], me: int) -> List[Tuple[int, Exchange]]:
    """(partner, exchange) for each exchange ``me`` takes part in, in list order."""
    return [(j if i == me else i, (i, j)) for i, j in exchanges if me in (i, j)]


def digest(*arrays) -> bytes:
    """16-byte BLAKE2b of arrays' bytes: what ranks allgather to prove they agree."""
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str(a.dtype).encode())
        h.update(np.asarray(a.shape, dtype=np.int64).tobytes())
        h.update(a.tobytes())
    return h.digest()


class RunningDigest:
    """A digest chained over everything the ranks must agree on (exchange lists, communities).

    ``update`` folds new arrays into it; two ranks hold the same value only if
    they derived the same sequence of decisions. Ranks allgather it each round.
    """

    def __init__(self, value: bytes = b""):
        self.value = value

    def update(self, *arrays) -> bytes:
        self.value = digest(np.frombuffer(self.value, dtype=np.uint8), *arrays)
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value.hex()}

    def load_state_dict(self, state: dict) -> None:
        self.value = bytes.fromhex(state["value"])
