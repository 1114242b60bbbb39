"""Read back what an offline W&B run wrote: its ``run-<id>.wandb`` file, record by record.

wandb 0.31 keeps no Python reader of its own transaction log. The file is a 7-byte header
(``:W&B``, a magic number, a version) followed by LevelDB's log format: 32 KiB blocks of
chunks, each ``crc32 (4) | length (2) | type (1) | data`` with type 1 a whole record, 2/3/4
the first/middle/last piece of one; a block's tail under 7 bytes is padding. Each record is
a ``wandb_internal_pb2.Record`` protobuf.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> List[bytes]:
    """The records of a ``.wandb`` file, each as its protobuf bytes."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a W&B transaction log")
    out, part, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and n == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + n]
        pos += HEADER + n
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            part = chunk
        elif kind == MIDDLE:
            part += chunk
        elif kind == LAST:
            out.append(part + chunk)
    return out


@dataclass
class OfflineRun:
    """What an offline run logged: its config, each ``log`` call's items, its summary, and its directory."""

    directory: Path
    config: Dict[str, Any] = field(default_factory=dict)
    history: List[Dict[str, Any]] = field(default_factory=list)
    summary: Dict[str, Any] = field(default_factory=dict)

    def scalars(self, tag: str, step: str = "unit") -> Dict[int, float]:
        """``{step: value}`` of one scalar over the run's log calls."""
        return {int(row[step]): row[tag] for row in self.history if tag in row and step in row}

    def images(self, tag: str, step: str = "unit") -> Dict[int, Path]:
        """``{step: the image file}`` of one image tag."""
        return {int(row[step]): self.directory / "files" / row[f"{tag}/path"] for row in self.history
                if f"{tag}/path" in row}


def read_run(directory: Path) -> OfflineRun:
    """The offline run in ``directory`` (``.../wandb/offline-run-*``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    [log] = sorted(Path(directory).glob("run-*.wandb"))
    run = OfflineRun(Path(directory))
    for data in records(log):
        record = pb.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run.config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run.history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in record.history.item})
        elif kind == "summary":
            run.summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                for i in record.summary.update if i.key or i.nested_key})
    run.config = {k: v.get("value", v) if isinstance(v, dict) else v for k, v in run.config.items()}
    return run
