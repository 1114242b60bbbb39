"""Checkpoints, collective stop on a signal or STOP file, and exact resume, under a real mpiexec."""
import os
import signal
from pathlib import Path

import pytest
import torch

from communities.tools import jobs
from tests.conftest import TINY
from tests.helpers.mpi import Job, finish, run_batch, run_engine, start, tiny_batch, wait_for

pytestmark = pytest.mark.timeout(900)

LONG = ["train.budget=150", "checkpoint.every=10"]
SHORT = ["train.budget=20", "checkpoint.every=10", "checkpoint.at_end=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's uninterrupted runs, one batch per world size."""
    four = tiny_batch(tmp_path_factory, "resume4", 4, {"reference": LONG, "refuse": SHORT})
    two = tiny_batch(tmp_path_factory, "resume2", 2, {"complete": ["train.budget=10"], "damaged": SHORT})
    return {name: batch[name].parent for batch, names in ((four, ("reference", "refuse")),
                                                           (two, ("complete", "damaged"))) for name in names}


def consensus(run_dir: Path) -> dict:
    return torch.load(run_dir / "consensus.pt", weights_only=True)


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def last_rank(proc) -> int:
    """The pid of the highest rank of a job started with ``start`` (its ranks found by their environment)."""
    ranks = jobs.job_ranks(proc.pid)
    assert ranks, "no rank processes found"
    return ranks[max(ranks)]


@pytest.mark.parametrize("how", ["signal", "stopfile"])
def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, tiny_config, runs, how):
    ref, cut = runs["reference"], tmp_path / "cut"
    proc = start(4, tiny_config, cut, *LONG)
    wait_for(cut / "tiny" / "checkpoints" / "latest", proc)
    if how == "signal":
        os.kill(last_rank(proc), signal.SIGUSR1)  # one rank only: the stop must still be collective
    else:
        (cut / "tiny" / "STOP").touch()
    code, out, err = finish(proc)
    assert code == 75, err[-3000:]
    assert "checkpoint written" in out
    assert not (cut / "tiny" / "summary.json").exists()
    res = run_engine(4, tiny_config, cut, *LONG, extra=["--resume"])
    assert "resuming" in res.stdout
    assert identical(consensus(ref / "tiny"), consensus(cut / "tiny"))
    # logs of the resumed run match the uninterrupted one row for row (no duplicates, no gaps)
    from communities.results import read_jsonl

    for log in ("metrics.jsonl", "merges.jsonl"):
        a, b = read_jsonl(ref / "tiny" / log), read_jsonl(cut / "tiny" / log)
        def strip(rows):
            return [{k: v for k, v in r.items() if k not in ("bytes_sent", "wall")} for r in rows]
        assert strip(a) == strip(b), log
    def rounds(d):
        return sorted(p.name for p in (d / "tiny" / "rounds").iterdir())
    assert rounds(ref) == rounds(cut)


def as_if_interrupted(run_dir: Path) -> None:
    """Make a finished run look like one that was killed after its last periodic checkpoint."""
    (run_dir / "summary.json").unlink()
    meta = run_dir / "meta.json"
    meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, runs):
    """The resumes of this module that train nothing, in one batch on 2 ranks (tests/helpers/batch.py): of the
    4-rank run (another world size: refused), of a complete run (nothing to do), of a run whose newest checkpoint
    has a truncated file (refused). Returns (each resume's result, complete's summary.json bytes before)."""
    config = tmp_path_factory.mktemp("resumed") / "tiny.yaml"
    config.write_text(TINY)
    as_if_interrupted(runs["refuse"] / "tiny")
    as_if_interrupted(runs["damaged"] / "tiny")
    latest = (runs["damaged"] / "tiny" / "checkpoints" / "latest").read_text().strip()
    victim = runs["damaged"] / "tiny" / "checkpoints" / latest / "rank00001.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    before = (runs["complete"] / "tiny" / "summary.json").read_bytes()
    jobs = {"refuse": Job(config, runs["refuse"], ["train.budget=20"], ["--resume"]),
            "complete": Job(config, runs["complete"], ["train.budget=10"], ["--resume"]),
            "damaged": Job(config, runs["damaged"], ["train.budget=20"], ["--resume"])}
    return run_batch(2, jobs, timeout=600, check=False), before, victim


def test_resume_refuses_another_world_size_or_config(tiny_config, runs, resumed):
    res = resumed[0]["refuse"]
    assert res.returncode == 2 and "written by 4 ranks, this job has 2" in res.stderr
    res = run_engine(4, tiny_config, runs["refuse"], "train.budget=20", "train.lr=0.5", extra=["--resume"],
                     check=False)
    assert res.returncode == 2 and "train.lr: checkpoint has 0.05, config has 0.5" in res.stderr


def test_resume_of_a_complete_run_does_nothing(runs, resumed):
    results, before, _ = resumed
    res = results["complete"]
    assert res.returncode == 0, res.stderr[-2000:]
    assert "already complete" in res.stdout
    assert (runs["complete"] / "tiny" / "summary.json").read_bytes() == before


def test_damaged_checkpoint_is_named(resumed):
    results, _, victim = resumed
    res = results["damaged"]
    assert res.returncode == 2 and "rank00001.pt: damaged checkpoint file" in res.stderr
    assert "no intact checkpoint to resume from" in res.stderr and "the manifest says" in res.stderr
    assert "Traceback" not in res.stderr
    assert victim.exists()  # nothing deleted: the user decides


def test_killed_rank_ends_the_job_and_the_last_checkpoint_resumes(tmp_path, tiny_config):
    import json

    from communities.report.load import load_view
    from communities.runlock import probe

    run = tmp_path / "tiny"
    proc = start(4, tiny_config, tmp_path, *LONG)
    wait_for(run / "checkpoints" / "latest", proc)
    os.kill(last_rank(proc), signal.SIGKILL)
    code, _, _ = finish(proc, timeout=120)
    assert code != 0
    # meta.json still says running; nobody holds the lock any more, and its heartbeat stops
    assert json.loads((run / "meta.json").read_text())["status"] == "running"
    state = probe(run)
    assert state.held is False and state.holder is not None and state.holder_alive is False
    view = load_view(run)
    assert view.status == "interrupted" and any("its process is gone" in n for n in view.notes)
    res = run_engine(4, tiny_config, tmp_path, *LONG, extra=["--resume"])
    assert "taking over the lock of a run that ended without releasing it" in res.stdout
    assert (run / "summary.json").exists()
