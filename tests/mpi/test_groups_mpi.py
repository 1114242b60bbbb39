"""Data-parallel groups (``train.group_size``) under a real mpiexec: placement, the mean, resume, bytes, inspect.

Four replicas in two groups of two, on the tiny config. Each invariant is one a user relies on:

- placement changes no result: the same consensus bits on 4, 2 and 1 processes (the group's average is a
  Comm.Split Allreduce on 4, a tree in memory on 2 and 1), and the stacked path agrees within float tolerance;
- a merge conserves the mean of the groups: with lr 0 gossip drives every group to the mean of the groups'
  initial weights (each group starts from its lead's);
- a resume from a checkpoint, onto another number of processes, gives the uninterrupted run's bits;
- under protocol async (a group per process) a group trains at its own pace, its lead exchanges for it, and the
  merges still conserve the mean of the groups;
- the summary splits bytes inside groups from bytes between them, and ``communities inspect`` reads the run.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.mpi import ROOT, consensus_weights, initial_weights, run_engine, tiny_batch

pytestmark = pytest.mark.timeout(900)

G2 = ["train.group_size=2", "strategy=community", "world_size=4"]
LR0 = ["train.lr=0", "model.init=per_rank", "strategy=gossip", "consensus.stop=false"]
CKPT = ["checkpoint.every=10"]
ASYNC = ["protocol=async", "comm.timeout=20", "train.budget=60"]  # a group per process, each at its own pace


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    four = tiny_batch(tmp_path_factory, "groups4", 4, {
        "p4": G2, "ckpt": G2 + CKPT, "lr0": G2 + LR0 + ["train.budget=60"],
        "start": G2 + LR0 + ["train.budget=1", "strategy=isolated"]})
    two = tiny_batch(tmp_path_factory, "groups2", 2, {"p2": G2, "vec": G2 + ["train.vectorize=on"],
                                                      "async_lr0": G2 + LR0 + ASYNC})
    one = tiny_batch(tmp_path_factory, "groups1", 1, {"p1": G2})
    return {**{k: four[k] for k in ("p4", "ckpt", "lr0", "start")}, "p2": two["p2"], "vec": two["vec"],
            "async_lr0": two["async_lr0"],
            "p1": one["p1"], "config": four.config}


def _state(run: Path) -> dict:
    return torch.load(run / "consensus.pt", weights_only=True)


def test_placement_changes_no_bit_and_the_stacked_path_agrees(runs):
    ref = _state(runs["p4"])
    for p in ("p2", "p1"):
        got = _state(runs[p])
        assert all(torch.equal(ref[k], got[k]) for k in ref), p
    vec = _state(runs["vec"])
    assert all(torch.allclose(ref[k], vec[k], atol=1e-4) for k in ref)
    summary = json.loads((runs["p2"] / "summary.json").read_text())
    assert summary["placement"]["processes"] == 2 and summary["groups"]["groups"] == 2


def test_merges_conserve_the_mean_of_the_groups(runs):
    inits = initial_weights(runs["config"], 4)
    mean0 = (inits[0] + inits[2]) / 2  # each group starts from its lead's weights
    start = consensus_weights(runs["config"], runs["start"])
    final = consensus_weights(runs["config"], runs["lr0"])
    assert torch.allclose(start, mean0, atol=1e-6)
    assert torch.allclose(final, mean0, atol=1e-5)
    summary = json.loads((runs["lr0"] / "summary.json").read_text())
    assert summary["merges"] > 10 and summary["consensus_distance"] < 1e-4  # the groups met at the mean


def test_under_async_a_group_trains_at_its_own_pace_and_its_merges_conserve_the_mean(runs):
    """protocol async, one group per process: only the leads exchange (posted, between processes), the members
    take their lead's state at each unit's end, and lr 0 gossip still ends at the mean of the groups."""
    inits = initial_weights(runs["config"], 4)
    mean0 = (inits[0] + inits[2]) / 2
    final = consensus_weights(runs["config"], runs["async_lr0"])
    assert torch.allclose(final, mean0, atol=1e-5), float((final - mean0).abs().max())
    s = json.loads((runs["async_lr0"] / "summary.json").read_text())
    assert s["protocol"] == "async" and s["groups"]["groups"] == 2 and s["merges"] > 5
    assert s["consensus_distance"] < 1e-3  # members equal to their leads, the leads to each other
    merges = [json.loads(line) for line in (runs["async_lr0"] / "merges.jsonl").read_text().splitlines()]
    assert {m["i"] for m in merges if m["event"] == "merge"} == {0, 1}  # groups, logged by their leads


def test_a_resume_onto_other_processes_gives_the_uninterrupted_bits(runs, tmp_path):
    run = tmp_path / "tiny"
    shutil.copytree(runs["ckpt"], run)
    checkpoints = run / "checkpoints"
    steps = sorted(p.name for p in checkpoints.iterdir() if p.is_dir())
    assert len(steps) >= 2  # (checkpoint.keep)
    shutil.rmtree(checkpoints / steps[-1])  # as if killed after the one before
    (checkpoints / "latest").write_text(steps[-2] + "\n")
    (run / "summary.json").unlink()
    meta = run / "meta.json"
    meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))
    res = run_engine(2, runs["config"], tmp_path, *G2, *CKPT, extra=["--resume"])
    assert "resuming" in res.stdout
    ref, got = _state(runs["ckpt"]), _state(run)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_bytes_inside_and_between_groups_are_counted_apart(runs):
    s = json.loads((runs["p4"] / "summary.json").read_text())
    g = s["groups"]
    assert g["size"] == 2 and g["groups"] == 2
    assert g["bytes_in_group_mean"] > 0 and g["bytes_between_groups_mean"] > 0
    assert g["bytes_in_group_mean"] + g["bytes_between_groups_mean"] == pytest.approx(s["bytes_sent_mean"])
    # a member never sends the exchanges (its lead does): its bytes between groups are the leads' smaller
    sent = s["bytes_sent_per_rank"]
    merges = [json.loads(line) for line in (runs["p4"] / "merges.jsonl").read_text().splitlines()]
    assert merges and {m["i"] for m in merges if m.get("event", "merge") == "merge"} <= {0, 1}  # groups, not replicas
    assert sent[0] > 0 and sent[2] > 0
    res = subprocess.run([sys.executable, "-m", "communities", "inspect", str(runs["p4"]), "--no-svg", "--last"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={"MPLBACKEND": "Agg",
                                                                                    "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert "data-parallel group of 2 replicas" in res.stdout + res.stderr


# ---------------------------------------------------------------- comm.fault_tolerance shrink (ULFM)

SHRINK = ["comm.fault_tolerance=shrink", "comm.timeout=120", "train.budget=40"]


@pytest.mark.timeout(1800)
def test_a_lost_member_leaves_its_group_and_the_group_goes_on(tmp_path, tiny_config):
    """ULFM, one replica per process: replica 0, lead of group 0 and the writer, is killed; replica 1 leads group 0
    alone (its average over the members alive, the group's communicator rebuilt), takes the run directory over,
    and lr 0 gossip still ends at the mean of the two groups' initial weights: group 0 lost a member, not its
    weights."""
    from tests.helpers.openmpi import run_engine_ompi

    run_engine_ompi(4, tiny_config, tmp_path, *G2, *LR0, *SHRINK, "faults.kill={0: 12}", ulfm=True, timeout=900,
                    check=False)
    run = tmp_path / "tiny"
    s = json.loads((run / "summary.json").read_text())
    assert [e["rank"] for e in s["membership"]["lost"]] == [0] and s["membership"]["survivors"] == [1, 2, 3]
    inits = initial_weights(tiny_config, 4)
    final = consensus_weights(tiny_config, run)
    assert torch.allclose(final, (inits[0] + inits[2]) / 2, atol=1e-5), float((final - inits[0]).abs().max())
    merges = [json.loads(line) for line in (run / "merges.jsonl").read_text().splitlines()]
    assert any(m["event"] == "merge" and m["i"] == 0 and m["t"] > 12 for m in merges)  # group 0 merges on


@pytest.mark.timeout(1800)
def test_under_async_a_group_that_loses_every_member_is_lost_as_a_rank(tmp_path, tiny_config):
    """ULFM, protocol async, 8 replicas in groups of 2 on 4 processes (a group per process): replica 2's process
    dies after its first unit, so group 1 is lost whole; the other groups settle and go on, and lr 0 gossip ends
    at the mean of their initial weights."""
    from tests.helpers.openmpi import run_engine_ompi

    run_engine_ompi(4, tiny_config, tmp_path, "train.group_size=2", "world_size=8", *LR0, *SHRINK,
                    "protocol=async", "faults.kill={2: 1}", ulfm=True, timeout=900, check=False)
    run = tmp_path / "tiny"
    s = json.loads((run / "summary.json").read_text())
    assert [e["rank"] for e in s["membership"]["lost"]] == [2, 3]
    inits = initial_weights(tiny_config, 8)
    final = consensus_weights(tiny_config, run)
    want = torch.stack([inits[0], inits[4], inits[6]]).mean(0)
    assert torch.allclose(final, want, atol=1e-5), float((final - want).abs().max())
