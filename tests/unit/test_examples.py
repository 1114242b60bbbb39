"""Per-example bookkeeping (communities.core.example_table), without MPI: confidence, retirement, visited sets,
packets."""
import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from communities.core import example_table as ex
from communities.core.example_table import ACTIVE, RESERVE, RETIRED, ExampleTable

NAN = np.float32("nan")


def _table(n=5, world=4, **kw):
    return ExampleTable(np.arange(100, 100 + n), np.arange(n) % 3, world, **kw)


# ----------------------------------------------------------------------------- confidence

def test_confidence_ema_exact():
    t = _table(3)
    np.testing.assert_array_equal(t.confidence, [NAN, NAN, NAN])
    t.update_confidence([0, 2], [0.5, 0.25], ema=0.5)  # first values initialise
    np.testing.assert_array_equal(t.confidence, np.array([0.5, NAN, 0.25], np.float32))
    np.testing.assert_array_equal(t.evaluated, [True, False, True])
    t.update_confidence([0, 1], torch.tensor([1.0, 0.75]), ema=0.5)  # 0.5*0.5 + 0.5*1; row 1 initialised
    np.testing.assert_array_equal(t.confidence, np.array([0.75, 0.75, 0.25], np.float32))
    t.update_confidence(np.array([0, 1, 2]), [0.0, 0.75, 1.0], ema=0.75)
    np.testing.assert_array_equal(t.confidence, np.array([0.5625, 0.75, 0.4375], np.float32))
    t.update_confidence([1], [0.125], ema=0.0)  # ema 0: the last value
    assert t.confidence[1] == np.float32(0.125)
    assert t.confidence.dtype == np.float32


@pytest.mark.parametrize("rows,p,ema", [([0], [1.5], 0.5), ([0], [np.nan], 0.5), ([0, 0], [0.1, 0.2], 0.5),
                                        ([0], [0.5], 1.0), ([7], [0.5], 0.5), ([0, 1], [0.5], 0.5)])
def test_confidence_rejects_bad_input(rows, p, ema):
    with pytest.raises(ValueError):
        _table(3).update_confidence(rows, p, ema)


# ----------------------------------------------------------------------------- retirement

def _step(t, p, tau=0.8, M=2, R=2, rho=1.0, rng=None, rows=None):
    rows = np.arange(len(t)) if rows is None else np.asarray(rows)
    t.update_confidence(rows, np.asarray(p, dtype=np.float64), ema=0.0)
    return t.step_retirement(tau, M, R, rho, rng)


def test_retirement_state_machine_exact():
    t = _table(3)
    # row 0 always high; row 1 high then low then high...; row 2 always low
    out = _step(t, [0.9, 0.9, 0.1])
    np.testing.assert_array_equal(t.status, [ACTIVE, ACTIVE, ACTIVE])
    np.testing.assert_array_equal(t.high_streak, [1, 1, 0])
    assert out == {"checked": 3, "promoted": 0, "retired": 0, "forgotten": 0}
    out = _step(t, [0.9, 0.5, 0.1])  # row 0: M = 2 consecutive highs -> RESERVE; row 1 streak broken
    np.testing.assert_array_equal(t.status, [RESERVE, ACTIVE, ACTIVE])
    np.testing.assert_array_equal(t.high_streak, [2, 0, 0])
    np.testing.assert_array_equal(t.reserve_age, [0, 0, 0])
    assert out["promoted"] == 1
    _step(t, [0.9, 0.9, 0.1])  # age 1 < R = 2: stays in reserve
    np.testing.assert_array_equal(t.status, [RESERVE, ACTIVE, ACTIVE])
    np.testing.assert_array_equal(t.reserve_age, [1, 0, 0])
    out = _step(t, [0.9, 0.9, 0.1])  # age 2 >= R, high -> RETIRED; row 1 -> RESERVE
    np.testing.assert_array_equal(t.status, [RETIRED, RESERVE, ACTIVE])
    np.testing.assert_array_equal(t.reserve_age, [2, 0, 0])
    assert out == {"checked": 3, "promoted": 1, "retired": 1, "forgotten": 0}
    assert t.counts() == {"active": 1, "reserve": 1, "retired": 1, "total": 3, "forgetting_events": 0}
    assert not t.evaluated.any() and not t.sampled.any()


def test_threshold_is_strict():
    t = _table(1)
    for _ in range(3):
        _step(t, [0.8], tau=0.8, M=1)  # equal to tau is not high
    assert t.status[0] == ACTIVE and t.high_streak[0] == 0


def test_reserve_and_retired_come_back_when_forgotten():
    t = _table(2)
    for _ in range(4):
        _step(t, [0.95, 0.95], M=2, R=1)
    np.testing.assert_array_equal(t.status, [RETIRED, RETIRED])
    out = _step(t, [0.3, 0.95], M=2, R=1)  # retired row 0 forgotten
    np.testing.assert_array_equal(t.status, [ACTIVE, RETIRED])
    np.testing.assert_array_equal(t.forgets, [1, 0])
    assert out["forgotten"] == 1 and t.forgetting_events == 1
    assert t.high_streak[0] == 0 and t.reserve_age[0] == 0
    _step(t, [0.95, 0.95], M=2, R=1)
    _step(t, [0.95, 0.95], M=2, R=1)
    assert t.status[0] == RESERVE
    _step(t, [0.1, 0.95], M=2, R=1)  # reserve row 0 forgotten before it could retire
    np.testing.assert_array_equal(t.status, [ACTIVE, RETIRED])
    np.testing.assert_array_equal(t.forgets, [2, 0])
    assert t.forgetting_events == 2 and t.counts()["forgetting_events"] == 2


def test_unevaluated_rows_keep_their_state():
    t = _table(2)
    _step(t, [0.9, 0.9])
    _step(t, [0.9], rows=[0])  # row 1 not evaluated: streak kept, not reset
    np.testing.assert_array_equal(t.status, [RESERVE, ACTIVE])
    np.testing.assert_array_equal(t.high_streak, [2, 1])
    _step(t, [0.9], rows=[1])
    np.testing.assert_array_equal(t.status, [RESERVE, RESERVE])
    np.testing.assert_array_equal(t.reserve_age, [1, 0])  # the reserve ages whether checked or not
    t.confidence[0] = 0.1  # stale low confidence, not re-evaluated: no forgetting
    t.step_retirement(0.8, 2, 2)
    assert t.status[0] == RESERVE and t.forgetting_events == 0


def test_sampling_is_deterministic_and_at_rate_rho():
    t = ExampleTable(np.arange(4000), np.zeros(4000), 8)
    t.status[:3000] = RESERVE
    t.status[3000:3500] = RETIRED
    a = t.sample_reserve(0.3, np.random.default_rng(5))
    t.sampled[:] = False
    b = t.sample_reserve(0.3, np.random.default_rng(5))
    np.testing.assert_array_equal(a, b)
    assert (t.status[a] == RESERVE).all() and 0.25 < a.size / 3000 < 0.35
    tr = t.training_rows(0.3, np.random.default_rng(6))
    assert np.all(np.diff(tr) > 0)
    assert set(range(3500, 4000)) <= set(tr.tolist()) and not (t.status[tr] == RETIRED).any()
    ev = t.evaluation_rows(0.3, np.random.default_rng(7))
    assert (t.status[ev] == RETIRED).any()
    assert t.sample_reserve(0.0, None).size == 0
    assert t.sample_reserve(1.0, None).size == 3000
    with pytest.raises(ValueError):
        t.sample_reserve(0.5, None)
    with pytest.raises(ValueError):
        t.sample_reserve(1.5, np.random.default_rng(0))


def test_reserve_checked_at_rate_rho_whichever_way_it_was_evaluated():
    def run(use_sampler, seed):
        t = ExampleTable(np.arange(2000), np.zeros(2000), 4)
        t.status[:] = RESERVE
        t.reserve_age[:] = 10
        rng = np.random.default_rng(seed)
        if use_sampler:  # engine trains on the sample and evaluates it: every sampled row is checked
            rows = t.training_rows(0.25, rng)
        else:  # engine evaluated the whole shard: the step thins the checks itself
            rows = np.arange(2000)
        t.update_confidence(rows, np.full(rows.size, 0.99), 0.0)
        return t.step_retirement(0.8, 2, 3, 0.25, rng)["retired"]

    for use in (True, False):
        assert 400 < run(use, 1) < 600  # rate rho = 0.25, never rho**2
        assert run(use, 1) == run(use, 1)


def test_step_retirement_validates():
    t = _table(2)
    for args in [(1.5, 2, 2), (0.8, 0, 2), (0.8, 2, -1)]:
        with pytest.raises(ValueError):
            t.step_retirement(*args)


# ----------------------------------------------------------------------------- hardest, logs

def test_hardest_order_ties_caps_and_preference():
    t = ExampleTable([7, 3, 9, 4, 5, 6], np.zeros(6), 4)
    t.update_confidence([0, 1, 2, 3, 4], [0.5, 0.5, 0.25, 0.75, 0.5], 0.0)  # row 5 never evaluated
    t.status[3] = RESERVE
    np.testing.assert_array_equal(t.hardest(), [2, 1, 4, 0])  # 0.25, then 0.5 by id 3, 5, 7
    np.testing.assert_array_equal(t.hardest(count=2), [2, 1])
    np.testing.assert_array_equal(t.hardest(fraction=0.5), [2, 1])
    np.testing.assert_array_equal(t.hardest(fraction=0.6), [2, 1])  # floor(0.6 * 4) = 2
    b = ex.example_bytes(10, 4)
    assert b == 4 * 11 + 8 * (6 + 1)
    np.testing.assert_array_equal(t.hardest(byte_cap=3 * b + b - 1, bytes_per_example=b), [2, 1, 4])
    np.testing.assert_array_equal(t.hardest(count=10, byte_cap=0, bytes_per_example=b), [])
    t.mark_visited([2, 1], 3)
    np.testing.assert_array_equal(t.hardest(prefer=3), [4, 0, 2, 1])  # unvisited by rank 3 first
    np.testing.assert_array_equal(t.hardest(prefer=1), [2, 1, 4, 0])
    with pytest.raises(ValueError):
        t.hardest(byte_cap=100)
    with pytest.raises(ValueError):
        t.hardest(fraction=2.0)


def test_quantiles_counts_globally_hard():
    t = ExampleTable(np.arange(5), np.zeros(5), 2)
    assert all(np.isnan(v) for v in t.quantiles().values())
    t.update_confidence([0, 1, 2, 3], [0.0, 0.25, 0.5, 1.0], 0.0)
    q = t.quantiles((0.0, 0.5, 1.0))
    assert q == {"q0": 0.0, "q50": 0.375, "q100": 1.0}
    assert list(t.quantiles()) == ["q10", "q25", "q50", "q75", "q90"]
    t.mark_visited([0, 1, 3, 4], 0)
    t.mark_visited([0, 3, 4], 1)
    np.testing.assert_array_equal(t.globally_hard(0.5), [0])  # 3 too confident, 4 not evaluated, 1 half-seen
    np.testing.assert_array_equal(t.all_visited(), [True, False, False, True, True])


# ----------------------------------------------------------------------------- visited sets

def test_bitset_visited_across_words():
    t = ExampleTable(np.arange(4), np.zeros(4), 130)
    assert t.form.kind == ex.BITSET and t.visited.shape == (4, 3)
    t.mark_visited([0, 1, 1], 0)
    t.mark_visited([1], 63)
    t.mark_visited([1, 2], 64)
    t.mark_visited([1], 129)
    t.mark_visited([1], 129)  # idempotent
    np.testing.assert_array_equal(t.visited_count(), [1, 4, 1, 0])
    np.testing.assert_array_equal(t.has_visited([0, 1, 2, 3], 64), [False, True, True, False])
    np.testing.assert_array_equal(t.has_visited([1], 128), [False])
    t.mark_visited(np.ones(4, bool), 5)
    for r in range(130):
        t.mark_visited([3], r)
    np.testing.assert_array_equal(t.all_visited(), [False, False, False, True])
    with pytest.raises(ValueError):
        t.mark_visited([0], 130)


def test_form_choice():
    assert ex.visited_form(1024).kind == ex.BITSET and ex.visited_form(1024).width == 16
    f = ex.visited_form(1025)
    assert f.kind == ex.RECENT and f.width == 1 + ex.RECENT_CAPACITY
    assert ex.visited_form(8, "recent", 3).width == 4
    with pytest.raises(ValueError):
        ex.visited_form(8, "bloom")


def test_recent_visited_lru_and_saturating_count():
    t = ExampleTable([1, 2], [0, 0], 5000, capacity=3)
    for r in (10, 20, 30):
        t.mark_visited([0], r)
    np.testing.assert_array_equal(t.visited[0], [3, 30, 20, 10])
    t.mark_visited([0], 20)  # already listed: moves to the front, not counted
    np.testing.assert_array_equal(t.visited[0], [3, 20, 30, 10])
    t.mark_visited([0], 40)  # evicts the least recent (10)
    np.testing.assert_array_equal(t.visited[0], [4, 40, 20, 30])
    assert not t.has_visited([0], 10)[0]  # what is lost: an evicted rank
    t.mark_visited([0], 10)  # ... and a returning evicted rank is counted again (over-count)
    np.testing.assert_array_equal(t.visited[0], [5, 10, 40, 20])
    np.testing.assert_array_equal(t.visited[1], [0, -1, -1, -1])
    small = ExampleTable([1], [0], 2, visited="recent", capacity=1)
    for r in (0, 1, 0, 1, 0):
        small.mark_visited([0], r)
    assert small.visited_count()[0] == 2  # saturates at world
    assert small.all_visited()[0]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 39)), max_size=40))
def test_recent_matches_bitset_while_under_capacity(marks):
    """With at most K distinct visitors per row, the compact form answers exactly like the bitset."""
    a = ExampleTable(np.arange(6), np.zeros(6), 40)
    b = ExampleTable(np.arange(6), np.zeros(6), 40, visited="recent", capacity=40)
    for row, rank in marks:
        a.mark_visited([row], rank)
        b.mark_visited([row], rank)
    np.testing.assert_array_equal(a.visited_count(), b.visited_count())
    for r in range(40):
        np.testing.assert_array_equal(a.has_visited(np.arange(6), r), b.has_visited(np.arange(6), r))
    np.testing.assert_array_equal(a.all_visited(), b.all_visited())


# ----------------------------------------------------------------------------- packets

def _filled(world, n=6, feature_shape=(2, 3), seed=0, **kw):
    rng = np.random.default_rng(seed)
    t = ExampleTable(rng.permutation(1000)[:n], rng.integers(0, 10, n), world, **kw)
    t.update_confidence(np.arange(n - 1), rng.random(n - 1), 0.5)  # last row stays NaN
    t.status[:] = rng.integers(0, 3, n)
    t.high_streak[:] = rng.integers(0, 5, n)
    t.reserve_age[:] = rng.integers(0, 5, n)
    t.forgets[:] = rng.integers(0, 3, n)
    for r in rng.integers(0, world, 3 * n):
        t.mark_visited(rng.integers(0, n, 2), int(r))
    x = rng.standard_normal((n,) + feature_shape).astype(np.float32)
    return t, x


@pytest.mark.parametrize("world,kw", [(70, {}), (3000, {}), (9, {"visited": "recent", "capacity": 2})])
@pytest.mark.parametrize("n_max_extra", [0, 3])
def test_pack_unpack_round_trip(world, kw, n_max_extra):
    t, x = _filled(world, **kw)
    rows = np.array([4, 0, 5, 2])
    floats, ints = t.pack(rows, torch.from_numpy(x), n_max=len(rows) + n_max_extra)
    assert floats.dtype == np.float32 and ints.dtype == np.int64
    assert (floats.size, ints.size) == ex.packet_sizes(len(rows) + n_max_extra, 6, world, **kw)
    x2, y2, got = ex.unpack(floats.copy(), ints.copy(), (2, 3), world, n_total=1000, n_classes=10, **kw)
    assert x2.shape == (4, 2, 3) and x2.tobytes() == x[rows].tobytes()
    np.testing.assert_array_equal(y2, t.labels[rows])
    np.testing.assert_array_equal(got.ids, t.ids[rows])
    np.testing.assert_array_equal(got.labels, t.labels[rows])
    assert got.confidence.tobytes() == t.confidence[rows].tobytes()  # NaN included, bit for bit
    for f in ("status", "high_streak", "reserve_age", "forgets"):
        np.testing.assert_array_equal(getattr(got, f), getattr(t, f)[rows])
        assert getattr(got, f).dtype == getattr(t, f).dtype
    assert got.visited.tobytes() == t.visited[rows].tobytes()
    np.testing.assert_array_equal(got.visited_count(), t.visited_count(rows))
    assert got.form == t.form and not got.evaluated.any()


def test_padded_and_empty_packets():
    t, x = _filled(16)
    f5, i5 = t.pack([1, 3], x, n_max=5)  # both partners send equal sizes: the shorter side pads
    x2, y2, got = ex.unpack(f5, i5, (2, 3), 16)
    assert len(got) == 2 and got.ids.tolist() == t.ids[[1, 3]].tolist()
    with pytest.raises(ValueError):
        t.pack([1, 3], x, n_max=1)
    fe, ie = t.pack([], x, n_max=2)
    x0, y0, got = ex.unpack(fe, ie, (2, 3), 16)
    assert x0.shape == (0, 2, 3) and y0.size == 0 and len(got) == 0
    fz, iz = t.pack([], x)
    assert fz.size == 0 and iz.size == ex.HEADER
    assert len(ex.unpack(fz, iz, (2, 3), 16)[2]) == 0


def _reseal(floats, ints):
    ints = ints.copy()
    ints[ex.HEADER - 1] = ex._checksum(floats, ints[ex.HEADER:])
    return floats, ints


def test_corrupted_packets_raise():
    world = 70
    t, x = _filled(world)
    floats, ints = t.pack([0, 1, 2], x, n_max=4)
    V = t.form.width
    lab, ids_, stat, vis = ex.HEADER, ex.HEADER + 4, ex.HEADER + 8, ex.HEADER + 24

    def bad(f, i, shape=(2, 3), w=world, **kw):
        with pytest.raises(ValueError):
            ex.unpack(f, i, shape, w, **kw)

    def header(k, v):
        i = ints.copy()
        i[k] = v
        return i

    bad(floats, header(0, 12345))            # magic
    bad(floats, header(1, 2))                # version
    bad(floats, header(2, 5))                # n > n_max
    bad(floats, header(2, -1))
    bad(floats, header(3, 10**15))           # absurd capacity
    bad(floats, header(4, 7))                # feature size
    bad(floats, header(5, 71))               # world
    bad(floats, header(6, 1))                # form
    bad(floats, header(7, V + 1))            # words per example
    bad(floats, header(9, floats.size + 1))
    bad(floats, ints, shape=(3, 3))          # receiver expects other features
    bad(floats, ints, w=69)                  # receiver has another world
    bad(floats[:-1], ints)                   # truncated
    bad(floats, ints[:-1])
    bad(floats, ints[:5])
    bad(floats.astype(np.float64), ints)     # wrong dtypes
    bad(floats, ints.astype(np.int32))
    flipped = floats.copy()
    flipped[3] += 1.0
    bad(flipped, ints)                       # payload corrupted: checksum
    # semantically invalid payloads with a valid checksum
    for k, v in [(stat, 3), (ids_ + 1, int(ints[ids_])), (ids_, -5), (lab, -1), (ex.HEADER + 12, -1),
                 (ids_ + 3, 7), (vis + 3 * V, 1)]:  # status, duplicate id, negative id/label/streak, padding
        i = ints.copy()
        i[k] = v
        bad(*_reseal(floats, i))
    i = ints.copy()
    i[vis + V - 1] = np.int64(1) << 10       # bit for rank 64 + 10 = 74 >= world
    bad(*_reseal(floats, i))
    f = floats.copy()
    f[4 * 6] = 1.5                           # confidence > 1
    bad(*_reseal(f, ints))
    f = floats.copy()
    f[0] = np.inf                            # non-finite feature
    bad(*_reseal(f, ints))
    bad(floats, ints, n_total=5)             # ids beyond the dataset
    bad(floats, ints, n_classes=1)
    ex.unpack(floats, ints, (2, 3), world)   # the untouched packet is fine


def test_corrupted_recent_words_raise():
    t, x = _filled(9, visited="recent", capacity=3)
    floats, ints = t.pack([0, 1], x)
    vis = ex.HEADER + 6 * 2
    for words in ([1, 5, 5, -1], [1, -1, 5, -1], [0, 5, -1, -1], [10, 5, -1, -1], [1, 9, -1, -1], [1, -2, -1, -1]):
        i = ints.copy()
        i[vis : vis + 4] = words
        with pytest.raises(ValueError):
            ex.unpack(*_reseal(floats, i), (2, 3), 9, visited="recent", capacity=3)


def test_hand_over_conserves_examples():
    world = 8
    a, xa = _filled(world, n=10, seed=1)
    a.status[:] = ACTIVE
    b = ExampleTable(np.arange(2000, 2007), np.arange(7) % 10, world)
    xb = np.random.default_rng(2).standard_normal((7, 2, 3)).astype(np.float32)
    b.update_confidence(np.arange(7), np.linspace(0.1, 0.7, 7), 0.0)
    feats = {int(i): xa[r].tobytes() for r, i in enumerate(a.ids)}
    feats.update({int(i): xb[r].tobytes() for r, i in enumerate(b.ids)})
    all_ids = set(feats)

    ra, rb = a.hardest(count=3), b.hardest(count=5)
    n_max = max(ra.size, rb.size)
    pa, pb = a.pack(ra, xa, n_max=n_max), b.pack(rb, xb, n_max=n_max)
    assert pa[0].size == pb[0].size and pa[1].size == pb[1].size  # equal-size Sendrecv buffers
    xa_in, _, in_a = ex.unpack(*pb, (2, 3), world)
    xb_in, _, in_b = ex.unpack(*pa, (2, 3), world)
    xa = np.concatenate([xa[a.remove(ra)], xa_in])
    new = a.append(in_a)
    np.testing.assert_array_equal(new, np.arange(10 - 3, 10 - 3 + 5))
    xb = np.concatenate([xb[b.remove(rb)], xb_in])
    b.append(in_b)
    assert len(a) + len(b) == 17 and len(a) == 12 and len(b) == 5
    assert set(a.ids.tolist()) | set(b.ids.tolist()) == all_ids
    assert not set(a.ids.tolist()) & set(b.ids.tolist())
    for t, x in ((a, xa), (b, xb)):  # features still aligned with their rows
        assert x.shape[0] == len(t)
        for r, i in enumerate(t.ids):
            assert x[r].tobytes() == feats[int(i)]
    with pytest.raises(ValueError):
        a.append(a.take([0]))  # duplicate ids
    with pytest.raises(ValueError):
        a.append(ExampleTable([5000], [0], world + 1))


def test_state_dict_round_trip_through_torch_save():
    for world, kw in ((70, {}), (9, {"visited": "recent", "capacity": 2})):
        t, _ = _filled(world, **kw)
        t.forgetting_events = 4
        t.evaluated[1] = True
        buf = io.BytesIO()
        torch.save(t.state_dict(), buf)
        buf.seek(0)
        state = torch.load(buf, weights_only=True)
        u = ExampleTable.from_state_dict(state)
        for f in ExampleTable._ROW_FIELDS:
            a, b = getattr(t, f), getattr(u, f)
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f
        assert u.form == t.form and u.forgetting_events == 4
        v = ExampleTable([1], [0], world, **kw)
        v.load_state_dict(state)
        assert v.ids.tobytes() == t.ids.tobytes()
        broken = dict(state, status=state["status"].clone())
        broken["status"][0] = 7
        with pytest.raises(ValueError):
            ExampleTable.from_state_dict(broken)
        with pytest.raises(ValueError):
            ExampleTable.from_state_dict({k: v for k, v in state.items() if k != "visited"})


def test_table_validates_construction():
    with pytest.raises(ValueError):
        ExampleTable([1, 1], [0, 0], 4)
    with pytest.raises(ValueError):
        ExampleTable([1, -2], [0, 0], 4)
    with pytest.raises(ValueError):
        ExampleTable([1, 2], [0], 4)
    with pytest.raises(ValueError):
        ExampleTable([1], [0], 0)
