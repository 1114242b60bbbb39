"""Checkpoint manifests and file digests: what a complete checkpoint holds, and whether it is still intact.

Why: a flipped bit in a checkpoint's tensor payload loads without complaint and
the resumed run silently differs from an uninterrupted one. So a checkpoint's
``COMPLETE`` marker lists every file it commits with its size and BLAKE2b digest
(``"files": {"rank00000.pt": {"bytes": ..., "blake2b": ...}}``), ``meta.json``
lists ``consensus.pt`` the same way, and ``--resume`` and ``communities inspect``
check them. Torch-free, so that inspect can verify a run on a login node.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import List, Optional

from .errors import ResultsError

COMPLETE = "COMPLETE"  # the marker rank 0 writes last: the checkpoint is whole, with its manifest
LATEST = "latest"  # names the newest complete checkpoint (for people; readers also sort the directories)
DAMAGED = "damaged"  # checkpoints/damaged/: where a resume moves checkpoints that failed their check
DIGEST = "blake2b"
_CHUNK = 1 << 20


def step_dir(root: Path, t: int) -> Path:
    return Path(root) / f"u{t:08d}"


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank{rank:05d}.pt"


def digest_bytes(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def entry(data: bytes) -> dict:
    """The manifest entry of a file with these bytes."""
    return {"bytes": len(data), DIGEST: digest_bytes(data)}


def mismatch(data: bytes, expected: dict) -> Optional[str]:
    """Why ``data`` is not the file ``expected`` describes, or None when it is."""
    size = expected.get("bytes")
    if isinstance(size, int) and len(data) != size:
        return f"{len(data)} bytes, the manifest says {size}: truncated or overwritten"
    want = expected.get(DIGEST)
    if not isinstance(want, str):
        return "its manifest entry has no digest"
    if digest_bytes(data) != want:
        return "its BLAKE2b digest differs from the manifest's: the bytes changed after they were written"
    return None


def file_mismatch(path: Path, expected: dict) -> Optional[str]:
    """``mismatch`` for a file on disk, read in chunks (a checkpoint can be large)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if isinstance(expected.get("bytes"), int) and size != expected["bytes"]:
            return f"{size} bytes, the manifest says {expected['bytes']}: truncated or overwritten"
        h = hashlib.blake2b(digest_size=32)
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(_CHUNK), b""):
                h.update(block)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if not isinstance(expected.get(DIGEST), str):
        return "its manifest entry has no digest"
    if h.hexdigest() != expected[DIGEST]:
        return "its BLAKE2b digest differs from the manifest's: the bytes changed after they were written"
    return None


def complete_dirs(root: Path) -> List[Path]:
    """The checkpoint directories that hold a ``COMPLETE`` marker, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("u*") if p.is_dir() and (p / COMPLETE).exists()), reverse=True)


def read_info(directory: Path) -> dict:
    """A checkpoint's ``COMPLETE`` marker; ResultsError naming it when it is unreadable."""
    path = Path(directory) / COMPLETE
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ResultsError(f"{path}: damaged checkpoint marker ({exc})") from None
    if not isinstance(info, dict) or not isinstance(info.get("t"), int):
        raise ResultsError(f"{path}: damaged checkpoint marker (not an object with an integer 't')")
    files = info.get("files")
    if files is not None and not (isinstance(files, dict) and all(isinstance(v, dict) for v in files.values())):
        raise ResultsError(f"{path}: damaged checkpoint marker ('files' is not a manifest)")
    return info


def problems(directory: Path) -> List[str]:
    """One line per damaged file of a complete checkpoint (its marker included); [] when it is intact.

    A checkpoint written before manifests existed has nothing to check against: [].
    """
    directory = Path(directory)
    try:
        info = read_info(directory)
    except ResultsError as exc:
        return [str(exc)]
    out = []
    for name, expected in sorted((info.get("files") or {}).items()):
        why = file_mismatch(directory / name, expected)
        if why is not None:
            out.append(f"{directory / name}: damaged checkpoint file ({why})")
    return out
