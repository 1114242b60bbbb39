"""Data that moves, under a real mpiexec: hard examples passed between ranks arrive intact, and the engine
moves data, conserves it, logs it and resumes it bit for bit. The pure parts are in tests/unit/test_moving.py."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from communities.engine.state import checkpoint
from tests.helpers.mpi import finish, initial_mean_and_final, run_engine, run_mpi, start, tiny_batch, wait_for

pytestmark = pytest.mark.timeout(900)

MOVING = ["examples.track=true", "examples.retire=true", "examples.pass_hard=true", "examples.eval_every=2",
          "examples.pass_fraction=0.1", "examples.tau_retire=0.9"]
RESUMED = [*MOVING, "signature.kind=logits", "merge.rule=swap", "merge.partner_policy=least_recent",
           "train.budget=150", "checkpoint.every=10"]
SWAP_LR0 = ["train.lr=0", "train.momentum=0", "model.init=per_rank", "merge.rule=swap",
            "merge.partner_policy=least_recent", "strategy=gossip", "train.budget=30"]


POPULATION = ["world_size=4"]  # 4 replicas, here on 2 MPI processes (placement changes no bit)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's uninterrupted 4-rank runs, in one batch: 4 replicas on 2 processes."""
    return tiny_batch(tmp_path_factory, "moving", 2, {name: [*POPULATION, *overrides] for name, overrides in {
        "moves": [*MOVING, "signature.kind=cka", "comm.check_hashes=true"],
        "keep": [*MOVING, "examples.handover=false", "examples.retire=false"],
        "reference": RESUMED, "swap_lr0": SWAP_LR0}.items()})


def final_tables(run: Path, n: int):
    """Each rank's example table in the run's last checkpoint (a rank's file holds ``{"parts": {name: state}}``)."""
    ckpt = checkpoint.latest(run / "checkpoints")
    return [checkpoint.load_rank(ckpt, r)["parts"]["replica"]["examples"]["table"] for r in range(n)]


# --------------------------------------------------------------------------- real MPI


@pytest.mark.parametrize("mode", ["handover", "keep"])
def test_passed_examples_arrive_intact(mode):
    res = run_mpi(2, ["-m", "mpi4py", "tests/helpers/mpi_pass_examples.py", mode], timeout=120)
    assert res.stdout.count("ok ") == 2, res.stdout


def test_engine_moves_data_conserves_it_and_logs_it(runs):
    n = 4
    # comm.check_hashes (on by default) allgathers a digest of each round's communities and of the 1 - CKA
    # distances they were cut from: had any rank derived another CKA matrix, the run would stop with an error
    run = runs["moves"]
    s = json.loads((run / "summary.json").read_text())
    part = json.loads((run / "partition.json").read_text())
    tables = final_tables(run, n)
    ids = np.concatenate([t["ids"].numpy() for t in tables])
    assert ids.size == np.unique(ids).size, "an example is held by two ranks after hand-over"
    assert ids.size == sum(part["shard_sizes"]) and ids.max() < part["n_train"]  # none lost, none made up
    assert [len(t["ids"]) for t in tables] != part["shard_sizes"]  # and the data did move
    e = s["examples"]
    assert e["total"] == ids.size and e["passed_out"] == e["passed_in"] > 0
    assert s["data_bytes_mean"] > 0 and 0 < e["retired_fraction"] <= 1
    assert s["consensus_test_acc"] > 0.8
    rows = [json.loads(line) for line in (run / "examples.jsonl").read_text().splitlines()]
    assert {r["rank"] for r in rows} == set(range(n)) and len(rows) == n * s["rounds"]
    assert all(r["active"] + r["reserve"] + r["retired"] == r["total"] for r in rows)
    hard = json.loads((run / "globally_hard.json").read_text())
    assert hard["count"] == len(hard["ids"]) == e["globally_hard"]
    rounds = sorted((run / "rounds").glob("round_*"))
    assert rounds and json.loads((rounds[0] / "round.json").read_text())["n_communities"] >= 1


def test_keep_copy_mode_grows_shards_without_duplicates(runs):
    run = runs["keep"]
    e = json.loads((run / "summary.json").read_text())["examples"]
    tables = final_tables(run, 4)
    for t in tables:
        ids = t["ids"].numpy()
        assert ids.size == np.unique(ids).size
    assert e["total"] > 600 and e["passed_in"] > 0  # 800 synthetic examples, 25% held out for the test set


def test_resume_with_moving_data_is_bitwise(tmp_path, tiny_config, runs):
    """Cut by a STOP file as 4 replicas on 2 processes, resumed on 4 processes: the uninterrupted run's bits."""
    args = [*POPULATION, *RESUMED]
    ref, cut = runs["reference"], tmp_path / "cut"
    proc = start(2, tiny_config, cut, *args)
    wait_for(cut / "tiny" / "checkpoints" / "latest", proc)
    (cut / "tiny" / "STOP").touch()
    rc, out, err = finish(proc)
    assert rc == 75, err[-3000:]
    run_engine(4, tiny_config, cut, *args, extra=["--resume"])
    a = torch.load(ref / "consensus.pt", weights_only=True)
    b = torch.load(cut / "tiny" / "consensus.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ea = json.loads((ref / "summary.json").read_text())["examples"]
    eb = json.loads((cut / "tiny" / "summary.json").read_text())["examples"]
    assert ea == eb
    ta, tb = final_tables(ref, 4), final_tables(cut / "tiny", 4)
    assert all(torch.equal(x["ids"], y["ids"]) and torch.equal(x["confidence"], y["confidence"])
               for x, y in zip(ta, tb))


def test_swap_with_least_recent_policy_conserves_the_mean(runs):
    """Swaps permute whole models: with no training the mean over ranks never moves."""
    mean0, final_mean, _ = initial_mean_and_final(runs.config, 4, runs["swap_lr0"])
    assert torch.allclose(final_mean, mean0, atol=1e-6)
    merges = [json.loads(x) for x in (runs["swap_lr0"] / "merges.jsonl").read_text().splitlines()]
    assert merges and all(m["a"] == 1.0 for m in merges if m["event"] == "merge")


def test_bad_probe_input_is_refused_before_training(tmp_path_factory):
    """Both refusals in one batch on 2 ranks (tests/helpers/batch.py), each under an output root of its own."""
    runs = tiny_batch(tmp_path_factory, "probe", 2, {"layer": ["signature.kind=cka", "signature.layer=nope"],
                                                     "size": ["signature.kind=logits", "signature.probe_size=100000"]},
                      check=False)
    res = runs.result["layer"]
    assert res.returncode == 2 and "signature.layer='nope'" in res.stderr and "Traceback" not in res.stderr
    res = runs.result["size"]
    assert res.returncode == 2 and "signature.probe_size=100000" in res.stderr
    for name in ("layer", "size"):
        assert not (runs[name] / "metrics.jsonl").exists() or (runs[name] / "metrics.jsonl").read_text() == ""
