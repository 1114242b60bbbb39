"""pbt in whole runs (4 replicas on 2 processes, one mpiexec): a replica started at lr 0 adopts a better
replica's learning rate (truncation selection at signature rounds) and trains; adoptions are logged, each unit's
hyperparameters written and the final ones summarised; with every replica at lr 0 and learnable, per-replica
merge.alpha, the merges still conserve the mean; a resume from a checkpoint ends with the uninterrupted run's bits;
and under async (2 processes) the tournament's adoption works inside the asynchronous exchange."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.helpers.mpi import Job, initial_mean_and_final, run_batch

pytestmark = pytest.mark.timeout(600)
N = 4
PBT = ["data.local_test_fraction=0.2", "pbt.enabled=true", "pbt.ready=2", "pbt.params.train.lr.low=0.01",
       "pbt.params.train.lr.high=0.3", "pbt.params.merge.lam={low: 1.5, high: 3, scale: linear}",
       "pbt.params.merge.alpha={low: 0.3, high: 0.5, scale: linear}"]
LR0 = ["pbt.start={0: {train.lr: 0.0}}"]
CHECKPOINTED = ["train.budget=30", "checkpoint.every=10", "checkpoint.at_end=false"]


def _rows(path, name):
    return [json.loads(line) for line in (path / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.conftest import TINY

    root = tmp_path_factory.mktemp("pbt")
    config = root / "tiny.yaml"
    config.write_text(TINY)
    frozen = "pbt.start={" + ", ".join(f"{r}: {{train.lr: 0.0}}" for r in range(N)) + "}"
    jobs = {
        "pbt": Job(config, root / "pbt", [f"world_size={N}", *PBT, *LR0, *CHECKPOINTED]),
        "stacked": Job(config, root / "stacked", [f"world_size={N}", *PBT, *LR0, "train.vectorize=on",
                                                  "train.budget=20"]),
        # a linear range from 0: explore keeps 0 at 0 (0 times any factor, inside the range)
        "frozen": Job(config, root / "frozen", [f"world_size={N}", *PBT, frozen, "model.init=per_rank",
                                                "pbt.params.train.lr={low: 0.0, high: 0.3, scale: linear}",
                                                "train.budget=20", "logging.tensorboard=true"]),
    }
    res = run_batch(2, jobs, timeout=500, check=False)
    for name, r in res.items():
        assert r.returncode == 0, (name, r.stderr[-3000:])
    run = root / "pbt" / "tiny"
    resumed = root / "resumed" / "tiny"
    shutil.copytree(run, resumed)
    for product in ("summary.json", "consensus.pt"):
        (resumed / product).unlink()
    meta = resumed / "meta.json"
    meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))
    asynchronous = Job(config, root / "async", ["protocol=async", *PBT, *LR0, "train.budget=30",
                                                "pbt.selection=tournament"])
    again = run_batch(2, {"resumed": Job(config, root / "resumed", [f"world_size={N}", *PBT, *LR0, *CHECKPOINTED],
                                         extra=["--resume"]),
                          "async": asynchronous}, timeout=500, check=False)
    for name, r in again.items():
        assert r.returncode == 0, (name, r.stderr[-3000:])
    return {"config": config, "pbt": run, "stacked": root / "stacked" / "tiny", "frozen": root / "frozen" / "tiny",
            "resumed": resumed, "async": root / "async" / "tiny"}


@pytest.mark.parametrize("run", ["pbt", "stacked"])
def test_a_replica_started_at_lr_0_adopts_and_trains(runs, run):
    """The sequential path, and the stacked one (train.vectorize: each replica steps with its own lr)."""
    rows = _rows(runs[run], "metrics.jsonl")
    lr0 = [r["hyper"]["train.lr"] for r in rows if r["rank"] == 0]
    assert lr0[0] == 0.0 and lr0[-1] > 0.0  # it started frozen and ends training
    adoptions = [r for r in _rows(runs[run], "merges.jsonl") if r["event"] == "adopt"]
    mine = [r for r in adoptions if r["i"] == 0]
    assert mine, "replica 0 never adopted"
    first = mine[0]
    assert first["score"] > first["partner_score"]  # the worse side adopts
    # every row carries every learnable value, in range once adopted
    assert all(set(r["hyper"]) == {"train.lr", "merge.lam", "merge.alpha"} for r in rows)
    assert all(0.3 <= r["hyper"]["merge.alpha"] <= 0.5 for r in rows)
    summary = json.loads((runs[run] / "summary.json").read_text())["pbt"]
    assert summary["names"] == ["merge.alpha", "merge.lam", "train.lr"] and len(summary["per_replica"]) == N
    assert all(0.01 <= v[2] <= 0.3 for v in summary["per_replica"])  # every replica ends training, in range
    assert summary["per_community"]


def test_the_stacked_path_trains_each_replica_with_its_own_lr(runs):
    """Before the first merge (the first round is at t=5) the stacked run's training losses are the sequential
    run's, replica 0 (lr 0) included: had the stacked step used the config's lr, replica 0 would have trained."""
    def losses(run):
        return {(r["t"], r["rank"]): r["loss"] for r in _rows(runs[run], "metrics.jsonl") if r["t"] <= 4}

    seq, stacked = losses("pbt"), losses("stacked")
    assert seq.keys() == stacked.keys() and len(seq) == 4 * N
    assert all(abs(seq[k] - stacked[k]) < 1e-4 for k in seq), {k: (seq[k], stacked[k]) for k in seq}


def test_adoption_is_rate_limited_by_ready(runs):
    adoptions = [r for r in _rows(runs["pbt"], "merges.jsonl") if r["event"] == "adopt"]
    by_replica: dict = {}
    for r in adoptions:
        by_replica.setdefault(r["i"], []).append(r["t"])
    for ts in by_replica.values():
        assert ts[0] >= 2 and all(b - a >= 2 for a, b in zip(ts, ts[1:]))  # pbt.ready=2


def test_learnable_alpha_and_lr_0_conserve_the_mean(runs):
    """lr 0 everywhere (0 times any factor stays 0): only merges move the weights, and each pair merges with one
    alpha (the mean of the two sides'), so the mean over replicas never moves."""
    assert {r["hyper"]["train.lr"] for r in _rows(runs["frozen"], "metrics.jsonl")} == {0.0}
    assert any(r["event"] == "adopt" for r in _rows(runs["frozen"], "merges.jsonl"))  # alphas were adopted too
    mean0, final, _ = initial_mean_and_final(runs["config"], N, runs["frozen"])
    assert torch.allclose(final, mean0, atol=1e-6)
    alphas = {r["hyper"]["merge.alpha"] for r in _rows(runs["frozen"], "metrics.jsonl")}
    assert len(alphas) > 1  # the replicas did merge with different alphas
    merges = [r for r in _rows(runs["frozen"], "merges.jsonl") if r["event"] == "merge"]
    assert merges and all(0.3 <= r["a"] <= 0.5 for r in merges)


def test_a_resume_with_pbt_ends_with_the_same_bits(runs):
    a = torch.load(runs["pbt"] / "consensus.pt", weights_only=True)
    b = torch.load(runs["resumed"] / "consensus.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa = json.loads((runs["pbt"] / "summary.json").read_text())["pbt"]
    sb = json.loads((runs["resumed"] / "summary.json").read_text())["pbt"]
    assert sa["per_replica"] == sb["per_replica"]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("wall", "bytes_sent")} for r in rows]  # noqa: E731
    assert strip(_rows(runs["pbt"], "metrics.jsonl")) == strip(_rows(runs["resumed"], "metrics.jsonl"))


def test_async_adopts_inside_the_exchange(runs):
    rows = _rows(runs["async"], "metrics.jsonl")
    lr0 = [r["hyper"]["train.lr"] for r in rows if r["rank"] == 0]
    assert lr0[0] == 0.0 and lr0[-1] > 0.0
    assert any(r["event"] == "adopt" and r["i"] == 0 for r in _rows(runs["async"], "merges.jsonl"))


def test_tensorboard_and_inspect_show_the_learnt_values(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs["frozen"] / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    alphas = [r for r in _rows(runs["frozen"], "metrics.jsonl") if r["t"] == 20]
    assert scalars["pbt/merge.alpha_max"][20] == pytest.approx(max(r["hyper"]["merge.alpha"] for r in alphas))
    assert set(scalars["pbt/train.lr_median"].values()) == {0.0}
    out = subprocess.run([sys.executable, "-m", "communities", "inspect", str(runs["pbt"]), "--last"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "pbt: final medians merge.alpha" in out.stdout
    assert (runs["pbt"] / "report" / "hyperparameters.png").stat().st_size > 10_000
