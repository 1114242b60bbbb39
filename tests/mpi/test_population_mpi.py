"""Populations under a real mpiexec: checkpoints are per replica, so a run resumes bitwise on another number of
MPI processes; what a population cannot do is refused before training; its summary splits the bytes by kind.

8 replicas of the tiny config (tests/conftest.py) run on 2 processes, checkpointed every 10 units up to 20 of
30 (``checkpoint.at_end=false``). Copies of that run, set back to interrupted at t=20 (as a job killed after its
last checkpoint), are resumed on 4 processes and on 1; both must end with the uninterrupted run's consensus,
byte for byte. One batch (one mpiexec) per number of processes.
"""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from communities.engine.state import checkpoint
from communities.results import TIME_CATEGORIES
from tests.helpers.mpi import Job, TinyRuns, run_batch, run_engine, tiny_batch

pytestmark = pytest.mark.timeout(900)

N = 8
POPULATION = [f"world_size={N}", "train.budget=30", "checkpoint.every=10", "checkpoint.at_end=false"]
RESUME_ON = (4, 1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> TinyRuns:
    """The uninterrupted run: 8 replicas on 2 processes."""
    return tiny_batch(tmp_path_factory, "population2", 2, {"reference": POPULATION})


def cut_copy(run: Path, dest: Path) -> Path:
    """A copy of finished ``run`` as a job killed after its last periodic checkpoint would leave it."""
    shutil.copytree(run, dest)
    for product in ("summary.json", "consensus.pt"):
        (dest / product).unlink()
    meta = dest / "meta.json"
    meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))
    return dest


@pytest.fixture(scope="module")
def resumed(reference, tmp_path_factory):
    """{processes: (the copy resumed on that many processes, the batch's results)}; the 4-process batch also
    holds protocol=async with averaged optimizer moments, 8 replicas on 4 processes (refused: a pair across
    processes is a posted exchange, which carries no moments)."""
    done = {}
    for p in RESUME_ON:
        root = tmp_path_factory.mktemp(f"resumed{p}")
        cut_copy(reference["reference"], root / "resumed" / "tiny")
        jobs = {"resumed": Job(reference.config, root / "resumed", POPULATION, extra=["--resume"])}
        if p == 4:
            jobs["async"] = Job(reference.config, root / "async",
                                [f"world_size={N}", "protocol=async", "merge.optimizer_state=average",
                                 "comm.timeout=20"])
        results = run_batch(p, jobs, check=False)
        res = results["resumed"]
        assert res.returncode == 0, (p, res.stdout[-2000:], res.stderr[-3000:])
        done[p] = (root / "resumed" / "tiny", results)
    return done


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_cut_is_at_a_checkpoint_before_the_end(reference):
    """What the resumes start from: the run's last checkpoint is t=20 of 30 (else they would resume nothing)."""
    latest = checkpoint.latest(reference["reference"] / "checkpoints")
    assert latest is not None and "20" in latest.name, latest


@pytest.mark.parametrize("processes", RESUME_ON)
def test_a_population_resumes_bitwise_on_another_number_of_processes(reference, resumed, processes):
    run, results = resumed[processes]
    assert "resuming" in results["resumed"].stdout
    ref = reference["reference"]
    assert sha256(run / "consensus.pt") == sha256(ref / "consensus.pt")
    a, b = (torch.load(d / "consensus.pt", weights_only=True) for d in (ref, run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    s = json.loads((run / "summary.json").read_text())
    assert s["placement"]["processes"] == processes
    from communities.results import read_jsonl

    def rows(d: Path):  # the logs row for row: no duplicate and no gap where the run was cut
        return [{k: v for k, v in r.items() if k not in ("bytes_sent", "wall")} for r in read_jsonl(d / "merges.jsonl")]

    assert rows(ref) == rows(run)


def test_a_population_summary_splits_the_bytes_by_kind(reference):
    s = json.loads((reference["reference"] / "summary.json").read_text())
    placement = s["placement"]
    assert placement["processes"] == 2 and placement["replicas_per_process"] == N // 2
    assert placement["bytes_in_process_mean"] > 0 and placement["bytes_network_mean"] > 0
    assert placement["bytes_network_mean"] + placement["bytes_in_process_mean"] == pytest.approx(s["bytes_sent_mean"])
    assert len(placement["train_share_per_process"]) == 2


def test_a_population_summary_splits_the_wall_time_per_process_and_a_replicas_turn_is_not_idle(reference):
    """Each process's wall time is its replicas training and evaluating, its waits on the other process, and the
    rest; a replica's own split counts the others of its process running as ``turn``, not as idle."""
    s = json.loads((reference["reference"] / "summary.json").read_text())
    p = s["placement"]
    for k in range(2):
        parts = [p[f"{c}_per_process"][k] for c in ("train", "eval", "waiting", "other")]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(p["wall_per_process"][k], rel=0.02)
        assert p["train_share_per_process"][k] == pytest.approx(p["train_per_process"][k] / p["wall_per_process"][k])
    per = s["time_split_per_rank"]
    for r in range(N):  # the categories, turn included, add up to each replica's wall time
        assert sum(per[c][r] for c in TIME_CATEGORIES) == pytest.approx(per["wall"][r], rel=0.02, abs=0.05)
    assert s["time_split"]["turn"] > s["time_split"]["idle"]  # N / 2 replicas a process: mostly the others' turns


def test_an_async_population_refuses_what_a_posted_exchange_cannot_carry_naming_the_keys(resumed):
    res = resumed[4][1]["async"]
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-3000:])
    assert "is refused with protocol='async' and merge.optimizer_state='average'" in res.stderr
    assert f"world_size={N} replicas on 4 MPI processes" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (resumed[4][0].parent.parent / "async" / "tiny" / "checkpoints").exists()  # refused before training


def test_a_world_size_the_processes_do_not_divide_is_refused_before_training(tmp_path, tiny_config):
    res = run_engine(3, tiny_config, tmp_path, f"world_size={N}", check=False, timeout=180)
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-3000:])
    assert f"world_size={N}" in res.stderr and "3 MPI processes" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()  # nothing trained
