"""Run directories read into views for ``communities inspect``, and the pure helpers on them.

This part of the report reads only the results layout (docs/reference/results-layout.md)
through ``communities.results`` and uses numpy and scipy; it never imports torch,
mpi4py or matplotlib, so a run can be read (and its terminal summary printed) on a
login node. ``load_view`` reads one run directory into a ``RunView``: every series
the figures (``figures.py``) and the HTML report (``html.py``) draw, derived once.

Partial runs (killed mid-way) are read up to their last complete round; a missing
or damaged file raises a ``ResultsError`` naming it (the command line turns it into
one line and exit status 2). Two kinds of damage only warn (naming the file, in
``RunView.notes``) and the rest is read: a ``round_NNNN`` directory that lacks a
file (rounds are renamed into place whole, so it is left out), and damage in the
last round of a run that did not finish (the tail of the crash). Hidden
``.round_*`` temporaries, rounds still being built, are skipped silently.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from scipy.cluster import hierarchy
from scipy.spatial.distance import pdist

from .. import manifest, runlock
from ..core.clustering import adjusted_rand, stable_labels
from ..results import LanguageModel, ResultsError, Run, load_round, read_json, read_jsonl, read_run

# --------------------------------------------------------------------------- pure helpers


def cophenetic_correlation(Z: np.ndarray, signatures: np.ndarray, metric: str) -> float:
    """How faithfully the tree keeps the signatures' own distances (scipy ``cophenet``); NaN if undefined."""
    Y = pdist(np.asarray(signatures), metric=metric)
    if Y.size < 2 or not np.all(np.isfinite(Y)):
        return float("nan")
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c, _ = hierarchy.cophenet(np.asarray(Z, dtype=np.float64), Y)
    return float(c)


def compress_counts(values: Sequence[int]) -> str:
    """Run-length text of communities per round: [4,4,4,3,1,1] -> '4x3, 3x1, 1x2'."""
    parts: List[str] = []
    prev, count = None, 0
    for v in values:
        if v == prev:
            count += 1
            continue
        if prev is not None:
            parts.append(f"{prev}x{count}")
        prev, count = v, 1
    if prev is not None:
        parts.append(f"{prev}x{count}")
    return ", ".join(parts)


def merge_counts(rows: Sequence[dict], n: int) -> np.ndarray:
    """N x N symmetric count of exchanges per pair, each exchange counted once.

    merges.jsonl holds one line per side, (i, j) and (j, i); an exchange is keyed by
    (t, pair, initiator), so it counts once even when one side's line is missing
    (a torn tail). Only ``event == "merge"`` lines count (skips and resets do not).
    """
    rows = [r for r in rows if r.get("event", "merge") == "merge"]
    M = np.zeros((n, n), dtype=np.int64)
    if not rows:
        return M
    count = len(rows)
    i = np.fromiter((int(r["i"]) for r in rows), dtype=np.int64, count=count)
    j = np.fromiter((int(r["j"]) for r in rows), dtype=np.int64, count=count)
    t = np.fromiter((int(r["t"]) for r in rows), dtype=np.int64, count=count)
    init = np.fromiter((-1 if r.get("initiator") is None else int(r["initiator"]) for r in rows), dtype=np.int64,
                       count=count)
    keys = np.column_stack([t, np.minimum(i, j), np.maximum(i, j), init])[i != j]
    if keys.size:
        keys = np.unique(keys, axis=0)
        np.add.at(M, (keys[:, 1], keys[:, 2]), 1)
        M = M + M.T
    return M


def community_merge_counts(M: np.ndarray, labels: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Exchanges between and inside communities: the community ids (sorted) and a k x k symmetric count.

    The rank x rank matrix ``M`` (``merge_counts``) summed over blocks; each exchange counts once,
    off the diagonal in both of its cells (a -> b and b -> a), on it once.
    """
    ids, code = np.unique(np.asarray(labels).ravel(), return_inverse=True)
    onehot = np.zeros((code.size, ids.size), dtype=np.int64)
    onehot[np.arange(code.size), code.ravel()] = 1
    B = onehot.T @ np.asarray(M, dtype=np.int64) @ onehot
    B[np.diag_indices_from(B)] //= 2
    return ids, B


def select_rounds(
    available: Sequence[int],
    rounds: Optional[Sequence[int]] = None,
    every: Optional[int] = None,
    last: bool = False,
    cap: Optional[int] = None,
) -> Tuple[List[int], str]:
    """Which rounds get a dendrogram, and a sentence saying which were drawn.

    ``rounds`` (round numbers), ``every`` (every K-th saved round, from the first)
    and ``last`` are combined as a union. Without any of them: every round (so that
    every signature round can be read), or, when ``cap`` is given and there are
    more than ``cap + 2`` rounds, the first, the last and ``cap`` evenly spaced
    between (the comparison report uses ``cap=0``: first and last). Raises
    ValueError for a requested round that was not saved.
    """
    available = list(available)
    if not available:
        return [], "no complete signature rounds"
    chosen = set()
    explicit = bool(rounds) or bool(every) or last
    for r in rounds or []:
        if r not in available:
            raise ValueError(
                f"--round {r}: no such complete round "
                f"(saved rounds: {available[0]}..{available[-1]}, {len(available)} in all)"
            )
        chosen.add(r)
    if every:
        chosen.update(available[::every])
    if last:
        chosen.add(available[-1])
    if explicit:
        picked = sorted(chosen)
        return picked, f"dendrograms for {len(picked)} of {len(available)} rounds (as selected): {_ranges(picked)}"
    if cap is None or len(available) <= cap + 2:
        more = " (pick fewer with --every K, --round N or --last)" if len(available) > 1 else ""
        return available, f"dendrograms for all {len(available)} rounds{more}"
    pos = np.unique(np.round(np.linspace(0, len(available) - 1, cap + 2)).astype(int))
    picked = [available[p] for p in pos]
    between = f" and {len(picked) - 2} evenly spaced between" if len(picked) > 2 else ""
    return picked, (
        f"dendrograms for {len(picked)} of {len(available)} rounds: the first, the last{between}: "
        f"{_ranges(picked)} (choose with --round N, --every K or --last; --every 1 draws all)"
    )


def _ranges(values: Sequence[int]) -> str:
    """Round numbers as text: [0, 1, 2, 5, 7, 8] -> 'rounds 0-2, 5, 7-8'."""
    parts: List[str] = []
    values = sorted(int(v) for v in values)
    k = 0
    while k < len(values):
        j = k
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[k]) if j == k else f"{values[k]}-{values[j]}")
        k = j + 1
    return ("round " if len(values) == 1 else "rounds ") + ", ".join(parts)


# --------------------------------------------------------------------------- loading


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """Turn malformed content (a missing key, a wrong type) into a ResultsError naming the file."""
    try:
        yield
    except ResultsError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        detail = f"missing field {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ResultsError(f"{path}: damaged ({detail})") from None


def _num(x) -> float:
    return float("nan") if x is None else float(x)


@dataclass
class RunView:
    """Everything the report needs from one run directory, read and derived once."""

    run: Run
    label: str
    name: str
    strategy: str
    n: int  # the ranks the algorithm sees: replicas, or data-parallel groups (train.group_size > 1)
    groups: Optional[np.ndarray]
    group_size: int = 1  # train.group_size: replicas per rank of ``n`` (metrics: each group's lead's rows)
    infos: List[dict] = field(default_factory=list)
    round_idx: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    round_t: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    labels: List[np.ndarray] = field(default_factory=list)
    Zs: List[np.ndarray] = field(default_factory=list)
    n_comm: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    cophenetic: np.ndarray = field(default_factory=lambda: np.zeros(0))
    ari: np.ndarray = field(default_factory=lambda: np.zeros(0))
    stable: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), int))
    metric_t: np.ndarray = field(default_factory=lambda: np.zeros(0, int))
    test_acc: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # N x T, NaN where no eval
    bytes_sent: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # N x T, cumulative
    epsilon: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # N x T (privacy.enabled), else empty
    hyper: Dict[str, np.ndarray] = field(default_factory=dict)  # pbt: each learnable value, N x T
    consensus_t: np.ndarray = field(default_factory=lambda: np.zeros(0))
    consensus_acc: np.ndarray = field(default_factory=lambda: np.zeros(0))
    # a language model's run: losses are nats per token, accuracies next-token accuracies (None: a classifier's)
    lm: Optional[LanguageModel] = None
    test_loss: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # N x T (a language model's), NaN: none
    train_loss: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # N x T (a language model's)
    consensus_loss: np.ndarray = field(default_factory=lambda: np.zeros(0))  # at consensus_t
    merge_t: np.ndarray = field(default_factory=lambda: np.zeros(0))
    merge_norm: np.ndarray = field(default_factory=lambda: np.zeros(0))  # mean update norm per t
    merge_matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), int))
    view_agreement: Dict[int, Tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # async: rank -> (wall, ARI)
    community_models: List[dict] = field(default_factory=list)  # models/ and exports/*/ communities.json records
    lost: List[Tuple[int, int]] = field(default_factory=list)  # comm.fault_tolerance shrink: (rank, t) of each loss
    notes: List[str] = field(default_factory=list)
    status: str = "?"  # meta.json's status as it stands (a killed run's "running" reads "interrupted")

    @property
    def path(self) -> Path:
        return self.run.path

    def series(self, key: str) -> np.ndarray:
        """A round.json field over rounds, NaN where null or absent."""
        return np.array([_num(i.get(key)) for i in self.infos], dtype=float)


def _check_round(rnd, n: int) -> None:
    """Shapes the layout promises; a mismatch names the file rather than failing later in scipy."""
    p = rnd.path  # round.json itself (an object with integer round and t) is checked by load_round
    sig = rnd.signatures
    if sig.ndim != 2 or sig.shape[0] != n or not np.issubdtype(sig.dtype, np.number):
        raise ResultsError(f"{p / 'signatures.npy'}: shape {sig.shape} {sig.dtype}, expected ({n}, d) numbers")
    Z = rnd.Z
    if Z.ndim != 2 or Z.shape != (n - 1, 4) or not np.issubdtype(Z.dtype, np.number):
        raise ResultsError(f"{p / 'Z.npy'}: shape {Z.shape} {Z.dtype}, expected a ({n - 1}, 4) linkage of {n} ranks")
    rnd.Z = Z.astype(np.float64, copy=False)
    try:
        if n > 1:  # a world of one has an empty tree, which scipy calls invalid
            hierarchy.is_valid_linkage(rnd.Z, throw=True, name="Z")
    except (ValueError, TypeError) as exc:
        raise ResultsError(f"{p / 'Z.npy'}: not a valid linkage matrix ({exc})") from None
    lab = rnd.labels
    if lab.shape != (n,) or not np.issubdtype(lab.dtype, np.integer):
        raise ResultsError(f"{p / 'labels.npy'}: shape {lab.shape} {lab.dtype}, expected ({n},) integers")


def load_view(path: Path) -> RunView:
    """Open a (possibly partial) run and derive every series the report draws. Raises ResultsError."""
    view = _open_view(Path(path))
    _read_rounds(view)
    _read_metrics(view)
    _read_consensus(view)
    _read_merges(view)
    _read_views(view)
    _read_community_models(view)
    return view


def _open_view(path: Path) -> RunView:
    """The run's JSON files checked, its world size, planted groups and label: a view with no series yet."""
    run = read_run(path)
    meta_p = path / "meta.json"
    for fname, obj in (("meta.json", run.meta), ("partition.json", run.partition), ("summary.json", run.summary)):
        if obj is not None and not isinstance(obj, dict):
            raise ResultsError(f"{path / fname}: damaged (expected a JSON object, got {type(obj).__name__})")
    if not isinstance(run.config, dict):
        raise ResultsError(f"{path / 'config.yaml'}: damaged (expected a mapping, got {type(run.config).__name__})")
    with _reading(meta_p):
        n = int(run.meta["world_size"])
        if n < 1:
            raise ValueError(f"world_size {n} < 1")
    with _reading(path / "config.yaml"):
        size = int((run.config.get("train") or {}).get("group_size") or 1)
        if size < 1 or n % size:
            raise ValueError(f"train.group_size {size} does not divide world_size {n}")
    groups = None
    with _reading(path / "partition.json"):
        if run.partition.get("groups") is not None:
            groups = np.asarray(run.partition["groups"], dtype=np.int64)
            if groups.shape != (n,):
                raise ValueError(f"'groups' has {groups.size} entries for {n} ranks")
            groups = groups[::size]  # a data-parallel group's planted group: its lead's
    summary = run.summary or {}
    name = str(summary.get("name") or run.config.get("name") or path.name)
    strategy = str(run.meta.get("strategy") or run.config.get("strategy") or summary.get("strategy") or "?")
    view = RunView(run=run, label=f"{name} ({strategy})", name=name, strategy=strategy, n=n // size, groups=groups,
                   group_size=size)
    if size > 1:
        view.notes.append(f"train.group_size={size}: each rank here is a data-parallel group of {size} replicas "
                          f"({n // size} groups of world_size={n}); per-rank curves are each group's lead's")
    with _reading(path / "summary.json"):
        view.lm = LanguageModel.of_run(run.summary, run.partition, run.config)
    view.status = run_status(path, run.meta, view.notes)
    check_products(path, run.meta, view.notes)
    return view


def run_status(path: Path, meta: dict, notes: List[str]) -> str:
    """meta.json's status, except that a ``running`` run whose process is gone is ``interrupted`` (noted why)."""
    status = str(meta.get("status", "?"))
    state = runlock.probe(path)
    effective = runlock.effective_status(status, state)
    if effective != status:
        age = f"{state.age / 60:.0f} min ago" if state.age is not None else "long ago"
        why = ("its process is gone" if state.holder_alive is False
               else f"nobody holds its lock and its last heartbeat was {age}")
        notes.append(f"{path / 'meta.json'} says '{status}', but {why} ({runlock.describe(state.holder)}): "
                     f"read as '{effective}' (killed, or its node failed); continue it with --resume")
    return effective


def check_products(path: Path, meta: dict, notes: List[str]) -> None:
    """consensus.pt against meta.json's digest (damage is an error), checkpoints against their manifests (warned)."""
    files = meta.get("files")
    if isinstance(files, dict):
        for name, expected in files.items():
            if not isinstance(expected, dict):
                raise ResultsError(f"{path / 'meta.json'}: damaged ('files' entry {name!r} is not an object)")
            why = manifest.file_mismatch(path / name, expected)
            if why is not None:
                raise ResultsError(f"{path / name}: damaged ({why}; compared with {path / 'meta.json'})")
    intact = None
    damaged = []
    for d in manifest.complete_dirs(path / "checkpoints"):
        bad = manifest.problems(d)
        if bad:
            damaged.append((d, bad))
        elif intact is None:
            intact = d
    for d, bad in damaged:
        newer = intact is None or d.name > intact.name
        then = (f"--resume falls back to {intact.name}" if intact is not None and newer
                else "--resume finds no intact checkpoint" if intact is None else "it is older than the one in use")
        notes.append(f"checkpoint {d.name} is damaged: {'; '.join(bad)} ({then})")


def _read_rounds(view: RunView) -> None:
    """Every complete round: labels, trees, community counts, cophenetic correlation, ARI, stable ids."""
    run, n, groups = view.run, view.n, view.groups
    clustering = run.config.get("clustering")
    cfg_metric = clustering.get("metric") if isinstance(clustering, dict) else None
    infos, idx, ts, labels, Zs, ncomm, coph, aris = [], [], [], [], [], [], [], []
    view.notes.extend(run.problems)  # round directories with a missing file: named, left out
    for pos, rp in enumerate(run.round_paths):
        try:
            rnd = load_round(rp)
            _check_round(rnd, n)
        except ResultsError as exc:
            # A run that did not finish is read up to its last complete round: damage in its very
            # last round directory is the tail of the crash, not a reason to refuse the rest.
            if pos == len(run.round_paths) - 1 and not run.complete:
                view.notes.append(f"{one_line(exc)}; the run did not finish (status "
                                  f"{view.status}), so it is read up to the round before")
                break
            raise
        info = rnd.info
        metric = str(info.get("metric") or cfg_metric or "cosine")
        with _reading(rp / "round.json"):  # shapes are checked, so pdist can only object to the metric
            c = cophenetic_correlation(rnd.Z, rnd.signatures, metric)
        a = adjusted_rand(rnd.labels, groups)
        k = int(np.unique(rnd.labels).size)
        if info.get("n_communities") is not None and int(info["n_communities"]) != k:
            view.notes.append(f"{rp / 'round.json'}: n_communities={info['n_communities']} but labels.npy has {k}")
        if a is not None and info.get("ari") is not None and abs(float(info["ari"]) - a) > 1e-6:
            view.notes.append(f"{rp / 'round.json'}: ari={float(info['ari']):.4f} but recomputed {a:.4f}")
        infos.append(info)
        idx.append(int(info["round"]))
        ts.append(int(info["t"]))
        labels.append(rnd.labels)
        Zs.append(rnd.Z)
        ncomm.append(k)
        coph.append(c)
        aris.append(float("nan") if a is None else a)
    view.infos, view.labels, view.Zs = infos, labels, Zs
    view.round_idx = np.asarray(idx, dtype=np.int64)
    view.round_t = np.asarray(ts, dtype=np.int64)
    view.n_comm = np.asarray(ncomm, dtype=np.int64)
    view.cophenetic = np.asarray(coph, dtype=float)
    view.ari = np.asarray(aris, dtype=float)
    view.stable = stable_labels(labels) if labels else np.zeros((0, n), dtype=np.int64)


def _read_metrics(view: RunView) -> None:
    """metrics.jsonl as N x T tables of test accuracy and cumulative bytes sent."""
    n = view.n
    with _reading(view.path / "metrics.jsonl"):
        G = view.group_size  # (groups: each group's lead's rows, the group as a rank)
        rows = [r for r in read_jsonl(view.path / "metrics.jsonl") if int(r["rank"]) >= 0 and int(r["rank"]) % G == 0]
        if rows:
            t = np.fromiter((int(r["t"]) for r in rows), dtype=np.int64, count=len(rows))
            rank = np.fromiter((int(r["rank"]) // G for r in rows), dtype=np.int64, count=len(rows))
            if rank.max() >= n:
                raise ValueError(f"rank {int(rank.max())} outside world size {n}")
            acc = np.fromiter((_num(r.get("test_acc")) for r in rows), dtype=float, count=len(rows))
            byt = np.fromiter((_num(r.get("bytes_sent")) for r in rows), dtype=float, count=len(rows))
            view.metric_t, col = np.unique(t, return_inverse=True)
            view.test_acc = np.full((n, view.metric_t.size), np.nan)
            view.bytes_sent = np.full((n, view.metric_t.size), np.nan)
            view.test_acc[rank, col] = acc
            view.bytes_sent[rank, col] = byt
            if view.lm is not None:  # the loss curves: a language model's are what it is judged by
                view.test_loss = np.full((n, view.metric_t.size), np.nan)
                view.train_loss = np.full((n, view.metric_t.size), np.nan)
                view.test_loss[rank, col] = [_num(r.get("test_loss")) for r in rows]
                view.train_loss[rank, col] = [_num(r.get("loss")) for r in rows]
            if "epsilon" in rows[0]:
                view.epsilon = np.full((n, view.metric_t.size), np.nan)
                view.epsilon[rank, col] = [_num(r.get("epsilon")) for r in rows]
            for name in rows[0].get("hyper") or {}:
                view.hyper[name] = np.full((n, view.metric_t.size), np.nan)
                view.hyper[name][rank, col] = [_num((r.get("hyper") or {}).get(name)) for r in rows]


def _read_consensus(view: RunView) -> None:
    """consensus.jsonl: the consensus model's test accuracy (and loss) over t."""
    with _reading(view.path / "consensus.jsonl"):
        rows = [r for r in view.run.consensus_evals() if r.get("test_acc") is not None]
        view.consensus_t = np.array([int(r["t"]) for r in rows], dtype=float)
        view.consensus_acc = np.array([float(r["test_acc"]) for r in rows], dtype=float)
        view.consensus_loss = np.array([_num(r.get("test_loss")) for r in rows], dtype=float)


def _read_merges(view: RunView) -> None:
    """merges.jsonl: exchanges per pair and the mean merge update norm per t."""
    with _reading(view.path / "merges.jsonl"):
        every = read_jsonl(view.path / "merges.jsonl")
        view.lost = sorted((int(r["i"]), int(r["t"])) for r in every if r.get("event") == "lost")
        if view.lost:
            view.notes.append("ranks lost (the survivors went on from t): "
                              + ", ".join(f"rank {r} at t={t}" for r, t in view.lost))
        rows = [r for r in every if r.get("event", "merge") == "merge"]
        view.merge_matrix = merge_counts(rows, view.n)
        norm_rows = [(int(r["t"]), float(r["update_norm"])) for r in rows if r.get("update_norm") is not None]
        if norm_rows:
            arr = np.asarray(norm_rows, dtype=float)
            ut, inv = np.unique(arr[:, 0], return_inverse=True)
            view.merge_t = ut
            view.merge_norm = np.bincount(inv, weights=arr[:, 1]) / np.bincount(inv)


def _read_views(view: RunView) -> None:
    """protocol async: each rank's community views (views.jsonl) against rank 0's at the same wall time."""
    path = view.path / "views.jsonl"
    if not path.exists():
        return
    with _reading(path):
        rows = [v for v in read_jsonl(path) if len(v.get("labels", ())) == view.n]
    own = sorted((v for v in rows if v["rank"] == 0), key=lambda v: v["wall"])
    if not own:
        return
    walls = np.array([v["wall"] for v in own])
    for r in sorted({v["rank"] for v in rows} - {0}):
        mine = sorted((v for v in rows if v["rank"] == r), key=lambda v: v["wall"])
        k = [max(int(np.searchsorted(walls, v["wall"], side="right")) - 1, 0) for v in mine]
        ari = [adjusted_rand(np.asarray(v["labels"]), own[j]["labels"]) for v, j in zip(mine, k)]
        view.view_agreement[r] = (np.array([v["wall"] for v in mine]), np.array(ari, dtype=float))


def _read_community_models(view: RunView) -> None:
    """The per-community models the engine delivered (models/) and ``communities export`` wrote (exports/*/).

    Each record gets ``source`` (the directory it came from, relative to the run). The numbers are read, not
    recomputed: the report never loads the models (no torch).
    """
    paths = [view.path / "models" / "communities.json"] + sorted(view.path.glob("exports/*/communities.json"))
    for p in paths:
        if not p.is_file():
            continue
        with _reading(p):
            record = read_json(p)
            if not isinstance(record, dict) or not isinstance(record.get("models"), list):
                raise ValueError("expected an object with a 'models' list")
            for e in record["models"]:
                int(e["community"]), list(e["members"])  # noqa: B018 - the fields the report shows must be there
        view.community_models.append({**record, "source": str(p.parent.relative_to(view.path))})


def models_at_round(view: RunView, round_index: int) -> List[dict]:
    """The community-model records of one round (engine models taken at that round's unit, exports of it)."""
    return [r for r in view.community_models if r.get("round") is not None and int(r["round"]) == round_index]


def community_model_rows(record: dict) -> List[Dict[str, object]]:
    """One row per community model of a record: what the report's tables show."""
    level = (f"k={record['k']}" if record.get("k") is not None else
             f"height={record['height']}" if record.get("height") is not None else record.get("kind", "?"))
    return [{"source": record["source"], "round": record.get("round"), "t": record.get("t"), "level": level,
             "community": int(e["community"]), "members": _ranges_plain(e["members"]),
             "local test acc": e.get("local_test_acc"), "shared test acc": e.get("test_acc")}
            for e in record["models"]]


def _ranges_plain(values: Sequence[int], limit: int = 12) -> str:
    """Ranks as ranges; more than ``limit`` ranges are cut, with the count (a population's tables stay short)."""
    text = _ranges(values) if values else "none"
    text = text.removeprefix("rounds ").removeprefix("round ")
    parts = text.split(", ")
    if len(parts) > limit:
        text = ", ".join(parts[:limit]) + f", ... ({len(set(values))} ranks)"
    return text


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def disambiguate(views: Sequence[RunView]) -> None:
    """Legend labels must differ: add the directory when two runs share name and strategy."""
    seen: Dict[str, int] = {}
    for v in views:
        seen[v.label] = seen.get(v.label, 0) + 1
    for v in views:
        if seen[v.label] > 1:
            v.label = f"{v.label} [{v.path.resolve().parent.name}/{v.path.resolve().name}]"
    seen = {}
    for k, v in enumerate(views, 1):
        if v.label in seen:
            v.label = f"{v.label} #{k}"
        seen[v.label] = 1


# --------------------------------------------------------------------------- text


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        v = float(x)
        if not math.isfinite(v):
            return "-"
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 10 ** -digits):
            return f"{x:.{digits}g}"
        return f"{x:.{digits}f}".rstrip("0").rstrip(".")
    return str(x)


def _final_accuracy(view: RunView) -> str:
    """The final accuracies: from summary.json, or, for partial runs, the last evaluation seen."""
    s = view.run.record
    if s is not None:
        return (f"consensus {fmt(s.consensus_test_acc)}; ranks mean {fmt(s.mean_rank_acc)}, "
                f"best {fmt(s.best_rank_acc)}, worst {fmt(s.worst_rank_acc)}")
    parts = []
    if view.consensus_acc.size:
        parts.append(f"consensus {fmt(float(view.consensus_acc[-1]))} (t={int(view.consensus_t[-1])})")
    if view.test_acc.size:
        last = _last_finite(view.test_acc)
        if np.isfinite(last).any():
            parts.append(f"ranks mean {fmt(float(np.nanmean(last)))}, best {fmt(float(np.nanmax(last)))}, "
                         f"worst {fmt(float(np.nanmin(last)))} (last evaluations)")
    return "; ".join(parts) or "no evaluations yet"


def _last_finite(rows: np.ndarray) -> np.ndarray:
    """Each rank's last finite evaluation (NaN for a rank with none)."""
    return np.array([row[np.isfinite(row)][-1] if np.isfinite(row).any() else np.nan for row in rows])


def loss_text(x: Optional[float], lm: LanguageModel) -> str:
    """A language model's loss in both units: ``2.935 nats/token (4.234 bits/byte)``."""
    if x is None or not math.isfinite(x):
        return "-"
    bpb = lm.bpb(x)
    return f"{fmt(x)} nats/token" + (f" ({fmt(bpb)} bits/byte)" if bpb is not None else "")


def _final_loss(view: RunView, lm: LanguageModel) -> str:
    """A language model's final losses (lower is better): from summary.json, or the last evaluations seen."""
    s = view.run.record
    if s is not None:
        ranks = [x for x in (s.rank_test_loss or []) if x is not None]
        return (f"consensus {loss_text(s.consensus_test_loss, lm)}" + (
            f"; ranks mean {loss_text(s.mean_rank_loss, lm)}, best {fmt(min(ranks))}, worst {fmt(max(ranks))}"
            if ranks else ""))
    parts = []
    if np.isfinite(view.consensus_loss).any():
        k = int(np.flatnonzero(np.isfinite(view.consensus_loss))[-1])
        parts.append(f"consensus {loss_text(float(view.consensus_loss[k]), lm)} (t={int(view.consensus_t[k])})")
    if view.test_loss.size:
        last = _last_finite(view.test_loss)
        if np.isfinite(last).any():
            parts.append(f"ranks mean {loss_text(float(np.nanmean(last)), lm)}, best {fmt(float(np.nanmin(last)))}, "
                         f"worst {fmt(float(np.nanmax(last)))} (last evaluations)")
    return "; ".join(parts) or "no evaluations yet"


def summary_text(view: RunView) -> str:
    """The terminal summary of one run: what a user wants to know before opening the report."""
    s = view.run.record
    status = view.status
    lines = [f"== {view.label}: {view.path}"]
    head = f"status {status}, {view.n} ranks"
    if s is None:
        head += " (no summary.json: partial run"
        head += f", read up to round {int(view.round_idx[-1])}, t={int(view.round_t[-1])})" if view.infos else ")"
    lines.append(head)
    if view.infos:
        lines.append(f"rounds: {len(view.infos)} (t={int(view.round_t[0])}..{int(view.round_t[-1])})")
        lines.append(f"communities per round: {compress_counts([int(k) for k in view.n_comm])}")
        coph = view.cophenetic
        struct = f"cophenetic first {fmt(float(coph[0]))}, last {fmt(float(coph[-1]))}"
        if view.groups is not None:
            struct += f"; ARI vs planted groups first {fmt(float(view.ari[0]))}, last {fmt(float(view.ari[-1]))}"
        lines.append(struct)
    else:
        lines.append("rounds: 0 (no complete signature round)")
    if view.lm is not None:  # a language model: judged by its loss; its accuracy is a next-token accuracy
        lines.append(f"final loss: {_final_loss(view, view.lm)}")
        lines.append(f"next-token accuracy: {_final_accuracy(view)}")
    else:
        lines.append(f"final accuracy: {_final_accuracy(view)}")
    if s is None:
        lines.append("consensus: unknown (the run has no summary.json yet)")
    elif s.consensus_reached_t is not None:
        lines.append(f"consensus reached at t={s.consensus_reached_t} (final dispersion {fmt(s.final_dispersion, 4)})")
    else:
        lines.append(f"consensus not reached (final dispersion {fmt(s.final_dispersion, 4)}, {s.units} units)")
    if s is not None and s.consensus_mode:
        lines.append(f"consensus.mode {mode_text(s.consensus_mode)}")
    if s is not None and s.local_test and view.lm is not None:
        lt = s.local_test
        lines.append(f"local test loss: delivered ({lt.get('delivered')}) mean "
                     f"{loss_text(lt.get('mean_loss'), view.lm)}; next-token accuracy {fmt(lt.get('mean_acc'))}")
    elif s is not None and s.local_test:
        lt = s.local_test
        lines.append(f"local test accuracy: delivered ({lt.get('delivered')}) mean {fmt(lt.get('mean_acc'))}; "
                     f"own models {fmt(lt.get('mean_own_acc'))}, consensus {fmt(lt.get('mean_consensus_acc'))}")
    if s is not None and s.privacy:
        lines.append(privacy_text(s.privacy))
    if s is not None and s.pbt:
        lines.append(pbt_text(s.pbt))
    if s is not None and s.time_split:
        lines.append(f"wall time {fmt(s.wall_time)} s: " + wall_split_text(s.time_split))
    return "\n".join(lines)


def privacy_text(dp: dict) -> str:
    """summary.json's privacy in one line: the worst replica's epsilon and what it assumed."""
    sigmas = [x for x in dp.get("noise_multiplier_per_rank", []) if x is not None]
    target = f" (target {fmt(dp.get('target_epsilon'))})" if dp.get("target_epsilon") is not None else ""
    return (f"privacy: epsilon {fmt(dp.get('epsilon_max'))} at delta {dp.get('delta')}{target}, worst replica; "
            f"noise multiplier {fmt(min(sigmas)) if sigmas else '?'}, clipping {dp.get('max_grad_norm')}, "
            f"{dp.get('sampling')} sampling, {dp.get('noise')} noise")


def pbt_text(record: dict) -> str:
    """summary.json's pbt in one line: each learnt value's final median, and per community where there are several."""
    parts = []
    groups = record.get("per_community") or {}
    for name, median in (record.get("median") or {}).items():
        text = f"{name} {fmt(median, 3)}"
        if len(groups) > 1:
            text += " (" + ", ".join(f"c{c}: {fmt(g[name]['median'], 3)}" for c, g in groups.items()) + ")"
        parts.append(text)
    return "pbt: final medians " + "; ".join(parts)


def mode_text(mode: dict) -> str:
    """summary.json's consensus_mode in one line: what was decided, when."""
    head = f"{mode.get('mode')}: "
    if mode.get("decision") == "communities":
        return head + (f"froze {mode.get('communities')} communities at round {mode.get('frozen_round')} "
                       f"(t={mode.get('frozen_t')}); one model each")
    return head + "the communities kept merging into one consensus"


def wall_split_text(split: Dict[str, float]) -> str:
    """The time split as shares of its total (the categories partition each rank's wall time); a population's
    ``turn`` (a replica waiting while the others of its process ran) only where there is one."""
    total = sum(split.values()) or 1.0
    return " / ".join(f"{k} {100 * v / total:.0f}%" for k, v in split.items() if k != "turn" or v > 0)


def round_rows(view: RunView) -> List[Dict[str, object]]:
    """The per-round table: one dict per complete round."""
    out = []
    for k, info in enumerate(view.infos):
        out.append({
            "round": int(view.round_idx[k]), "t": int(view.round_t[k]), "n_communities": int(view.n_comm[k]),
            "cut_height": info.get("cut_height"), "dispersion": info.get("dispersion"),
            "mean_update_norm": info.get("mean_update_norm"), "p_cross": info.get("p_cross"),
            "temperature": info.get("temperature"), "cophenetic": float(view.cophenetic[k]),
            "ari": None if view.groups is None else float(view.ari[k]),
        })
    return out
