"""train.vectorize in a population: 8 replicas on 2 processes trained as stacked models, against the same run
trained one replica after another. Equal within rounding (the batched kernels sum in another order), never bitwise;
refused naming both keys where a replica's own batches matter."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.mpi import Job, run_batch

pytestmark = pytest.mark.timeout(600)
POP = ["world_size=8", "train.budget=20"]
TOL = 1e-4  # max |w| difference of the consensus weights after 20 units (measured: about 1e-6)


def test_stacked_training_equals_the_sequential_path_within_rounding(tiny_config, tmp_path):
    jobs = {name: Job(tiny_config, tmp_path, [f"name={name}", *POP, f"train.vectorize={mode}"])
            for name, mode in (("seq", "off"), ("vec", "on"))}
    jobs["refused"] = Job(tiny_config, tmp_path, ["name=refused", *POP, "train.vectorize=on", "examples.track=true"])
    res = run_batch(2, jobs, timeout=500, check=False)
    assert res["seq"].returncode == 0 and res["vec"].returncode == 0, res["vec"].stderr[-2000:]
    a = torch.load(tmp_path / "seq" / "consensus.pt", weights_only=True)
    b = torch.load(tmp_path / "vec" / "consensus.pt", weights_only=True)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert 0 < diff <= TOL  # not bitwise (another summation order), but within rounding
    sa, sb = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("seq", "vec"))
    assert sa["merges"] == sb["merges"] and sa["communities_per_round"] == sb["communities_per_round"]
    assert sb["time_split"]["train"] > 0  # the stacked step's seconds are each replica's share of training
    assert sb["time_split"]["eval"] > 0  # and the stacked evaluation's, of evaluation
    rows = {n: [json.loads(line) for line in (tmp_path / n / "metrics.jsonl").read_text().splitlines()]
            for n in ("seq", "vec")}
    scored = [(r, q) for r, q in zip(rows["seq"], rows["vec"]) if r["test_acc"] is not None]
    assert len(scored) == 8 * 2  # every replica scored itself at t=10 and t=20, stacked as one by one
    for r, q in scored:
        assert (r["t"], r["rank"]) == (q["t"], q["rank"])
        assert q["test_acc"] == pytest.approx(r["test_acc"], abs=0.01)
        assert q["test_loss"] == pytest.approx(r["test_loss"], rel=1e-3)
    assert res["refused"].returncode == 2
    assert "train.vectorize=on cannot apply with examples.track" in res["refused"].stdout + res["refused"].stderr
