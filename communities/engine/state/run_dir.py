"""The run directory as the engine opens, resumes and closes it (rank 0 writes; every rank learns the outcome).

Opening is a collective step:

1. rank 0 takes the directory's lock (communities/runlock.py) before anything in
   it is deleted or written, so a second run on it is refused, naming the holder;
2. with ``--resume``, every rank checks its own file of each complete checkpoint,
   newest first, against the checkpoint's manifest; the newest one intact on
   every rank is taken, and damaged newer ones are moved to ``checkpoints/damaged/``
   with a message (none intact: an error naming the files);
3. rank 0 creates the directory, or checks that the checkpoint fits this job and
   rewinds the logs to it.

So a refusal stops every rank with the same message before anything trains. The
lock is held until the run ends (``complete``, ``interrupted`` or ``failed``).
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import shutil
import socket
import subprocess
import uuid
from enum import Enum
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ...config import Config, differences
from ...errors import ConfigError, DiskError, ResultsError, RunComplete, collective
from ...manifest import DAMAGED, LATEST, complete_dirs
from ...results import RunWriter, atomic_write_bytes, read_json, read_jsonl, repair_jsonl
from ...runlock import RunLock
from ...runtime.collective import collective_check
from ...runtime.launcher import library_version
from ...runtime.view import WorldView
from ...workload import data
from . import checkpoint, provenance

log = logging.getLogger(__name__)

STOP_FILE = "STOP"
TAKEOVER_WAIT_S = 10.0  # how long a new writer waits for the lost writer's lock (the kernel frees it at exit)
LOGS = ("metrics.jsonl", "merges.jsonl", "consensus.jsonl", "examples.jsonl")


class Resume(Enum):
    """How ``RunDirectory.open`` treats an existing run: start it, continue it, or continue it if it can."""

    FRESH = "fresh"  # a new run (``--overwrite`` to replace one)
    RESUME = "resume"  # ``--resume``: from the newest intact checkpoint; none is an error
    AUTO = "auto"  # a SLURM restart: resume if there is a checkpoint, else start over

    @classmethod
    def of(cls, flag: bool, restart_count: int) -> "Resume":
        """The command line's ``--resume`` and SLURM's ``SLURM_RESTART_COUNT``, as one value."""
        return cls.RESUME if flag else (cls.AUTO if restart_count > 0 else cls.FRESH)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def by_rank(bad: List[Tuple[int, str]], size: int) -> str:
    """``rank 1: msg; ranks 2, 3: msg`` (one message when every rank says the same)."""
    groups: Dict[str, List[int]] = {}
    for r, m in bad:
        groups.setdefault(m, []).append(r)
    if len(groups) == 1 and len(bad) == size:
        return next(iter(groups))
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {m}" for m, rs in groups.items())


class RunDirectory:
    """``results/<name>/`` of one run: its lock and writer (rank 0), ``meta.json``, and the checkpoint to resume."""

    def __init__(self, cfg: Config, world: WorldView, path: Path):
        self.cfg, self.world, self.path = cfg, world, Path(path)
        self.writer: Optional[RunWriter] = None
        self.lock: Optional[RunLock] = None
        self.meta: dict = {}
        self.resumed_from: Optional[Path] = None
        self.resume_data: Optional[bytes] = None  # this rank's file of ``resumed_from``, read and checked

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def open(self, overwrite: bool, resume: Resume, partition: Callable[[], dict], argv: List[str],
             device: torch.device, *, n_params: int) -> Optional[Path]:
        """Lock, then create or continue the directory (a collective); returns the checkpoint every rank loads.

        ``partition`` gives ``partition.json``'s record; rank 0 calls it inside the collective check.
        """
        try:
            return self._open(overwrite, resume, partition, argv, device, n_params=n_params)
        except BaseException:
            self.release()
            raise

    def _open(self, overwrite: bool, resume: Resume, partition: Callable[[], dict], argv: List[str],
              device: torch.device, *, n_params: int) -> Optional[Path]:
        w = self.world

        def lock_and_list() -> str:
            self.lock = RunLock(self.path)
            note = self.lock.acquire(argv)
            if note:
                log.info(note)
            if resume is Resume.FRESH:
                return ""
            self._refuse_complete()
            found = complete_dirs(self.checkpoints)
            if not found and resume is Resume.RESUME:
                raise ResultsError(f"{self.checkpoints}: no complete checkpoint to resume from")
            return "\n".join(p.name for p in found)

        names = [n for n in w.bcast_text(collective_check(w, lock_and_list)).split("\n") if n]
        chosen, damaged = self._choose(names)
        if names and chosen is None:
            detail = "; ".join(f"{name}: {why}" for name, why in damaged)
            raise collective(ResultsError(
                f"no intact checkpoint to resume from in {self.checkpoints}: {detail}. Nothing was changed; "
                "--overwrite starts the run over (deleting them)"))

        def open_writer() -> RunWriter:
            if chosen is None:
                fresh_over_partial = resume is Resume.AUTO  # requeued before any checkpoint: same job, start over
                writer = RunWriter(self.path, overwrite=overwrite or fresh_over_partial)
                writer.write_json("partition.json", partition())
            else:
                ckpt = self.checkpoints / chosen
                info = checkpoint.read_info(ckpt)
                self._check_fits(ckpt, info)
                writer = RunWriter(self.path, resume=True)
                if damaged:
                    self._set_aside(writer, damaged, chosen, info["t"])
                writer.guard(self.path, lambda: self.rewind(info["t"]), "rewind the logs in")
                writer.sweep()  # temporaries of the run that stopped (it is gone: this run holds the lock)
            writer.write_text("config.yaml", self.cfg.to_yaml())
            return writer

        self.writer = collective_check(w, open_writer)
        hosts = w.hostnames()
        collective_check(w, lambda: self._write_meta(chosen or "", hosts, argv, device, n_params))
        if self.writer is not None:
            self.writer.defer_errors()  # from here on rank 0 must not stop alone: the engine shares failures
        self.resumed_from = self.checkpoints / chosen if chosen else None
        return self.resumed_from

    def _choose(self, names: List[str]) -> Tuple[Optional[str], List[Tuple[str, str]]]:
        """Every rank checks its own file of each checkpoint, newest first; the first intact everywhere is taken."""
        w = self.world
        damaged: List[Tuple[str, str]] = []
        for name in names:
            problem, data_, checked = checkpoint.verify_own(self.checkpoints / name, w.rank, w.shared)
            said = w.allgather_text(problem, width=1024)
            bad = [(r, m) for r, m in enumerate(said) if m]
            if not bad:
                self.resume_data = data_
                if w.leads and not checked:
                    log.info(f"communities: checkpoint {name} has no checksums (written by an older version); "
                             "loading it unchecked")
                return name, damaged
            damaged.append((name, by_rank(bad, w.size)))
        return None, damaged

    def _set_aside(self, writer: RunWriter, damaged: List[Tuple[str, str]], chosen: str, t: int) -> None:
        """Rank 0: move damaged newer checkpoints to ``checkpoints/damaged/`` (kept, out of the way), and say so."""
        for name, why in damaged:
            target = self.checkpoints / DAMAGED / name
            k = 1
            while target.exists():
                target = self.checkpoints / DAMAGED / f"{name}.{k}"
                k += 1
            src = self.checkpoints / name

            def move(src: Path = src, target: Path = target) -> None:
                target.parent.mkdir(exist_ok=True)
                os.replace(src, target)

            writer.guard(target, move, "move a checkpoint to")
            log.info(f"communities: checkpoint {name} is damaged ({why}); moved to {target}")
        pointer = self.checkpoints / LATEST
        writer.guard(pointer, lambda: atomic_write_bytes(pointer, (chosen + "\n").encode()))
        log.info(f"communities: falling back to checkpoint {chosen} (t={t}), the newest intact one")

    def _write_meta(self, resumed_from: str, hosts: List[str], argv: List[str], device, n_params: int) -> None:
        previous = read_json(self.path / "meta.json") if resumed_from and (self.path / "meta.json").exists() else {}
        why = f"resumed from {resumed_from}" if resumed_from else "started the run"
        self.meta = {
            **provenance.provenance(argv, library_version()),
            "run_id": previous.get("run_id") or uuid.uuid4().hex[:16],
            "world_size": self.world.size, "hosts": sorted(set(hosts)), "device": str(device),
            "strategy": self.cfg.strategy, "n_params": int(n_params),
            "start_time": previous.get("start_time", now()), "end_time": None, "status": "running",
            "resumed": previous.get("resumed", []) + ([{"from": resumed_from, "at": now()}] if resumed_from else []),
            "writers": previous.get("writers", []) + [self._writer_entry(why)],
        }
        assert self.writer is not None  # rank 0
        self.writer.write_json("meta.json", self.meta)

    def _writer_entry(self, why: str) -> dict:
        """``meta.json``'s record of a writer: which rank, which process (and SLURM job), since when, and why."""
        entry = {"rank": int(self.world.rank), "host": socket.gethostname(), "pid": os.getpid(), "at": now(),
                 "why": why}
        job = os.environ.get("SLURM_JOB_ID")
        if job:
            entry["slurm_job_id"] = job
        return entry

    def take_over(self, t: int, lost: List[int], argv: List[str]) -> None:
        """The new lead, when the writer was lost (``comm.fault_tolerance: shrink``): it becomes the writer.

        The kernel dropped the dead writer's ``flock`` with its process, so the lock is taken as a killed run's
        is. One still held means the writer reported lost is alive (the failure detector was wrong): two
        writers must never share a directory, so that is ``RunLocked``, and the survivors stop. The partial
        rows the dead writer left are finished or dropped by the rewind to ``t`` that follows (as for any loss),
        its temporaries are swept, and ``meta.json`` names the new writer. Idempotent.
        """
        if self.writer is not None:
            return
        lock = RunLock(self.path)
        note = lock.acquire(argv, wait=TAKEOVER_WAIT_S)
        self.lock = lock
        if note:
            log.debug(note)
        writer = RunWriter(self.path, resume=True)
        writer.sweep()
        for name in LOGS + ("views.jsonl",):  # a line the writer was appending when it died
            repair_jsonl(self.path / name)
        self.meta = read_json(self.path / "meta.json")
        self.meta.setdefault("writers", []).append(
            self._writer_entry(f"writer rank {min(lost)} lost" + (f" (with ranks {', '.join(map(str, lost[1:]))})"
                                                                   if len(lost) > 1 else "")
                               + f"; survivors went on from t={t}"))
        writer.write_json("meta.json", self.meta)
        writer.defer_errors()
        self.writer = writer

    def _refuse_complete(self) -> None:
        summary = self.path / "summary.json"
        if summary.exists() and (self.path / "meta.json").exists() and \
                read_json(self.path / "meta.json").get("status") == "complete":
            raise RunComplete(f"{self.path} is already complete ({summary}); nothing to resume")

    def _check_fits(self, ckpt: Path, info: dict) -> None:
        """Rank 0: the checkpoint was written by a job like this one (world size, format, config)."""
        if info.get("world_size") != self.world.size:
            raise ConfigError(f"cannot resume from {ckpt}: it was written by {info.get('world_size')} ranks, "
                              f"this job has {self.world.size}")
        if info.get("version") != checkpoint.VERSION:
            raise ConfigError(f"cannot resume from {ckpt}: it was written by another version of communities "
                              f"(checkpoint format {info.get('version', 1)}, this one reads {checkpoint.VERSION})")
        diffs = differences(info.get("config", {}), self.cfg.model_dump())
        if diffs:
            raise ConfigError(f"cannot resume from {ckpt}: the config differs: " + "; ".join(diffs))
        # A final checkpoint at the budget resumes only to finish a run whose end was not written (a full disk).
        if info.get("final") and info["t"] > self.cfg.train.budget:
            raise ConfigError(f"cannot resume from {ckpt}: it is the end of a {info['t']}-unit run; "
                              f"raise train.budget to continue training")

    def rewind(self, t: int, lost: bool = False) -> None:
        """Rank 0: drop log rows and rounds written after unit t (they will be redone identically).

        ``lost``: the survivors of a lost rank go back to t (fault_tolerance shrink): checkpoints committed
        after t are dropped too (the run that wrote them had the lost rank), and a STOP file stays.
        """
        if self.writer is not None:
            self.writer.close()  # its appends reopen the files: a log rewritten below is a new file (a new inode)
        if lost:
            for d in self.checkpoints.glob("u*"):
                if d.is_dir() and d.name[1:].isdigit() and int(d.name[1:]) > t:
                    shutil.rmtree(d, ignore_errors=True)
            found = complete_dirs(self.checkpoints)
            if found:
                atomic_write_bytes(self.checkpoints / LATEST, (found[0].name + "\n").encode())
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
        for stale in ("summary.json", "consensus.pt") + (() if lost else (STOP_FILE,)):
            (self.path / stale).unlink(missing_ok=True)

    # ------------------------------------------------------------------ during the run

    @property
    def failure(self) -> Optional[DiskError]:
        """Rank 0: the first write that failed since the run started training (None elsewhere)."""
        return self.writer.failure if self.writer is not None else None

    def stop_file_present(self) -> bool:
        """Rank 0: ``RUN_DIR/STOP`` asks the run to stop at the next round."""
        return self.world.leads and (self.path / STOP_FILE).exists()

    # ------------------------------------------------------------------ the end

    def interrupted(self, t: int) -> None:
        """Rank 0, after the stop checkpoint: record the interruption and ask SLURM to requeue if configured."""
        if self.writer is None:
            return
        try:
            (self.path / STOP_FILE).unlink(missing_ok=True)
        except OSError:
            pass
        self.meta.update(status="interrupted", end_time=now())
        self.writer.write_json("meta.json", self.meta)
        self.writer.close()
        self.release()
        job = os.environ.get("SLURM_JOB_ID")
        requeued = False
        if job and self.cfg.checkpoint.requeue and shutil.which("scontrol"):
            res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            requeued = res.returncode == 0
            if not requeued:
                log.warning(f"communities: scontrol requeue {job} failed: {res.stderr.strip()}")
        log.info(f"communities: stopped at t={t}, checkpoint written"
                 + (f"; job {job} requeued" if requeued else "; continue with --resume"))

    def complete(self, files: Optional[dict] = None) -> None:
        """Rank 0: the run finished; ``files`` are the manifest entries of its products (``consensus.pt``)."""
        if self.writer is None:
            return
        if self.writer.failure is None:
            self.meta.update(end_time=now(), status="complete")
            if files:
                self.meta["files"] = files
            self.writer.write_json("meta.json", self.meta)
        self.writer.close()
        if self.writer.failure is None:
            self.release()

    def failed(self, exc: DiskError, t: int) -> DiskError:
        """Rank 0, when a write failed: no temporaries left, ``meta.json`` says why, the lock released.

        Returns the error to report, with what to do next (the other ranks keep theirs: only rank 0 prints).
        """
        if self.writer is None:
            return exc
        w = self.writer
        w.full = False  # fault injection: the disk "has room" again once the failed writes are cleaned up
        w.close()
        w.sweep()
        w.failure, reason = None, str(exc)
        self.meta.update(status="failed", end_time=now(), reason=reason)
        w.defer_errors()
        wrote = w.write_json("meta.json", self.meta) or json_in_place(self.path / "meta.json", self.meta)
        self.release()
        found = complete_dirs(self.checkpoints)
        last = f"its last complete checkpoint {found[0].name} is intact" if found else "it has no checkpoint yet"
        tail = (f"The run stopped at t={t}; {last}. Free some space, then continue with --resume"
                if found else f"The run stopped at t={t}; {last}. Free some space, then start it again (--overwrite)")
        if not wrote:
            tail += f" ({self.path / 'meta.json'} could not be updated: it still says 'running')"
        err = DiskError(f"{reason}. {tail}")
        collective(err)
        return err

    def release(self) -> None:
        """Rank 0: give the directory's lock back (idempotent)."""
        if self.lock is not None:
            self.lock.release()


def json_in_place(path: Path, obj: dict) -> bool:
    """On a disk with no room for a new file, overwrite a JSON file's own blocks (meta.json only grows by a line)."""
    try:
        data = (json.dumps(obj, indent=2) + "\n").encode()
        with open(path, "r+b") as fh:
            fh.write(data)
            fh.truncate()
            fh.flush()
            os.fsync(fh.fileno())
        return True
    except OSError:
        return False


def describe_partition(replica) -> dict:
    """The ``partition.json`` record of a replica's dataset and shards."""
    ds = replica.data.dataset
    kind = data.SHARDED if ds.sharded else replica.cfg.data.partition
    return data.describe(replica.data.shards, ds.y_train, kind, len(ds.y_test), replica.data.label_counts,
                         local_test_sizes=replica.data.local_test_sizes, shift=replica.cfg.data.shift, text=ds.text,
                         n_groups=replica.cfg.data.groups)
