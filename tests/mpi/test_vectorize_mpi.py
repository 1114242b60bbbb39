"""train.vectorize in a population: 8 replicas on 2 processes trained as stacked models, against the same run
trained one replica after another. Equal within rounding (the batched kernels sum in another order), never bitwise;
refused naming both keys where a replica's own batches matter."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.mpi import Job, run_batch, tiny_batch

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


def test_a_stacked_population_resumes_bitwise_on_another_number_of_processes(tmp_path_factory):
    """Replicas trained as rows of their process's block (engine/replica/block.py), checkpointed as one file per
    process (engine/state/blocks.py): 8 on 2 processes, cut at the checkpoint of t=20 of 30 and resumed on 4 (two
    rows per block, each process reading the half of a block it needs) end with the uninterrupted run's bits."""
    import hashlib
    import shutil

    from communities.engine.state import checkpoint

    stacked = ["world_size=8", "train.vectorize=on", "train.budget=30", "checkpoint.every=10",
               "checkpoint.at_end=false", "merge.optimizer_state=average"]
    ref = tiny_batch(tmp_path_factory, "stacked2", 2, {"reference": stacked})
    latest = checkpoint.latest(ref["reference"] / "checkpoints")
    assert latest is not None and latest.name == "u00000020"
    assert sorted(p.name for p in latest.glob("*.pt")) == ["block00000.pt", "block00004.pt"]
    root = tmp_path_factory.mktemp("stacked4")
    cut = root / "resumed" / "tiny"
    shutil.copytree(ref["reference"], cut)
    for product in ("summary.json", "consensus.pt"):
        (cut / product).unlink()
    meta = cut / "meta.json"
    meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))
    res = run_batch(4, {"resumed": Job(ref.config, root / "resumed", stacked, extra=["--resume"])}, check=False)
    assert res["resumed"].returncode == 0, res["resumed"].stderr[-3000:]
    assert "resuming" in res["resumed"].stdout
    sha = [hashlib.sha256((d / "consensus.pt").read_bytes()).hexdigest() for d in (ref["reference"], cut)]
    assert sha[0] == sha[1]
