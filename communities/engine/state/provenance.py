"""Where a run came from, for ``meta.json``: the code's git commit, the SLURM job, the software's versions.

Rank 0 collects it once, when it opens the run directory (two or three ``git`` calls, about
10 ms; none where git or a checkout is missing). docs/reference/results-layout.md lists the fields.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Mapping, Optional

GIT_TIMEOUT_S = 10.0
PACKAGE_DIR = Path(__file__).resolve().parents[2]  # communities/
# SLURM's variables in a batch job (and in the ranks srun starts), as meta.json's ``slurm`` keys
SLURM_VARS = {"job_id": "SLURM_JOB_ID", "array_job_id": "SLURM_ARRAY_JOB_ID", "array_task_id": "SLURM_ARRAY_TASK_ID",
              "restart_count": "SLURM_RESTART_COUNT", "job_name": "SLURM_JOB_NAME", "nodelist": "SLURM_JOB_NODELIST",
              "partition": "SLURM_JOB_PARTITION", "account": "SLURM_JOB_ACCOUNT", "cluster": "SLURM_CLUSTER_NAME",
              "ntasks": "SLURM_NTASKS", "cpus_per_task": "SLURM_CPUS_PER_TASK", "gpus_on_node": "SLURM_GPUS_ON_NODE",
              "submit_dir": "SLURM_SUBMIT_DIR"}
NUMBERS = ("job_id", "array_job_id", "array_task_id", "restart_count", "ntasks", "cpus_per_task", "gpus_on_node")


def _git(directory: Path, *args: str) -> Optional[str]:
    try:
        res = subprocess.run(["git", "-C", str(directory), *args], capture_output=True, text=True,
                             timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def git_state(directory: Path) -> Optional[dict]:
    """``{"commit", "dirty", "root"}`` of the git checkout holding ``directory``; None outside one (or no git).

    ``dirty``: tracked files differ from the commit (untracked files do not count, as for ``git describe
    --dirty``); None when git could not tell.
    """
    root = _git(directory, "rev-parse", "--show-toplevel")
    commit = _git(directory, "rev-parse", "HEAD") if root else None
    if not root or not commit:
        return None
    status = _git(directory, "status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": None if status is None else bool(status), "root": root}


def slurm_job(env: Optional[Mapping[str, str]] = None) -> Optional[dict]:
    """The SLURM job this process runs in (job id, array index, restart count, nodes, ...); None outside one."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    out: Dict[str, object] = {}
    for key, var in SLURM_VARS.items():
        value = env.get(var)
        if value is None or value == "":
            continue
        out[key] = int(value) if key in NUMBERS and value.isdigit() else value
    return out


def versions(mpi_library: str) -> Dict[str, object]:
    """The versions that decide what a run computes: Python, torch (and its CUDA), numpy, scipy, mpi4py, MPI."""
    import mpi4py
    import numpy as np
    import scipy
    import torch

    from ... import __version__

    return {"package_version": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "numpy": np.__version__, "scipy": scipy.__version__,
            "mpi4py": mpi4py.__version__, "mpi_library": mpi_library}


def provenance(argv: List[str], mpi_library: str, cwd: Optional[Path] = None) -> Dict[str, object]:
    """meta.json's record of the code, the command, the job and the software (rank 0, once per attempt)."""
    cwd = Path.cwd() if cwd is None else cwd
    code = git_state(PACKAGE_DIR)
    work = git_state(cwd)
    if work is not None and code is not None and work["root"] == code["root"]:
        work = None  # the same checkout
    return {**versions(mpi_library), "command": list(argv), "executable": sys.executable, "cwd": str(cwd),
            "git": code, "workdir_git": work, "slurm": slurm_job()}
