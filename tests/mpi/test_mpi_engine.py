"""The engine under a real mpiexec: results layout and the invariants of DESIGN.md.

Every run has a timeout that kills the whole process group, so a hang fails the
test instead of stalling CI.
"""
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from communities import config
from communities.results import open_run
from tests.helpers.mpi import initial_mean_and_final, run_engine

pytestmark = pytest.mark.timeout(600)


def consensus_weights(run_dir):
    return torch.load(run_dir / "consensus.pt", weights_only=True)


@pytest.mark.parametrize("n", [4, 3])
def test_run_writes_the_results_layout(tmp_path, tiny_config, n):
    run_engine(n, tiny_config, tmp_path)
    run = open_run(tmp_path / "tiny")
    assert run.complete and run.world_size == n
    for f in ("config.yaml", "meta.json", "partition.json", "metrics.jsonl", "merges.jsonl", "consensus.jsonl",
              "consensus.pt", "summary.json"):
        assert (run.path / f).stat().st_size > 0, f
    s = run.summary
    assert s["units"] == 40 and s["rounds"] == 8 and len(run.round_paths) == 8
    metrics = run.metrics()
    assert len(metrics) == 40 * n and {m["rank"] for m in metrics} == set(range(n))
    merges = run.merges()
    # both sides of every exchange are logged, with one coefficient
    sides = {}
    for m in merges:
        sides.setdefault((m["t"], min(m["i"], m["j"]), max(m["i"], m["j"])), []).append(m)
    assert merges and all(len(v) % 2 == 0 for v in sides.values())
    assert s["merges"] == sum(1 for m in merges if m["i"] == m["initiator"])
    r0 = run.round(0)
    assert r0.signatures.shape == (n, 64) and r0.Z.shape == (n - 1, 4) and r0.labels.shape == (n,)
    assert len(r0.info["hash"]) == 32
    walls = [m["wall"] for m in metrics if m["rank"] == 0]
    assert walls == sorted(walls) and walls[0] > 0  # seconds since the run started, per unit
    assert s["bytes_sent_mean"] > 0
    assert set(s["time_split"]) == {"train", "exchange", "signature", "idle", "eval", "other"}


def test_same_seed_gives_bitwise_identical_consensus(tmp_path, tiny_config):
    a, b = tmp_path / "a", tmp_path / "b"
    run_engine(4, tiny_config, a)
    run_engine(4, tiny_config, b)
    wa, wb = consensus_weights(a / "tiny"), consensus_weights(b / "tiny")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    c = tmp_path / "c"
    run_engine(4, tiny_config, c, "seed=4")
    wc = consensus_weights(c / "tiny")
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_lr0_gossip_reaches_the_initial_mean(tmp_path, tiny_config):
    """With lr = 0 and different initial weights, symmetric merges drive all ranks to the initial mean."""
    n = 4
    run_engine(n, tiny_config, tmp_path, "train.lr=0", "train.momentum=0", "model.init=per_rank",
               "strategy=gossip", "train.budget=60", "merge.lam=1")
    mean0, final_mean, spread0 = initial_mean_and_final(tiny_config, n, tmp_path / "tiny")
    s = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert torch.allclose(final_mean, mean0, atol=1e-5)  # the mean is conserved
    assert s["consensus_distance"] < 1e-3 * spread0  # and every rank is at it


def test_planted_groups_are_recovered_by_the_first_round(tmp_path, tiny_config):
    run_engine(4, tiny_config, tmp_path)
    s = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert s["first_round_ari"] >= 0.9


@pytest.mark.parametrize("strategy", ["gossip", "ring", "isolated"])
def test_other_strategies_share_the_layout(tmp_path, tiny_config, strategy):
    run_engine(4, tiny_config, tmp_path, f"strategy={strategy}", "train.budget=20")
    run = open_run(tmp_path / "tiny")
    assert run.summary["strategy"] == strategy and len(run.round_paths) == 4
    if strategy == "isolated":
        assert run.summary["merges"] == 0 and not run.merges()
    else:
        assert run.summary["merges"] > 0
    if strategy == "ring":
        assert all((m["j"] - m["i"]) % 4 in (1, 3) for m in run.merges())


@pytest.mark.parametrize("extra", [["merge.rule=clock", "merge.optimizer_state=average"],
                                   ["merge.rule=swap", "merge.optimizer_state=reset"],
                                   ["merge.rule=ema", "merge.outer.enabled=true", "train.optimizer=adamw",
                                    "train.lr=0.01", "model.batchnorm=true"],
                                   ["partners.law=hierarchical", "clustering.cut=maxclust",
                                    "clustering.k={start: 2, end: 1, horizon: 30}"],
                                   ["signature.overlap=true", "signature.kind=gaussian"]])
def test_merge_and_law_variants_run(tmp_path, tiny_config, extra):
    run_engine(4, tiny_config, tmp_path, "train.budget=30", *extra)
    s = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert s["merges"] > 0 and np.isfinite(s["consensus_test_acc"])
    assert s["consensus_test_acc"] > 0.4


def test_config_error_exits_2_once_before_training(tmp_path, tiny_config):
    res = run_engine(4, tiny_config, tmp_path, "merge.lam=0.2", check=False)
    assert res.returncode == 2
    assert res.stderr.count("merge.lam") == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "tiny").exists()


def test_existing_run_dir_is_refused_without_overwrite(tmp_path, tiny_config):
    run_engine(2, tiny_config, tmp_path, "train.budget=5")
    before = (tmp_path / "tiny" / "summary.json").read_bytes()
    res = run_engine(2, tiny_config, tmp_path, "train.budget=5", check=False)
    assert res.returncode == 2 and "--overwrite" in res.stderr
    assert (tmp_path / "tiny" / "summary.json").read_bytes() == before
    run_engine(2, tiny_config, tmp_path, "train.budget=5", extra=["--overwrite"])


def test_exception_on_one_rank_aborts_the_job(tmp_path, tiny_config):
    res = run_engine(4, tiny_config, tmp_path, "data.dataset=tests.helpers.user_fns:bug_on_rank_1",
                     "data.partition=iid", check=False, timeout=120)
    assert res.returncode != 0
    assert "injected bug on rank 1" in res.stderr and "rank 1 failed" in res.stderr


def test_quickstart_meets_its_promises(tmp_path):
    """The README's quickstart claims: consensus >= 0.95, first-round ARI >= 0.9, one community, dispersion < tol;
    with logging.tensorboard its event file holds the scalars the README lists (read back with TensorBoard's reader)."""
    res = run_engine(8, "configs/quickstart.yaml", tmp_path, "logging.tensorboard=true", timeout=600)
    s = json.loads((tmp_path / "quickstart" / "summary.json").read_text())
    check_tensorboard(tmp_path / "quickstart", s)
    # the printed summary ends with the wall split, a partition of the loop's time (README, "What a run looks like")
    assert re.search(r"wall time +[\d.]+s: train [\d.]+s \(\d+%\) / exchange .* / other [\d.]+s \(\d+%\)", res.stdout)
    assert s["consensus_test_acc"] >= 0.95
    assert s["first_round_ari"] >= 0.9
    assert s["communities_per_round"][-1] == 1
    assert s["final_dispersion"] < config.load("configs/quickstart.yaml").consensus.tol


def check_tensorboard(run: Path, summary: dict) -> None:
    """The quickstart's event file, as TensorBoard reads it: every listed scalar, at the units it belongs to."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    rounds = [json.loads(p.read_text()) for p in sorted((run / "rounds").glob("round_*/round.json"))]
    assert [int(v) for v in scalars["communities/count"].values()] == summary["communities_per_round"]
    assert sorted(scalars["communities/p_cross"]) == [r["t"] for r in rounds]
    assert scalars["communities/dispersion"][summary["units"]] == pytest.approx(summary["final_dispersion"])
    consensus = [json.loads(line) for line in (run / "consensus.jsonl").read_text().splitlines()]
    assert scalars["accuracy/consensus_test"] == pytest.approx({c["t"]: c["test_acc"] for c in consensus})
    assert "loss/consensus_test" in scalars and "loss/rank_train_mean" in scalars
    t_end, evaluated = summary["units"], max(scalars["accuracy/rank_test_max"])  # the ranks' last evaluation
    assert scalars["accuracy/rank_test_max"][evaluated] == pytest.approx(summary["best_rank_acc"])
    assert scalars["final/consensus_test_acc"][t_end] == pytest.approx(summary["consensus_test_acc"])
    assert scalars["bytes/sent_per_rank_mean_mb"][t_end] > 0
    for category, seconds in summary["time_split"].items():  # the wall split
        assert scalars[f"time/{category}_s"][t_end] == pytest.approx(seconds)
    assert len(acc.Images("dendrogram")) == summary["rounds"]  # one dendrogram per round


def test_update_tol_gates_the_consensus_stop(tmp_path, tiny_config):
    """Dispersion alone stops the tiny run early; an update_tol no merge can meet keeps it going to the budget,
    and every round logs the relative update norm it was judged on, the same on every rank (rank 0 writes it)."""
    stop = ["consensus.stop=true", "consensus.tol=0.5", "consensus.patience=1", "train.budget=60"]
    run_engine(4, tiny_config, tmp_path / "a", *stop)
    run_engine(4, tiny_config, tmp_path / "b", *stop, "consensus.update_tol=1e-9")
    a, b = open_run(tmp_path / "a" / "tiny"), open_run(tmp_path / "b" / "tiny")
    assert a.summary["consensus_reached_t"] is not None and a.summary["units"] < 60
    assert b.summary["consensus_reached_t"] is None and b.summary["units"] == 60
    rel = [r.info["relative_update"] for r in b.rounds()]
    assert all(v is None or v > 1e-9 for v in rel) and any(v is not None for v in rel)


@pytest.mark.parametrize("strategy, extra", [("local_sgd", ["merge.period=3"]),
                                             ("diloco", ["merge.period=3", "train.optimizer=adamw", "train.lr=0.01"]),
                                             ("allreduce", ["train.unit=epoch"])])
def test_global_strategies(tmp_path, tiny_config, strategy, extra):
    run_engine(3, tiny_config, tmp_path, f"strategy={strategy}", "train.budget=12", *extra)
    run = open_run(tmp_path / "tiny")
    s = run.summary
    assert s["strategy"] == strategy and s["merges"] == 0 and s["consensus_test_acc"] > 0.5
    averages = [m for m in run.merges() if m["event"] == "average"]
    if strategy == "allreduce":
        # identical inits and identical averaged gradients: the ranks never diverge
        assert s["consensus_distance"] < 1e-6 and not averages and s["bytes_sent_mean"] > 0
    else:
        assert sorted({m["t"] for m in averages}) == [3, 6, 9, 12] and len(averages) == 4 * 3
        if strategy == "local_sgd":  # the last unit ended in an average: every rank holds the mean
            assert s["consensus_distance"] < 1e-6


def test_a_user_dataset_declares_groups_and_first_round_ari_is_reported(tmp_path, tiny_config):
    run_engine(4, tiny_config, tmp_path, "data.dataset=tests.helpers.user_fns:declared_rank_groups",
               "data.partition=iid", "train.budget=10", "name=tiny")
    run = tmp_path / "tiny"
    assert json.loads((run / "partition.json").read_text())["groups"] == [0, 0, 1, 1]
    s = json.loads((run / "summary.json").read_text())
    assert s["first_round_ari"] is not None and -1.0 <= s["first_round_ari"] <= 1.0
    assert s["consensus_test_split"] == "shared"


def test_test_splits_that_differ_by_rank_are_said_under_on_mismatch_warn(tmp_path, tiny_config):
    """data.on_mismatch=warn trains on data that differ by rank (the default refuses: test_plugins_mpi.py)."""
    res = run_engine(3, tiny_config, tmp_path, "data.dataset=tests.helpers.user_fns:not_deterministic",
                     "data.partition=iid", "train.budget=5", "name=tiny", "data.on_mismatch=warn")
    assert "the ranks' test splits differ (ranks [1, 2] from rank 0's)" in res.stderr  # a warning
    s = json.loads((tmp_path / "tiny" / "summary.json").read_text())
    assert s["consensus_test_split"].startswith("rank 0's (the test splits differ across ranks: 2 of 3")
