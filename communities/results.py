"""The run directory: atomic writers for the engine, readers for inspection.

Everything here is readable with numpy, json and yaml alone (``consensus.pt`` and
``checkpoints/`` need torch), so a user can call
``scipy.cluster.hierarchy.dendrogram(np.load("rounds/round_0003/Z.npy"))`` directly.

Layout of ``results/<name>/`` (see docs/reference/results-layout.md):

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
only ever get whole lines appended, and readers drop a torn last line. A write
that fails (a full disk, a quota, a read-only or failing filesystem) leaves no
temporary behind and becomes a ``DiskError`` naming the path and the free space.
"""
from __future__ import annotations

import errno
import json
import math
import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field, fields
from enum import Enum, IntEnum
from pathlib import Path
from typing import Any, ClassVar, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

from .errors import DiskError, ResultsError

ROUND_FILES = ("signatures.npy", "Z.npy", "labels.npy", "round.json")

# Files a batch system may put in a run directory before the run starts (a hand-written script's
# log, or an older ``communities slurm``'s job.sbatch and slurm-<jobid>.out; it now writes them
# beside the run directory, as <name>.sbatch and <name>-<jobid>.out). They do not make the
# directory "an existing run", and --overwrite (or a requeued job starting over) keeps them:
# the log is open in slurmstepd and the script is what the user resubmits.
LAUNCHER_FILES = ("job.sbatch", "slurm-*.out", "slurm-*.err")


# The run directory's lock (communities/runlock.py): held by rank 0 of the run writing the directory. It is never
# deleted (--overwrite keeps it: deleting a lock file another process has open would let two runs hold "the" lock).
LOCK_FILE = ".lock"


def _is_launcher_file(path: Path) -> bool:
    return path.is_file() and any(path.match(pattern) for pattern in LAUNCHER_FILES)


def is_bookkeeping(path: Path) -> bool:
    """A file that does not make a directory an existing run: a batch system's file, or the lock."""
    return _is_launcher_file(path) or (path.name == LOCK_FILE and path.is_file())


# What the engine and ``communities inspect`` put in a run directory. --overwrite clears a directory only when it
# holds meta.json or config.yaml, or nothing but these (a run that died before writing config.yaml).
RUN_MARKERS = ("meta.json", "config.yaml")
RUN_ENTRIES = RUN_MARKERS + ("partition.json", "metrics.jsonl", "merges.jsonl", "consensus.jsonl", "examples.jsonl",
                             "rounds", "checkpoints", "consensus.pt", "summary.json", "report", "STOP",
                             "tensorboard", "wandb", "models", "snapshots", "exports")


def _looks_like_run(root: Path, content: List[Path]) -> bool:
    if any((root / m).is_file() for m in RUN_MARKERS):
        return True
    # the hidden temporaries of atomic_write_bytes (.NAME.XXXX.tmp) are run entries too
    return all(p.name in RUN_ENTRIES or (p.name.startswith(".") and p.name.endswith(".tmp")) for p in content)


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


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def free_space(path: Path) -> str:
    """``"12.0 KiB free of 1.0 MiB"`` for the filesystem holding ``path`` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError as exc:
        return f"free space unknown ({exc.strerror or exc})"
    return f"{_human(usage.free)} free of {_human(usage.total)}"


def disk_error(path: Path, exc: OSError, doing: str = "write") -> DiskError:
    """A failed write as a user error: what, where, why, and how much room the filesystem has left."""
    code = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    why = exc.strerror or str(exc) or type(exc).__name__
    return DiskError(f"cannot {doing} {path}: {why}{f' ({code})' if code else ''}; {free_space(path)} "
                     "on that filesystem")


def _injected_full(path: Path) -> OSError:
    """What a full disk raises (``faults.disk_full_at``)."""
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def new_temp_file(directory: Path, name: str) -> Tuple[int, Path]:
    """An open, new, hidden ``.NAME.XXXXXXXX.tmp`` in ``directory``, with the mode a plain ``open()`` gives: 0666
    less the umask (``tempfile.mkstemp`` makes 0600, which would hide a run's files from the user's group)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        path = Path(directory) / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            return os.open(path, flags, 0o666), path
        except FileExistsError:
            continue


def new_temp_dir(directory: Path, prefix: str) -> Path:
    """A new directory ``PREFIXXXXXXXXX`` with the mode ``mkdir`` gives (0777 less the umask; mkdtemp's is 0700)."""
    while True:
        path = Path(directory) / f"{prefix}{secrets.token_hex(4)}"
        try:
            path.mkdir(0o777)
            return path
        except FileExistsError:
            continue


def atomic_write_bytes(path: Path, data: bytes, full: bool = False) -> None:
    """Write ``data`` to a temporary name, fsync, rename. On failure no temporary is left behind.

    The file gets the mode a plain ``open()`` gives it (the umask decides who may read it).
    ``full`` simulates a disk that fills up mid-write (fault injection): half the bytes, then ENOSPC.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = new_temp_file(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data[: len(data) // 2] if full else data)
            fh.flush()
            if full:
                raise _injected_full(path)
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, _json_bytes(obj))


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
    """Rank 0's handle on a run directory. Only rank 0 constructs one.

    Every write goes through ``guard``: an OSError becomes a ``DiskError``
    naming the path and the free space, with no temporary left behind. During set-up
    it is raised at once (every rank stops there, collectively). Once the run trains,
    ``defer_errors()`` makes the writer record the first failure in ``failure`` and
    skip every later write instead, because rank 0 must not stop alone: the engine
    shares ``failure`` with every rank at its next collective step.
    """

    def __init__(self, root: Path, overwrite: bool = False, resume: bool = False):
        self.root = Path(root)
        self.failure: Optional[DiskError] = None
        self.full = False  # fault injection (faults.disk_full_at): every write fails as on a full disk
        self._defer = False
        self._jsonl: Dict[str, int] = {}
        content = [p for p in self.root.iterdir() if not is_bookkeeping(p)] if self.root.exists() else []
        if content and not (overwrite or resume):
            raise ResultsError(
                f"run directory {str(self.root)!r} already exists; pass --overwrite to replace it "
                "or --resume to continue it"
            )
        if overwrite and not resume:
            if content and not _looks_like_run(self.root, content):
                # the last line of defence against a name or output.root that points at a directory the user
                # did not mean (results/.. is the repository): never empty a directory that is not a run
                shown = ", ".join(sorted(p.name for p in content)[:5]) + (", ..." if len(content) > 5 else "")
                raise ResultsError(
                    f"refusing to --overwrite {str(self.root)!r}: it is not empty ({shown}) and does not look like a "
                    f"run directory (no {' or '.join(RUN_MARKERS)}); choose another name or output.root, or remove "
                    "it yourself"
                )
            for p in content:
                self.guard(p, lambda p=p: shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(),
                              "remove")
        self.guard(self.root / "rounds", lambda: (self.root / "rounds").mkdir(parents=True, exist_ok=True),
                      "create")

    # ------------------------------------------------------------------ failures

    def defer_errors(self) -> None:
        """From now on record the first failure (``failure``) and skip later writes instead of raising."""
        self._defer = True

    def guard(self, path: Path, write, doing: str = "write") -> bool:
        """Run ``write`` (it writes ``path``); False when it failed, or was skipped after an earlier failure."""
        if self.failure is not None:
            return False
        try:
            write()
            return True
        except OSError as exc:
            err = disk_error(path, exc, doing)
        if not self._defer:
            raise err
        self.failure = err
        return False

    # ------------------------------------------------------------------ writes

    def write_bytes(self, name: str, data: bytes) -> bool:
        path = self.root / name
        return self.guard(path, lambda: atomic_write_bytes(path, data, full=self.full))

    def write_json(self, name: str, obj: Any) -> bool:
        return self.write_bytes(name, _json_bytes(obj))

    def write_text(self, name: str, text: str) -> bool:
        return self.write_bytes(name, text.encode())

    def append_jsonl(self, name: str, rows: Iterable[dict]) -> bool:
        """Append whole lines and fsync; a crash can tear at most the last line, a failed write tears none."""
        text = "".join(json.dumps(r, default=_json_default) + "\n" for r in rows)
        if not text:
            return self.failure is None
        path = self.root / name
        return self.guard(path, lambda: self._append(name, path, text.encode()))

    def _append(self, name: str, path: Path, data: bytes) -> None:
        fd = self._jsonl.get(name)
        if fd is None:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
            self._jsonl[name] = fd
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data[: len(data) // 2] if self.full else data)
            while view:
                view = view[os.write(fd, view):]
            if self.full:
                raise _injected_full(path)
            os.fsync(fd)
        except OSError:
            try:  # cut what this append wrote, so the file ends on a whole line
                os.ftruncate(fd, start)
            except OSError:
                pass
            raise

    def write_round(self, index: int, signatures: np.ndarray, Z: np.ndarray, labels: np.ndarray,
                    info: dict) -> Optional[Path]:
        """Build ``rounds/round_NNNN`` under a temporary name, then rename it whole (None: it failed)."""
        final = self.root / "rounds" / f"round_{index:04d}"
        tmp: List[Path] = []

        def build() -> None:
            tmp.append(new_temp_dir(self.root / "rounds", f".round_{index:04d}."))
            try:
                for name, arr in (("signatures.npy", signatures), ("Z.npy", Z), ("labels.npy", labels)):
                    atomic_write_bytes(tmp[0] / name, _np_bytes(np.ascontiguousarray(arr)), full=self.full)
                atomic_write_bytes(tmp[0] / "round.json", _json_bytes(info), full=self.full)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp[0], final)
            except BaseException:
                shutil.rmtree(tmp[0], ignore_errors=True)
                raise
            _fsync_dir(final.parent)

        return final if self.guard(final, build) else None

    def sweep(self) -> List[Path]:
        """Remove the hidden temporaries a failed or killed writer may have left (the caller holds the lock)."""
        gone = []
        for p in list(self.root.glob(".*.tmp")) + list((self.root / "rounds").glob(".round_*")):
            try:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
                gone.append(p)
            except OSError:
                pass
        return gone

    def close(self) -> None:
        for fd in self._jsonl.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._jsonl.clear()


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2, default=_json_default) + "\n").encode()


# --------------------------------------------------------------------------- records


def finite_or_none(x: float) -> Optional[float]:
    """JSON has no NaN: a missing figure is null."""
    return None if not math.isfinite(x) else float(x)


# --------------------------------------------------------------------------- language models

LANGUAGE_MODEL = "language_model"  # summary.json ``task`` of a run whose examples are token windows


def bits_per_byte(loss: Optional[float], bytes_per_token: Optional[float]) -> Optional[float]:
    """A mean cross-entropy in nats per token as bits per byte, ``loss / ln 2 / bytes_per_token``: the figure that
    compares across tokenizers and corpora. None where either is unknown, or the loss is not finite."""
    if loss is None or bytes_per_token is None or not math.isfinite(loss) or not bytes_per_token > 0:
        return None
    return float(loss) / math.log(2) / float(bytes_per_token)


@dataclass(frozen=True)
class LanguageModel:
    """What a language-model run's figures mean: losses are nats per token, accuracies next-token accuracies.

    ``bytes_per_token`` is 1 for a byte corpus, a token corpus's only when ``data.lm.bytes_per_token`` says it
    (else None: no bits per byte); ``context`` is the tokens per window (an example, a "sample").
    """

    bytes_per_token: Optional[float] = None
    context: Optional[int] = None

    @property
    def factor(self) -> Optional[float]:
        """Bits per byte per nat per token (None without bytes_per_token)."""
        return bits_per_byte(1.0, self.bytes_per_token)

    def bpb(self, loss: Optional[float]) -> Optional[float]:
        return bits_per_byte(loss, self.bytes_per_token)

    def with_bpb(self, row: dict) -> dict:
        """A metrics or consensus row with ``test_bpb`` right after its ``test_loss`` (a new dict; the row as it
        is where bits per byte are unknown or the row has no test_loss)."""
        if self.bytes_per_token is None or "test_loss" not in row or "test_bpb" in row:
            return row
        out = {}
        for key, value in row.items():
            out[key] = value
            if key == "test_loss":
                out["test_bpb"] = self.bpb(value)
        return out

    def summary_fields(self, consensus_loss: float, rank_losses: Sequence[float]) -> dict:
        """summary.json's language-model fields (``Summary``): the task, the conversion and the losses in bits."""
        losses = [float(x) for x in rank_losses]
        finite = [x for x in losses if math.isfinite(x)]
        mean = float(np.mean(finite)) if finite else None
        return {"task": LANGUAGE_MODEL, "context": self.context, "bytes_per_token": self.bytes_per_token,
                "bits_per_byte_factor": self.factor, "consensus_test_bpb": self.bpb(consensus_loss),
                "rank_test_loss": [finite_or_none(x) for x in losses], "mean_rank_loss": mean,
                "mean_rank_bpb": self.bpb(mean)}

    @classmethod
    def of_run(cls, summary: Optional[dict], partition: Optional[dict], config: Optional[dict]
               ) -> Optional["LanguageModel"]:
        """A run directory's, from what it wrote (None: a classifier's). summary.json says it once the run has
        ended; before, partition.json (written at the start) holds a text corpus's ``bytes_per_token``."""
        summary, partition, config = summary or {}, partition or {}, config or {}
        lm = (config.get("data") or {}).get("lm") or {}
        context = lm.get("context") if isinstance(lm, dict) else None
        if summary.get("task") == LANGUAGE_MODEL:
            return cls(summary.get("bytes_per_token"), summary.get("context") or context)
        if "bytes_per_token" in partition:  # text.describe_domains: a text corpus
            return cls(partition.get("bytes_per_token"), context)
        return None


class Event(IntEnum):
    """What one rank's side of a mixing step did (``merges.jsonl`` field ``event``, by name)."""

    MERGE = 0  # a pairwise merge
    AVERAGE = 1  # a global Allreduce average (j = initiator = -1)
    SKIP_DIVERGED = 2  # kept its weights: the partner diverged
    RESET = 3  # took the partner's (or the mean's) weights: this rank had diverged
    QUARANTINED = 4  # left alone: this rank is quarantined
    TIMEOUT = 5  # protocol async: the partner did not answer within comm.timeout; skipped
    BUSY = 6  # protocol async: the partner was waiting on a request of its own; another one was drawn
    LOST = 7  # comm.fault_tolerance shrink: rank i was lost; the survivors went on from unit t (j = -1)
    ADOPT = 8  # pbt: rank i adopted rank j's hyperparameters (perturbed) at their exchange

    @property
    def label(self) -> str:
        return self.name.lower()


class _Record:
    """A fixed-width numeric row: ranks gather these as float64 blocks (no pickle), rank 0 writes JSON."""

    def to_row(self) -> List[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]  # type: ignore[arg-type]

    @classmethod
    def width(cls) -> int:
        return len(fields(cls))  # type: ignore[arg-type]

    @classmethod
    def from_row(cls, row: Sequence[float]):
        kinds = {f.name: f.type for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{name: (int(v) if kinds[name] == "int" else float(v)) for name, v in zip(kinds, row)})


@dataclass
class MetricRow(_Record):
    """One rank's unit (``metrics.jsonl``)."""

    t: int
    loss: float
    train_acc: float
    test_acc: float
    test_loss: float
    samples: int
    bytes_sent: int
    wall: float  # seconds since the run started (earlier segments of a resumed run included)
    local_acc: float = float("nan")  # on the rank's local test data (data.local_test_fraction)
    local_loss: float = float("nan")
    epsilon: float = float("nan")  # privacy.enabled: the replica's epsilon so far (at privacy.delta)

    def to_json(self, rank: int, local: bool = False, private: bool = False,
                lm: Optional[LanguageModel] = None) -> dict:
        """The metrics.jsonl line; ``local_acc``/``local_loss`` only in runs that hold out local test data,
        ``epsilon`` only in runs with privacy (``Infinity`` never: a noiseless private run writes null),
        ``test_bpb`` only in a language model's run whose bytes per token are known."""
        out = {"t": self.t, "rank": rank, "loss": finite_or_none(self.loss),
               "train_acc": finite_or_none(self.train_acc), "test_acc": finite_or_none(self.test_acc),
               "test_loss": finite_or_none(self.test_loss), "samples": self.samples, "bytes_sent": self.bytes_sent,
               "wall": round(self.wall, 4)}
        if local:
            out.update(local_acc=finite_or_none(self.local_acc), local_loss=finite_or_none(self.local_loss))
        if private:
            out["epsilon"] = finite_or_none(self.epsilon)
        return out if lm is None else lm.with_bpb(out)


@dataclass
class MergeRow(_Record):
    """One rank's side of a mixing step (``merges.jsonl``)."""

    t: int
    i: int  # this rank
    j: int  # the partner (-1: a global average)
    initiator: int  # the rank whose timer fired (-1: a global average)
    a: float  # the weight this rank gave the partner's weights
    update_norm: float  # ||w_after - w_before||
    distance: float  # ||w_i - w_j|| before the merge (nan: not measured)
    bytes: int
    event: int  # an Event

    @classmethod
    def pairwise(cls, t: int, rank: int, partner: int, initiator: int, a: float, *, update: float, distance: float,
                 sent: int, event: Event) -> "MergeRow":
        """This rank's side of an exchange with ``partner`` (merged, skipped or reset: ``event``)."""
        return cls(t, rank, partner, initiator, a, update, distance, sent, int(event))

    @classmethod
    def global_average(cls, t: int, rank: int, update: float, sent: int, event: Event = Event.AVERAGE
                       ) -> "MergeRow":
        """This rank's side of a global average (local_sgd, diloco, ifca): no partner, full weight on the mean."""
        return cls(t, rank, -1, -1, 1.0, update, float("nan"), sent, int(event))

    @classmethod
    def declined(cls, t: int, rank: int, partner: int, event: Event) -> "MergeRow":
        """protocol async: a request of this rank to ``partner`` that ended without an exchange (busy, timeout)."""
        return cls(t, rank, partner, rank, 0.0, 0.0, float("nan"), 0, int(event))

    @classmethod
    def lost(cls, t: int, rank: int) -> "MergeRow":
        """comm.fault_tolerance shrink: ``rank`` was lost; the survivors went on from unit t."""
        return cls(t, rank, -1, -1, 0.0, 0.0, float("nan"), 0, int(Event.LOST))

    @classmethod
    def adopted(cls, t: int, rank: int, partner: int, initiator: int, score: float, *, partner_score: float
                ) -> "MergeRow":
        """pbt: ``rank`` adopted ``partner``'s hyperparameters; the two scores are kept in the norm columns."""
        return cls(t, rank, partner, initiator, 0.0, score, partner_score, 0, int(Event.ADOPT))

    def to_json(self, rule: str) -> dict:
        if self.event == Event.ADOPT:
            return {"t": self.t, "i": self.i, "j": self.j, "initiator": self.initiator, "event": "adopt",
                    "score": finite_or_none(self.update_norm), "partner_score": finite_or_none(self.distance)}
        return {"t": self.t, "i": self.i, "j": self.j, "initiator": self.initiator, "a": self.a,
                "update_norm": finite_or_none(self.update_norm), "distance": finite_or_none(self.distance),
                "bytes": self.bytes, "rule": rule, "event": Event(self.event).label}

    @property
    def counts_as_update(self) -> bool:
        """Whether its update norm says the ranks still move: merges, and every side of a global average."""
        return self.event == Event.MERGE or self.j == -1


# Where a rank's wall time goes; the categories partition it ("other": checkpoints, logs, the loop itself).
# "idle" is every wait for a slower peer, whatever call it happens in (engine/timer.py settles collectives).
class TimeCategory(str, Enum):
    """A timer section (engine/timer.py); str-valued, so rows and JSON keep the plain names."""

    TRAIN = "train"
    EXCHANGE = "exchange"
    SIGNATURE = "signature"
    IDLE = "idle"
    EVAL = "eval"
    OTHER = "other"
    TURN = "turn"  # a population's replica waiting while the other replicas of its process run (0: one per process)


TIME_CATEGORIES = tuple(c.value for c in TimeCategory)  # the plain names, in the order of summary.json


@dataclass
class Summary:
    """``summary.json``: the final figures of one run (docs/reference/results-layout.md has every field)."""

    name: str
    strategy: str
    world_size: int
    n_params: int
    units: int
    rounds: int
    merges: int
    consensus_test_acc: float
    consensus_test_loss: float
    rank_test_acc: List[float]
    best_rank_acc: float
    worst_rank_acc: float
    mean_rank_acc: float
    communities_per_round: List[int]
    first_round_ari: Optional[float]
    final_dispersion: Optional[float]
    consensus_reached_t: Optional[int]
    consensus_distance: float
    bytes_sent_per_rank: List[int]
    bytes_sent_mean: float
    wall_time: float
    monitoring_bytes_mean: float = 0.0  # Allreduces that only evaluate the consensus model
    data_bytes_mean: float = 0.0  # training examples passed between partners
    time_split: Dict[str, float] = field(default_factory=dict)  # mean over ranks, seconds per category
    examples: Optional[dict] = None  # with examples.track
    protocol: str = "virtual_clock"
    time_split_per_rank: Dict[str, List[float]] = field(default_factory=dict)  # also "wall": each rank's loop
    consensus_test_split: str = "shared"  # which test split consensus_test_acc is measured on
    view_agreement: Optional[dict] = None  # protocol async: how much the ranks' community views agreed
    units_per_rank: List[int] = field(default_factory=list)  # protocol async: each rank's own units (units: max)
    local_test: Optional[dict] = None  # data.local_test_fraction: the delivered models on each rank's local test data
    consensus_mode: Optional[dict] = None  # consensus.mode other than global: the decision and its evidence
    community_models: Optional[dict] = None  # the per-community (or IFCA) models delivered (models/communities.json)
    membership: Optional[dict] = None  # comm.fault_tolerance shrink: the survivors, the ranks lost, each recovery
    placement: Optional[dict] = None  # a population (world_size > MPI processes): processes, bytes by kind
    groups: Optional[dict] = None  # train.group_size > 1: the groups, bytes inside them and between them
    privacy: Optional[dict] = None  # privacy.enabled: each replica's epsilon, the worst one, noise and sampling
    pbt: Optional[dict] = None  # pbt.enabled: each replica's final hyperparameters, and per community
    # a language model's run (LanguageModel.summary_fields): losses in nats per token, accuracies next-token ones
    task: Optional[str] = None  # "language_model"; absent: a classifier
    context: Optional[int] = None  # tokens per window (one example)
    bytes_per_token: Optional[float] = None  # absent: unknown (a token corpus without data.lm.bytes_per_token)
    bits_per_byte_factor: Optional[float] = None  # bits per byte = nats per token x this
    consensus_test_bpb: Optional[float] = None
    rank_test_loss: Optional[List[Optional[float]]] = None  # each rank's own model's last test loss
    mean_rank_loss: Optional[float] = None
    mean_rank_bpb: Optional[float] = None

    OPTIONAL: ClassVar[Tuple[str, ...]] = ("examples", "view_agreement", "local_test", "consensus_mode",
                                           "community_models", "membership", "placement", "groups", "privacy", "pbt",
                                           "task", "context", "bytes_per_token", "bits_per_byte_factor",
                                           "consensus_test_bpb", "rank_test_loss", "mean_rank_loss", "mean_rank_bpb")

    def to_dict(self) -> dict:
        d = asdict(self)
        for key in self.OPTIONAL:
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Summary":
        """A summary read back; fields an older version did not write take their defaults."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def language_model(self) -> Optional[LanguageModel]:
        """The run's LanguageModel (None: a classifier's)."""
        return LanguageModel(self.bytes_per_token, self.context) if self.task == LANGUAGE_MODEL else None

    @classmethod
    def read(cls, path: Path) -> "Summary":
        """``summary.json`` at ``path`` (a file, or the run directory holding it)."""
        path = Path(path)
        data = read_json(path / "summary.json" if path.is_dir() else path)
        try:
            return cls.from_dict(data)
        except TypeError as exc:  # a required field missing
            raise ResultsError(f"{path}: damaged summary ({exc})") from None


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
    """All complete lines. Only an unterminated last line can be torn (a crash mid-append): it is dropped.

    The whole file is parsed by one ``json.loads`` (about twice as fast as line by line for 10^5+ lines);
    blank lines or any damage fall back to reading line by line, which names the damaged line.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    body, _, torn = text.rpartition("\n")
    try:
        rows: List[dict] = json.loads("[" + body.replace("\n", ",") + "]") if body else []
    except json.JSONDecodeError:
        rows = _read_lines(path, body.split("\n"))
    if torn.strip():
        try:
            rows.append(json.loads(torn))
        except json.JSONDecodeError:
            pass
    return rows


def _read_lines(path: Path, lines: List[str]) -> List[dict]:
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ResultsError(f"{path}: line {n} is damaged") from None
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
    """A run directory opened for reading. Missing optional parts are empty, not errors.

    ``round_paths`` lists the round directories that hold every file of ``ROUND_FILES``;
    ``problems`` has one line for each ``round_NNNN`` directory left out because a file is
    missing (naming it). Round directories are built under a hidden ``.round_*`` name and
    renamed whole, so a missing file in a visible one is damage; hidden temporaries (a
    round being written when the run stopped) are skipped silently.
    """

    path: Path
    config: dict
    meta: dict
    partition: dict
    summary: Optional[dict]
    round_paths: List[Path] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

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

    @property
    def record(self) -> Optional[Summary]:
        """``summary`` as a typed record; None without one, or when a field is missing."""
        if not isinstance(self.summary, dict):
            return None
        try:
            return Summary.from_dict(self.summary)
        except TypeError:
            return None

    def metrics(self) -> List[dict]:
        return read_jsonl(self.path / "metrics.jsonl")

    def consensus_evals(self) -> List[dict]:
        """consensus.jsonl's evaluations, ending with the run's final one, marked ``final: true``.

        The final evaluation (summary.json's ``consensus_test_acc``, the run's headline) is taken after the last
        unit, which the file's evaluations every ``output.consensus_every`` units need not reach: it is added as
        a row at ``t = units`` where the file's last row is not it. Without a summary (a run not finished), the
        file's rows alone."""
        rows = read_jsonl(self.path / "consensus.jsonl")
        s = self.record
        if s is None:
            return rows
        last = rows[-1] if rows else {}
        if last.get("t") == s.units and last.get("test_acc") == s.consensus_test_acc:
            rows[-1] = {**last, "final": True}
            return rows
        final: Dict[str, Any] = {"t": s.units, "test_acc": s.consensus_test_acc, "test_loss": s.consensus_test_loss}
        if s.consensus_test_bpb is not None:
            final["test_bpb"] = s.consensus_test_bpb
        if "wall" in last:  # protocol async: the curve is over wall time
            final["wall"] = s.wall_time
        return rows + [{**final, "final": True}]

    def merges(self) -> List[dict]:
        return read_jsonl(self.path / "merges.jsonl")

    def round(self, i: int) -> Round:
        return load_round(self.round_paths[i])

    def rounds(self) -> List[Round]:
        return [load_round(p) for p in self.round_paths]


def read_round_info(path: Path) -> dict:
    """``round.json`` of a round directory: a JSON object with integer ``round`` and ``t``, else ResultsError."""
    path = Path(path)
    info = read_json(path)
    if not isinstance(info, dict):
        raise ResultsError(f"{path}: damaged (expected a JSON object, got {type(info).__name__})")
    for key in ("round", "t"):
        if key not in info:
            raise ResultsError(f"{path}: damaged (missing field {key!r})")
        value = info[key]
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ResultsError(f"{path}: damaged (field {key!r} is {value!r}, expected an integer)")
    return info


def load_round(path: Path) -> Round:
    """Read one round directory; a missing or damaged file raises ResultsError naming it."""
    path = Path(path)
    info = read_round_info(path / "round.json")
    return Round(
        index=int(info["round"]),
        path=path,
        info=info,
        signatures=read_npy(path / "signatures.npy"),
        Z=read_npy(path / "Z.npy"),
        labels=read_npy(path / "labels.npy"),
    )


def _round_number(p: Path) -> int:
    suffix = p.name.split("_", 1)[1]
    return int(suffix) if suffix.isdigit() else -1


def list_rounds(rounds_dir: Path):
    """(complete round directories in numeric order, one line per incomplete one naming its missing file).

    Hidden ``.round_*`` temporaries (a round still being built) are not listed and not reported.
    """
    rounds_dir = Path(rounds_dir)
    if not rounds_dir.is_dir():
        return [], []
    found = sorted((p for p in rounds_dir.glob("round_*") if p.is_dir()), key=_round_number)
    complete, problems = [], []
    for p in found:
        missing = [f for f in ROUND_FILES if not (p / f).is_file()]
        if missing:
            more = f" (and {', '.join(missing[1:])})" if len(missing) > 1 else ""
            problems.append(f"{p / missing[0]}: missing{more}; round directories are renamed into place whole, "
                            f"so {p.name} is damaged and left out")
        else:
            complete.append(p)
    return complete, problems


def read_run(path: Path) -> Run:
    """Read a (possibly partial) run's files; only complete round directories are listed (see ``Run``). The
    checked view of a run, with its frames, is ``communities.open_run`` (report/api.py)."""
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
    round_paths, problems = list_rounds(path / "rounds")
    return Run(path=path, config=config, meta=meta, partition=partition, summary=summary, round_paths=round_paths,
               problems=problems)
