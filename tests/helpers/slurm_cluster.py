"""A real one-node SLURM cluster for the tests, started by launch/ci/slurm-up.sh.

The session fixture ``slurm_cluster`` runs the script (which installs Debian's slurm-wlm
and munge with apt-get when they are missing, as root), and at the end stops the daemons
it started, by their PIDs (launch/ci/slurm-down.sh). Where the cluster cannot come up (not
root, no apt-get, a daemon that fails) the tests skip with the reason, unless CI is set
(CI=true), where they fail: CI must really run them.

``gen`` runs ``communities slurm`` as a user would; tests/unit/test_slurm_script.py and
tests/slurm/test_slurm.py both use it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from communities.tools import jobs
from tests.helpers import stacks

ROOT = Path(__file__).resolve().parents[2]  # the repository root
UP, DOWN = ROOT / "launch" / "ci" / "slurm-up.sh", ROOT / "launch" / "ci" / "slurm-down.sh"
CANNOT = 3  # slurm-up.sh: cannot run here


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def skip_or_fail(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CI is set, so the SLURM tests must run, but: {reason}", pytrace=False)
    pytest.skip(reason)


class Cluster:
    """Handles on the running cluster: its SLURM_CONF, and job helpers that shell out to the clients."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.conf = directory / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf), OMP_NUM_THREADS="1", MPLBACKEND="Agg",
                        PYTHONPATH=str(ROOT), PATH=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
            if var != "SLURM_CONF":
                del self.env[var]

    def cmd(self, *args, check: bool = True, cwd=None, env: Optional[Dict[str, str]] = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        res = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd,
                             env=dict(self.env, **(env or {})), timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
        return res

    def jobs(self, job: str) -> List[Dict[str, str]]:
        """``scontrol show job -o JOB``: one dict per job (per array task), {} fields when unknown."""
        res = self.cmd("scontrol", "show", "job", "-o", job, check=False)
        return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in res.stdout.splitlines() if line.strip()]

    def job(self, job: str) -> Dict[str, str]:
        found = self.jobs(job)
        return found[0] if found else {}

    def wait(self, job: str, until, timeout: float, what: str, poll: float = 0.5,
             output: Optional[Path] = None) -> List[Dict[str, str]]:
        """Poll until ``until(list of job dicts)`` is true; fail on timeout with the jobs' state, the daemons'
        logs, the job's ``output`` file, its processes and where its Python processes are stuck."""
        deadline = time.monotonic() + timeout
        while True:
            jobs = self.jobs(job)
            if jobs and until(jobs):
                return jobs
            if time.monotonic() > deadline:
                state = [(j.get("JobId"), j.get("ArrayTaskId"), j.get("JobState"), j.get("Reason"), j.get("Restarts"),
                          j.get("ExitCode")) for j in jobs]
                raise AssertionError(f"job {job}: timed out after {timeout:.0f}s waiting for {what}; now {state}\n"
                                     + self.logs() + self.stuck(job, output))
            time.sleep(poll)

    def wait_done(self, job: str, timeout: float, output: Optional[Path] = None) -> List[Dict[str, str]]:
        """Wait until every task of ``job`` has ended; return their final records."""
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                 "PREEMPTED")
        return self.wait(job, lambda js: all(j.get("JobState") in ended for j in js), timeout, "the job to end",
                         output=output)

    def node_idle(self) -> bool:
        """True when every node is idle: no job running or still completing on it."""
        res = self.cmd("sinfo", "-h", "-N", "-o", "%T", check=False)
        states = res.stdout.split()
        return bool(states) and all(s == "idle" for s in states)

    @staticmethod
    def steps_gone(job: str) -> bool:
        """True when no ``slurmstepd`` of ``job`` is left on this machine. The node turns idle when the batch
        step ends, but a task step's slurmstepd may still be tearing down: a requeued attempt launched then gets
        the same step id (``job.0``), and srun's PMI2 exchange with it failed at the end of a run that had
        finished (one CI run in five: 'mpi/pmi2: failed to send temp kvs', then the step cancelled, exit 137)."""
        return not Cluster.steps_of(job)

    @staticmethod
    def steps_of(job: str) -> str:
        """``pid command`` of each ``slurmstepd`` of ``job`` on this machine, a line each ("" when none)."""
        return subprocess.run(["pgrep", "-af", f"slurmstepd: \\[{job}\\."], capture_output=True, text=True).stdout

    @staticmethod
    def stuck(job: str, output: Optional[Path] = None) -> str:
        """What a job that does not progress is doing: its output's tail, its processes (those whose
        environment holds ``SLURM_JOB_ID=job``, and their slurmstepd), and a py-spy dump of each Python one
        (py-spy from the dev extra; skipped where it is missing)."""
        out = []
        if output is not None and output.exists():
            out.append(f"--- {output} (tail)\n" + output.read_text(errors="replace")[-3000:])
        out.append(f"--- slurmstepd of job {job}\n{Cluster.steps_of(job)}")
        out.append(stacks.describe(jobs.with_env(f"SLURM_JOB_ID={job}")))
        return "\n" + "\n".join(out)

    def logs(self, lines: int = 30) -> str:
        out = []
        for f in (self.dir / "log" / "slurmctld.log", self.dir / "log" / "slurmd.log"):
            if f.exists():
                tail = f.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {f} (last {lines} lines)\n" + "\n".join(tail))
        return "\n".join(out)


def start_cluster() -> Cluster:
    if sys.platform != "linux":
        skip_or_fail(f"the SLURM tests need Linux (this is {sys.platform})")
    directory = Path(tempfile.mkdtemp(prefix="slurm-ci."))
    try:
        res = subprocess.run(["bash", str(UP), str(directory)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        stop_cluster(Cluster(directory))
        skip_or_fail("launch/ci/slurm-up.sh did not finish in 15 minutes")
    if res.returncode != 0:
        stop_cluster(Cluster(directory))
        why = res.stderr.strip().splitlines()
        head = "cannot start a SLURM cluster here" if res.returncode == CANNOT else "the SLURM daemons did not start"
        skip_or_fail(f"{head} (launch/ci/slurm-up.sh exited {res.returncode}): " + " | ".join(why[-12:]))
    return Cluster(directory)


def stop_cluster(cluster: Cluster) -> None:
    """Stop the daemons by PID, then remove the cluster's directory (SLURM_CI_KEEP=1 keeps it, logs and all)."""
    subprocess.run(["bash", str(DOWN), str(cluster.dir)], capture_output=True, timeout=120)
    if not os.environ.get("SLURM_CI_KEEP"):
        shutil.rmtree(cluster.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


# --------------------------------------------------------------------------- communities slurm

PY = sys.executable


def gen(*args, cwd, env=None, check=True) -> subprocess.CompletedProcess:
    """``python -m communities.tools.slurm ARGS`` as a user would run it."""
    res = subprocess.run([PY, "-m", "communities.tools.slurm", *map(str, args)], capture_output=True, text=True,
                         cwd=cwd, env=env if env is not None else dict(os.environ, PYTHONPATH=str(ROOT)),
                         timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"communities slurm {args} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res
