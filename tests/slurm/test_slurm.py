"""SLURM: the batch-script template and ``communities slurm``, then jobs on a real SLURM.

The first tests need nothing but bash. The ones marked ``slurm`` submit jobs to a one-node
cluster that tests/slurm_cluster.py starts (Debian's slurm-wlm and munge, installed by
launch/ci/slurm-up.sh when missing; root only). They skip where it cannot start, and fail
instead when CI is set. Deselect them with ``-m "not slurm"``.

Inside the allocation both launchers are exercised: ``srun --mpi=pmi2`` (works with the
``mpich`` PyPI wheel's PMI client) and the wheel's own hydra ``mpiexec`` (which starts its
proxies with srun and reads the allocation from SLURM's environment).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from communities import slurm

from .conftest import ROOT, run_engine
from .slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.timeout(900)

PY = sys.executable


def gen(*args, cwd, env=None, check=True) -> subprocess.CompletedProcess:
    """``python -m communities.slurm ARGS`` as a user would run it."""
    res = subprocess.run([PY, "-m", "communities.slurm", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                         env=env if env is not None else dict(os.environ, PYTHONPATH=str(ROOT)),
                         timeout=120)
    if check and res.returncode != 0:
        raise AssertionError(f"communities slurm {args} exited {res.returncode}\n{res.stdout}\n{res.stderr}")
    return res


def sbatch_lines(text: str) -> dict:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, re.M))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weights_equal(a: Path, b: Path) -> bool:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# --------------------------------------------------------------------------- no SLURM needed


def test_template_is_the_packaged_one_and_renders_to_itself():
    """launch/slurm.sbatch is the one template: the package reads it, and rendering nothing changes nothing."""
    assert slurm.template_path().resolve() == (ROOT / "launch" / "slurm.sbatch").resolve()
    text = slurm.template_text()
    assert slurm.render(text, {k: None for k in slurm.SBATCH_OPTIONS}, {}) == text
    for script in ("slurm.sbatch", "sweep.sbatch", "mpirun.sh", "ci/slurm-up.sh", "ci/slurm-down.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True)


def test_generated_script(tmp_path, tiny_config):
    res = gen(tiny_config, "output.root=res", "train.lr=0.1", "--nodes", 2, "--ntasks-per-node", 2,
              "--cpus-per-task", 3, "--time", "01:30:00", "--partition", "gpu", "--account", "proj",
              "--launcher", "srun", "--sbatch-option=--gpus-per-node=2", "--overwrite", cwd=tmp_path)
    path = Path(res.stdout.split()[0])
    assert path == tmp_path / "res" / "tiny" / "job.sbatch" and path.stat().st_mode & 0o111
    text = path.read_text()
    assert sbatch_lines(text) == {
        "job-name": "tiny", "nodes": "2", "ntasks-per-node": "2", "cpus-per-task": "3", "time": "01:30:00",
        "partition": "gpu", "account": "proj", "output": f"{tmp_path}/res/tiny/slurm-%j.out", "open-mode": "append",
        "signal": "B:USR1@120", "gpus-per-node": "2"}
    assert "\n#SBATCH --requeue\n" in text
    for line in (f"CONFIG={tiny_config}", "OVERRIDES=(output.root=res train.lr=0.1)", "LAUNCHER=srun",
                 f"PYTHON={PY}", f"WORKDIR={tmp_path}", f"RUN_DIR={tmp_path}/res/tiny", "FIRST_RUN_ARGS=(--overwrite)"):
        assert f"\n{line}\n" in text, line
    subprocess.run(["bash", "-n", str(path)], check=True)
    # the body is the template's, untouched
    body = slurm.template_text().split("no edits needed below")[1]
    assert text.endswith(body)
    # the run directory is announced, and holding only job.sbatch it is no "existing run"
    assert gen(tiny_config, "output.root=res", "--print-run-dir", cwd=tmp_path).stdout.strip() == str(path.parent)
    gen(tiny_config, "output.root=res", "--ntasks-per-node", 2, cwd=tmp_path)


def test_user_errors_exit_2(tmp_path, tiny_config, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def run(*args):
        code = slurm.main_slurm([str(tiny_config), *map(str, args)])
        return code, capsys.readouterr().err

    cases = [
        (["train.lr=oops"], "train.lr"),
        (["world_size=4", "--nodes", "3"], "world_size=4"),
        (["world_size=4", "--ntasks-per-node", "3"], "world_size=4"),
        (["--time", "ten minutes"], "--time"),
        (["--nodes", "0"], "--nodes=0"),
        (["--partition", "a b"], "--partition"),
        (["--python", "/no/such/python"], "--python"),
    ]
    for args, needle in cases:
        code, err = run(*args)
        assert code == 2 and needle in err and "Traceback" not in err, (args, err)
    # a directory that holds a run needs --overwrite or --resume
    run_dir = tmp_path / "results" / "tiny"
    run_dir.mkdir(parents=True)
    (run_dir / "meta.json").write_text("{}")
    code, err = run("--ntasks-per-node", 2)
    assert code == 2 and "already holds a run" in err
    assert run("--ntasks-per-node", 2, "--resume")[0] == 0
    assert "\nFIRST_RUN_ARGS=(--resume)\n" in (run_dir / "job.sbatch").read_text()
    # --submit without SLURM's clients says so
    monkeypatch.setenv("PATH", "/nonexistent")
    code, err = run("--ntasks-per-node", 2, "--overwrite", "--submit")
    assert code == 2 and "sbatch not found" in err


def test_launcher_files_are_not_a_run(tmp_path):
    """job.sbatch and the SLURM log may wait in results/<name>/; --overwrite keeps them."""
    from communities.results import ResultsError, RunWriter

    run = tmp_path / "tiny"
    run.mkdir()
    (run / "job.sbatch").write_text("#!/bin/bash\n")
    (run / "slurm-12.out").write_text("log\n")
    RunWriter(run).close()
    (run / "meta.json").write_text("{}")
    with pytest.raises(ResultsError, match="already exists"):
        RunWriter(run)
    RunWriter(run, overwrite=True).close()
    assert sorted(p.name for p in run.iterdir()) == ["job.sbatch", "rounds", "slurm-12.out"]


# --------------------------------------------------------------------------- a real SLURM


def read_meta(run: Path) -> dict:
    return json.loads((run / "meta.json").read_text())


def say(capsys, text: str) -> None:
    """Into the test log even under ``pytest -q`` (CI shows the timings and the weight hashes)."""
    with capsys.disabled():
        print(text, flush=True)


@pytest.mark.slurm
def test_submit_runs_to_completion(slurm_cluster, tmp_path, tiny_config, capsys):  # noqa: F811
    """srun --mpi=pmi2 here; the preemption test runs under both launchers, the sweep under mpiexec."""
    c = slurm_cluster
    launcher = "srun"
    t0 = time.monotonic()
    res = gen(tiny_config, "output.root=results", "--ntasks-per-node", 4, "--time", "00:10:00",
              "--launcher", launcher, "--submit", cwd=tmp_path, env=c.env)
    script, job = res.stdout.split()
    assert job.isdigit() and Path(script) == tmp_path / "results" / "tiny" / "job.sbatch"
    [info] = c.wait_done(job, timeout=240)
    run = tmp_path / "results" / "tiny"
    log = (run / f"slurm-{job}.out").read_text()
    say(capsys, f"\n{launcher}: job {job} {info['JobState']} exit {info['ExitCode']} in {time.monotonic() - t0:.1f}s")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", log[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    meta = read_meta(run)
    assert meta["status"] == "complete" and meta["world_size"] == 4 and summary["units"] == 40
    assert (run / "consensus.pt").stat().st_size > 0
    assert "attempt 1 on " in log and "done: " in log
    assert ("srun --mpi=pmi2" in log) == (launcher == "srun")


@pytest.mark.slurm
@pytest.mark.parametrize("launcher", ["mpiexec", "srun"])
def test_preempted_job_is_requeued_and_resumes_bitwise(slurm_cluster, tmp_path, tiny_config, capsys,  # noqa: F811
                                                       launcher):
    """USR1 to the batch shell mid-run: checkpoint, scontrol requeue, a second attempt resumes;
    the consensus weights equal an uninterrupted run's bit for bit. Under srun --kill-on-bad-exit the first
    rank to exit 75 would end the step: every rank waits until rank 0 has committed the checkpoint."""
    c = slurm_cluster
    longer = ["train.budget=200", "train.steps_per_unit=8", "checkpoint.every=10"]
    t0 = time.monotonic()
    run_engine(4, tiny_config, tmp_path / "ref", *longer)  # the uninterrupted reference, plain mpiexec
    ref = tmp_path / "ref" / "tiny" / "consensus.pt"
    t_ref = time.monotonic() - t0

    res = gen(tiny_config, "output.root=results", *longer, "--ntasks-per-node", 4, "--time", "00:15:00",
              "--launcher", launcher, "--submit", cwd=tmp_path, env=c.env)
    job = res.stdout.split()[1]
    run = tmp_path / "results" / "tiny"
    log = run / f"slurm-{job}.out"

    # wait for a committed checkpoint while the job is still running, then signal the batch shell
    c.wait(job, lambda js: js[0].get("JobState") != "PENDING" and (run / "checkpoints" / "latest").exists(),
           timeout=300, what="a first checkpoint", poll=0.2)
    info = c.job(job)
    assert info["JobState"] == "RUNNING" and not (run / "summary.json").exists(), \
        f"the run ended before it could be interrupted ({info.get('JobState')}): lengthen it\n{log.read_text()[-2000:]}"
    c.cmd("scancel", "--signal=USR1", "--batch", job)
    t_sig = time.monotonic()

    # SLURM requeues the job: Restarts=1. A requeued job is held ~2 min (BeginTime); release it now.
    c.wait(job, lambda js: int(js[0].get("Restarts", 0)) >= 1, timeout=180, what="the requeue (Restarts >= 1)")
    t_requeue = time.monotonic() - t_sig
    first = log.read_text()
    assert "got SIGUSR1" in first and re.search(r"stopped at t=\d+, checkpoint written", first) \
        and "requeueing job" in first, \
        first[-3000:]
    stopped_at = int(re.search(r"stopped at t=(\d+)", first).group(1))
    assert 0 < stopped_at < 200
    # Release the hold only once slurmd has finished tearing down the first attempt (node idle, not
    # completing): a batch launch onto a node still cleaning up the same job id fails the job.
    c.wait(job, lambda js: js[0].get("JobState") in ("PENDING", "RUNNING", "COMPLETED") and c.node_idle(),
           timeout=180, what="the requeued job to be pending on an idle node")
    # slurmd refuses a batch credential created in the same second as (or before) the first attempt's revocation
    # ("Job credential revoked"; slurm_cred_revoked compares whole-second times), which is why SLURM holds a
    # requeued job for cred_expire. The revocation came before the node went idle: two seconds later is safe.
    time.sleep(2.5)
    if c.job(job).get("JobState") == "PENDING":
        c.cmd("scontrol", "update", f"JobId={job}", "StartTime=now", check=False)
    [info] = c.wait_done(job, timeout=300)
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
    got = run / "consensus.pt"
    say(capsys, f"{launcher}: sha256 uninterrupted {sha256(ref)}\n{launcher}: sha256 resumed       {sha256(got)}")
    assert weights_equal(ref, got)


@pytest.mark.slurm
def test_sweep_array_of_two_seeds(slurm_cluster, tmp_path, tiny_config, capsys):  # noqa: F811
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
    runs = sorted(p.name for p in (tmp_path / "results").iterdir())
    assert runs == ["tiny-seed0", "tiny-seed1"]
    for seed, name in enumerate(runs):
        run = tmp_path / "results" / name
        meta, cfg = read_meta(run), (run / "config.yaml").read_text()
        assert meta["status"] == "complete" and meta["world_size"] == 2 and (run / "summary.json").exists()
        assert re.search(rf"^seed: {seed}$", cfg, re.M) and (run / "job.sbatch").exists()
    assert not weights_equal(tmp_path / "results" / runs[0] / "consensus.pt",
                             tmp_path / "results" / runs[1] / "consensus.pt")
