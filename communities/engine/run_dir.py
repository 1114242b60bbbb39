"""The run directory as the engine opens, resumes and closes it (rank 0 writes; every rank learns the outcome).

Opening is a collective step: rank 0 creates the directory (or, with
``--resume``, finds the last complete checkpoint that fits this job and rewinds
the logs to it) and every rank learns which checkpoint to load, so a refusal
stops every rank with the same message before anything trains.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import torch

from ..config import differences
from ..errors import ConfigError, ResultsError, RunComplete
from ..results import RunWriter, atomic_write_bytes, read_json, read_jsonl, repair_jsonl
from ..runtime.collective import collective_check
from ..runtime.comm import World
from ..workload import data
from . import checkpoint

STOP_FILE = "STOP"
LOGS = ("metrics.jsonl", "merges.jsonl", "consensus.jsonl", "examples.jsonl")


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


class RunDirectory:
    """``results/<name>/`` of one run: its writer (rank 0), ``meta.json``, and the checkpoint to resume from."""

    def __init__(self, cfg, world: World, path: Path):
        self.cfg, self.world, self.path = cfg, world, Path(path)
        self.writer: Optional[RunWriter] = None
        self.meta: dict = {}
        self.resumed_from: Optional[Path] = None

    def open(self, overwrite: bool, resume, partition: Callable[[], dict], argv: List[str], device: torch.device,
             n_params: int) -> Optional[Path]:
        """Create or continue the directory (a collective); returns the checkpoint every rank loads, or None.

        ``resume`` is False, True (``--resume``) or ``"auto"`` (a SLURM restart:
        resume if there is a checkpoint, else start over). ``partition`` gives
        ``partition.json``'s record; rank 0 calls it inside the collective check.
        """
        def open_writer():
            ckpt = self._find_checkpoint(resume) if resume else None
            if ckpt is None:
                fresh_over_partial = resume == "auto"  # requeued before any checkpoint: same job, start over
                w = RunWriter(self.path, overwrite=overwrite or fresh_over_partial)
                w.write_json("partition.json", partition())
            else:
                w = RunWriter(self.path, resume=True)
                self._rewind(checkpoint.read_info(ckpt)["t"])
            w.write_text("config.yaml", self.cfg.to_yaml())
            return w, ckpt

        opened = collective_check(self.world, open_writer)
        self.writer, ckpt = opened if self.world.rank == 0 else (None, None)
        name = self.world.bcast_text(ckpt.name if ckpt is not None else "")
        hosts = self.world.hostnames()
        if self.world.rank == 0:
            self._write_meta(name, hosts, argv, device, n_params)
        self.resumed_from = self.path / "checkpoints" / name if name else None
        return self.resumed_from

    def _write_meta(self, resumed_from: str, hosts: List[str], argv: List[str], device, n_params: int) -> None:
        import mpi4py
        import scipy

        from .. import __version__

        previous = read_json(self.path / "meta.json") if resumed_from and (self.path / "meta.json").exists() else {}
        self.meta = {
            "package_version": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "scipy": scipy.__version__, "mpi4py": mpi4py.__version__,
            "mpi_library": World.library_version(), "world_size": self.world.size, "hosts": sorted(set(hosts)),
            "device": str(device), "strategy": self.cfg.strategy, "n_params": int(n_params),
            "command": list(argv), "start_time": previous.get("start_time", now()), "end_time": None,
            "status": "running",
            "resumed": previous.get("resumed", []) + ([{"from": resumed_from, "at": now()}] if resumed_from else []),
        }
        self.writer.write_json("meta.json", self.meta)

    def _find_checkpoint(self, resume) -> Optional[Path]:
        """Rank 0: the last complete checkpoint, after checking it fits this job; None to start fresh."""
        summary = self.path / "summary.json"
        if summary.exists() and (self.path / "meta.json").exists() and \
                read_json(self.path / "meta.json").get("status") == "complete":
            raise RunComplete(f"{self.path} is already complete ({summary}); nothing to resume")
        ckpt = checkpoint.latest(self.path / "checkpoints")
        if ckpt is None:
            if resume == "auto":
                return None
            raise ResultsError(f"{self.path / 'checkpoints'}: no complete checkpoint to resume from")
        info = checkpoint.read_info(ckpt)
        if info.get("world_size") != self.world.size:
            raise ConfigError(f"cannot resume from {ckpt}: it was written by {info.get('world_size')} ranks, "
                              f"this job has {self.world.size}")
        if info.get("version") != checkpoint.VERSION:
            raise ConfigError(f"cannot resume from {ckpt}: it was written by another version of communities "
                              f"(checkpoint format {info.get('version', 1)}, this one reads {checkpoint.VERSION})")
        diffs = differences(info.get("config", {}), self.cfg.model_dump())
        if diffs:
            raise ConfigError(f"cannot resume from {ckpt}: the config differs: " + "; ".join(diffs))
        if info.get("final") and info["t"] >= self.cfg.train.budget:
            raise ConfigError(f"cannot resume from {ckpt}: it is the end of a {info['t']}-unit run; "
                              f"raise train.budget to continue training")
        return ckpt

    def _rewind(self, t: int) -> None:
        """Rank 0: drop log rows and rounds written after unit t (they will be redone identically)."""
        for name in LOGS:
            path = self.path / name
            repair_jsonl(path)
            rows = read_jsonl(path)
            kept = [r for r in rows if r["t"] <= t]
            if len(kept) != len(rows):
                atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        for d in (self.path / "rounds").glob("round_*"):
            info = d / "round.json"
            if not info.exists() or read_json(info)["t"] > t:
                shutil.rmtree(d)
        for stale in ("summary.json", "consensus.pt", STOP_FILE):
            (self.path / stale).unlink(missing_ok=True)

    def stop_file_present(self) -> bool:
        """Rank 0: ``RUN_DIR/STOP`` asks the run to stop at the next round."""
        return self.world.rank == 0 and (self.path / STOP_FILE).exists()

    def interrupted(self, t: int) -> None:
        """Rank 0, after the stop checkpoint: record the interruption and ask SLURM to requeue if configured."""
        if self.writer is None:
            return
        (self.path / STOP_FILE).unlink(missing_ok=True)
        self.meta.update(status="interrupted", end_time=now())
        self.writer.write_json("meta.json", self.meta)
        self.writer.close()
        job = os.environ.get("SLURM_JOB_ID")
        requeued = False
        if job and self.cfg.checkpoint.requeue and shutil.which("scontrol"):
            res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            requeued = res.returncode == 0
            if not requeued:
                print(f"communities: scontrol requeue {job} failed: {res.stderr.strip()}", file=sys.stderr)
        print(f"communities: stopped at t={t}, checkpoint written"
              + (f"; job {job} requeued" if requeued else "; continue with --resume"), flush=True)

    def complete(self) -> None:
        """Rank 0: the run finished."""
        if self.writer is None:
            return
        self.meta.update(end_time=now(), status="complete")
        self.writer.write_json("meta.json", self.meta)
        self.writer.close()


def describe_partition(replica) -> dict:
    """The ``partition.json`` record of a replica's dataset and shards."""
    ds = replica.dataset
    return data.describe(replica.shards, ds.y_train, replica.cfg.data.partition, len(ds.y_test))
