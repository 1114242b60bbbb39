"""Checkpoint files: per-rank states under ``checkpoints/uNNNNNNNN/``, committed collectively.

A checkpoint at unit t is complete only when every rank has written its file
(atomically) and rank 0, after a collective agreement, has written
``COMPLETE`` into the directory and pointed ``checkpoints/latest`` at it. Older
checkpoints are pruned only after that, so a crash at any moment leaves the last
complete checkpoint loadable. ``COMPLETE`` is also the manifest: the size and
BLAKE2b digest of every rank's file (communities/manifest.py), which each rank
checks before it loads its own, so a damaged file is found and another checkpoint
taken instead of a silently different resume. Files are read with
``torch.load(weights_only=True)``: a checkpoint holds tensors and plain numbers only.

A rank's file is ``{"version", "rank", "world_size", "t", "parts": {name:
part.state_dict()}}``: the engine's parts each own their state, so adding state
to a part needs no edit here.

A failed write (a full disk, ...) on any rank is a ``DiskError`` raised on every
rank: the unfinished directory is removed and the previous checkpoint stays in force.
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Callable, Dict, Hashable, List, Optional, Protocol, Tuple

import torch

from ...config import Config
from ...errors import DiskError, ResultsError, collective
from ...manifest import COMPLETE, LATEST, complete_dirs, entry, mismatch, rank_file, read_info, step_dir
from ...results import atomic_write_bytes, atomic_write_json, disk_error
from ...runtime.collective import on_every_rank
from ...runtime.view import WorldView
from . import blocks

__all__ = ["COMPLETE", "LATEST", "VERSION", "Checkpointer", "commit", "latest", "load_rank", "rank_file",
           "read_info", "save_rank", "step_dir", "verify_own"]

VERSION = 2  # 2: one state_dict per engine part (the manifest's digests came later, without a format change)


class Stateful(Protocol):
    """What a checkpointed part provides (torch's convention)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def serialize(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def save_rank(directory: Path, rank: int, state: dict, full: bool = False) -> dict:
    """Write one rank's file; returns its manifest entry (size and digest)."""
    data = serialize(state)
    atomic_write_bytes(rank_file(directory, rank), data, full=full)
    return entry(data)


def _deserialize(data: bytes) -> dict:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle opcodes, ...
        raise ResultsError(f"damaged checkpoint block ({type(exc).__name__}: {exc})") from None


def load_rank(directory: Path, rank: int, data: Optional[bytes] = None) -> dict:
    """One rank's state (from ``data``, the file's bytes already read and checked, when given).

    Without ``data`` the state is found wherever the checkpoint holds it: in the rank's own file, or in its
    process's block (a population), checked against the manifest; so a post-hoc reader needs no layout.
    """
    path = rank_file(directory, rank)
    if data is None and (Path(directory) / COMPLETE).exists():
        info = read_info(directory)
        held = blocks.holder(info, directory, rank)
        if held != path:
            return blocks.Block(held, (info.get("files") or {}).get(held.name), _deserialize).take(rank)
    try:
        if data is None:
            data = path.read_bytes()
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing from checkpoint {Path(directory).name}") from None
    except Exception as exc:  # truncated zip, bad pickle opcodes, ...
        raise ResultsError(f"{path}: damaged checkpoint file ({type(exc).__name__}: {exc})") from None


def verify_own(directory: Path, rank: int, shared: Optional[Callable[[Hashable, Callable[[], str]], str]] = None
               ) -> Tuple[str, Optional[bytes], bool]:
    """Check this rank's file against the manifest: (problem or "", its bytes when intact, whether it was checked).

    A checkpoint written before manifests existed cannot be checked: its bytes are returned unchecked. A rank
    whose state is in its process's block (blocks.py) gets no bytes (the load reads and checks the block); the
    block is checked once per process through ``shared`` (``world.shared``) where given.
    """
    path = rank_file(directory, rank)
    try:
        info = read_info(directory)
    except ResultsError as exc:
        return str(exc), None, False
    held = blocks.holder(info, directory, rank)
    if held != path:
        def check() -> str:
            return blocks.verify(held, (info.get("files") or {}).get(held.name))
        return (check() if shared is None else shared(("checked block", str(held)), check)), None, True
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return f"{path}: missing from checkpoint {Path(directory).name}", None, False
    except OSError as exc:
        return f"{path}: unreadable ({exc.strerror or exc})", None, False
    files = info.get("files")
    if files is None:
        return "", data, False
    expected = files.get(path.name)
    if expected is None:
        return f"{path}: not in the manifest of {Path(directory) / COMPLETE}", None, False
    why = mismatch(data, expected)
    if why is not None:
        return f"{path}: damaged checkpoint file ({why})", None, True
    return "", data, True


def commit(root: Path, t: int, info: dict, keep: int = 1) -> None:
    """Rank 0, after every rank confirmed its file: mark complete, move ``latest``, prune older ones."""
    directory = step_dir(root, t)
    atomic_write_json(directory / COMPLETE, info)
    atomic_write_bytes(Path(root) / LATEST, (directory.name + "\n").encode())
    complete = sorted(complete_dirs(root))
    for old in complete[: max(0, len(complete) - 1 - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    for partial in Path(root).glob("u*"):  # abandoned, never-completed attempts older than this one
        if partial.is_dir() and not (partial / COMPLETE).exists() and partial.name < directory.name:
            shutil.rmtree(partial, ignore_errors=True)


def latest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint directory, or None."""
    found = complete_dirs(root)
    return found[0] if found else None


def _discard(directory: Path) -> None:
    """Rank 0: remove a checkpoint directory that was never committed (a failed save leaves nothing behind)."""
    if directory.is_dir() and not (directory / COMPLETE).exists():
        shutil.rmtree(directory, ignore_errors=True)


class Checkpointer:
    """Saves and restores ``{name: part.state_dict()}`` for every part of one rank's engine.

    ``failure`` (rank 0) returns the run writer's recorded disk error, if any: a
    checkpoint is a collective step, so it is where every rank learns of it.
    """

    def __init__(self, cfg: Config, world: WorldView, root: Path, *, parts: Dict[str, Stateful],
                 before_save: Callable[[], None], info: Callable[[], dict],
                 failure: Callable[[], Optional[DiskError]] = lambda: None, faults=None):
        self.cfg, self.world, self.root, self.parts = cfg, world, Path(root), parts
        self.faults = faults  # fault injection (faults.kill_in: checkpoint)
        self._before_save, self._info, self._failure = before_save, info, failure
        self.full = False  # fault injection (faults.disk_full_at): rank files fail as on a full disk

    def due(self, t: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and t % every == 0 and t < self.cfg.train.budget

    def save(self, t: int, final: bool = False) -> None:
        """Every rank writes its file; rank 0 commits once all succeeded. DiskError on every rank if any failed."""
        self._before_save()
        world, rank = self.world, self.world.rank
        own_t = t  # each rank's file keeps its own unit (under async the ranks are at different units) ...
        if self.cfg.protocol == "async":  # ... and the directory is named by the furthest one, the same on all
            t = int(world.allreduce_scalar(float(t), "max"))
        directory = step_dir(self.root, t)
        earlier = self._failure()
        if len(world.process_block) > 1:  # a population: the process's replicas in one file (blocks.py)
            status = self._save_block(directory, own_t, "" if earlier is None else "disk " + str(earlier))
        elif earlier is not None:
            status = "disk " + str(earlier)
        else:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                status = "ok " + json.dumps(save_rank(directory, rank, {
                    "version": VERSION, "rank": rank, "world_size": world.size, "t": own_t,
                    "parts": {name: part.state_dict() for name, part in self.parts.items()}}, full=self.full))
            except OSError as exc:
                status = "disk " + str(disk_error(rank_file(directory, rank), exc))
        statuses = world.allgather_text(status, width=1024)
        failed = [(r, s[5:]) for r, s in enumerate(statuses) if s.startswith("disk ")]
        if failed:
            if world.leads:
                _discard(directory)
            raise collective(DiskError(_failures(failed, t)))
        if self.faults is not None:
            self.faults.in_checkpoint(t)
        problem = ""
        if world.leads:
            files, ranks = blocks.manifest(statuses, world.alive)  # (fault_tolerance shrink: the survivors' files)
            try:
                commit(self.root, t, {"version": VERSION, "t": t, "final": final, "world_size": world.size,
                                      **self._info(), "config": self.cfg.model_dump(), "files": files,
                                      **({"ranks": ranks} if ranks else {})},
                       keep=self.cfg.checkpoint.keep)
            except OSError as exc:
                problem = _failures([(0, str(disk_error(directory / COMPLETE, exc)))], t)
                shutil.rmtree(directory, ignore_errors=True)  # not committed: the previous one stays in force
        problem = world.bcast_text(problem)
        if problem:
            raise collective(DiskError(problem))

    def _save_block(self, directory: Path, own_t: int, failed: str) -> str:
        """This replica's state written with its process's others, as one file (``blocks.write``); its status."""
        world = self.world
        state = {"version": VERSION, "rank": world.rank, "world_size": world.size, "t": own_t,
                 "parts": {name: part.state_dict() for name, part in self.parts.items()}}

        def write(items: List[tuple]) -> List[str]:
            return blocks.write(directory, items, world_size=world.size, serialize=serialize)

        return world.together(("checkpoint", own_t), (world.rank, state, failed, self.full), write)

    def load(self, directory: Path, data: Optional[bytes] = None) -> int:
        """Load this rank's file into every part (a collective); returns the unit it was written after."""
        rank, n = self.world.rank, self.world.size

        def read() -> dict:
            path = rank_file(directory, rank)
            held = blocks.holder(read_info(directory), directory, rank)
            if held == path:
                saved = load_rank(directory, rank, data)
            else:  # in a block: read and checked once per process, each replica takes its own state
                expected = (read_info(directory).get("files") or {}).get(held.name)
                saved = self.world.shared(("checkpoint block", str(held)),
                                          lambda: blocks.Block(held, expected, _deserialize)).take(rank)
                path = held
            if not isinstance(saved, dict) or saved.get("version") != VERSION or saved.get("rank") != rank \
                    or saved.get("world_size") != n:
                got = saved if isinstance(saved, dict) else {}
                raise ResultsError(f"{path}: written for rank {got.get('rank')} of {got.get('world_size')} "
                                   f"(format {got.get('version', 1)}); this is rank {rank} of {n} (format {VERSION})")
            for name, part in self.parts.items():
                try:
                    part.load_state_dict(saved["parts"][name])
                except (KeyError, ValueError, RuntimeError) as exc:
                    raise ResultsError(f"{path}: cannot restore {name}: {exc}") from exc
            return saved

        return int(on_every_rank(self.world, read)["t"])


def _failures(failed: List[Tuple[int, str]], t: int) -> str:
    """One message for the ranks whose checkpoint write failed (they share one filesystem: usually the same)."""
    first = failed[0][1]
    more = f" (and on {len(failed) - 1} other rank{'s' if len(failed) > 2 else ''})" if len(failed) > 1 else ""
    return f"{first}{more}; the checkpoint at t={t} was not written"
