"""Damage a checkpoint file the way disks and copies do: one flipped bit in a tensor's bytes, or a cut-off tail."""
from __future__ import annotations

import zipfile
from pathlib import Path


def flip_payload_bit(path: Path) -> int:
    """Flip one bit inside the largest tensor record of a ``torch.save`` file; returns its offset.

    torch.save writes an uncompressed zip whose records torch.load does not checksum, so the file still loads,
    with one number changed: the silent damage a manifest digest must catch.
    """
    path = Path(path)
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len = int.from_bytes(data[info.header_offset + 26: info.header_offset + 28], "little")
    extra_len = int.from_bytes(data[info.header_offset + 28: info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    offset = start + info.file_size // 2
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    return offset


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut the file to ``keep`` of its length (a copy or a write that stopped part-way)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * keep)])


def as_if_interrupted(run_dir: Path) -> None:
    """Make a finished run look like one that was killed after its last periodic checkpoint."""
    (run_dir / "summary.json").unlink()
    meta = run_dir / "meta.json"
    meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))
