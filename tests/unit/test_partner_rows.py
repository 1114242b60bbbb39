"""Partner laws served per row (no N x N array) give the bits of the N x N laws they replace."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.cluster import hierarchy
from scipy.spatial.distance import squareform

from communities.config import apply_overrides, from_dict
from communities.core import clustering, partners, protocol
from communities.engine.mixing import strategies

METHODS = ("average", "complete", "single", "ward", "centroid", "median")  # the last two may invert heights


# ----------------------------------------------------------------------------- reference: the N x N laws as they were

def ref_cophenetic_heights(Z):
    """Condensed cophenetic heights divided by the top merge height (the law's heights as first written)."""
    h = hierarchy.cophenet(Z)
    top = float(Z[-1, 2]) if Z.size else 0.0
    return h / top if top > 0 else np.zeros_like(h)


def ref_hierarchical_probabilities(heights, n, i, temperature):
    h = partners.condensed_row(heights, n, i)
    logits = np.divide(h, -float(temperature), out=h)
    top = max(logits[:i].max(initial=-np.inf), logits[i + 1:].max(initial=-np.inf))
    logits[i] = -np.inf
    if not np.isfinite(top):
        top = logits[np.isfinite(logits)].max()
    logits -= top
    w = np.exp(logits, out=logits)
    return w / w.sum()


def ref_staleness_weights(seen_at, t, power=2.0):
    W = (1.0 + float(t) - np.asarray(seen_at, dtype=np.float64)) ** float(power)
    np.fill_diagonal(W, 0.0)
    return W


def linkage(n, method, seed, ties=False):
    X = np.random.default_rng(seed).normal(size=(n, 3))
    if ties:  # repeated points: merges at equal (and zero) heights
        X = np.round(X)
    return hierarchy.linkage(X, method)


# ----------------------------------------------------------------------------- heights per row

@given(st.integers(2, 60), st.sampled_from(METHODS), st.integers(0, 10**6), st.booleans())
@settings(max_examples=80, deadline=None)
def test_height_rows_are_the_scipy_cophenet_squareform_rows(n, method, seed, ties):
    Z = linkage(n, method, seed, ties)
    square = squareform(ref_cophenetic_heights(Z))
    h = partners.cophenetic_heights(Z)
    for i in range(n):
        row = h.row(i)
        assert row.dtype == np.float64 and np.array_equal(row, square[i]), (i, method)


def test_one_rank_and_a_flat_tree():
    assert np.array_equal(partners.cophenetic_heights(np.zeros((0, 4))).row(0), [0.0])
    Z = hierarchy.linkage(np.zeros((4, 2)), "average")  # every merge at height 0: all heights 0
    assert all(np.array_equal(partners.cophenetic_heights(Z).row(i), np.zeros(4)) for i in range(4))


def test_rows_are_fresh_arrays():
    h = partners.cophenetic_heights(linkage(9, "average", 0))
    a = h.row(3)
    a[:] = 7.0
    assert np.array_equal(h.row(3), squareform(ref_cophenetic_heights(linkage(9, "average", 0)))[3])


@pytest.mark.parametrize("method", METHODS)
def test_hierarchical_law_equals_the_condensed_law(method):
    n = 23
    Z = linkage(n, method, 3)
    ref, h = ref_cophenetic_heights(Z), partners.cophenetic_heights(Z)
    for T in (1e-3, 0.07, 1.0, 1e9, np.inf):
        law = partners.Law("hierarchical", n, heights=h, temperature=T)
        for i in range(n):
            assert np.array_equal(law.probabilities(i), ref_hierarchical_probabilities(ref, n, i, T)), (i, T)


# ----------------------------------------------------------------------------- staleness per row

@given(st.integers(2, 30), st.integers(0, 200), st.integers(0, 10**6))
@settings(max_examples=40, deadline=None)
def test_staleness_rows_equal_the_matrix(n, t, seed):
    seen = np.random.default_rng(seed).integers(-1, t + 1, size=(n, n))
    W = ref_staleness_weights(seen, t)
    bias = partners.Staleness(seen, t)
    for i in range(n):
        assert np.array_equal(bias[i], W[i])


# ----------------------------------------------------------------------------- the draws, end to end

def _cfg(*overrides):
    return from_dict(apply_overrides({}, ["strategy=community", *overrides]))


def _planted(n, groups=3, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(groups, 8))
    return (centres[np.arange(n) % groups] + 0.3 * rng.normal(size=(n, 8))).astype(np.float32)


class _World:
    def __init__(self, table):
        self.world, self.table, self.seen_at = self, table, table[0]

    def allgather(self, _row):
        return self.table


def _reference_draws(law, heights, bias, excluded=None):
    """P(j | i) of the strategy as first written: condensed heights, an (N, N) bias, the exclusion mask."""
    n = law.n

    def p(i):
        if heights is not None:
            out = ref_hierarchical_probabilities(heights, n, i, law.temperature)
        else:
            out = law.probabilities(i)
        if bias is not None:
            b = out * bias[i]
            out = b / b.sum() if b.sum() > 0 else out
        if excluded is not None:
            out = np.where(excluded, 0.0, out)
            out = out / out.sum() if out.sum() > 0 else out
        return out
    return p


@pytest.mark.parametrize("law,policy", [("flat", "law"), ("hierarchical", "law"), ("flat", "least_recent"),
                                        ("hierarchical", "least_recent")])
def test_exchange_lists_equal_those_of_the_n_by_n_laws(law, policy):
    """Strategy.exchanges with rows equals the same draws from the old N x N heights and bias, unit by unit."""
    n = 19
    cfg = _cfg(f"partners.law={law}", f"merge.partner_policy={policy}", "clustering.cut=maxclust")
    com = clustering.find_communities(_planted(n), cut="maxclust", k=3)
    heights = ref_cophenetic_heights(com.Z) if law == "hierarchical" else None
    excluded = np.zeros(n, dtype=bool)
    excluded[[2, 5]] = True
    rng = np.random.default_rng(1)
    for t in range(1, 40):
        if t % 5 == 1:  # a signature round
            table = rng.integers(-1, t + 1, size=(n, n))
            s = strategies.make(cfg, n)
            s.observe(com, _World(table), t)
            bias = ref_staleness_weights(table, t) if policy == "least_recent" else None
        initiators = s.clock.fire(t)
        assert s.exchanges(t, initiators) == protocol.exchange_list(
            initiators, t, cfg.seed, _reference_draws(s.law(t), heights, bias)), t
        assert s.exchanges(t, initiators, excluded) == protocol.exchange_list(
            [i for i in initiators if not excluded[i]], t, cfg.seed,
            _reference_draws(s.law(t), heights, bias, excluded)), t


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    return torch.load(io.BytesIO(buf.getvalue()), weights_only=True)


def test_staleness_survives_a_checkpoint_and_an_older_checkpoints_matrix_still_loads():
    n, t = 7, 12
    cfg = _cfg("merge.partner_policy=least_recent")
    table = np.random.default_rng(0).integers(-1, t + 1, size=(n, n))
    s = strategies.make(cfg, n)
    s.observe(clustering.find_communities(_planted(n), cut="maxclust", k=2), _World(table), t)
    state = _roundtrip(s.state_dict())
    r = strategies.make(cfg, n)
    r.load_state_dict(state)
    assert isinstance(r.bias, partners.Staleness) and r.bias.t == t
    assert all(np.array_equal(r.bias[i], s.bias[i]) for i in range(n))
    old = dict(state, bias=torch.from_numpy(ref_staleness_weights(table, t)))  # a checkpoint written before rows
    o = strategies.make(cfg, n)
    o.load_state_dict(old)
    for u in range(t, t + 20):
        assert o.exchanges(u, np.arange(n)) == r.exchanges(u, np.arange(n))


def test_bench_partners_runs_small_and_prints(capsys, tmp_path):
    from communities.tools.bench.main import main_bench

    out = tmp_path / "p.json"
    assert main_bench(["partners", "--n", "8", "32", "--reps", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "all N ms (cpu)" in text and "least_recent" in text and out.exists()


# ----------------------------------------------------------------------------- draws a block of initiators at a time


def ref_exchange_list(initiators, t, seed, probabilities):
    """Unit t's exchanges as first written: one probability vector, cumulative sum and draw per initiator."""
    out = []
    for i in sorted(int(x) for x in initiators):
        p = probabilities(i)
        if not p.sum() > 0:
            continue
        j = partners.draw(p, protocol.rng(seed, protocol.Purpose.PARTNER, t, i))
        if j != i:
            out.append((i, j))
    return out


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 300), groups=st.integers(1, 6), p_cross=st.sampled_from([0.0, 1e-3, 0.05, 0.3, 1.0]),
       kind=st.sampled_from(["flat", "uniform", "frozen"]), t=st.integers(0, 50), block=st.integers(1, 70),
       seed=st.integers(0, 3))
def test_rows_and_block_draws_give_the_bits_of_the_row_by_row_law(n, groups, p_cross, kind, t, block, seed):
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, groups, size=n)
    law = partners.Law(kind, n, labels=labels, p_intra=1.0, p_cross=p_cross)
    ids = sorted(rng.choice(n, size=int(rng.integers(0, n + 1)), replace=False).tolist())
    with np.errstate(invalid="ignore", divide="ignore"):  # a lone rank of N = 1 has nobody to draw
        rows = law.rows(ids)
        assert rows.shape == (len(ids), n)
        for r, i in enumerate(ids):
            np.testing.assert_array_equal(rows[r], law.probabilities(i))
        want = ref_exchange_list(ids, t, seed, law.probabilities)
        assert protocol.exchange_list(ids, t, seed, law.probabilities, law.rows, block=block) == want
        assert protocol.exchange_list(ids, t, seed, law.probabilities, block=block) == want
