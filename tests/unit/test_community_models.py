"""One model or several (issue 15), without MPI: concept shift, local test splits, the auto rule, the frozen law,
the new config keys, and compare's columns. The engine's side is in tests/mpi/test_community_models_mpi.py."""
import json
import subprocess
import sys

import numpy as np
import pytest

from communities import config
from communities.core import conflict, partners, protocol, signature
from communities.errors import ConfigError, DataError
from communities.tools.compare.curves import delivered
from communities.workload import data, shift
from tests.helpers.mpi import ROOT

QUICK = ROOT / "configs" / "quickstart.yaml"


# --------------------------------------------------------------------------- concept shift


def test_label_permutations_are_fixed_per_group_and_group_0_keeps_the_identity():
    assert np.array_equal(shift.label_permutation(10, 0, 5), np.arange(10))
    perms = [shift.label_permutation(10, g, 5) for g in range(1, 6)]
    for p in perms:
        assert sorted(p.tolist()) == list(range(10)) and not np.array_equal(p, np.arange(10))
    assert len({tuple(p) for p in perms}) == 5  # each group its own
    assert np.array_equal(perms[0], shift.label_permutation(10, 1, 5))  # seeded
    assert not np.array_equal(perms[0], shift.label_permutation(10, 1, 6))


def test_rotation_turns_digit_images_and_rolls_signals():
    x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
    side = shift.image_side(64, "digits")
    assert side == 8 and shift.image_side(40, "mnist1d") is None
    r1 = shift.rotate(x, 1, 4, side).reshape(2, 8, 8)
    assert np.array_equal(r1, np.rot90(x.reshape(2, 8, 8), 1, axes=(1, 2)))
    assert np.array_equal(shift.rotate(x, 0, 4, side), x)
    signal = np.arange(40, dtype=np.float32)[None]
    assert np.array_equal(shift.rotate(signal, 1, 4, None), np.roll(signal, 10, axis=1))
    with pytest.raises(DataError, match="data.groups=9"):
        shift.rotate(x, 1, 9, side)


def test_every_example_carries_its_groups_transform_and_the_test_split_is_pooled():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 6)).astype(np.float32)
    y = rng.integers(0, 5, size=100)
    groups = np.repeat(np.arange(4), 25)
    for kind in ("label_permutation", "input_permutation", "rotation"):
        xs, ys = shift.apply(kind, x, y, groups, 4, seed=1, n_classes=5)
        for g in range(4):
            m = groups == g
            want = shift.transform(kind, x[m], y[m], g, 4, seed=1, n_classes=5)
            assert np.array_equal(xs[m], want[0]) and np.array_equal(ys[m], want[1])
        assert np.array_equal(xs[groups == 0], x[groups == 0]) and np.array_equal(ys[groups == 0], y[groups == 0])
    pooled = shift.pooled_test_groups(450, 4, seed=1)
    assert np.bincount(pooled).tolist() == [113, 113, 112, 112]
    assert np.array_equal(pooled, shift.pooled_test_groups(450, 4, seed=1))


def test_prepare_gives_each_rank_its_groups_distribution_and_a_local_test_split():
    cfg = config.load(QUICK, ["data.partition=iid", "data.shift=label_permutation", "data.local_test_fraction=0.2"])
    plain = data.load(cfg.data, cfg.seed)
    p = data.prepare(cfg.data, cfg.seed, 8)
    assert [s.group for s in p.shards] == [0, 0, 1, 1, 2, 2, 3, 3]  # data.groups blocks, whatever the partition
    for s, local in zip(p.shards, p.local_tests):
        assert local.size and not set(local.tolist()) & set(s.indices.tolist())
        perm = shift.label_permutation(10, s.group, cfg.seed)
        for idx in (s.indices, local):  # training and local test data: the same group's labels
            assert np.array_equal(p.dataset.y_train[idx], perm[plain.y_train[idx]])
    described = data.describe(p.shards, p.dataset.y_train, "iid", len(p.dataset.y_test),
                              local_test_sizes=[t.size for t in p.local_tests], shift="label_permutation")
    assert described["shift"] == "label_permutation" and described["local_test_sizes"] == [34] * 8


def test_hold_out_is_seeded_disjoint_and_off_at_zero():
    shards = data.partition(np.repeat(np.arange(4), 50), 4, "iid", seed=0)
    same, tests = data.hold_out(shards, 0.0, seed=0)
    assert same is shards and all(t.size == 0 for t in tests)
    a, ta = data.hold_out(shards, 0.25, seed=0)
    b, tb = data.hold_out(shards, 0.25, seed=0)
    for s, x, t, u in zip(shards, a, ta, tb):
        assert np.array_equal(t, u) and t.size == 12
        assert sorted(np.concatenate([x.indices, t]).tolist()) == sorted(s.indices.tolist())
    with pytest.raises(DataError, match="rank 1's shard holds 1"):
        data.hold_out([data.Shard(np.arange(5), None), data.Shard(np.arange(5, 6), None)], 0.5, seed=0)


def test_defaults_leave_the_data_pipeline_as_it_was():
    cfg = config.load(QUICK)
    p = data.prepare(cfg.data, cfg.seed, 8)
    ds = data.load(cfg.data, cfg.seed)
    shards = data.partition(ds.y_train, 8, "label_groups", cfg.seed, groups=4)
    assert all(np.array_equal(a.indices, b.indices) and a.group == b.group for a, b in zip(p.shards, shards))
    assert np.array_equal(p.dataset.x_train, ds.x_train) and np.array_equal(p.dataset.y_test, ds.y_test)


# --------------------------------------------------------------------------- the auto rule


def _rows(cross=None, intra=None):
    row = conflict.empty()
    for kind, sides in (("cross", cross), ("intra", intra)):
        for before, after in sides or []:
            conflict.record(row, kind, examples=10, loss_before=before * 10, loss_after=after * 10,
                            loss_partner=after * 20, correct_before=9.0, correct_after=5.0, correct_partner=1.0)
    return row


def test_cross_merges_that_hurt_freeze_and_ones_that_do_not_anneal():
    hurt = _rows(cross=[(0.2, 1.0)] * 4, intra=[(0.2, 0.2)] * 8)
    v = conflict.decide(hurt, threshold=0.5, min_merges=4)
    assert v.decision == "freeze" and v.harm == pytest.approx(4.0) and v.cross_merges == 4
    assert v.cross_acc_before == pytest.approx(0.9) and v.cross_acc_after == pytest.approx(0.5)
    assert conflict.decide(_rows(cross=[(0.2, 1.0)] * 3), 0.5, 4).decision == "undecided"  # too few yet
    helps = _rows(cross=[(0.2, 0.1)] * 6, intra=[(0.2, 0.15)] * 6)  # label skew: merging across helps
    assert conflict.decide(helps, 0.5, 4).decision == "undecided"
    # the intra merges are the control for what merging costs: when every merge costs as much, crossing is no worse
    same = _rows(cross=[(0.2, 0.5)] * 6, intra=[(0.2, 0.5)] * 6)
    assert conflict.decide(same, 0.5, 4).harm == pytest.approx(0.0)
    # ... but only a cost: cross merges that help, if less than intra merges do (label skew), are no harm
    skew = _rows(cross=[(0.2, 0.14)] * 6, intra=[(0.2, 0.1)] * 6)
    v = conflict.decide(skew, 0.05, 4)
    assert v.decision == "undecided" and v.harm == pytest.approx(-0.3)
    nothing = conflict.decide(np.stack([conflict.empty()] * 3), 0.5, 4)
    assert nothing.decision == "undecided" and nothing.harm is None and nothing.to_dict()["cross_rise"] is None


def test_the_verdict_is_a_function_of_the_gathered_rows_alone():
    rows = np.stack([_rows(cross=[(0.3, 0.9)] * 2), _rows(cross=[(0.3, 0.9)] * 2, intra=[(0.3, 0.3)])])
    a = conflict.decide(rows, 0.5, 4)
    b = conflict.decide(rows.sum(axis=0), 0.5, 4)
    assert a == b and a.decision == "freeze"


def test_only_the_classes_a_partner_trains_on_are_scored():
    counts = np.array([[50, 50, 0, 0], [0, 1, 60, 39], [25, 25, 25, 25]])
    known = conflict.known_classes(counts)
    assert known.tolist() == [[True, True, False, False], [False, False, True, True], [True] * 4]


# --------------------------------------------------------------------------- frozen communities


def test_a_frozen_law_keeps_partners_inside_and_leaves_a_lone_rank_alone():
    labels = np.array([0, 0, 1, 1, 1, 2])
    law = partners.Law("frozen", 6, labels=labels, p_cross=0.0)
    assert law.probabilities(0).tolist() == [0, 1, 0, 0, 0, 0]
    assert law.probabilities(2)[[3, 4]].tolist() == [0.5, 0.5] and law.probabilities(2)[[0, 1, 5]].sum() == 0
    assert law.probabilities(5).sum() == 0
    plan = protocol.exchange_list(range(6), t=3, seed=0, probabilities=law.probabilities)
    assert all(labels[i] == labels[j] for i, j in plan) and all(5 not in pair for pair in plan)


def test_community_dispersion_is_the_calm_of_the_least_settled_community():
    S = np.array([[1.0, 0], [1.0, 0], [0, 1.0], [0, 2.0], [5.0, 5.0]])
    labels = np.array([0, 0, 1, 1, 2])
    assert signature.community_dispersion(S, labels) == pytest.approx(signature.dispersion(S[2:4]))
    assert signature.community_dispersion(S[:2], labels[:2]) == 0.0
    assert signature.dispersion(S) > signature.community_dispersion(S, labels)


# --------------------------------------------------------------------------- config: every bad key is named


@pytest.mark.parametrize("overrides,needle", [
    (["consensus.mode=communities", "strategy=gossip"], "consensus.mode='communities'"),
    (["consensus.mode=auto", "strategy=ifca", "data.local_test_fraction=0.2"], "strategy='ifca' has none"),
    (["consensus.mode=auto"], "data.local_test_fraction > 0"),
    (["data.shift=label_permutation", "data.groups=1"], "data.groups >= 2"),
    (["data.shift=rotation", "data.dataset=tests.helpers.user_fns:good"], "data.shift='rotation'"),
    (["data.local_test_fraction=1.0"], "data.local_test_fraction"),
    (["data.local_test_fraction=-0.1"], "data.local_test_fraction"),
    (["data.shift=flip"], "data.shift"),
    (["consensus.mode=communities", "protocol=async"], "protocol='virtual_clock'"),
    (["output.round_snapshots=true", "protocol=async"], "output.round_snapshots"),
    (["ifca.k=0", "strategy=ifca"], "ifca.k"),
    (["consensus.finetune_units=-1"], "consensus.finetune_units"),
])
def test_bad_new_keys_name_themselves(overrides, needle):
    with pytest.raises(ConfigError, match=None) as err:
        config.load(QUICK, overrides)
    assert needle in str(err.value)


@pytest.mark.parametrize("overrides,world,needle", [
    (["data.partition=iid", "data.shift=label_permutation", "data.groups=5", "world_size=null"], 4,
     "data.groups=5"),
    (["consensus.mode=communities", "consensus.k=9"], 8, "consensus.k=9"),
])
def test_world_checks_of_the_new_keys(overrides, world, needle):
    cfg = config.load(QUICK, overrides)
    with pytest.raises(ConfigError, match=needle):
        cfg.check_world(world)


def test_validate_exits_2_naming_the_key():
    res = subprocess.run([sys.executable, "-m", "communities", "validate", str(QUICK), "consensus.mode=communities",
                          "strategy=ring"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "consensus.mode" in res.stderr and "Traceback" not in res.stderr


def test_the_new_keys_default_off():
    c = config.Config()
    assert (c.data.local_test_fraction, c.data.shift, c.consensus.mode, c.consensus.finetune_units,
            c.output.round_snapshots) == (0.0, "none", "global", 0, False)


# --------------------------------------------------------------------------- compare reports the new columns


def _summary(**extra):
    from communities.results import Summary

    base = dict(name="x", strategy="community", world_size=4, n_params=10, units=5, rounds=1, merges=2,
                consensus_test_acc=0.3, consensus_test_loss=1.0, rank_test_acc=[0.3] * 4, best_rank_acc=0.3,
                worst_rank_acc=0.3, mean_rank_acc=0.3, communities_per_round=[2], first_round_ari=1.0,
                final_dispersion=0.1, consensus_reached_t=None, consensus_distance=0.1, bytes_sent_per_rank=[1] * 4,
                bytes_sent_mean=1.0, wall_time=1.0)
    base.update(extra)
    return Summary(**base)


def test_what_a_run_delivers_is_named_for_the_table():
    models = {"models": [{"community": 0, "members": [0, 1]}, {"community": 1, "members": [2, 3]},
                         {"community": 2, "members": []}]}
    assert delivered(_summary()) == "consensus"
    assert delivered(_summary(strategy="isolated")) == "own"
    assert delivered(_summary(local_test={"delivered": "communities"}, community_models=models)) == \
        "communities (2)"
    assert delivered(_summary(local_test={"delivered": "ifca"}, community_models=models)) == "ifca (2)"
    assert delivered(_summary(local_test={"delivered": "finetuned"})) == "finetuned"
    s = _summary(local_test={"delivered": "communities", "mean_acc": 0.9})
    assert json.loads(json.dumps(s.to_dict()))["local_test"]["mean_acc"] == 0.9
    assert "local_test" not in _summary().to_dict()  # optional fields stay out of a default summary
