"""Checkpoint files: per-rank states under ``checkpoints/uNNNNNNNN/``, committed collectively.

A checkpoint at unit t is complete only when every rank has written its file
(atomically) and rank 0, after a collective agreement, has written
``COMPLETE`` into the directory and pointed ``checkpoints/latest`` at it. Older
checkpoints are pruned only after that, so a crash at any moment leaves the last
complete checkpoint loadable. Files are read with ``torch.load(weights_only=True)``:
a checkpoint holds tensors and plain numbers only.

A rank's file is ``{"version", "rank", "world_size", "t", "parts": {name:
part.state_dict()}}``: the engine's parts each own their state, so adding state
to a part needs no edit here.
"""
from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path
from typing import Callable, Dict, Optional, Protocol

import torch

from ..errors import ResultsError
from ..results import atomic_write_bytes, atomic_write_json
from ..runtime.collective import on_every_rank
from ..runtime.comm import World

LATEST = "latest"
COMPLETE = "COMPLETE"
VERSION = 2  # 2: one state_dict per engine part


class Stateful(Protocol):
    """What a checkpointed part provides (torch's convention)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def step_dir(root: Path, t: int) -> Path:
    return Path(root) / f"u{t:08d}"


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.pt"


def save_rank(directory: Path, rank: int, state: dict) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(rank_file(directory, rank), buf.getvalue())


def load_rank(directory: Path, rank: int) -> dict:
    path = rank_file(directory, rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing from checkpoint {directory.name}") from None
    except Exception as exc:  # truncated zip, bad pickle opcodes, ...
        raise ResultsError(f"{path}: damaged checkpoint file ({type(exc).__name__}: {exc})") from None


def commit(root: Path, t: int, info: dict, keep: int = 1) -> None:
    """Rank 0, after every rank confirmed its file: mark complete, move ``latest``, prune older ones."""
    directory = step_dir(root, t)
    atomic_write_json(directory / COMPLETE, info)
    atomic_write_bytes(Path(root) / LATEST, (directory.name + "\n").encode())
    complete = sorted(p for p in Path(root).glob("u*") if p.is_dir() and (p / COMPLETE).exists())
    for old in complete[: max(0, len(complete) - 1 - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    for partial in Path(root).glob("u*"):  # abandoned, never-completed attempts older than this one
        if partial.is_dir() and not (partial / COMPLETE).exists() and partial.name < directory.name:
            shutil.rmtree(partial, ignore_errors=True)


def latest(root: Path) -> Optional[Path]:
    """The newest complete checkpoint directory, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.exists():
        name = pointer.read_text(encoding="utf-8", errors="replace").strip()
        candidate = root / name
        if name and (candidate / COMPLETE).exists():
            return candidate
    complete = sorted(p for p in root.glob("u*") if p.is_dir() and (p / COMPLETE).exists())
    return complete[-1] if complete else None


def read_info(directory: Path) -> dict:
    path = Path(directory) / COMPLETE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: damaged checkpoint marker ({exc})") from None


class Checkpointer:
    """Saves and restores ``{name: part.state_dict()}`` for every part of one rank's engine."""

    def __init__(self, cfg, world: World, root: Path, parts: Dict[str, Stateful], before_save: Callable[[], None],
                 info: Callable[[], dict]):
        self.cfg, self.world, self.root, self.parts = cfg, world, Path(root), parts
        self._before_save, self._info = before_save, info

    def due(self, t: int) -> bool:
        every = self.cfg.checkpoint.every
        return bool(every) and t % every == 0 and t < self.cfg.train.budget

    def save(self, t: int, final: bool = False) -> bool:
        """Every rank writes its file; rank 0 commits once all succeeded. False: the previous one stays in force."""
        self._before_save()
        directory = step_dir(self.root, t)
        ok, err = 1.0, ""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            save_rank(directory, self.world.rank, {
                "version": VERSION, "rank": self.world.rank, "world_size": self.world.size, "t": t,
                "parts": {name: part.state_dict() for name, part in self.parts.items()}})
        except OSError as exc:
            ok, err = 0.0, str(exc)
        all_ok = self.world.allreduce_scalar(ok, "min") > 0
        if err:
            print(f"communities: rank {self.world.rank} could not write its checkpoint at t={t}: {err}",
                  file=sys.stderr)
        if not all_ok:
            if self.world.rank == 0:
                print(f"communities: checkpoint at t={t} incomplete; the previous one stays in force", file=sys.stderr)
            return False
        if self.world.rank == 0:
            commit(self.root, t, {"version": VERSION, "t": t, "final": final, "world_size": self.world.size,
                                  **self._info(), "config": self.cfg.model_dump()}, keep=self.cfg.checkpoint.keep)
        return True

    def load(self, directory: Path) -> int:
        """Load this rank's file into every part (a collective); returns the unit it was written after."""
        rank, n = self.world.rank, self.world.size

        def read() -> dict:
            saved = load_rank(directory, rank)
            path = rank_file(directory, rank)
            if saved.get("version") != VERSION or saved.get("rank") != rank or saved.get("world_size") != n:
                raise ResultsError(f"{path}: written for rank {saved.get('rank')} of {saved.get('world_size')} "
                                   f"(format {saved.get('version', 1)}); this is rank {rank} of {n} (format {VERSION})")
            for name, part in self.parts.items():
                try:
                    part.load_state_dict(saved["parts"][name])
                except (KeyError, ValueError, RuntimeError) as exc:
                    raise ResultsError(f"{path}: cannot restore {name}: {exc}") from exc
            return saved

        return int(on_every_rank(self.world, read)["t"])
