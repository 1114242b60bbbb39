"""Population-based training's pure parts: draws and perturbations stay in range, the worse side of a pair adopts
(never both, ties and non-finite scores deterministically), the pair's merge.alpha conserves the mean, per-replica
merge timers stay identical on every rank, and what pbt cannot ride on is refused by name."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from communities import config as config_mod
from communities.core import merge, pbt, protocol
from communities.engine.replica.hyper import Hyperparameters, initial, initial_lams
from communities.errors import ConfigError

PARAMS = {"train.lr": {"low": 1e-3, "high": 1.0}, "train.momentum": {"low": 0.5, "high": 0.95, "scale": "linear"},
          "merge.alpha": {"low": 0.1, "high": 0.5, "scale": "linear"},
          "merge.lam": {"low": 1.0, "high": 4.0, "scale": "linear"}}


def _cfg(**extra) -> config_mod.Config:
    raw = {"data": {"local_test_fraction": 0.1}, "pbt": {"enabled": True, "params": PARAMS, **extra}}
    return config_mod.from_dict(raw)


def _space() -> pbt.Space:
    return pbt.Space.of(_cfg().pbt.params)


def test_space_is_sorted_so_every_rank_lays_the_values_out_alike():
    assert _space().names == ("merge.alpha", "merge.lam", "train.lr", "train.momentum")


def test_draws_stay_in_range_and_log_scales_are_log_uniform():
    space = _space()
    rng = np.random.default_rng(0)
    draws = np.array([pbt.draw(space, rng) for _ in range(4000)])
    assert (draws >= space.low).all() and (draws <= space.high).all()
    lr = draws[:, space.index("train.lr")]
    # log-uniform on [1e-3, 1]: the median is the geometric mean 10^-1.5, a quarter lies below 10^-2.25
    assert abs(np.log10(np.median(lr)) + 1.5) < 0.08
    assert abs(np.mean(lr < 10 ** -2.25) - 0.25) < 0.03
    mom = draws[:, space.index("train.momentum")]
    assert abs(np.median(mom) - 0.725) < 0.02  # linear: the midpoint


def test_explore_multiplies_by_a_factor_or_clips_and_is_deterministic():
    space = _space()
    values = np.array([0.3, 2.0, 0.01, 0.9])
    key = (7, protocol.Purpose.PBT_EXPLORE, 5, 3)
    a = pbt.explore(space, values, protocol.rng(*key), [0.8, 1.25])
    b = pbt.explore(space, values, protocol.rng(*key), [0.8, 1.25])
    assert np.array_equal(a, b)
    for k in range(len(space)):
        options = {float(np.clip(values[k] * f, space.low[k], space.high[k])) for f in (0.8, 1.25)}
        assert any(math.isclose(a[k], o) for o in options)
    # at the edge a factor pushes out of range: clipped back in
    edge = pbt.explore(space, space.high.copy(), np.random.default_rng(1), [2.0])
    assert np.array_equal(edge, space.high)


def test_resample_one_draws_afresh_inside_the_range():
    space = _space()
    rng = np.random.default_rng(3)
    out = np.array([pbt.explore(space, space.low.copy(), rng, [1.0], resample=1.0) for _ in range(200)])
    assert (out >= space.low).all() and (out <= space.high).all()
    assert (out > space.low).mean() > 0.95  # not the adopted values: fresh draws


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(0.5)),
       st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(0.5)),
       st.floats(0, 0.9))
def test_a_pair_never_both_adopts(x, y, margin):
    assert not (pbt.adopts(x, y, True, margin) and pbt.adopts(y, x, True, margin))


def test_the_worse_adopts_ties_and_nans_decide_deterministically():
    assert pbt.adopts(1.0, 0.5, ready=True)  # worse (higher loss) adopts
    assert not pbt.adopts(0.5, 1.0, ready=True)  # the better keeps its own
    assert not pbt.adopts(1.0, 0.5, ready=False)  # not ready: keeps its own
    assert not pbt.adopts(0.5, 0.5, ready=True)  # a tie adopts nothing, on both sides
    assert pbt.adopts(float("nan"), 3.0, ready=True)  # a diverged replica adopts a finite one's
    assert not pbt.adopts(3.0, float("nan"), ready=True)
    assert not pbt.adopts(float("nan"), float("nan"), ready=True)
    assert not pbt.adopts(1.0, 0.95, ready=True, margin=0.1)  # within the margin
    assert pbt.adopts(1.0, 0.85, ready=True, margin=0.1)


def test_the_pairs_alpha_conserves_the_sum_of_the_two_models():
    wi, wj = torch.randn(100, dtype=torch.float64), torch.randn(100, dtype=torch.float64)
    a = pbt.pair_alpha(0.2, 0.45)
    total = wi + wj
    mine, theirs = wi.clone(), wj.clone()
    merge.interpolate_(mine, wj, a)
    merge.interpolate_(theirs, wi, a)
    assert torch.allclose(mine + theirs, total, atol=1e-12)


def test_each_replica_draws_its_own_start_from_its_own_stream():
    cfg = _cfg()
    a, b = initial(cfg, 0), initial(cfg, 1)
    assert not np.array_equal(a, b) and np.array_equal(a, initial(cfg, 0))
    lams = initial_lams(cfg, 4)
    k = _space().index("merge.lam")
    assert lams is not None and np.array_equal(lams, [initial(cfg, i)[k] for i in range(4)])


def test_hyperparameters_act_on_the_optimizer_adopt_and_round_trip():
    cfg = _cfg(ready=3)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    h = Hyperparameters(cfg, rank=2)
    h.apply(opt)
    assert opt.param_groups[0]["lr"] == h.get("train.lr", -1) and opt.param_groups[0]["momentum"] == h.values[3]
    assert not h.ready(2) and h.ready(3)
    other = np.array([0.4, 3.0, 0.2, 0.8])
    h.adopt(5, other, opt)
    assert h.adopted_t == 5 and not h.ready(7) and h.ready(8)
    ratio = h.values / other
    assert all(math.isclose(r, 0.8) or math.isclose(r, 1.25) or v in (lo, hi)
               for r, v, lo, hi in zip(ratio, h.values, h.space.low, h.space.high))
    assert opt.param_groups[0]["lr"] == h.values[2]
    state = h.state_dict()
    g = Hyperparameters(cfg, rank=2)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g.load_state_dict(state, opt2)
    assert np.array_equal(g.values, h.values) and g.adopted_t == 5 and opt2.param_groups[0]["lr"] == h.values[2]


def test_adamw_betas_are_set_one_entry_at_a_time():
    raw = {"data": {"local_test_fraction": 0.1}, "train": {"optimizer": "adamw"},
           "pbt": {"enabled": True, "params": {"train.beta1": {"low": 0.8, "high": 0.95, "scale": "linear"}}}}
    cfg = config_mod.from_dict(raw)
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), betas=(0.9, 0.999))
    h = Hyperparameters(cfg, rank=0)
    h.apply(opt)
    assert opt.param_groups[0]["betas"] == (h.values[0], 0.999)


def test_per_replica_merge_timers_fire_at_each_replicas_own_rate_and_agree():
    lams = np.array([1.0, 2.0, 4.0])
    a = protocol.MergeClock(3, seed=5, lam=2.0, lams=lams)
    b = protocol.MergeClock(3, seed=5, lam=2.0, lams=lams)
    fires = np.zeros(3)
    for t in range(1, 3001):
        due = a.fire(t)
        assert np.array_equal(due, b.fire(t))
        fires[due] += 1
    assert np.allclose(3000 / fires, lams, rtol=0.08)
    shared = protocol.MergeClock(3, seed=5, lam=2.0)
    assert np.array_equal(shared.next_fire, protocol.MergeClock(3, seed=5, lam=2.0, lams=[2.0] * 3).next_fire)


@pytest.mark.parametrize("extra,key", [
    ({"strategy": "allreduce"}, "strategy='allreduce'"),
    ({"data": {"local_test_fraction": 0.0}}, "data.local_test_fraction"),
    ({"privacy": {"enabled": True, "epsilon": 8.0}}, "privacy.enabled"),
    ({"merge": {"rule": "ema"}}, "merge.alpha"),
    ({"train": {"optimizer": "adamw"}}, "train.momentum"),
])
def test_what_pbt_cannot_ride_on_is_refused_by_name(extra, key):
    raw = {"data": {"local_test_fraction": 0.1}, "pbt": {"enabled": True, "params": PARAMS}}
    for section, value in extra.items():
        raw[section] = {**raw.get(section, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("(", r"\(")):
        config_mod.from_dict(raw)


@pytest.mark.parametrize("params,key", [
    ({"train.lrr": {"low": 0.1, "high": 1}}, "did you mean 'train.lr'"),
    ({"train.lr": {"low": 0.0, "high": 1}}, "low > 0"),
    ({"train.momentum": {"low": 0.5, "high": 1.0, "scale": "linear"}}, r"train\.momentum"),
    ({"merge.lam": {"low": 0.5, "high": 2, "scale": "linear"}}, r"merge\.lam"),
    ({"train.lr": {"low": 1.0, "high": 0.1}}, "below low"),
])
def test_bad_ranges_are_refused_by_name(params, key):
    with pytest.raises(ConfigError, match=key):
        config_mod.from_dict({"data": {"local_test_fraction": 0.1}, "pbt": {"enabled": True, "params": params}})


def test_params_without_pbt_enabled_are_an_error():
    with pytest.raises(ConfigError, match="no effect"):
        config_mod.from_dict({"pbt": {"params": {"train.lr": {"low": 0.1, "high": 1}}}})


def test_a_dotted_override_reaches_a_learnable_key():
    raw = config_mod.apply_overrides({}, ["pbt.enabled=true", "pbt.params.train.lr.low=0.01",
                                          "pbt.params.train.lr.high=0.5", "data.local_test_fraction=0.1",
                                          "pbt.params.merge.lam={low: 1, high: 3, scale: linear}"])
    cfg = config_mod.from_dict(raw)
    assert cfg.pbt.params["train.lr"].low == 0.01 and cfg.pbt.params["merge.lam"].high == 3


def test_a_score_taken_between_batches_leaves_the_model_in_training_mode():
    """pbt scores a replica at each exchange; under async that is between two batches of a unit."""
    from communities.workload import train

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
    model.train()
    train.evaluate(model, torch.randn(10, 4), torch.randint(0, 3, (10,)))
    assert model.training
    model.eval()
    train.evaluate(model, torch.randn(10, 4), torch.randint(0, 3, (10,)))
    assert not model.training


# ---------------------------------------------------------------- truncation selection (pbt.selection: truncation)


def test_truncation_moves_the_ready_bottom_to_the_top_and_nothing_else():
    scores = np.array([0.5, 0.1, np.nan, 0.9, 0.3, 0.2, 0.8, 0.05])  # ranked: 7 1 5 4 0 6 3 2 (nan last)
    src = pbt.truncation(scores, np.ones(8, dtype=bool), 0.25, protocol.rng(0, protocol.Purpose.PBT_SELECT, 5))
    assert set(np.flatnonzero(src >= 0)) == {2, 3}  # the bottom two adopt ...
    assert set(src[src >= 0]) <= {7, 1}  # ... from the top two; the middle keeps its own
    again = pbt.truncation(scores, np.ones(8, dtype=bool), 0.25, protocol.rng(0, protocol.Purpose.PBT_SELECT, 5))
    assert np.array_equal(src, again)  # every rank draws the same
    not_ready = np.ones(8, dtype=bool)
    not_ready[3] = False
    src = pbt.truncation(scores, not_ready, 0.25, protocol.rng(0, protocol.Purpose.PBT_SELECT, 5))
    assert src[3] == -1 and src[2] >= 0  # a replica that is not ready keeps its values


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=40),
       st.floats(0.01, 0.5), st.integers(0, 1000))
def test_truncation_never_adopts_its_own_nor_from_the_bottom(values, fraction, seed):
    scores = np.array(values, dtype=np.float64)
    src = pbt.truncation(scores, np.ones(len(scores), dtype=bool), fraction,
                         protocol.rng(seed, protocol.Purpose.PBT_SELECT, 1))
    adopters = np.flatnonzero(src >= 0)
    assert all(src[i] != i for i in adopters)
    assert not set(src[adopters].tolist()) & set(adopters.tolist())  # no source is also an adopter
    if len(scores) >= 2:
        assert len(adopters) == max(1, int(np.floor(fraction * len(scores))))


def test_truncation_is_the_default_and_refused_under_async():
    cfg = config_mod.from_dict({"pbt": {"enabled": True, "params": {"train.lr": {"low": 0.01, "high": 1}}},
                                "data": {"local_test_fraction": 0.1}})
    assert cfg.pbt.selection == "truncation" and cfg.pbt.fraction == 0.25
    with pytest.raises(ConfigError, match=r"pbt.enabled=true is refused with protocol=.async. \(pbt.selection"):
        config_mod.from_dict({"protocol": "async", "pbt": {"enabled": True, "params": {"train.lr": {"low": 0.01,
                                                                                                    "high": 1}}},
                              "data": {"local_test_fraction": 0.1}})
