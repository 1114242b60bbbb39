"""Diverged, hostile, slow and stalled ranks: no poisoning, no hang, invariants hold."""
import json

import numpy as np
import pytest
import torch

from communities.results import read_run
from tests.helpers.mpi import Job, initial_mean_and_final, run_batch, run_engine

pytestmark = pytest.mark.timeout(1800)

DIGITS = """
name: faults
seed: 1
world_size: 8
data: {dataset: digits, partition: iid}
model: {name: mlp, hidden: [64]}
train: {optimizer: sgd, lr: 0.05, momentum: 0.9, batch_size: 32, unit: epoch, budget: 40, eval_every: 10}
merge: {lam: 2.0}
signature: {every: 5}
partners: {p_cross: {start: 0.05, end: 1.0, shape: cosine, begin: 5, horizon: 20}}
consensus: {stop: false}
"""


HOSTILE = {kind: ["faults.hostile_rank=6", f"faults.hostile_kind={kind}", "faults.hostile_scale=-10"]
           for kind in ("scale", "random")}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The 8-rank digits runs of this module, in one batch: clean, NaN, quarantine, hostile with robust off/on."""
    root = tmp_path_factory.mktemp("faults")
    cfg = root / "faults.yaml"
    cfg.write_text(DIGITS)
    jobs = {"clean": [], "nan": ["faults.nan_rank=3", "faults.nan_at=12"],
            "nan_robust": ["faults.nan_rank=3", "faults.nan_at=12", "robust.enabled=true"],
            "q": ["faults.nan_rank=5", "faults.nan_at=12", "robust.diverged=quarantine"],
            **{f"off_{k}": v for k, v in HOSTILE.items()},
            **{f"on_{k}": [*v, "robust.enabled=true"] for k, v in HOSTILE.items()}}
    # a population: the 8 replicas on 2 processes (NaN and hostile ranks act on a replica; placement changes no bit)
    run_batch(2, {name: Job(cfg, root / name, overrides) for name, overrides in jobs.items()}, timeout=1700)
    clean = json.loads((root / "clean" / "faults" / "summary.json").read_text())
    return cfg, root, clean


def summary(root):
    return json.loads((root / "faults" / "summary.json").read_text())


def test_a_nan_rank_never_poisons_the_consensus(digits):
    cfg, root, clean = digits
    s = summary(root / "nan")
    w = torch.load(root / "nan" / "faults" / "consensus.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in w.values())
    assert s["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.01
    events = [m for m in read_run(root / "nan" / "faults").merges() if m["event"] != "merge"]
    assert any(m["event"] == "reset" and m["i"] == 3 for m in events)
    assert any(m["event"] == "skip_diverged" and m["j"] == 3 for m in events)
    print(f"clean {clean['consensus_test_acc']:.4f}  nan-rank {s['consensus_test_acc']:.4f}")


def test_a_nan_rank_is_still_reset_when_outliers_are_excluded(digits):
    """robust.enabled leaves signature outliers out of the exchanges; a NaN rank must stay in them, or no
    partner could ever reset it and its shard would be lost for the rest of the run."""
    cfg, root, clean = digits
    s = summary(root / "nan_robust")
    assert s["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.01
    run = read_run(root / "nan_robust" / "faults")
    assert any(m["event"] == "reset" and m["i"] == 3 for m in run.merges())
    assert all(3 not in (r.info["outliers"] or []) for r in run.rounds())
    assert np.isfinite(s["rank_test_acc"][3]) and s["rank_test_acc"][3] > 0.5  # it trains again after the reset


def test_quarantine_leaves_the_diverged_rank_out(digits):
    cfg, root, clean = digits
    s = summary(root / "q")
    assert np.isfinite(s["consensus_test_acc"]) and s["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.02
    assert any(m["event"] == "quarantined" and m["i"] == 5 for m in read_run(root / "q" / "faults").merges())


@pytest.mark.parametrize("kind", ["scale", "random"])
def test_a_hostile_rank_is_isolated_by_the_robust_option(digits, kind):
    """A rank that sends -10 x its weights (sign-flip scaling) or random weights of the same norm."""
    cfg, root, clean = digits
    off, on = summary(root / f"off_{kind}"), summary(root / f"on_{kind}")
    print(f"{kind}: clean {clean['consensus_test_acc']:.4f}  robust off {off['consensus_test_acc']:.4f}  "
          f"robust on {on['consensus_test_acc']:.4f}")
    assert on["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.02
    if kind == "scale":
        # without it the damage shows (clustering alone already keeps the singleton hostile rank a rare partner;
        # random weights of the same norm are trained away and cost nothing measurable here)
        assert off["consensus_test_acc"] < min(clean["consensus_test_acc"], on["consensus_test_acc"]) - 0.03
    rounds = read_run(root / f"on_{kind}" / "faults").rounds()
    # A scaled sender is far from the median at once; random weights of the same norm start at ~5x the median
    # distance, on the default outlier_factor, and are left out from the second round on (measured: 5.0, 7.9).
    judged = rounds if kind == "scale" else rounds[1:]
    assert all(r.info["outliers"] == [6] for r in judged)
    assert all(r.info["outliers"] in ([], [6]) for r in rounds)  # never an honest rank
    assert all(np.sum(r.labels == r.labels[6]) == 1 for r in judged)  # a singleton community


def test_stalled_rank_trips_the_watchdog_naming_ranks(tmp_path, tiny_config):
    res = run_engine(4, tiny_config, tmp_path, "faults.stall_rank=2", "faults.stall_at=3", "comm.timeout=5",
                     check=False, timeout=120)
    assert res.returncode != 0
    # The others run on past the stall until they need rank 2: an exchange with it (which names it), or the
    # signature round at t=5 (a collective: the roll call names who has not arrived). No per-unit barrier holds them.
    import re

    m = re.search(r"watchdog: rank (\d) waited more than 5s at t=(\d+) in (.*)", res.stderr)
    assert m, res.stderr[-2000:]
    waiter, t, what = int(m.group(1)), int(m.group(2)), m.group(3)
    assert waiter != 2 and 3 <= t <= 5
    assert "rank 2" in what


def test_watchdog_names_the_ranks_missing_from_a_collective(tmp_path, tiny_config):
    """local_sgd averages with an Allreduce every 3 units: rank 2 stalls before it, the others wait inside it."""
    import re
    import time

    t0 = time.monotonic()
    res = run_engine(4, tiny_config, tmp_path, "strategy=local_sgd", "merge.period=3", "faults.stall_rank=2",
                     "faults.stall_at=3", "comm.timeout=4", check=False, timeout=120)
    took = time.monotonic() - t0
    assert res.returncode != 0
    lines = re.findall(r"watchdog: rank (\d) waited more than 4s at t=3 in Allreduce \(collective #(\d+)\): "
                       r"not arrived: rank 2 \(at collective #(\d+): busy outside MPI[^)]*\); aborting", res.stderr)
    assert lines, res.stderr[-2000:]
    for waiter, seq, at in lines:
        assert waiter != "2" and int(at) == int(seq) - 1
    print(f"stall to abort, process start included: {took:.1f}s")


def test_stress_16_ranks_slowdowns_conserve_the_mean(tmp_path, tiny_config):
    """16 ranks on 2 cores, random sleeps, 500+ exchanges, lr = 0: no hang, and the mean is the initial mean."""
    n = 16
    run_engine(n, tiny_config, tmp_path, "train.lr=0", "train.momentum=0", "model.init=per_rank",
               "strategy=gossip", "train.budget=70", "merge.lam=1", "faults.slow_max=0.02",
               "train.steps_per_unit=1", "signature.every=10", timeout=600)
    run = read_run(tmp_path / "tiny")
    assert run.summary["merges"] >= 500
    mean0, final, _ = initial_mean_and_final(tmp_path / "tiny.yaml", n, tmp_path / "tiny")
    assert torch.allclose(final, mean0, atol=1e-5)
