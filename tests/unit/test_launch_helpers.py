"""The test suite's own launch helpers (tests/helpers/mpi.py): a launcher that outlives its ranks is ended
with LAUNCHER_HUNG, only where the caller allows it, and a hung job's message says where its processes wait."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers import mpi

# a "launcher" whose one "rank" exits at once, while the launcher itself never returns (prterun's hang)
ORPHAN = [sys.executable, "-c", "import subprocess, sys, time\n"
          "subprocess.run([sys.executable, '-c', 'pass'])\nprint('rank done', flush=True)\ntime.sleep(600)"]
# a launcher that waits on a live rank
WAITS = [sys.executable, "-c", "import subprocess, sys\n"
         "subprocess.run([sys.executable, '-c', 'import time\\ndef in_the_rank(): time.sleep(600)\\nin_the_rank()'])"]


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(mpi, "ORPHANED_LAUNCHER_S", 1.0)


@pytest.mark.timeout(60)
def test_a_launcher_alone_after_its_ranks_is_ended_with_launcher_hung(quick):
    t0 = time.monotonic()
    res = mpi.run_command(ORPHAN, 30, "orphan", launcher_may_hang=True)
    assert res.returncode == mpi.LAUNCHER_HUNG and "rank done" in res.stdout and "outlived" in res.stderr
    assert time.monotonic() - t0 < 15


@pytest.mark.timeout(60)
def test_without_launcher_may_hang_the_same_launcher_times_out(quick):
    with pytest.raises(AssertionError, match="timed out after 3s"):
        mpi.run_command(ORPHAN, 3, "orphan")


@pytest.mark.timeout(60)
def test_a_launcher_with_a_live_rank_is_not_ended_and_the_timeout_shows_the_rank_waiting(quick):
    with pytest.raises(AssertionError) as info:
        mpi.run_command(WAITS, 4, "waits", launcher_may_hang=True)
    text = str(info.value)
    assert "timed out after 4s" in text and "--- processes" in text
    if "py-spy dump" in text:  # (py-spy comes with the dev extra)
        assert "in_the_rank" in text


@pytest.mark.timeout(60)
def test_finish_returns_the_exit_code():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(75)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert mpi.finish(proc, timeout=30)[0] == 75
