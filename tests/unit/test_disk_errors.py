"""Full disks: a failed write is one DiskError naming the path and the free space, leaves no temporary, and a
run it stops says ``failed`` in meta.json, keeps its last checkpoint, and resumes bitwise once there is room.

The writer's failures are injected (``faults.disk_full_at``, or ``RunWriter.full``: half the bytes, then
ENOSPC, as a disk that fills mid-write); a real full tmpfs under mpiexec is in tests/mpi/test_run_integrity_mpi.py.
"""
from __future__ import annotations

import errno
import json

import pytest
import torch

from communities import manifest
from communities.engine.loop import Engine
from communities.engine.state.run_dir import Resume
from communities.errors import DiskError
from communities.results import LOCK_FILE, RunWriter, disk_error, read_jsonl
from communities.runlock import probe
from tests.unit.test_engine_parts import make_cfg

pytestmark = pytest.mark.timeout(300)


def leftovers(run) -> list:
    """Temporaries a writer may leave: hidden .tmp files anywhere, half-built rounds, uncommitted checkpoints."""
    tmp = [p for p in run.rglob(".*") if p.name != LOCK_FILE]
    partial = [p for p in (run / "checkpoints").glob("u*") if not (p / manifest.COMPLETE).exists()]
    return tmp + partial


def test_disk_error_names_the_path_the_reason_and_the_free_space(tmp_path):
    err = disk_error(tmp_path / "a" / "b.json", OSError(errno.ENOSPC, "No space left on device"))
    msg = str(err)
    assert str(tmp_path / "a" / "b.json") in msg and "No space left on device (ENOSPC)" in msg and " free of " in msg


def test_a_failed_write_leaves_no_temporary_and_no_torn_line(tmp_path):
    w = RunWriter(tmp_path / "run")
    w.append_jsonl("metrics.jsonl", [{"t": 1}])
    w.full = True
    for write in (lambda: w.write_json("summary.json", {"a": 1}),
                  lambda: w.append_jsonl("metrics.jsonl", [{"t": 2, "pad": "x" * 100}]),
                  lambda: w.write_round(0, torch.zeros(2, 3).numpy(), torch.zeros(1, 4).numpy(),
                                        torch.zeros(2, dtype=torch.int64).numpy(), {"round": 0, "t": 5})):
        with pytest.raises(DiskError, match="No space left on device"):
            write()
    assert not (tmp_path / "run" / "summary.json").exists()
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == '{"t": 1}\n'  # the half-written line was cut
    assert list((tmp_path / "run" / "rounds").iterdir()) == []  # the half-built round is gone
    assert leftovers(tmp_path / "run") == []


def test_deferred_errors_record_the_first_failure_and_skip_later_writes(tmp_path):
    w = RunWriter(tmp_path / "run")
    w.defer_errors()
    w.full = True
    assert w.append_jsonl("metrics.jsonl", [{"t": 1}]) is False
    first = w.failure
    assert isinstance(first, DiskError) and "metrics.jsonl" in str(first)
    w.full = False
    assert w.write_json("summary.json", {}) is False  # skipped: the run is stopping
    assert w.failure is first and not (tmp_path / "run" / "summary.json").exists()


_WORLD = []


def world_():
    """One World for the module (a one-rank MPI world, in-process)."""
    if not _WORLD:
        from communities.runtime.comm import World

        _WORLD.append(World(timeout=0))
    return _WORLD[0]


def run_engine(tmp_path, name, resume=Resume.FRESH, **overrides):
    cfg = make_cfg(**{"output.root": str(tmp_path / name), "checkpoint.every": 4, **overrides})
    engine = Engine(cfg, world_(), tmp_path / name / "tiny", progress=False, resume=resume)
    return engine.run()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref")
    run_engine(root, "ref")
    return torch.load(root / "ref" / "tiny" / "consensus.pt", weights_only=True)


# where the first failing write is, with TINY (budget 12, rounds every 3, checkpoints every 4, evaluations every 4):
# a round at t=6; the flush before the checkpoint at t=8; a consensus evaluation at t=12 and the end's files
CASES = {"round": ({"faults.disk_full_at": 5}, 6, "u00000004"),
         "checkpoint": ({"faults.disk_full_at": 7}, 8, "u00000004"),
         "end": ({"faults.disk_full_at": 11, "signature.every": 5, "checkpoint.at_end": False}, 12, "u00000008")}


@pytest.mark.parametrize("where", list(CASES))
def test_a_full_disk_stops_the_run_cleanly_and_resume_continues_bitwise(tmp_path, reference, where):
    overrides, t_stop, last = CASES[where]
    with pytest.raises(DiskError) as err:
        run_engine(tmp_path, "cut", **overrides)
    run = tmp_path / "cut" / "tiny"
    msg = str(err.value)
    assert str(run) in msg and "No space left on device" in msg and " free of " in msg
    assert f"stopped at t={t_stop}" in msg and f"last complete checkpoint {last} is intact" in msg and "--resume" in msg
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "failed" and "No space left on device" in meta["reason"] and meta["end_time"]
    assert leftovers(run) == []
    assert manifest.complete_dirs(run / "checkpoints")[0].name == last
    assert all(manifest.problems(d) == [] for d in manifest.complete_dirs(run / "checkpoints"))
    assert not (run / "summary.json").exists() and not (run / "consensus.pt").exists()
    assert probe(run).held is False and (run / LOCK_FILE).read_text() == ""
    rest = {k: v for k, v in overrides.items() if k != "faults.disk_full_at"}
    run_engine(tmp_path, "cut", resume=Resume.RESUME, **rest)
    final = torch.load(run / "consensus.pt", weights_only=True)
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final)
    assert [r["t"] for r in read_jsonl(run / "metrics.jsonl")] == list(range(1, 13))
    assert json.loads((run / "meta.json").read_text())["status"] == "complete"


def test_setup_on_a_full_disk_names_the_path(tmp_path, monkeypatch):
    import communities.results as results

    real = results.atomic_write_bytes
    monkeypatch.setattr(results, "atomic_write_bytes", lambda path, data, full=False: real(path, data, full=True))
    cfg = make_cfg(**{"output.root": str(tmp_path)})
    from communities.errors import ConfigError

    with pytest.raises(ConfigError, match=r"cannot write .*partition.json: No space left on device.* free of "):
        Engine(cfg, world_(), tmp_path / "tiny", progress=False)
    assert probe(tmp_path / "tiny").held is False  # the lock was given back
