"""The run directory's lock (communities/runlock.py): one writer at a time, stale locks taken over, liveness read.

Two holders are two processes in real use; flock conflicts between two open file
descriptions of one process too, so most checks run in-process, and one holder is
a real subprocess that is killed with SIGKILL (the case a stale lock comes from).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from communities.errors import RunLocked
from communities.results import LOCK_FILE, ResultsError, RunWriter
from communities.runlock import LockState, RunLock, effective_status, probe

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def test_a_second_holder_is_refused_naming_host_and_pid(tmp_path):
    run = tmp_path / "run"
    first = RunLock(run)
    assert first.acquire(["communities", "run", "a.yaml"]) is None  # a fresh directory: nothing to say
    holder = json.loads((run / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    t0 = time.monotonic()
    with pytest.raises(RunLocked) as err:
        RunLock(run).acquire(wait=0.3)
    assert time.monotonic() - t0 >= 0.3  # it retried (an inspect probe holds the lock for an instant only)
    msg = str(err.value)
    assert f"host {socket.gethostname()}" in msg and f"pid {os.getpid()}" in msg and "in use by another run" in msg
    assert probe(run).held is True
    first.release()
    assert (run / LOCK_FILE).read_text() == ""  # released cleanly: empty, so the next run has nothing to report
    assert probe(run).held is False
    second = RunLock(run)
    assert second.acquire() is None
    second.release()
    first.release()  # idempotent


def test_a_killed_holder_leaves_a_stale_lock_that_the_next_run_takes_over(tmp_path):
    run = tmp_path / "run"
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from communities.runlock import RunLock; "
            "RunLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(run), str(ROOT)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked, match=f"pid {proc.pid}"):
            RunLock(run).acquire(wait=0.1)
        state = probe(run)
        assert state.held is True and state.holder["pid"] == proc.pid and state.holder_alive is True
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    state = probe(run)
    assert state.held is False and state.holder["pid"] == proc.pid and state.holder_alive is False
    lock = RunLock(run)
    note = lock.acquire()
    assert note is not None and "taking over" in note and f"pid {proc.pid}" in note
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_overwrite_keeps_the_lock_and_a_lock_alone_is_no_existing_run(tmp_path):
    run = tmp_path / "run"
    lock = RunLock(run)
    lock.acquire()
    RunWriter(run).write_json("meta.json", {"status": "running"})  # only the lock there: a fresh directory
    with pytest.raises(ResultsError, match="already exists"):
        RunWriter(run)
    RunWriter(run, overwrite=True)
    assert (run / LOCK_FILE).exists() and probe(run).held is True  # never deleted while held
    assert not (run / "meta.json").exists()
    lock.release()


def test_effective_status_reads_a_killed_run_as_interrupted(tmp_path):
    def state(held, age, pid=None):
        holder = {"host": socket.gethostname(), "pid": pid} if pid else {"host": "elsewhere", "pid": 1}
        return LockState(True, held, holder, age)

    assert effective_status("running", state(True, 10_000)) == "running"  # held: alive, whatever the clock says
    assert effective_status("running", state(False, 10_000)) == "interrupted"
    assert effective_status("running", state(None, 10_000)) == "interrupted"  # no flock: the heartbeat decides
    assert effective_status("running", state(False, 5)) == "running"  # another node's lock may be invisible
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert effective_status("running", state(False, 5, pid=dead.pid)) == "interrupted"  # its pid is gone here
    assert effective_status("complete", state(False, 10_000)) == "complete"
    assert effective_status("running", LockState(False, None, None, None)) == "running"  # a run from before locks


def test_the_heartbeat_is_the_lock_files_mtime(tmp_path, monkeypatch):
    import communities.runlock as runlock

    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    path = tmp_path / "run" / LOCK_FILE
    os.utime(path, (time.time() - 1000, time.time() - 1000))
    deadline = time.time() + 5
    while time.time() - path.stat().st_mtime > 100 and time.time() < deadline:
        time.sleep(0.02)
    assert time.time() - path.stat().st_mtime < 100
    lock.release()
