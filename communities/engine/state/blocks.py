"""A process's replicas checkpointed as one file (a population): one write and one fsync per process, not per replica.

A process hosting several replicas writes their per-rank states (each the dict a rank's own file holds) into
``blockNNNNN.pt`` (named by its first rank), ``{"version", "world_size", "ranks": {rank: state}}``. The
checkpoint's ``COMPLETE`` lists each file once in ``files`` and, for every rank whose state is in a block,
``ranks: {rank: file}``; a rank not listed there is in its own ``rankNNNNN.pt``, as a process of one replica
writes it. A resume on any number of processes finds each rank's state through that map, so the placement may
change; a process reads and checks each file it needs once (``world.shared``), and each replica takes its own
state out of it (so the rest is freed as they go).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

from ...errors import ResultsError
from ...manifest import entry, file_mismatch, mismatch, rank_file
from ...results import atomic_write_bytes, disk_error


def block_file(directory: Path, first: int) -> Path:
    return Path(directory) / f"block{first:05d}.pt"


def holder(info: dict, directory: Path, rank: int) -> Path:
    """The file of ``directory`` that holds ``rank``'s state (its block's, or its own)."""
    name = (info.get("ranks") or {}).get(str(rank))
    return Path(directory) / name if isinstance(name, str) else rank_file(directory, rank)


def write(directory: Path, items: List[Tuple[int, dict, str, bool]], *, world_size: int,
          serialize: Callable[[dict], bytes]) -> List[str]:
    """Write the states of ``items`` ((rank, state, a failure already known or "", whether its disk is "full":
    fault injection), in block order) as one file; each item's status as ``Checkpointer.save`` gathers it:
    "ok {file, bytes, blake2b}" or "disk why"."""
    path = block_file(directory, items[0][0])
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        data = serialize({"version": items[0][1]["version"], "world_size": world_size,
                          "ranks": {rank: state for rank, state, _, _ in items}})
        atomic_write_bytes(path, data, full=any(full for *_, full in items))
        ok = "ok " + json.dumps({"file": path.name, **entry(data)})
    except OSError as exc:
        ok = "disk " + str(disk_error(path, exc))
    return [failed or ok for _, _, failed, _ in items]


def manifest(statuses: List[str], alive: Any) -> Tuple[Dict[str, dict], Dict[str, str]]:
    """From the gathered "ok ..." statuses: (files: {name: entry}, ranks: {rank: block file}) of the ranks alive,
    a block listed once; a rank in a file of its own (an entry without "file") is not in ``ranks``."""
    files: Dict[str, dict] = {}
    ranks: Dict[str, str] = {}
    for r, s in enumerate(statuses):
        if not alive[r]:
            continue
        got = json.loads(s[3:])
        name = got.pop("file", None)
        if name is None:
            files[rank_file(Path("."), r).name] = got
        else:
            files[name] = got
            ranks[str(r)] = name
    return files, ranks


def verify(path: Path, expected: Optional[dict]) -> str:
    """Why the block file ``path`` is not what the manifest lists ("" when it is)."""
    if expected is None:
        return f"{path}: not in the manifest of {path.parent / 'COMPLETE'}"
    why = file_mismatch(path, expected)
    return "" if why is None else f"{path}: damaged checkpoint file ({why})"


class Block:
    """A block file's states, checked against the manifest, that its replicas take one by one."""

    def __init__(self, path: Path, expected: Optional[dict], load: Callable[[bytes], Any]):
        self.path = path
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ResultsError(f"{path}: missing from checkpoint {path.parent.name}") from None
        why = None if expected is None else mismatch(data, expected)
        if why is not None:
            raise ResultsError(f"{path}: damaged checkpoint file ({why})")
        saved = load(data)
        if not isinstance(saved, dict) or not isinstance(saved.get("ranks"), dict):
            raise ResultsError(f"{path}: not a block of ranks' states")
        self.states: Dict[int, dict] = saved["ranks"]

    def take(self, rank: int) -> dict:
        try:
            return self.states.pop(rank)
        except KeyError:
            raise ResultsError(f"{self.path}: holds no state of rank {rank}") from None
