"""One model or several (issue 15): the pure parts' edges, without MPI or a run. The auto rule's boundaries
(core/conflict.py), the transforms of data.shift (workload/shift.py), the local hold-out, export's cut and mean
and its refusals, and the bounds of the new config keys. tests/unit/test_community_models.py has the main cases."""
import numpy as np
import pytest
import torch
from scipy.cluster import hierarchy

from communities import config
from communities.core import conflict
from communities.errors import EXIT_USER, ConfigError, DataError
from communities.results import ResultsError
from communities.tools import export
from communities.workload import data, shift
from tests.helpers.mpi import ROOT

QUICK = ROOT / "configs" / "quickstart.yaml"


# --------------------------------------------------------------------------- the auto rule's boundaries


def _one(kind, merges, before, after):
    row = conflict.empty()
    for _ in range(merges):
        conflict.record(row, kind, examples=10, loss_before=before * 10, loss_after=after * 10,
                        loss_partner=0.0, correct_before=5.0, correct_after=5.0, correct_partner=5.0)
    return row


def test_rise_is_relative_and_names_a_rise_from_nothing_as_infinite():
    assert conflict.rise(2.0, 3.0) == pytest.approx(0.5) and conflict.rise(2.0, 1.0) == pytest.approx(-0.5)
    assert conflict.rise(0.0, 0.0) == 0.0 and conflict.rise(0.0, 1.0) == float("inf")
    # an infinite harm freezes, and JSON holds it as null
    v = conflict.decide(_one("cross", 4, 0.0, 1.0), threshold=0.5, min_merges=4)
    assert v.decision == "freeze" and v.harm == float("inf") and v.to_dict()["harm"] is None


def test_the_rule_needs_min_merges_and_a_harm_strictly_over_the_threshold():
    row = _one("cross", 4, 1.0, 1.5)  # harm 0.5 exactly
    assert conflict.decide(row, threshold=0.5, min_merges=4).decision == "undecided"  # not over it
    assert conflict.decide(row, threshold=0.49, min_merges=4).decision == "freeze"
    assert conflict.decide(row, threshold=0.49, min_merges=5).decision == "undecided"  # too few merge sides
    # intra merges alone are no evidence either way
    v = conflict.decide(_one("intra", 20, 1.0, 3.0), threshold=0.0 + 1e-9, min_merges=1)
    assert v.decision == "undecided" and v.cross_merges == 0 and v.intra_merges == 20 and v.harm is None
    assert v.intra_rise == pytest.approx(2.0)


def test_record_adds_into_its_kinds_columns_and_totals_name_them():
    row = conflict.empty()
    conflict.record(row, "intra", examples=7, loss_before=1.0, loss_after=2.0,
                    loss_partner=3.0, correct_before=4.0, correct_after=5.0, correct_partner=6.0)
    conflict.record(row, "intra", examples=3, loss_before=1.0, loss_after=2.0,
                    loss_partner=3.0, correct_before=4.0, correct_after=5.0, correct_partner=6.0)
    t = conflict.totals(row)
    assert set(t) == set(conflict.FIELDS) and len(row) == conflict.WIDTH
    assert (t["intra_merges"], t["intra_examples"], t["intra_loss_after"], t["intra_correct_partner"]) == \
        (2.0, 10.0, 4.0, 12.0)
    assert all(t[f"cross_{m}"] == 0 for m in conflict.MEASURES)
    assert conflict.totals(np.stack([row, row]))["intra_merges"] == 4.0


def test_known_classes_keep_at_least_one_example_and_a_share_of_the_mean():
    # 100 examples over 4 classes: the mean is 25, half of it 12.5; a class needs 13
    known = conflict.known_classes(np.array([[13, 12, 75, 0]]))
    assert known.tolist() == [[True, False, True, False]]
    assert conflict.known_classes(np.array([[1, 0]]), share=0.1).tolist() == [[True, False]]  # floor 1 example


# --------------------------------------------------------------------------- data.shift's transforms


def test_input_permutations_are_seeded_per_group_and_keep_the_labels():
    assert np.array_equal(shift.input_permutation(64, 0, 3), np.arange(64))
    p1, p2 = shift.input_permutation(64, 1, 3), shift.input_permutation(64, 2, 3)
    assert sorted(p1.tolist()) == list(range(64)) and not np.array_equal(p1, p2)
    assert np.array_equal(p1, shift.input_permutation(64, 1, 3))
    assert not np.array_equal(shift.input_permutation(64, 1, 3), shift.label_permutation(64, 1, 3))  # own stream
    x = np.arange(3 * 64, dtype=np.float32).reshape(3, 8, 8)
    y = np.array([1, 2, 3])
    xs, ys = shift.transform("input_permutation", x, y, 1, 4, seed=3, n_classes=10)
    assert xs.shape == x.shape and ys is y
    assert np.array_equal(xs.reshape(3, -1), x.reshape(3, -1)[:, p1])
    assert np.array_equal(shift.label_permutation(1, 3, 0), [0])  # one class: nothing to permute


def test_digit_rotations_give_eight_distinct_groups():
    x = np.arange(64, dtype=np.float32)[None]
    views = [shift.rotate(x, g, 8, 8) for g in range(8)]
    assert len({v.tobytes() for v in views}) == 8
    assert np.array_equal(views[4].reshape(8, 8), np.rot90(x.reshape(8, 8), 0).T)
    signal = np.arange(12, dtype=np.float32)[None]  # a 1-D signal rolls by g * L / G
    assert np.array_equal(shift.rotate(signal, 3, 4, None), np.roll(signal, 9, axis=1))


def test_none_and_group_0_are_the_identity_and_an_unknown_shift_is_named():
    x, y = np.ones((2, 4), dtype=np.float32), np.array([0, 1])
    for kind in shift.KINDS:
        assert shift.transform(kind, x, y, 0, 4, seed=0, n_classes=2) == (x, y)
    assert shift.transform("none", x, y, 3, 4, seed=0, n_classes=2) == (x, y)
    with pytest.raises(DataError, match="data.shift='flip'"):
        shift.transform("flip", x, y, 1, 4, seed=0, n_classes=2)


def test_apply_leaves_its_inputs_alone():
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    y = np.array([0, 1, 2, 0, 1, 2])
    x0, y0 = x.copy(), y.copy()
    xs, ys = shift.apply("label_permutation", x, y, np.array([0, 0, 1, 1, 2, 2]), 3, seed=0, n_classes=3)
    assert np.array_equal(x, x0) and np.array_equal(y, y0) and xs is not x and ys is not y
    assert np.array_equal(ys[2:4], shift.label_permutation(3, 1, 0)[y[2:4]])


def test_the_pooled_test_split_covers_every_group_in_balance():
    for n, g in ((10, 4), (3, 3), (1000, 7)):
        counts = np.bincount(shift.pooled_test_groups(n, g, seed=2), minlength=g)
        assert counts.sum() == n and counts.max() - counts.min() <= 1
    assert not np.array_equal(shift.pooled_test_groups(100, 4, 0), shift.pooled_test_groups(100, 4, 1))


# --------------------------------------------------------------------------- the local hold-out


def test_hold_out_takes_at_least_one_and_leaves_at_least_one():
    shards = [data.Shard(np.arange(0, 3), 0), data.Shard(np.arange(3, 103), 1)]
    train, tests = data.hold_out(shards, 0.01, seed=0)
    assert [t.size for t in tests] == [1, 1] and [s.indices.size for s in train] == [2, 99]
    train, tests = data.hold_out(shards, 0.99, seed=0)
    assert [t.size for t in tests] == [2, 99] and [s.indices.size for s in train] == [1, 1]
    assert [s.group for s in train] == [0, 1]  # the groups stay with their ranks
    other = data.hold_out(shards, 0.5, seed=1)[1]
    assert not np.array_equal(other[1], data.hold_out(shards, 0.5, seed=0)[1][1])  # seeded


# --------------------------------------------------------------------------- export's cut and mean


def test_export_cuts_the_saved_linkage_as_fcluster_does():
    pts = np.array([[0.0], [0.1], [5.0], [5.2], [20.0]])
    Z = hierarchy.linkage(pts, method="average")
    assert export.community_labels(Z, k=3).tolist() == [0, 0, 1, 1, 2]
    assert export.community_labels(Z, k=1).tolist() == [0] * 5
    assert export.community_labels(Z, height=1.0).tolist() == [0, 0, 1, 1, 2]
    assert export.community_labels(Z, height=100.0).tolist() == [0] * 5
    want = hierarchy.fcluster(Z, t=2, criterion="maxclust")
    got = export.community_labels(Z, k=2)
    assert (got[:, None] == got[None]).tolist() == (want[:, None] == want[None]).tolist()  # same partition


def test_export_means_are_a_float64_sum_cast_back():
    w = torch.tensor([[1.0, 1e8], [2.0, 1.0], [4.0, -1e8], [8.0, 3.0]], dtype=torch.float32)
    means = export.community_means(w, np.array([0, 1, 0, 1]))
    assert list(means) == [0, 1] and all(m.dtype == torch.float32 for m in means.values())
    assert means[0].tolist() == [2.5, 0.0] and means[1].tolist() == [5.0, 2.0]
    # in any order of the members: a float64 sum of a few float32 values is exact
    flipped = export.community_means(w.flip(0), np.array([1, 0, 1, 0]))  # the same communities, members reversed
    assert torch.equal(flipped[0], means[0]) and torch.equal(flipped[1], means[1])


def _snapshot(path, flat):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"flat": flat, "rank": 0, "round": 1, "t": 5, "n_params": flat.numel()}, path)


def test_snapshots_missing_damaged_or_of_another_size_are_named(tmp_path):
    with pytest.raises(ResultsError, match="rank00000.pt: missing .*output.round_snapshots=true"):
        export.load_snapshots(tmp_path, 1, 2)
    base = tmp_path / "snapshots" / "round_0001"
    _snapshot(base / "rank00000.pt", torch.zeros(4))
    with pytest.raises(ResultsError, match="rank00001.pt: missing$"):  # snapshots exist: no hint
        export.load_snapshots(tmp_path, 1, 2)
    _snapshot(base / "rank00001.pt", torch.zeros(5))
    with pytest.raises(ResultsError, match="rank00001.pt: 5 weights, but rank 0's snapshot has 4"):
        export.load_snapshots(tmp_path, 1, 2)
    (base / "rank00001.pt").write_bytes(b"not a zip")
    with pytest.raises(ResultsError, match="rank00001.pt: damaged snapshot"):
        export.load_snapshots(tmp_path, 1, 2)
    _snapshot(base / "rank00001.pt", torch.ones(4))
    assert export.load_snapshots(tmp_path, 1, 2).tolist() == [[0.0] * 4, [1.0] * 4]


@pytest.mark.parametrize("argv,needle", [
    (["RUN", "--round", "1", "--k", "0"], "--k 0"),
    (["RUN", "--round", "1", "--height", "0"], "--height 0.0"),
    (["RUN", "--round", "1", "--height", "-2"], "--height -2.0"),
    (["RUN", "--round", "1", "--k", "2", "--height", "1"], "not allowed with argument"),
    (["RUN", "--k", "2"], "--round"),
    (["RUN", "--round", "1"], "one of the arguments --k --height is required"),
])
def test_export_refuses_bad_arguments_before_reading_anything(argv, needle, capsys):
    assert export.main_export(argv) == EXIT_USER
    assert needle in capsys.readouterr().err


def test_export_of_no_run_names_the_directory(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert export.main_export([str(missing), "--round", "0", "--k", "2"]) == EXIT_USER
    assert f"{missing}: not a run directory" in capsys.readouterr().err


# --------------------------------------------------------------------------- bounds of the new keys


@pytest.mark.parametrize("override,key", [
    ("consensus.freeze_round=-1", "consensus.freeze_round"),
    ("consensus.k=0", "consensus.k"),
    ("consensus.auto_harm=0", "consensus.auto_harm"),
    ("consensus.auto_min_merges=0", "consensus.auto_min_merges"),
    ("consensus.mode=sometimes", "consensus.mode"),
    ("output.round_snapshots=maybe", "output.round_snapshots"),
    ("ifca.k=-2", "ifca.k"),
])
def test_out_of_range_values_name_their_key(override, key):
    with pytest.raises(ConfigError) as err:
        config.load(QUICK, [override])
    assert key in str(err.value)


def test_the_mode_keys_are_refused_with_every_strategy_but_community():
    for strategy in ("gossip", "ring", "isolated", "local_sgd", "diloco", "allreduce", "ifca"):
        with pytest.raises(ConfigError, match=f"strategy='{strategy}' has none"):
            config.load(QUICK, ["consensus.mode=communities", f"strategy={strategy}"])
    ok = config.load(QUICK, ["consensus.mode=communities", "consensus.k=4", "world_size=null"])
    ok.check_world(4)  # k communities need k ranks: 4 of 4 is fine
    config.load(QUICK, ["consensus.k=9", "world_size=null"]).check_world(4)  # k is not read under mode global


def test_one_ranks_split_is_its_part_of_the_hold_out():
    shards = data.partition(np.repeat(np.arange(4), 30), 4, "iid", seed=2)
    train, tests = data.hold_out(shards, 0.3, seed=5)
    for r, s in enumerate(shards):  # what a sharded reader's rank computes alone
        kept, local = data.split_local(s.indices, 0.3, seed=5, rank=r)
        assert np.array_equal(kept, train[r].indices) and np.array_equal(local, tests[r])
    kept, local = data.split_local(np.arange(7), 0.0, seed=5, rank=0)
    assert kept.tolist() == list(range(7)) and local.size == 0


def test_export_cannot_rebuild_a_sharded_readers_data(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "plugins"))
    cfg = config.load(ROOT / "examples" / "plugins" / "config.yaml", ["data.dataset=my_data:blobs_sharded"])
    with pytest.raises(DataError, match="data.dataset='my_data:blobs_sharded' is a sharded reader"):
        data.prepare(cfg.data, cfg.seed, 4)


def test_validate_arranges_the_data_as_the_ranks_will():
    from communities.workload import dry_run

    cfg = config.load(QUICK, ["data.partition=iid", "data.shift=rotation", "data.local_test_fraction=0.2"])
    part = [line for line in dry_run.dry_run(cfg, 8) if line.startswith("partition:")][0]
    assert "34 to 34 held out as local test data" in part and "data.shift=rotation over 4 groups" in part
    small = config.load(QUICK, ["data.local_test_fraction=0.2", "data.partition=label_groups", "data.purity=1.0"])
    assert "held out" in [line for line in dry_run.dry_run(small, 8) if line.startswith("partition:")][0]
