"""The engine under a real mpiexec: results layout and the invariants of DESIGN.md.

The runs of this module go in one batch per world size (tests/helpers/batch.py:
each through the command line's entry, one start-up per batch); every batch and
run has a timeout that kills the whole process group, so a hang fails the test
instead of stalling CI.
"""
import json

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

from communities.results import read_run
from tests.helpers.mpi import initial_mean_and_final, run_engine, tiny_batch

pytestmark = pytest.mark.timeout(900)

OTHER_STRATEGIES = ["gossip", "ring", "isolated"]
VARIANTS = {
    "clock_average": ["merge.rule=clock", "merge.optimizer_state=average"],
    "swap_reset": ["merge.rule=swap", "merge.optimizer_state=reset"],
    "ema_outer_adamw_bn": ["merge.rule=ema", "merge.outer.enabled=true", "train.optimizer=adamw", "train.lr=0.01",
                           "model.batchnorm=true"],
    "hierarchical_maxclust": ["partners.law=hierarchical", "clustering.cut=maxclust",
                              "clustering.k={start: 2, end: 1, horizon: 30}"],
    "overlap_gaussian": ["signature.overlap=true", "signature.kind=gaussian"],
}
GLOBAL = {"local_sgd": ["merge.period=3"],
          "diloco": ["merge.period=3", "train.optimizer=adamw", "train.lr=0.01"],
          "allreduce": ["train.unit=epoch"]}
UPDATE_STOP = ["consensus.stop=true", "consensus.tol=0.5", "consensus.patience=1", "train.budget=60"]


def batch(tmp_path_factory, n, jobs, processes=None):
    """The jobs of world size n in one batch; on ``processes`` MPI processes (a population) where given."""
    if processes:
        jobs = {name: [*overrides, f"world_size={n}"] for name, overrides in jobs.items()}
    runs = tiny_batch(tmp_path_factory, f"engine{n}", processes or n, jobs, check=False)
    for name, res in runs.result.items():
        assert name == "config_error" or res.returncode == 0, (name, res.stdout[-2000:], res.stderr[-3000:])
    return runs


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    """Every 4-rank run of this module, in one batch: 4 replicas on 2 processes (placement changes no bit)."""
    jobs = {"default": [], "again": [], "seed4": ["seed=4"],
            "lr0": ["train.lr=0", "train.momentum=0", "model.init=per_rank", "strategy=gossip", "train.budget=60",
                    "merge.lam=1"],
            **{s: [f"strategy={s}", "train.budget=20"] for s in OTHER_STRATEGIES},
            **{v: ["train.budget=30", *extra] for v, extra in VARIANTS.items()},
            "config_error": ["merge.lam=0.2"],
            "update_dispersion": UPDATE_STOP, "update_tol": [*UPDATE_STOP, "consensus.update_tol=1e-9"],
            "declared_groups": ["data.dataset=tests.helpers.user_fns:declared_rank_groups", "data.partition=iid",
                                "train.budget=10", "name=tiny"]}
    return batch(tmp_path_factory, 4, jobs, processes=2)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Every 3-rank run of this module, in one batch (one process per rank: not_deterministic draws its data per
    process)."""
    jobs = {"default": [], **{s: [f"strategy={s}", "train.budget=12", *extra] for s, extra in GLOBAL.items()},
            "not_deterministic": ["data.dataset=tests.helpers.user_fns:not_deterministic", "data.partition=iid",
                                  "train.budget=5", "name=tiny", "data.on_mismatch=warn"]}
    return batch(tmp_path_factory, 3, jobs)


def consensus_weights(run_dir):
    return torch.load(run_dir / "consensus.pt", weights_only=True)


@pytest.mark.parametrize("n", [4, 3])
def test_run_writes_the_results_layout(four, three, n):
    run = read_run({4: four, 3: three}[n]["default"])
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
    assert set(s["time_split"]) == {"train", "exchange", "signature", "idle", "eval", "other", "turn"}
    assert (s["time_split"]["turn"] > 0) == (n == 4)  # 4 replicas on 2 processes wait for their turns
    assert (s.get("placement") or {}).get("processes", n) == {4: 2, 3: 3}[n]  # 4 replicas on 2 processes


def test_same_seed_gives_bitwise_identical_consensus(four):
    wa, wb = consensus_weights(four["default"]), consensus_weights(four["again"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    wc = consensus_weights(four["seed4"])
    assert not all(torch.equal(wa[k], wc[k]) for k in wa)


def test_lr0_gossip_reaches_the_initial_mean(four):
    """With lr = 0 and different initial weights, symmetric merges drive all ranks to the initial mean."""
    mean0, final_mean, spread0 = initial_mean_and_final(four.config, 4, four["lr0"])
    s = json.loads((four["lr0"] / "summary.json").read_text())
    assert torch.allclose(final_mean, mean0, atol=1e-5)  # the mean is conserved
    assert s["consensus_distance"] < 1e-3 * spread0  # and every rank is at it


def test_planted_groups_are_recovered_by_the_first_round(four):
    s = json.loads((four["default"] / "summary.json").read_text())
    assert s["first_round_ari"] >= 0.9


@pytest.mark.parametrize("strategy", OTHER_STRATEGIES)
def test_other_strategies_share_the_layout(four, strategy):
    run = read_run(four[strategy])
    assert run.summary["strategy"] == strategy and len(run.round_paths) == 4
    if strategy == "isolated":
        assert run.summary["merges"] == 0 and not run.merges()
    else:
        assert run.summary["merges"] > 0
    if strategy == "ring":
        assert all((m["j"] - m["i"]) % 4 in (1, 3) for m in run.merges())


@pytest.mark.parametrize("variant", VARIANTS)
def test_merge_and_law_variants_run(four, variant):
    s = json.loads((four[variant] / "summary.json").read_text())
    assert s["merges"] > 0 and np.isfinite(s["consensus_test_acc"])
    assert s["consensus_test_acc"] > 0.4


def test_config_error_exits_2_once_before_training(four):
    res = four.result["config_error"]
    assert res.returncode == 2
    assert res.stderr.count("merge.lam") == 1 and "Traceback" not in res.stderr
    assert not four["config_error"].exists()


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


def test_update_tol_gates_the_consensus_stop(four):
    """Dispersion alone stops the tiny run early; an update_tol no merge can meet keeps it going to the budget,
    and every round logs the relative update norm it was judged on, the same on every rank (rank 0 writes it)."""
    a, b = read_run(four["update_dispersion"]), read_run(four["update_tol"])
    assert a.summary["consensus_reached_t"] is not None and a.summary["units"] < 60
    assert b.summary["consensus_reached_t"] is None and b.summary["units"] == 60
    rel = [r.info["relative_update"] for r in b.rounds()]
    assert all(v is None or v > 1e-9 for v in rel) and any(v is not None for v in rel)


@pytest.mark.parametrize("strategy", GLOBAL)
def test_global_strategies(three, strategy):
    run = read_run(three[strategy])
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


def test_a_user_dataset_declares_groups_and_first_round_ari_is_reported(four):
    run = four["declared_groups"]
    groups = json.loads((run / "partition.json").read_text())["groups"]
    assert groups == [0, 0, 1, 1]
    s = json.loads((run / "summary.json").read_text())
    first = run / "rounds" / "round_0000"
    info = json.loads((first / "round.json").read_text())
    assert info["round"] == 0 and info["ari"] is not None
    # the summary's figure is the first round's, and that is the ARI of its communities against the declared groups
    assert s["first_round_ari"] == pytest.approx(info["ari"], abs=1e-12)
    assert info["ari"] == pytest.approx(adjusted_rand_score(groups, np.load(first / "labels.npy")), abs=1e-12)
    assert s["consensus_test_split"] == "shared"


def test_test_splits_that_differ_by_rank_are_said_under_on_mismatch_warn(three):
    """data.on_mismatch=warn trains on data that differ by rank (the default refuses: test_plugins_mpi.py)."""
    res = three.result["not_deterministic"]
    assert "the ranks' test splits differ (ranks [1, 2] from rank 0's)" in res.stderr  # a warning
    s = json.loads((three["not_deterministic"] / "summary.json").read_text())
    assert s["consensus_test_split"].startswith("rank 0's (the test splits differ across ranks: 2 of 3")
