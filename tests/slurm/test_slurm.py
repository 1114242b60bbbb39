"""SLURM: jobs on a real SLURM, submitted with ``communities slurm`` and launch/sweep.sbatch.

The tests here are marked ``slurm``: they submit jobs to a one-node cluster that
tests/helpers/slurm_cluster.py starts (its session fixture ``slurm_cluster``, registered by
tests/slurm/conftest.py; Debian's slurm-wlm and munge, installed by launch/ci/slurm-up.sh
when missing; root only). They skip where it cannot start, and fail instead when CI is set.
Deselect them with ``-m "not slurm"``. The batch-script template and ``communities slurm``
itself, which need nothing but bash, are tested in tests/unit/test_slurm_script.py.

Inside the allocation both launchers are exercised: ``srun --mpi=pmi2`` (works with the
``mpich`` PyPI wheel's PMI client; the default here, since this SLURM's ``srun --mpi=list``
offers pmi2) and the wheel's own hydra ``mpiexec`` (which starts its proxies with srun and
reads the allocation from SLURM's environment).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY
from tests.helpers.mpi import ROOT, run_engine
from tests.helpers.slurm_cluster import PY, gen

pytestmark = pytest.mark.timeout(900)
START_S = 120  # a job whose run has not started (no meta.json) this long after submission is stuck: ~5 s here

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weights_equal(a: Path, b: Path) -> bool:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# --------------------------------------------------------------------------- a real SLURM


def read_meta(run: Path) -> dict:
    return json.loads((run / "meta.json").read_text())


def say(capsys, text: str) -> None:
    """Into the test log even under ``pytest -q`` (CI shows the timings and the weight hashes)."""
    with capsys.disabled():
        print(text, flush=True)


@pytest.mark.slurm
def test_submit_runs_to_completion(slurm_cluster, tmp_path, tiny_config, capsys):
    """The default launcher on this cluster (its srun lists pmi2, which the mpich wheel speaks): srun --mpi=pmi2.
    The job runs the setup block first; its files honour the submitter's umask; meta.json names the job; the
    progress lines say how fast the run goes; generating the script made no run directory."""
    c = slurm_cluster
    t0 = time.monotonic()
    res = gen(tiny_config, "output.root=results", "--ntasks-per-node", 4, "--time", "00:10:00",
              "--setup", "export SETUP_MARK=from-setup", "--setup", 'echo "== setup ran in $PWD: $SETUP_MARK"',
              cwd=tmp_path, env=c.env)
    script = Path(res.stdout.split()[0])
    run = tmp_path / "results" / "tiny"
    assert script == tmp_path / "results" / "tiny.sbatch" and not run.exists()
    assert "communities slurm: launcher srun --mpi=pmi2 (srun --mpi=list offers pmi2, which MPICH" in res.stderr
    # sbatch passes the submitter's umask to the job (SLURM_UMASK)
    sub = c.cmd("bash", "-c", f"umask 002 && sbatch --parsable {script}", cwd=tmp_path)
    job = sub.stdout.strip().split(";")[0]
    [info] = c.wait_done(job, timeout=240)
    log = (tmp_path / "results" / f"tiny-{job}.out").read_text()
    say(capsys, f"\nsrun: job {job} {info['JobState']} exit {info['ExitCode']} in {time.monotonic() - t0:.1f}s")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    meta = read_meta(run)
    assert meta["status"] == "complete" and meta["world_size"] == 4 and summary["units"] == 40
    assert (run / "consensus.pt").stat().st_size > 0
    assert "attempt 1 on " in log and "done: " in log and "srun --mpi=pmi2 --ntasks=4" in log
    assert f"== setup ran in {tmp_path}: from-setup" in log
    # provenance: the job, its node, the code
    assert meta["slurm"]["job_id"] == int(job) and meta["slurm"]["ntasks"] == 4
    assert meta["slurm"].get("restart_count", 0) == 0 and "array_task_id" not in meta["slurm"]
    assert meta["hosts"] == [meta["writers"][0]["host"]] and meta["writers"][0]["slurm_job_id"] == job
    assert meta["git"]["commit"] and meta["command"][1:3] == ["run", str(tiny_config)]
    # progress lines with elapsed time, speed and ETA
    assert re.search(r"\[tiny\] t=\d+/40 \(\d+%\) \d+:\d\d elapsed, [\d.]+ (units/s|s/unit), eta \d+:\d\d", log), \
        log[-2000:]
    # every file and directory of the run as the umask says: the team can read them
    wrong = [(str(p.relative_to(run)), oct(p.stat().st_mode & 0o777)) for p in run.rglob("*")
             if p.stat().st_mode & 0o777 != (0o775 if p.is_dir() else 0o664)]
    assert not wrong, wrong


LONGER = ["train.budget=200", "train.steps_per_unit=8", "checkpoint.every=10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple:
    """The uninterrupted reference of the requeue tests, run once for both launchers: its 4 replicas as a
    population on 2 processes, trained one after another (placement changes no bit under the virtual clock; the
    stacked path agrees only within rounding, so it is off), at half the processes to start. (path, seconds)"""
    t0 = time.monotonic()
    root = tmp_path_factory.mktemp("uninterrupted")
    (root / "tiny.yaml").write_text(TINY)
    run_engine(2, root / "tiny.yaml", root, *LONGER, "world_size=4", "train.vectorize=off")
    return root / "tiny" / "consensus.pt", time.monotonic() - t0


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_preempted_job_is_requeued_and_resumes_bitwise(slurm_cluster, tmp_path, tiny_config, capsys,
                                                       launcher, uninterrupted):
    """USR1 to the batch shell mid-run: checkpoint, scontrol requeue, a second attempt resumes;
    the consensus weights equal an uninterrupted run's bit for bit. Under srun --kill-on-bad-exit the first
    rank to exit 75 would end the step: every rank waits until rank 0 has committed the checkpoint."""
    c = slurm_cluster
    t0 = time.monotonic()
    ref, t_ref = uninterrupted  # plain mpiexec, outside the allocation

    def submit(where: Path):
        res = gen(tiny_config, "output.root=results", *LONGER, "--ntasks-per-node", 4, "--time", "00:15:00",
                  "--launcher", launcher, "--submit", cwd=where, env=c.env)
        job = res.stdout.split()[1]
        run = where / "results" / "tiny"
        return job, run, where / "results" / f"tiny-{job}.out"

    job, run, log = submit(tmp_path)
    # Two CI runs (srun) saw a first attempt that never started its run: RUNNING for 5 minutes with no meta.json,
    # while the same test under mpiexec, and srun in the test before it, passed. Where a job does not start its
    # run within START_S, the test prints what its processes were doing (Cluster.stuck), cancels it and submits it
    # once more; everything below must then hold for the second job.
    try:
        c.wait(job, lambda js: js[0].get("JobState") != "PENDING" and (run / "meta.json").exists(),
               timeout=START_S, what="the run to start (meta.json)", poll=0.2, output=log)
    except AssertionError as hung:
        say(capsys, f"\n{launcher}: job {job} did not start its run in {START_S}s: cancelled and submitted again. "
                    f"What it was doing:\n{hung}")
        c.cmd("scancel", job)
        c.wait_done(job, timeout=120)
        (tmp_path / "again").mkdir()
        job, run, log = submit(tmp_path / "again")

    # wait for a committed checkpoint while the job is still running, then signal the batch shell
    c.wait(job, lambda js: js[0].get("JobState") != "PENDING" and (run / "checkpoints" / "latest").exists(),
           timeout=300, what="a first checkpoint", poll=0.2, output=log)
    info = c.job(job)
    assert info["JobState"] == "RUNNING" and not (run / "summary.json").exists(), \
        f"the run ended before it could be interrupted ({info.get('JobState')}): lengthen it\n{log.read_text()[-2000:]}"
    c.cmd("scancel", "--signal=USR1", "--batch", job)
    t_sig = time.monotonic()

    # SLURM requeues the job: Restarts=1. A requeued job is held ~2 min (BeginTime); release it now.
    c.wait(job, lambda js: int(js[0].get("Restarts", 0)) >= 1, timeout=180, what="the requeue (Restarts >= 1)",
           output=log)
    t_requeue = time.monotonic() - t_sig
    first = log.read_text()
    assert "got SIGUSR1" in first and re.search(r"stopped at t=\d+, checkpoint written", first) \
        and "requeueing job" in first, \
        first[-3000:]
    stopped_at = int(re.search(r"stopped at t=(\d+)", first).group(1))
    assert 0 < stopped_at < 200
    # Release the hold only once slurmd has finished tearing down the first attempt (node idle, not
    # completing): a batch launch onto a node still cleaning up the same job id fails the job.
    c.wait(job, lambda js: js[0].get("JobState") in ("PENDING", "RUNNING", "COMPLETED") and c.node_idle()
           and c.steps_gone(job), timeout=180, what="the requeued job to be pending on an idle node")
    # slurmd refuses a batch credential created in the same second as (or before) the first attempt's revocation
    # ("Job credential revoked"; slurm_cred_revoked compares whole-second times), which is why SLURM holds a
    # requeued job for cred_expire. The revocation came before the node went idle: two seconds later is safe.
    time.sleep(2.5)
    if c.job(job).get("JobState") == "PENDING":
        c.cmd("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    [info] = c.wait_done(job, timeout=300, output=log)
    text = log.read_text()
    if info.get("JobState") != "COMPLETED":
        text += f"\n--- scontrol show job {job}\n{info}\n{c.logs()}"
    say(capsys, f"\n{launcher}: reference run {t_ref:.1f}s; job {job}: signalled after a checkpoint, stopped at "
                f"t={stopped_at}, requeued {t_requeue:.1f}s later, {info['JobState']} exit {info['ExitCode']} "
                f"Restarts={info['Restarts']}; total {time.monotonic() - t0:.1f}s")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and int(info["Restarts"]) >= 1, text[-3000:]
    assert "attempt 2 on " in text and "done: " in text
    meta = read_meta(run)
    assert meta["status"] == "complete" and meta.get("resumed"), meta
    # the requeued attempt is the same job, restarted; each attempt's writer names it
    assert meta["slurm"]["job_id"] == int(job) and meta["slurm"]["restart_count"] >= 1
    assert [w["slurm_job_id"] for w in meta["writers"]] == [job, job]
    got = run / "consensus.pt"
    say(capsys, f"{launcher}: sha256 uninterrupted {sha256(ref)}\n{launcher}: sha256 resumed       {sha256(got)}")
    assert weights_equal(ref, got)


@pytest.mark.slurm
def test_sweep_array_of_two_seeds(slurm_cluster, tmp_path, tiny_config, capsys):
    c = slurm_cluster
    t0 = time.monotonic()
    env = {"COMMUNITIES_CONFIG": str(tiny_config), "COMMUNITIES_SEEDS": "0 1",
           "COMMUNITIES_OVERRIDES": "output.root=results", "COMMUNITIES_PYTHON": PY}
    res = c.cmd("sbatch", "--parsable", "--array=0-1", "--ntasks-per-node=2", "--time=00:10:00",
                ROOT / "launch" / "sweep.sbatch", cwd=tmp_path, env=env)
    job = res.stdout.strip().split(";")[0]
    tasks = c.wait_done(job, timeout=300)
    logs = {p.name: p.read_text() for p in tmp_path.glob("slurm-communities-sweep-*.out")}
    say(capsys, f"\nsweep job {job}: {[(t.get('ArrayTaskId'), t['JobState'], t['ExitCode']) for t in tasks]} "
          f"in {time.monotonic() - t0:.1f}s")
    assert len(tasks) == 2 and all(t["JobState"] == "COMPLETED" and t["ExitCode"] == "0:0" for t in tasks), logs
    runs = sorted(p.name for p in (tmp_path / "results").iterdir() if p.is_dir())
    assert runs == ["tiny-seed0", "tiny-seed1"]
    for seed, name in enumerate(runs):
        run = tmp_path / "results" / name
        meta, cfg = read_meta(run), (run / "config.yaml").read_text()
        assert meta["slurm"]["array_job_id"] == int(job) and meta["slurm"]["array_task_id"] == seed
        assert meta["status"] == "complete" and meta["world_size"] == 2 and (run / "summary.json").exists()
        assert re.search(rf"^seed: {seed}$", cfg, re.M) and (run.parent / f"{name}.sbatch").exists()
    assert not weights_equal(tmp_path / "results" / runs[0] / "consensus.pt",
                             tmp_path / "results" / runs[1] / "consensus.pt")
