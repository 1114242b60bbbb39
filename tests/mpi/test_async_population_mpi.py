"""protocol async with populations under a real mpiexec: 8 replicas on 2 processes (4 each, trained as one
stacked model), the processes at their own pace.

- lr 0 gossip conserves the mean across processes and drives every replica to it; pairs inside a process and
  across processes both merge, and both sides of every exchange log it;
- a process 3x slower (faults.speed acts on the process: its whole block) holds the other back neither in
  units nor in idle time;
- pbt (tournament) rides on the exchanges of both kinds; what a pair across processes cannot carry is refused
  before training, naming the key;
- under ULFM (comm.fault_tolerance shrink) a lost process is the loss of its block: the survivors settle the
  exchanges in flight and their mean is conserved.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from communities.results import read_jsonl
from tests.helpers.mpi import consensus_weights, initial_mean_and_final, initial_weights, tiny_batch
from tests.helpers.openmpi import run_engine_ompi

pytestmark = pytest.mark.timeout(1200)

ASYNC = ["protocol=async", "comm.timeout=20", "world_size=8"]
LR0 = ["strategy=gossip", "train.lr=0", "train.momentum=0", "model.init=per_rank", "merge.lam=1", "train.budget=60"]
WALL = ["model.hidden=[256,256]", "train.batch_size=64", "train.wall_budget=8", "train.budget=100000",
        "strategy=gossip", "data.partition=iid"]
PBT = ["data.local_test_fraction=0.2", "pbt.enabled=true", "pbt.selection=tournament", "pbt.ready=2",
       "pbt.params.train.lr.low=0.01", "pbt.params.train.lr.high=0.3",
       "pbt.params.merge.alpha={low: 0.3, high: 0.5, scale: linear}", "merge.lam=1", "train.budget=30"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    slow = ["world_size=8", *WALL, "faults.speed={0: 3.0}"]
    return tiny_batch(tmp_path_factory, "async_population", 2, {
        "lr0": [*ASYNC, *LR0], "slow": [*ASYNC, *slow], "slow_vc": slow, "pbt": [*ASYNC, *PBT],
        "refused": [*ASYNC, "examples.track=true", "examples.pass_hard=true"]}, check=False)


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def test_lr0_gossip_conserves_the_mean_across_processes_and_reaches_it(runs):
    assert runs.result["lr0"].returncode == 0, runs.result["lr0"].stderr[-3000:]
    mean0, final, spread0 = initial_mean_and_final(runs.config, 8, runs["lr0"])
    s = summary(runs["lr0"])
    assert s["protocol"] == "async" and s["placement"]["processes"] == 2
    assert torch.allclose(final, mean0, atol=1e-5)
    assert s["consensus_distance"] < 1e-2 * spread0
    rows = [m for m in read_jsonl(runs["lr0"] / "merges.jsonl") if m["event"] == "merge"]
    inside = [m for m in rows if m["i"] // 4 == m["j"] // 4]
    assert inside and len(inside) < len(rows)  # pairs inside a process and across processes both merged
    sides = Counter((m["i"], m["j"]) for m in rows)
    assert all(sides[(i, j)] == sides[(j, i)] for i, j in sides)  # both sides of every exchange, once each
    placement = s["placement"]
    assert placement["bytes_in_process_mean"] > 0 and placement["bytes_network_mean"] > 0


def test_a_slow_process_holds_the_other_back_neither_in_units_nor_in_idle_time(runs):
    """Process 0 (replicas 0-3) 3x slower, the same 8 s: under async process 1's replicas train further than
    process 0's and than under the virtual clock, where every replica keeps the slow process's pace."""
    for name in ("slow", "slow_vc"):
        assert runs.result[name].returncode == 0, runs.result[name].stderr[-3000:]
    asy, vc = summary(runs["slow"]), summary(runs["slow_vc"])
    units, vc_units = asy["units_per_rank"], vc["units_per_rank"]
    assert len(set(units[:4])) == 1 and len(set(units[4:])) == 1  # a process's replicas train together
    assert min(units[4:]) >= 1.5 * max(units[:4])
    assert min(units[4:]) >= 1.2 * max(vc_units)
    split = asy["time_split_per_rank"]
    vc_split = vc["time_split_per_rank"]
    fast_idle = np.mean([split["idle"][r] / split["wall"][r] for r in range(4, 8)])
    vc_idle = np.mean([vc_split["idle"][r] / vc_split["wall"][r] for r in range(4, 8)])
    assert fast_idle < vc_idle
    assert np.isfinite(asy["consensus_test_acc"])


def test_pbt_adopts_across_both_kinds_of_pair(runs):
    assert runs.result["pbt"].returncode == 0, runs.result["pbt"].stderr[-3000:]
    rows = read_jsonl(runs["pbt"] / "merges.jsonl")
    adopted = [m for m in rows if m["event"] == "adopt"]
    assert adopted
    assert np.isfinite(summary(runs["pbt"])["consensus_test_acc"])


def test_what_a_pair_across_processes_cannot_carry_is_refused_before_training(runs):
    res = runs.result["refused"]
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-3000:])
    assert "examples.pass_hard" in res.stderr and "posted exchange" in res.stderr and "Traceback" not in res.stderr
    assert not (runs["refused"] / "metrics.jsonl").exists()


def test_a_lost_process_takes_its_block_and_the_survivors_mean_is_conserved(tmp_path, tiny_config):
    """ULFM: replica 2 SIGKILLs its process after training unit 1 (before it ever merged), so replicas 2 and 3 are
    lost; exchanges in flight between survivors are settled (one side merged: undone), and lr 0 gossip ends at
    the mean of the 6 survivors' initial weights."""
    run_engine_ompi(4, tiny_config, tmp_path, *ASYNC, *LR0, "comm.fault_tolerance=shrink", "faults.kill={2: 1}",
                    ulfm=True, timeout=600, check=False)
    run = tmp_path / "tiny"
    s = summary(run)
    assert [e["rank"] for e in s["membership"]["lost"]] == [2, 3]
    assert s["membership"]["survivors"] == [0, 1, 4, 5, 6, 7]
    inits = initial_weights(tiny_config, 8)
    survivors = torch.stack([w for r, w in enumerate(inits) if r not in (2, 3)]).mean(0)
    final = consensus_weights(tiny_config, run)
    assert torch.allclose(final, survivors, atol=1e-5), float((final - survivors).abs().max())
    assert s["consensus_distance"] < 1e-3
    from communities.report.audit import audit

    assert audit(run) == []
