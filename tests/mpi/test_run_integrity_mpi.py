"""A run directory nobody can corrupt (issue 16), under a real mpiexec: the lock refuses a second run on an active
one, a damaged newest checkpoint falls back to an intact one with a bitwise-equal end, and a full disk (injected, and
a real 1 MiB tmpfs where mounting is allowed) stops every rank cleanly and resumes bitwise once space is freed."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

from communities import manifest
from communities.results import LOCK_FILE, read_jsonl
from communities.runlock import probe
from tests.conftest import TINY
from tests.helpers.damage import as_if_interrupted, flip_payload_bit, truncate
from tests.helpers.mpi import finish, run_engine, start, wait_for

pytestmark = pytest.mark.timeout(600)

N = 3  # rank 0 writes the run directory; ranks 1 and 2 write checkpoint files only
REF = ["train.budget=30", "checkpoint.every=10", "checkpoint.at_end=false"]  # complete checkpoints at t=10 and 20


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def ref(tmp_path_factory, cfg) -> Path:
    """The uninterrupted run every recovery below must equal bit for bit."""
    root = tmp_path_factory.mktemp("ref")
    run_engine(N, cfg, root, *REF)
    return root / "tiny"


def identical_ends(a: Path, b: Path) -> None:
    ca, cb = (torch.load(p / "consensus.pt", weights_only=True) for p in (a, b))
    assert ca.keys() == cb.keys() and all(torch.equal(ca[k], cb[k]) for k in ca), "consensus.pt differs"

    def rows(p):
        return [{k: v for k, v in r.items() if k not in ("bytes_sent", "wall")} for r in read_jsonl(p)]

    for log in ("metrics.jsonl", "merges.jsonl", "consensus.jsonl"):
        assert rows(a / log) == rows(b / log), log


def leftovers(run: Path) -> list:
    """Hidden temporaries anywhere, and checkpoint directories never committed."""
    tmp = [p for p in run.rglob(".*") if p.name != LOCK_FILE]
    return tmp + [p for p in (run / "checkpoints").glob("u*") if not (p / manifest.COMPLETE).exists()]


# --------------------------------------------------------------------------- the lock


def test_overwrite_and_resume_of_an_active_run_are_refused(tmp_path, cfg):
    run = tmp_path / "tiny"
    active = start(2, cfg, tmp_path, "train.budget=100000", "checkpoint.every=10")
    try:
        wait_for(run / "checkpoints" / "latest", active)
        holder = json.loads((run / LOCK_FILE).read_text())
        config_before = (run / "config.yaml").read_bytes()
        for flag in ("--overwrite", "--resume"):
            t0 = time.monotonic()
            res = run_engine(2, cfg, tmp_path, "train.budget=100000", "checkpoint.every=10", extra=[flag],
                             check=False, timeout=120)
            took = time.monotonic() - t0
            assert res.returncode == 2, res.stderr[-2000:]
            assert res.stderr.count("in use by another run") == 1 and "Traceback" not in res.stderr
            assert f"host {holder['host']}, pid {holder['pid']}" in res.stderr
            print(f"{flag} of an active run refused in {took:.1f}s (process start included)")
            assert active.poll() is None, "the active run must go on"
            assert (run / "config.yaml").read_bytes() == config_before and (run / "checkpoints" / "latest").exists()
    finally:
        (run / "STOP").touch()
        code, out, err = finish(active, timeout=120)
    assert code == 75, err[-2000:]
    rows = [(r["t"], r["rank"]) for r in read_jsonl(run / "metrics.jsonl")]
    assert len(rows) == len(set(rows)) and sorted(rows) == rows  # nothing interleaved, nothing twice
    assert probe(run).held is False and (run / LOCK_FILE).read_text() == ""


def test_two_runs_started_together_one_wins(tmp_path, cfg):
    procs = [start(2, cfg, tmp_path, "train.budget=15") for _ in range(2)]
    results = [finish(p, timeout=240) for p in procs]
    codes = sorted(r[0] for r in results)
    assert codes == [0, 2], [r[2][-1500:] for r in results]
    loser = next(r for r in results if r[0] == 2)
    assert "in use by another run" in loser[2] or "already exists" in loser[2]
    rows = [(r["t"], r["rank"]) for r in read_jsonl(tmp_path / "tiny" / "metrics.jsonl")]
    assert sorted(rows) == [(t, r) for t in range(1, 16) for r in range(2)]
    assert json.loads((tmp_path / "tiny" / "meta.json").read_text())["status"] == "complete"


# --------------------------------------------------------------------------- checksums


def interrupted_copy(ref: Path, root: Path, name: str = "tiny") -> Path:
    shutil.copytree(ref, root / name)
    as_if_interrupted(root / name)
    return root / name


@pytest.mark.parametrize("damage", [flip_payload_bit, truncate])
def test_a_damaged_newest_checkpoint_falls_back_to_an_intact_one_bitwise(tmp_path, cfg, ref, damage):
    cut = interrupted_copy(ref, tmp_path)
    damage(cut / "checkpoints" / "u00000020" / "rank00001.pt")
    res = run_engine(N, cfg, tmp_path, *REF, extra=["--resume"])
    assert "checkpoint u00000020 is damaged (rank 1: " in res.stdout and "rank00001.pt: damaged checkpoint file" \
        in res.stdout
    assert "falling back to checkpoint u00000010 (t=10)" in res.stdout
    assert (cut / "checkpoints" / "damaged" / "u00000020" / "rank00001.pt").exists()
    identical_ends(ref, cut)


def test_a_copied_and_renamed_run_directory_resumes(tmp_path, cfg, ref):
    cut = interrupted_copy(ref, tmp_path, name="trunc")
    res = run_engine(N, cfg, tmp_path, *REF, "name=trunc", extra=["--resume"])
    assert "resuming" in res.stdout and "u00000020" in res.stdout
    identical_ends(ref, cut)


# --------------------------------------------------------------------------- full disks


def test_an_injected_full_disk_stops_every_rank_cleanly_and_resume_is_bitwise(tmp_path, cfg, ref):
    cut = tmp_path / "tiny"
    res = run_engine(N, cfg, tmp_path, *REF, "faults.disk_full_at=23", check=False, timeout=180)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("communities: error:") == 1 and "Traceback" not in res.stderr
    err = res.stderr.split("communities: error:")[1]
    assert str(cut) in err and "No space left on device" in err and " free of " in err
    assert "stopped at t=25" in err and "last complete checkpoint u00000020 is intact" in err and "--resume" in err
    meta = json.loads((cut / "meta.json").read_text())
    assert meta["status"] == "failed" and "No space left on device" in meta["reason"]
    assert leftovers(cut) == []
    assert [d.name for d in manifest.complete_dirs(cut / "checkpoints")] == ["u00000020", "u00000010"]
    assert all(manifest.problems(d) == [] for d in manifest.complete_dirs(cut / "checkpoints"))
    assert probe(cut).held is False
    run_engine(N, cfg, tmp_path, *REF, extra=["--resume"])
    identical_ends(ref, cut)


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (needs root, or CAP_SYS_ADMIN: skipped where mounting is not allowed)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip() or res.returncode}); the injected full disk "
                    "test covers the same path")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path: Path) -> None:
    """Write zeros until the filesystem is full (it may be already: then even creating the file fails)."""
    try:
        with open(path, "wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
    except OSError:
        pass


def test_a_real_full_tmpfs_stops_cleanly_and_resumes_bitwise_once_space_is_freed(tmp_path, cfg, ref, tiny_tmpfs):
    # the whole run needs ~270 KiB here; 200 KiB free lets it write a checkpoint at t=10, then fills up
    (tiny_tmpfs / "filler").write_bytes(b"\0" * (1024 - 200) * 1024)
    cut = tiny_tmpfs / "tiny"
    res = run_engine(N, cfg, tiny_tmpfs, *REF, check=False, timeout=180)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.count("communities: error:") == 1 and "Traceback" not in res.stderr
    err = res.stderr.split("communities: error:")[1]
    assert f"cannot write {cut}" in err and "No space left on device (ENOSPC)" in err and "free of 1.0 MiB" in err
    meta = json.loads((cut / "meta.json").read_text())
    assert meta["status"] == "failed" and "ENOSPC" in meta["reason"]
    assert leftovers(cut) == []
    found = manifest.complete_dirs(cut / "checkpoints")
    assert found and all(manifest.problems(d) == [] for d in found)
    assert f"last complete checkpoint {found[0].name} is intact" in err

    fill(tiny_tmpfs / "filler2")  # still full: the resume says where and how much room there is
    res = run_engine(N, cfg, tiny_tmpfs, *REF, extra=["--resume"], check=False, timeout=180)
    assert res.returncode == 2 and res.stderr.count("communities: error:") == 1, res.stderr[-3000:]
    assert f"cannot write {cut}" in res.stderr and "No space left on device" in res.stderr \
        and "free of 1.0 MiB" in res.stderr
    assert manifest.complete_dirs(cut / "checkpoints") == found and leftovers(cut) == []

    (tiny_tmpfs / "filler").unlink()
    (tiny_tmpfs / "filler2").unlink(missing_ok=True)
    res = run_engine(N, cfg, tiny_tmpfs, *REF, extra=["--resume"])
    assert f"from {found[0].name}" in res.stdout
    identical_ends(ref, cut)
