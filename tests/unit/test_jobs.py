"""communities/tools/jobs.py: a job started there can always be ended whole, its ranks are found by their
environment, and the launcher's flags follow what ``--version`` says it is."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import psutil
import pytest

from communities.tools import jobs

SLEEP = "import time; time.sleep(600)"
# a "launcher" that starts one child in its session and one that leaves for a session of its own, prints both
LAUNCHER = ("import subprocess, sys\n"
            f"a = subprocess.Popen([sys.executable, '-c', {SLEEP!r}])\n"
            f"b = subprocess.Popen([sys.executable, '-c', {SLEEP!r}], start_new_session=True)\n"
            "print(a.pid, b.pid, flush=True)\n"
            "a.wait()\n")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
def test_end_kills_the_session_and_the_descendants_that_left_it():
    proc = jobs.start([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    a, b = (int(x) for x in proc.stdout.readline().split())
    try:
        assert {p.pid for p in jobs.in_session(proc.pid)} >= {proc.pid, a}
        assert b not in {p.pid for p in jobs.in_session(proc.pid)}  # outside the session, still a descendant
        assert {a, b} <= {p.pid for p in jobs.job_processes(proc.pid)}
    finally:
        jobs.end(proc)
    deadline = time.monotonic() + 10
    while not (_gone(a) and _gone(b)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(a) and _gone(b) and proc.returncode is not None


@pytest.mark.timeout(60)
def test_only_the_leader_left_once_its_children_exited():
    proc = jobs.start([sys.executable, "-c", "import subprocess, sys, time\n"
                       "subprocess.run([sys.executable, '-c', 'pass'])\nprint('done', flush=True)\ntime.sleep(600)"],
                      stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"
        assert jobs.only_leader_left(proc.pid)
    finally:
        jobs.end(proc)


@pytest.mark.timeout(60)
def test_ranks_are_found_by_their_environment_and_not_below_a_rank():
    """A Python process with an MPI rank variable is a rank; its own children (with the variable inherited) are not."""
    child = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); print('up', flush=True)"
    proc = jobs.start([sys.executable, "-c", child + "; import time; time.sleep(600)"], stdout=subprocess.PIPE,
                      text=True, env={**os.environ, "PMI_RANK": "4"})
    launcher = jobs.start([sys.executable, "-c", SLEEP])
    try:
        assert proc.stdout.readline().strip() == "up"
        assert jobs.job_ranks(os.getpid()) == {4: proc.pid}  # the rank's grandchild carries PMI_RANK too
        assert jobs.job_ranks(launcher.pid) == {}
        assert jobs.peak_rss(proc.pid) > 0
    finally:
        jobs.end(proc)
        jobs.end(launcher)


def test_launcher_flags_follow_its_version(tmp_path):
    def fake(name: str, version: str) -> str:
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\necho '{version}'\n")
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
        return str(path)

    ompi = jobs.launcher_flags(fake("ompi", "mpirun (Open MPI) 5.0.8"))
    assert ompi[0] == "--oversubscribe" and ("--allow-run-as-root" in ompi) == (os.geteuid() == 0)
    assert jobs.launcher_flags(fake("hydra", "HYDRA build details:")) == []
    assert jobs.launcher_flags(str(tmp_path / "missing")) == []


@pytest.mark.timeout(60)
def test_run_polled_ends_a_job_past_its_time(tmp_path):
    code, seconds, peaks = jobs.run_polled([sys.executable, "-c", SLEEP], dict(os.environ), tmp_path / "log", 1.0,
                                           every=0.1)
    assert code == 124 and 1.0 <= seconds < 30 and peaks == []
