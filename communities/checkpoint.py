"""Checkpoint files: per-rank states under ``checkpoints/uNNNNNNNN/``, committed collectively.

A checkpoint at unit t is complete only when every rank has written its file
(atomically) and rank 0, after a collective agreement, has written
``COMPLETE`` into the directory and pointed ``checkpoints/latest`` at it. Older
checkpoints are pruned only after that, so a crash at any moment leaves the last
complete checkpoint loadable. Files are read with ``torch.load(weights_only=True)``:
a checkpoint holds tensors and plain numbers only.
"""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Optional

import torch

from .results import ResultsError, atomic_write_bytes, atomic_write_json

LATEST = "latest"
COMPLETE = "COMPLETE"


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
