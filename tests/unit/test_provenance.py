"""meta.json's provenance (the code's git commit, the command, the SLURM job, the versions) and run files that
honour the umask, checked on runs of the engine in this process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from communities.engine.loop import Engine
from communities.engine.state import provenance
from tests.helpers.mpi import ROOT
from tests.unit.test_disk_errors import world_
from tests.unit.test_engine_parts import make_cfg

pytestmark = pytest.mark.timeout(300)

SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_ARRAY_JOB_ID": "4240", "SLURM_ARRAY_TASK_ID": "2",
             "SLURM_RESTART_COUNT": "1", "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_JOB_PARTITION": "gpu",
             "SLURM_NTASKS": "8"}


def _run(root: Path, **overrides) -> Path:
    cfg = make_cfg(**{"output.root": str(root), "checkpoint.every": 4, **overrides})
    Engine(cfg, world_(), root / "tiny", progress=False, argv=["communities", "run", "x.yaml", "seed=3"]).run()
    return root / "tiny"


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_meta_json_says_which_code_command_job_and_versions(tmp_path, monkeypatch):
    for var, value in SLURM_ENV.items():
        monkeypatch.setenv(var, value)
    run = _run(tmp_path)
    meta = json.loads((run / "meta.json").read_text())
    # the code: this checkout's commit, and whether tracked files differ from it
    head = _git("rev-parse", "HEAD", cwd=ROOT)
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no", cwd=ROOT))
    assert meta["git"] == {"commit": head, "dirty": dirty, "root": str(ROOT)}
    assert meta["workdir_git"] is None or meta["workdir_git"]["root"] != str(ROOT)
    # the command line and the process
    assert meta["command"] == ["communities", "run", "x.yaml", "seed=3"]
    assert meta["executable"] == sys.executable and meta["cwd"] == os.getcwd()
    # the SLURM job, numbers as numbers; each writer's job too (a requeued job's attempts keep theirs)
    assert meta["slurm"] == {"job_id": 4242, "array_job_id": 4240, "array_task_id": 2, "restart_count": 1,
                             "nodelist": "node[01-02]", "partition": "gpu", "ntasks": 8}
    assert meta["writers"][0]["slurm_job_id"] == "4242"
    # hosts and versions
    import mpi4py
    import torch

    assert meta["hosts"] and meta["python"] == ".".join(map(str, sys.version_info[:3]))
    assert meta["torch"] == torch.__version__ and meta["mpi4py"] == mpi4py.__version__
    assert meta["mpi_library"] and "torch_cuda" in meta
    assert len(meta["run_id"]) == 16 and meta["status"] == "complete"


def test_outside_slurm_and_git_the_fields_are_null(tmp_path, monkeypatch):
    for var in list(os.environ):
        if var.startswith("SLURM_"):
            monkeypatch.delenv(var)
    assert provenance.slurm_job() is None
    assert provenance.git_state(tmp_path) is None  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert provenance.git_state(ROOT) is None


def test_git_state_of_a_checkout_clean_and_dirty(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / "model.py").write_text("x = 1\n")
    _git("add", "model.py", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "m", cwd=repo)
    head = _git("rev-parse", "HEAD", cwd=repo)
    (repo / "notes.txt").write_text("untracked files do not make it dirty\n")
    assert provenance.git_state(repo) == {"commit": head, "dirty": False, "root": str(repo)}
    (repo / "model.py").write_text("x = 2\n")
    assert provenance.git_state(repo / ".") == {"commit": head, "dirty": True, "root": str(repo)}
    # a run started from the user's own checkout records it beside the package's
    record = provenance.provenance(["x"], "MPI", cwd=repo)
    assert record["workdir_git"]["root"] == str(repo) and record["git"]["root"] == str(ROOT)


def test_run_files_honour_the_umask(tmp_path):
    """Files 0666 and directories 0777 less the umask, as plain open() and mkdir give: not mkstemp's 0600 or
    mkdtemp's 0700, which kept a run from the user's group."""
    old = os.umask(0o002)
    try:
        run = _run(tmp_path)
    finally:
        os.umask(old)
    entries = [p for p in run.rglob("*")]
    assert any(p.parent.name.startswith("round_") for p in entries) and any("checkpoints" in p.parts for p in entries)
    wrong = [(str(p.relative_to(run)), oct(p.stat().st_mode & 0o777)) for p in entries
             if p.stat().st_mode & 0o777 != (0o775 if p.is_dir() else 0o664)]
    assert not wrong, wrong


def test_atomic_writes_and_appends_follow_the_umask(tmp_path):
    from communities.results import RunWriter, atomic_write_bytes

    old = os.umask(0o077)
    try:
        atomic_write_bytes(tmp_path / "private.json", b"{}")
        os.umask(0o022)
        atomic_write_bytes(tmp_path / "shared.json", b"{}")
        w = RunWriter(tmp_path / "run")
        w.append_jsonl("metrics.jsonl", [{"t": 1}])
        import numpy as np

        w.write_round(0, np.zeros((2, 3)), np.zeros((1, 4)), np.zeros(2, dtype=np.int64), {"t": 1})
        w.close()
    finally:
        os.umask(old)
    mode = {p.name: p.stat().st_mode & 0o777 for p in [*tmp_path.iterdir(), *(tmp_path / "run").rglob("*")]}
    assert mode["private.json"] == 0o600 and mode["shared.json"] == 0o644
    assert mode["metrics.jsonl"] == 0o644 and mode["round_0000"] == 0o755 and mode["Z.npy"] == 0o644
    assert not list(tmp_path.rglob("*.tmp"))
