"""The run directory: atomic writers for the engine, readers for inspection.

Everything here is readable with numpy, json and yaml alone (``consensus.pt`` and
``checkpoints/`` need torch), so a user can call
``scipy.cluster.hierarchy.dendrogram(np.load("rounds/round_0003/Z.npy"))`` directly.

Layout of ``results/<name>/`` (see docs/results-layout.md):

- ``config.yaml``      resolved config
- ``meta.json``        versions, world size, MPI library, hosts, start/end, status
- ``partition.json``   shard sizes, per-rank label histograms, planted group per rank (or null)
- ``metrics.jsonl``    one line per rank per unit (rank >= 0), consensus evals in ``consensus.jsonl``
- ``merges.jsonl``     one line per rank side of each exchange
- ``rounds/round_NNNN/`` signatures.npy (N x d), Z.npy, labels.npy, round.json
- ``consensus.pt``     consensus model state_dict
- ``summary.json``     final figures

Writes are atomic: a file is written to a temporary name, fsynced and renamed; a
round directory is built under a temporary name and renamed whole; JSONL files
only ever get whole lines appended, and readers drop a torn last line.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import numpy as np


class ResultsError(RuntimeError):
    """A results file that is missing or damaged; the message names the file."""


ROUND_FILES = ("signatures.npy", "Z.npy", "labels.npy", "round.json")

# Files a batch system puts in a run directory before the run starts (``communities slurm``
# writes job.sbatch there and points the job's log at slurm-<jobid>.out). They do not make the
# directory "an existing run", and --overwrite (or a requeued job starting over) keeps them:
# the log is open in slurmstepd and the script is what the user resubmits.
LAUNCHER_FILES = ("job.sbatch", "slurm-*.out", "slurm-*.err")


def _is_launcher_file(path: Path) -> bool:
    return path.is_file() and any(path.match(pattern) for pattern in LAUNCHER_FILES)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, default=_json_default) + "\n").encode())


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _np_bytes(arr: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


class RunWriter:
    """Rank 0's handle on a run directory. Only rank 0 constructs one."""

    def __init__(self, root: Path, overwrite: bool = False, resume: bool = False):
        self.root = Path(root)
        content = [p for p in self.root.iterdir() if not _is_launcher_file(p)] if self.root.exists() else []
        if content and not (overwrite or resume):
            raise ResultsError(
                f"run directory {str(self.root)!r} already exists; pass --overwrite to replace it "
                "or --resume to continue it"
            )
        if overwrite and not resume:
            for p in content:
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        (self.root / "rounds").mkdir(parents=True, exist_ok=True)
        self._jsonl: Dict[str, Any] = {}

    def write_json(self, name: str, obj: Any) -> None:
        atomic_write_json(self.root / name, obj)

    def write_text(self, name: str, text: str) -> None:
        atomic_write_text(self.root / name, text)

    def append_jsonl(self, name: str, rows: Iterable[dict]) -> None:
        """Append whole lines and fsync; a crash can tear at most the last line."""
        fh = self._jsonl.get(name)
        if fh is None:
            fh = open(self.root / name, "a", encoding="utf-8")
            self._jsonl[name] = fh
        text = "".join(json.dumps(r, default=_json_default) + "\n" for r in rows)
        if text:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    def write_round(self, index: int, signatures: np.ndarray, Z: np.ndarray, labels: np.ndarray, info: dict) -> Path:
        """Build ``rounds/round_NNNN`` under a temporary name, then rename it whole."""
        final = self.root / "rounds" / f"round_{index:04d}"
        tmp = Path(tempfile.mkdtemp(dir=self.root / "rounds", prefix=f".round_{index:04d}."))
        for name, arr in (("signatures.npy", signatures), ("Z.npy", Z), ("labels.npy", labels)):
            atomic_write_bytes(tmp / name, _np_bytes(np.ascontiguousarray(arr)))
        atomic_write_json(tmp / "round.json", info)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(final.parent)
        return final

    def close(self) -> None:
        for fh in self._jsonl.values():
            fh.close()
        self._jsonl.clear()


# --------------------------------------------------------------------------- readers


def read_json(path: Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: damaged JSON ({exc})") from None


def read_jsonl(path: Path) -> List[dict]:
    """All complete lines. Only an unterminated last line can be torn (a crash mid-append): it is dropped."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    torn = lines.pop() if lines else ""  # "" when the file ends with a newline
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ResultsError(f"{path}: line {n} is damaged") from None
    if torn.strip():
        try:
            rows.append(json.loads(torn))
        except json.JSONDecodeError:
            pass
    return rows


def repair_jsonl(path: Path) -> None:
    """Cut an unterminated (torn) last line, so that appends after a crash start on a fresh line."""
    path = Path(path)
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as fh:
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())


def read_npy(path: Path) -> np.ndarray:
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
        # np.load treats any non-.npy bytes as a pickle and says so; name the real problem.
        if magic != b"\x93NUMPY":
            raise ResultsError(f"{path}: damaged (not a .npy file)" if magic else f"{path}: damaged (empty file)")
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise ResultsError(f"{path}: missing") from None
    except (ValueError, OSError, EOFError) as exc:
        raise ResultsError(f"{path}: damaged ({exc})") from None


@dataclass
class Round:
    """One signature round as saved: signatures (N x d), linkage Z, labels, info."""

    index: int
    path: Path
    info: dict
    signatures: np.ndarray
    Z: np.ndarray
    labels: np.ndarray

    @property
    def t(self) -> int:
        return int(self.info["t"])


@dataclass
class Run:
    """A run directory opened for reading. Missing optional parts are empty, not errors."""

    path: Path
    config: dict
    meta: dict
    partition: dict
    summary: Optional[dict]
    round_paths: List[Path] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return int(self.meta["world_size"])

    @property
    def planted_groups(self) -> Optional[np.ndarray]:
        g = self.partition.get("groups")
        return None if g is None else np.asarray(g)

    @property
    def complete(self) -> bool:
        return self.meta.get("status") == "complete"

    def metrics(self) -> List[dict]:
        return read_jsonl(self.path / "metrics.jsonl")

    def consensus_evals(self) -> List[dict]:
        return read_jsonl(self.path / "consensus.jsonl")

    def merges(self) -> List[dict]:
        return read_jsonl(self.path / "merges.jsonl")

    def round(self, i: int) -> Round:
        return load_round(self.round_paths[i])

    def rounds(self) -> List[Round]:
        return [load_round(p) for p in self.round_paths]


def load_round(path: Path) -> Round:
    path = Path(path)
    info = read_json(path / "round.json")
    return Round(
        index=int(info["round"]),
        path=path,
        info=info,
        signatures=read_npy(path / "signatures.npy"),
        Z=read_npy(path / "Z.npy"),
        labels=read_npy(path / "labels.npy"),
    )


def open_run(path: Path) -> Run:
    """Open a (possibly partial) run; only complete round directories are listed."""
    path = Path(path)
    if not path.is_dir():
        raise ResultsError(f"{path}: not a run directory")
    try:
        import yaml

        config = yaml.safe_load((path / "config.yaml").read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ResultsError(f"{path / 'config.yaml'}: missing") from None
    except Exception as exc:  # yaml.YAMLError and decoding errors
        raise ResultsError(f"{path / 'config.yaml'}: damaged ({exc})") from None
    meta = read_json(path / "meta.json")
    partition = read_json(path / "partition.json") if (path / "partition.json").exists() else {}
    summary = read_json(path / "summary.json") if (path / "summary.json").exists() else None
    rounds_dir = path / "rounds"
    round_paths = sorted(
        (p for p in rounds_dir.glob("round_*") if p.is_dir() and all((p / f).exists() for f in ROUND_FILES)),
        key=lambda p: int(p.name.split("_", 1)[1]) if p.name.split("_", 1)[1].isdigit() else -1,
    ) if rounds_dir.exists() else []
    return Run(path=path, config=config, meta=meta, partition=partition, summary=summary, round_paths=round_paths)
