"""Post-hoc inspection of run directories: ``communities inspect RUN_DIR [RUN_DIR ...]``.

Why a separate tool: runs end on compute nodes; users look at them afterwards on a
login node that has no MPI and often no torch. So this module reads only the
results layout (docs/results-layout.md) through ``communities.results`` and uses
numpy, scipy, matplotlib, json and scikit-learn (for the adjusted Rand index). It
never imports torch or mpi4py. (It is not called ``inspect.py``: that would shadow
the standard library module.)

What it writes to ``--out`` (default ``RUN_DIR/report``, or
``FIRST_RUN/../compare_report`` for several runs):

- ``index.html``: opens from disk (relative image paths, no server, no JS);
- ``curves.png``: dispersion, merge update norms, p_cross and temperature
  schedules, test accuracy (ranks, their mean, the consensus model), bytes sent,
  community count, cophenetic correlation and ARI, all over virtual time t;
  several runs are overlaid in one figure;
- ``timeline.png``: ranks x rounds coloured by community, with ids kept stable
  across rounds (``stable_labels``) so splits and merges read as such;
- ``merge_matrix.png``: how often each pair of ranks merged, in the final round's
  dendrogram leaf order;
- ``dendrogram_round_NNNN.png``: one per complete round by default (``--round``,
  ``--every``, ``--last`` pick fewer), cut drawn at ``cut_height``, leaf labels
  coloured by planted group, truncated for many ranks;
- ``rounds.csv``: the per-round table (t, communities, dispersion, cophenetic, ARI);
- SVG copies of the figures that stay small (``--no-svg`` turns them off): a
  dendrogram gets one only when it is drawn untruncated (at most 128 ranks).

It also prints a short terminal summary. Partial runs (killed mid-way) are read
up to their last complete round; a missing or damaged file is reported in one
line naming it, with exit status 2. Two kinds of damage only warn (naming the
file) and the rest is read: a ``round_NNNN`` directory that lacks a file (rounds
are renamed into place whole, so it is left out), and damage in the last round
of a run that did not finish (the tail of the crash). Hidden ``.round_*``
temporaries, rounds still being built, are skipped silently.

It also checks what a run vouches for: ``consensus.pt`` against the size and
BLAKE2b digest in ``meta.json`` (a mismatch is an error naming it) and each
complete checkpoint against its manifest (a mismatch is a warning saying which
checkpoint ``--resume`` would take instead). A run whose ``meta.json`` says
``running`` but whose process is gone (nobody holds its lock, and its pid is dead
or its heartbeat old: communities/runlock.py) is reported as ``interrupted``.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import html
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from scipy.cluster import hierarchy
from scipy.optimize import linear_sum_assignment
from scipy.spatial.distance import pdist

from .. import manifest, runlock
from ..core.clustering import adjusted_rand
from ..results import ResultsError, Run, load_round, open_run

DPI = 100
MAX_DENDROGRAM_LEAVES = 128  # draw every leaf up to this many ranks; beyond, truncate
TRUNCATE_P = 64  # leaves shown by truncate_mode="lastp"
SVG_MAX_ELEMENTS = 40_000  # drawn points/cells (a line counts 50) above which an SVG passes ~1 MB

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_DAMAGED = 2


# --------------------------------------------------------------------------- pure helpers


def _first_appearance(labels: np.ndarray) -> np.ndarray:
    """Codes 0.. in order of first appearance by rank, so equal partitions get equal codes."""
    labels = np.asarray(labels).ravel()
    if labels.size == 0:
        return labels.astype(np.int64)
    _, first, inv = np.unique(labels, return_index=True, return_inverse=True)
    code = np.empty(first.size, dtype=np.int64)
    code[np.argsort(first, kind="stable")] = np.arange(first.size)
    return code[inv.ravel()]


def stable_labels(label_arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Community ids that persist across rounds (rounds x N), so a timeline shows splits and merges.

    Raw labels are renumbered every round, so colouring by them would make
    communities flicker. Round 0 keeps its labels (renumbered by first appearance).
    Each later round is matched to the previous round's ids by maximum total overlap
    (``linear_sum_assignment`` on the contingency table):

    - a matched community keeps the id it overlaps;
    - an unmatched one (the smaller part of a split, or one with no overlap) gets a
      fresh id, never used before;
    - when communities merge, the merged one keeps the id of the part it overlaps
      most; the other id ends.

    Ties go to the older (smaller) id and to the community holding the lowest rank,
    so the result is a deterministic function of the inputs.
    """
    arrays = [np.asarray(a).ravel() for a in label_arrays]
    if not arrays:
        return np.zeros((0, 0), dtype=np.int64)
    n = arrays[0].size
    for r, a in enumerate(arrays):
        if a.size != n:
            raise ValueError(f"round {r} labels {a.size} ranks, round 0 labels {n}")
    out = np.empty((len(arrays), n), dtype=np.int64)
    out[0] = _first_appearance(arrays[0])
    next_id = int(out[0].max()) + 1 if n else 0
    for r in range(1, len(arrays)):
        prev_ids, prev_code = np.unique(out[r - 1], return_inverse=True)
        cur = _first_appearance(arrays[r])
        n_prev, n_cur = prev_ids.size, int(cur.max()) + 1 if n else 0
        overlap = np.zeros((n_prev, n_cur), dtype=np.int64)
        np.add.at(overlap, (prev_code.ravel(), cur), 1)
        # A tie-break below one unit of overlap in total: it never changes the total
        # overlap, only which of the equally good matchings is chosen.
        k = min(n_prev, n_cur) + 1
        tie = (np.arange(n_prev)[:, None] * n_cur + np.arange(n_cur)[None, :] + 1) / ((n_prev * n_cur + 1) * k)
        rows, cols = linear_sum_assignment(overlap - tie, maximize=True)
        new_id = np.full(n_cur, -1, dtype=np.int64)
        for p, c in zip(rows, cols):
            if overlap[p, c] > 0:
                new_id[c] = prev_ids[p]
        for c in range(n_cur):
            if new_id[c] < 0:
                new_id[c] = next_id
                next_id += 1
        out[r] = new_id[cur]
    return out


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
    keys = set()
    for r in rows:
        if r.get("event", "merge") != "merge":
            continue
        i, j = int(r["i"]), int(r["j"])
        if i == j:
            continue
        lo, hi = (i, j) if i < j else (j, i)
        keys.add((int(r["t"]), lo, hi, r.get("initiator")))
    M = np.zeros((n, n), dtype=np.int64)
    if keys:
        pairs = np.array([(k[1], k[2]) for k in keys], dtype=np.int64)
        np.add.at(M, (pairs[:, 0], pairs[:, 1]), 1)
        M = M + M.T
    return M


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


@contextlib.contextmanager
def recursion_limit(limit: int) -> Iterator[None]:
    """Raise Python's recursion limit for a block: scipy's dendrogram recurses once per tree level."""
    old = sys.getrecursionlimit()
    if limit > old:
        sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _members(Z: np.ndarray, node: int) -> List[int]:
    """Leaves under a node of a linkage tree, without recursion (trees can be 2000 deep)."""
    n = Z.shape[0] + 1
    out, stack = [], [int(node)]
    while stack:
        k = stack.pop()
        if k < n:
            out.append(k)
        else:
            row = Z[k - n]
            stack.extend((int(row[1]), int(row[0])))
    return out


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
    n: int
    groups: Optional[np.ndarray]
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
    consensus_t: np.ndarray = field(default_factory=lambda: np.zeros(0))
    consensus_acc: np.ndarray = field(default_factory=lambda: np.zeros(0))
    merge_t: np.ndarray = field(default_factory=lambda: np.zeros(0))
    merge_norm: np.ndarray = field(default_factory=lambda: np.zeros(0))  # mean update norm per t
    merge_matrix: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), int))
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
    found = manifest.complete_dirs(path / "checkpoints")
    intact = None
    damaged = []
    for d in found:
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


def load_view(path: Path) -> RunView:
    """Open a (possibly partial) run and derive every series the report draws. Raises ResultsError."""
    path = Path(path)
    run = open_run(path)
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
    groups = None
    with _reading(path / "partition.json"):
        if run.partition.get("groups") is not None:
            groups = np.asarray(run.partition["groups"], dtype=np.int64)
            if groups.shape != (n,):
                raise ValueError(f"'groups' has {groups.size} entries for {n} ranks")
    summary = run.summary or {}
    name = str(summary.get("name") or run.config.get("name") or path.name)
    strategy = str(run.meta.get("strategy") or run.config.get("strategy") or summary.get("strategy") or "?")
    view = RunView(run=run, label=f"{name} ({strategy})", name=name, strategy=strategy, n=n, groups=groups)
    view.status = run_status(path, run.meta, view.notes)
    check_products(path, run.meta, view.notes)

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
                view.notes.append(f"{_one_line(exc)}; the run did not finish (status "
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

    with _reading(path / "metrics.jsonl"):
        rows = [r for r in run.metrics() if int(r["rank"]) >= 0]
        if rows:
            t = np.fromiter((int(r["t"]) for r in rows), dtype=np.int64, count=len(rows))
            rank = np.fromiter((int(r["rank"]) for r in rows), dtype=np.int64, count=len(rows))
            if rank.max() >= n:
                raise ValueError(f"rank {int(rank.max())} outside world size {n}")
            acc = np.fromiter((_num(r.get("test_acc")) for r in rows), dtype=float, count=len(rows))
            byt = np.fromiter((_num(r.get("bytes_sent")) for r in rows), dtype=float, count=len(rows))
            view.metric_t, col = np.unique(t, return_inverse=True)
            view.test_acc = np.full((n, view.metric_t.size), np.nan)
            view.bytes_sent = np.full((n, view.metric_t.size), np.nan)
            view.test_acc[rank, col] = acc
            view.bytes_sent[rank, col] = byt
    with _reading(path / "consensus.jsonl"):
        rows = [r for r in run.consensus_evals() if r.get("test_acc") is not None]
        view.consensus_t = np.array([int(r["t"]) for r in rows], dtype=float)
        view.consensus_acc = np.array([float(r["test_acc"]) for r in rows], dtype=float)
    with _reading(path / "merges.jsonl"):
        rows = [r for r in run.merges() if r.get("event", "merge") == "merge"]
        view.merge_matrix = merge_counts(rows, n)
        norm_rows = [(int(r["t"]), float(r["update_norm"])) for r in rows if r.get("update_norm") is not None]
        if norm_rows:
            arr = np.asarray(norm_rows, dtype=float)
            ut, inv = np.unique(arr[:, 0], return_inverse=True)
            view.merge_t = ut
            view.merge_norm = np.bincount(inv, weights=arr[:, 1]) / np.bincount(inv)
    return view


# --------------------------------------------------------------------------- text


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x).lower()
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(x):
            return "-"
        if x != 0 and (abs(x) >= 1e5 or abs(x) < 10 ** -digits):
            return f"{x:.{digits}g}"
        return f"{x:.{digits}f}".rstrip("0").rstrip(".")
    return str(x)


def _final_accuracy(view: RunView) -> str:
    """The final accuracies: from summary.json, or, for partial runs, the last evaluation seen."""
    s = view.run.record
    if s is not None:
        return (f"consensus {_fmt(s.consensus_test_acc)}; ranks mean {_fmt(s.mean_rank_acc)}, "
                f"best {_fmt(s.best_rank_acc)}, worst {_fmt(s.worst_rank_acc)}")
    parts = []
    if view.consensus_acc.size:
        parts.append(f"consensus {_fmt(float(view.consensus_acc[-1]))} (t={int(view.consensus_t[-1])})")
    if view.test_acc.size:
        last = np.array([row[np.isfinite(row)][-1] if np.isfinite(row).any() else np.nan for row in view.test_acc])
        if np.isfinite(last).any():
            parts.append(f"ranks mean {_fmt(float(np.nanmean(last)))}, best {_fmt(float(np.nanmax(last)))}, "
                         f"worst {_fmt(float(np.nanmin(last)))} (last evaluations)")
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
        struct = f"cophenetic first {_fmt(float(coph[0]))}, last {_fmt(float(coph[-1]))}"
        if view.groups is not None:
            struct += f"; ARI vs planted groups first {_fmt(float(view.ari[0]))}, last {_fmt(float(view.ari[-1]))}"
        lines.append(struct)
    else:
        lines.append("rounds: 0 (no complete signature round)")
    lines.append(f"final accuracy: {_final_accuracy(view)}")
    if s is None:
        lines.append("consensus: unknown (the run has no summary.json yet)")
    elif s.consensus_reached_t is not None:
        lines.append(f"consensus reached at t={s.consensus_reached_t} (final dispersion {_fmt(s.final_dispersion, 4)})")
    else:
        lines.append(f"consensus not reached (final dispersion {_fmt(s.final_dispersion, 4)}, {s.units} units)")
    return "\n".join(lines)


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


# --------------------------------------------------------------------------- figures


def _palette(k: int) -> List[tuple]:
    """k distinguishable colours: tab10/tab20, then golden-ratio hues."""
    from matplotlib import colormaps
    from matplotlib.colors import hsv_to_rgb

    if k <= 10:
        return [colormaps["tab10"](i) for i in range(max(k, 1))]
    if k <= 20:
        return [colormaps["tab20"](i) for i in range(k)]
    return [tuple(hsv_to_rgb(((i * 0.618034) % 1.0, 0.55 + 0.35 * (i % 3) / 2, 0.95 - 0.3 * (i % 2)))) + (1.0,)
            for i in range(k)]


def _group_palette(k: int) -> List[tuple]:
    """Planted-group colours, from a different palette than communities so no match is implied."""
    from matplotlib import colormaps

    if k <= 8:
        return [colormaps["Dark2"](i) for i in range(max(k, 1))]
    return _palette(k)[::-1]


def _node_communities(Z: np.ndarray, community: np.ndarray) -> np.ndarray:
    """Community of every tree node (leaves then merges), -1 where a node spans several. O(N), no recursion."""
    n = Z.shape[0] + 1
    node = np.empty(2 * n - 1, dtype=np.int64)
    node[:n] = community
    for k in range(n - 1):
        a, b = node[int(Z[k, 0])], node[int(Z[k, 1])]
        node[n + k] = a if a == b else -1
    return node


def _save(fig, out: Path, stem: str, svg: bool, release: bool = True) -> List[str]:
    """Write PNG (and SVG) and, unless the figure is reused, release it; return the file names written."""
    names = [f"{stem}.png"]
    fig.savefig(out / names[0], dpi=DPI)
    if svg:
        names.append(f"{stem}.svg")
        fig.savefig(out / names[1])
    if release:
        fig.clear()
    return names


def _figure(w: float, h: float, constrained: bool = False):
    """A Figure without pyplot: no global state, no GUI backend, nothing to close.

    Constrained layout measures every tick label several times per save; for
    figures with many labels (dendrograms) fixed margins are several times faster.
    """
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=DPI, layout="constrained" if constrained else None)


def plot_dendrogram(ax, Z: np.ndarray, groups: Optional[np.ndarray] = None, cut_height: Optional[float] = None,
                    max_leaves: Optional[int] = MAX_DENDROGRAM_LEAVES, p: int = TRUNCATE_P,
                    communities: Optional[np.ndarray] = None, palette: Optional[List[tuple]] = None) -> dict:
    """Draw one round's tree on ``ax``; returns scipy's dendrogram dict.

    More than ``max_leaves`` ranks are truncated to the last ``p`` merged clusters
    (``truncate_mode='lastp'``); ``max_leaves=None`` never truncates. Leaf labels are
    coloured by planted group (a contracted leaf only when all its ranks share one).
    Links inside one community take that community's colour (``palette[id]``, the
    timeline's colours) when ``communities`` is given, else scipy colours the links
    below the cut; the cut is a dashed line.
    """
    Z = np.asarray(Z, dtype=np.float64)
    n = Z.shape[0] + 1
    truncate = max_leaves is not None and n > max_leaves
    shown = min(p, n) if truncate else n
    kw = dict(truncate_mode="lastp", p=p, show_contracted=True) if truncate else {}
    font = 9 if shown <= 32 else 7 if shown <= 64 else 5 if shown <= 160 else 3
    color_threshold = float(cut_height) if cut_height is not None and math.isfinite(cut_height) else 0.0
    if communities is not None:
        from matplotlib.colors import to_hex

        node = _node_communities(Z, np.asarray(communities))
        hexes = [to_hex(c) for c in (palette or _palette(int(node.max()) + 1))]
        kw["link_color_func"] = lambda k: hexes[node[k] % len(hexes)] if node[k] >= 0 else "#666666"

    with recursion_limit(2 * n + 1000):
        R = hierarchy.dendrogram(Z, ax=ax, color_threshold=color_threshold, above_threshold_color="#666666",
                                 leaf_rotation=90, leaf_font_size=font, no_labels=shown > 512, **kw)
    if color_threshold > 0:
        ax.axhline(color_threshold, color="k", linestyle="--", linewidth=1, label=f"cut {color_threshold:.3g}")
    if groups is not None and shown <= 512:
        gpal = _group_palette(int(groups.max()) + 1)
        for text, leaf in zip(ax.get_xticklabels(), R["leaves"]):
            g = np.unique(groups[_members(Z, leaf)])
            text.set_color(gpal[int(g[0])] if g.size == 1 else "0.3")
        from matplotlib.patches import Patch

        handles = [Patch(color=gpal[g], label=f"group {g}") for g in range(min(len(gpal), 20))]
        ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=7, loc="upper right",
                  ncol=2 if len(handles) > 6 else 1, title="leaf colour: planted group", title_fontsize=7)
    elif color_threshold > 0:
        ax.legend(fontsize=7, loc="upper right")
    ax.set_ylabel("linkage height")
    ax.set_xlabel(f"rank (truncated to the last {shown} clusters; '(k)' = k ranks)" if truncate else "rank")
    return R


class _DendrogramCanvas:
    """One Figure and Axes reused for every dendrogram of a run (they all have the same size).

    Most of the time of drawing a tree goes to matplotlib making one tick object per leaf
    and laying out the leaf labels; a reused Axes keeps its ticks, so each round only
    replaces the links, the cut line, the legend and the texts. A fresh Figure per round
    costs about 0.25 s for 64 ranks, a reused one about 0.15 s (PNG, Agg).
    """

    def __init__(self) -> None:
        self.fig = None
        self.ax = None
        self._size: Optional[Tuple[float, float]] = None

    def axes(self, w: float, h: float):
        """An empty Axes of a (w x h inch) figure, with the leaf ticks of the previous round kept."""
        if self.fig is None or self._size != (w, h):
            self.close()
            self.fig = _figure(w, h)
            self.fig.subplots_adjust(left=0.8 / w, right=1 - 0.25 / w, bottom=0.16, top=0.92)
            self.ax = self.fig.add_subplot()
            self._size = (w, h)
            return self.ax
        ax = self.ax
        for artist in {id(a): a for a in (*ax.collections, *ax.lines, *ax.patches, *ax.texts, *ax.images)}.values():
            artist.remove()
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        return ax

    def close(self) -> None:
        if self.fig is not None:
            self.fig.clear()
        self.fig = self.ax = self._size = None


def _dendrogram_figure(view: RunView, k: int, out: Path, stem: str, svg: bool,
                       canvas: Optional[_DendrogramCanvas] = None) -> List[str]:
    Z = view.Zs[k]
    n = view.n
    shown = min(TRUNCATE_P, n) if n > MAX_DENDROGRAM_LEAVES else n
    w = min(18.0, max(7.0, 0.14 * shown + 2))
    own = canvas is None
    canvas = canvas or _DendrogramCanvas()
    ax = canvas.axes(w, 5.0)
    info = view.infos[k]
    plot_dendrogram(ax, Z, view.groups, info.get("cut_height"), communities=view.stable[k],
                    palette=_palette(int(view.stable.max()) + 1))
    title = (f"{view.label}: round {int(view.round_idx[k])} (t={int(view.round_t[k])}), "
             f"{int(view.n_comm[k])} communities, {info.get('linkage', '?')}/{info.get('metric', '?')}, "
             f"cophenetic {_fmt(float(view.cophenetic[k]))}")
    if view.groups is not None:
        title += f", ARI {_fmt(float(view.ari[k]))}"
    # A fixed title position: matplotlib otherwise measures every leaf label to place it.
    ax.set_title(title, fontsize=9, y=1.0)
    # Truncated trees still carry a marker per contracted merge: SVG only for untruncated ones.
    return _save(canvas.fig, out, stem, svg and n <= MAX_DENDROGRAM_LEAVES, release=own)


def _timeline_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    from matplotlib.colors import ListedColormap

    S = view.stable  # rounds x N
    R, n = S.shape
    # Rows grouped by their whole history (first round first), so splits show as a block dividing.
    order = np.lexsort(S[::-1]) if R else np.arange(n)
    n_ids = int(S.max()) + 1
    cmap = ListedColormap(_palette(n_ids))
    has_groups = view.groups is not None
    w, h = min(16.0, max(7.0, 0.18 * R + 3)), min(14.0, max(4.0, 0.12 * n + 1.5))
    fig = _figure(w, h)
    fig.subplots_adjust(left=0.55 / w, right=1 - 1.3 / w, bottom=0.75 / h, top=1 - 0.4 / h)
    if has_groups:
        gs = fig.add_gridspec(1, 2, width_ratios=[0.35, w - 2.2], wspace=0.6 / w * 4,
                              left=0.2 / w, right=1 - 1.3 / w, bottom=0.75 / h, top=1 - 0.4 / h)
        gax, ax = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
        gpal = ListedColormap(_group_palette(int(view.groups.max()) + 1))
        gax.imshow(view.groups[order][:, None], aspect="auto", interpolation="nearest", cmap=gpal,
                   vmin=-0.5, vmax=int(view.groups.max()) + 0.5)
        gax.set_xticks([0], ["group"], fontsize=7)
        gax.set_yticks([])
    else:
        ax = fig.add_subplot()
    ax.imshow(S[:, order].T, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=n_ids - 0.5)
    step = max(1, int(math.ceil(R / 25)))
    ax.set_xticks(np.arange(0, R, step), [str(int(t)) for t in view.round_t[::step]], fontsize=7,
                  rotation=90 if R > 12 else 0)
    ax.set_xlabel("virtual time t of the signature round")
    if n <= 64:
        ax.set_yticks(np.arange(n), [str(int(r)) for r in order], fontsize=6 if n > 32 else 8)
        ax.set_ylabel("rank")
    else:
        ax.set_yticks([])
        ax.set_ylabel(f"{n} ranks (grouped by community history)")
    if n_ids <= 20:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=cmap(i), label=str(i)) for i in range(n_ids)], title="community",
                  fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{view.label}: communities per round (ids matched across rounds)", fontsize=9)
    return _save(fig, out, stem, svg and n * R <= SVG_MAX_ELEMENTS and n <= 256)


def _merge_matrix_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    """Merges per pair in the final round's leaf order (where the run ended up) and, beside it,
    in the first round's order (where the communities were sharpest), so both who-merged-with-whom
    and how much gossip stayed inside the early communities are visible."""
    n = view.n
    orders = []
    if view.Zs and n > 1:
        orders.append(("the final round's dendrogram leaf order", hierarchy.leaves_list(view.Zs[-1])))
        if len(view.Zs) > 1:
            orders.append(("the first round's dendrogram leaf order", hierarchy.leaves_list(view.Zs[0])))
    else:
        orders.append(("rank order (no rounds)", np.arange(n)))
    w = 7.0 * len(orders) + 0.8
    fig = _figure(w, 6.8)
    fig.subplots_adjust(left=0.5 / w, right=1 - 0.2 / w, bottom=0.08, top=0.9, wspace=0.12)
    axes = fig.subplots(1, len(orders), squeeze=False)[0]
    vmax = max(1, int(view.merge_matrix.max()))
    for ax, (where, order) in zip(axes, orders):
        M = view.merge_matrix[np.ix_(order, order)]
        im = ax.imshow(M, interpolation="nearest", cmap="magma_r", vmin=0, vmax=vmax)
        if n <= 64:
            labels = [str(int(r)) for r in order]
            ax.set_xticks(np.arange(n), labels, fontsize=5 if n > 32 else 7, rotation=90)
            ax.set_yticks(np.arange(n), labels, fontsize=5 if n > 32 else 7)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(f"in {where}", fontsize=9)
    fig.colorbar(im, ax=list(axes), label="exchanges", shrink=0.9)
    fig.suptitle(f"{view.label}: merges per pair ({int(view.merge_matrix.sum() // 2)} exchanges)", fontsize=10)
    return _save(fig, out, stem, svg and n <= 128)


def _lines(ax, x: np.ndarray, Y: np.ndarray, color, alpha: float = 0.25, lw: float = 0.6) -> int:
    """One thin line per row of Y (NaNs skipped) as a single LineCollection; returns points drawn."""
    from matplotlib.collections import LineCollection

    segs = []
    for row in Y:
        ok = np.isfinite(row)
        if ok.sum() >= 1:
            segs.append(np.column_stack([x[ok], row[ok]]))
    if segs:
        ax.add_collection(LineCollection(segs, colors=[color], alpha=alpha, linewidths=lw))
        ax.autoscale_view()
    return int(sum(len(s) for s in segs)) + 50 * len(segs)


def _nanmean_cols(Y: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Column means over the rows that have a value; the mask of columns with any value."""
    ok = np.isfinite(Y).any(axis=0)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.nanmean(Y[:, ok], axis=0) if ok.any() else np.zeros(0), ok


def plot_curves(views: Sequence[RunView], out: Path, stem: str, svg: bool) -> List[str]:
    """The over-t panels; one run shows its ranks too, several runs are overlaid (colour = run)."""
    overlay = len(views) > 1
    fig = _figure(15.0, 11.0)
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.05, top=0.92 if overlay else 0.93, hspace=0.38, wspace=0.18)
    axes = fig.subplots(3, 3)
    (a_disp, a_norm, a_pc), (a_temp, a_acc, a_bytes), (a_k, a_coph, a_ari) = axes
    colours = _palette(max(len(views), 1)) if overlay else [None]
    points = 0
    has = {id(ax): False for ax in axes.ravel()}

    def plot(ax, x, y, **kw):
        nonlocal points
        x, y = np.asarray(x, float), np.asarray(y, float)
        ok = np.isfinite(y)
        if ok.any():
            ax.plot(x[ok], y[ok], **kw)
            has[id(ax)] = True
            points += int(ok.sum())

    for v, c in zip(views, colours):
        col = c if overlay else "C0"
        lab = v.label if overlay else None
        rt = v.round_t.astype(float)
        plot(a_disp, rt, v.series("dispersion"), color=col, marker=".", label=lab)
        if v.merge_t.size:
            plot(a_norm, v.merge_t, v.merge_norm, color=col, linewidth=0.7, alpha=0.6,
                 label=lab if overlay else "mean per unit (merges.jsonl)")
        plot(a_norm, rt, v.series("mean_update_norm"), color=col if overlay else "C3", marker="o", markersize=3,
             linestyle="none" if not overlay else "--", label=None if overlay else "mean per round (round.json)")
        plot(a_pc, rt, v.series("p_cross"), color=col, marker=".", label=lab)
        plot(a_temp, rt, v.series("temperature"), color=col, marker=".", label=lab)
        if v.test_acc.size:
            mean, ok = _nanmean_cols(v.test_acc)
            tt = v.metric_t.astype(float)
            if not overlay and ok.any():
                points += _lines(a_acc, tt, v.test_acc, "C0")
                a_acc.plot([], [], color="C0", alpha=0.4, linewidth=0.6, label=f"each rank ({v.n})")
            plot(a_acc, tt[ok], mean, color=col if overlay else "C1", linewidth=2,
                 label=lab if overlay else "mean over ranks")
            b_mean, b_ok = _nanmean_cols(v.bytes_sent / 1e6)
            if not overlay and b_ok.any():
                points += _lines(a_bytes, tt, v.bytes_sent / 1e6, "C0")
                a_bytes.plot([], [], color="C0", alpha=0.4, linewidth=0.6, label="each rank")
            plot(a_bytes, tt[b_ok], b_mean, color=col if overlay else "C1", linewidth=2,
                 label=lab if overlay else "mean over ranks")
        if v.consensus_acc.size:
            plot(a_acc, v.consensus_t, v.consensus_acc, color=col if overlay else "k", linestyle="--", marker="s",
                 markersize=3, label=None if overlay else "consensus model")
        plot(a_k, rt, v.n_comm, color=col, drawstyle="steps-post", marker=".", label=lab)
        plot(a_coph, rt, v.cophenetic, color=col, marker=".", label=lab)
        if v.groups is not None:
            plot(a_ari, rt, v.ari, color=col, marker=".", label=lab)

    titles = {
        id(a_disp): "signature dispersion", id(a_norm): "merge update norm ||w_after - w_before||",
        id(a_pc): "p_cross schedule (flat law)", id(a_temp): "temperature schedule (hierarchical law)",
        id(a_acc): "test accuracy" + (" (solid: rank mean, dashed: consensus)" if overlay else ""),
        id(a_bytes): "bytes sent per rank, cumulative (MB)", id(a_k): "communities",
        id(a_coph): "cophenetic correlation", id(a_ari): "ARI vs planted groups",
    }
    for ax in axes.ravel():
        ax.set_title(titles[id(ax)], fontsize=10)
        ax.set_xlabel("virtual time t", fontsize=8)
        ax.tick_params(labelsize=8)
        if not has[id(ax)]:
            empty = "no planted groups" if ax is a_ari else "no data"
            ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="0.5")
        ax.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    a_k.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (a_disp, a_temp):
        ys = [ln.get_ydata() for ln in ax.get_lines()]
        if ys and all(np.all(np.asarray(y, float) > 0) for y in ys if len(y)):
            ax.set_yscale("log")
    if overlay:
        handles, labels = a_k.get_legend_handles_labels()
        if not handles:  # runs without rounds: take the accuracy panel's
            handles, labels = a_acc.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(views)), fontsize=9, frameon=False)
    else:
        for ax in (a_norm, a_acc, a_bytes):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle(f"{views[0].label}: {views[0].path}", fontsize=11)
    return _save(fig, out, stem, svg and points <= SVG_MAX_ELEMENTS)


# --------------------------------------------------------------------------- report

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1600px;color:#222}
img{max-width:100%;border:1px solid #ddd;margin:.3em 0}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;vertical-align:top}
th{background:#f3f3f3} td.k{text-align:left;font-family:monospace}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto} .note{color:#a50}
section{margin-bottom:2em}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _value_html(v) -> str:
    """A summary/meta value in a table cell; long lists are shortened."""
    if isinstance(v, dict):
        return ", ".join(f"{_e(k)}: {_e(_fmt(x))}" for k, x in v.items())
    if isinstance(v, list):
        shown = ", ".join(_e(_fmt(x)) for x in v[:16])
        return f"[{shown}{', ...' if len(v) > 16 else ''}]" + (f" ({len(v)} values)" if len(v) > 16 else "")
    return _e(_fmt(v, 4))


def _img(names: List[str], alt: str) -> str:
    links = " ".join(f'<a href="{_e(n)}">{_e(n.rsplit(".", 1)[1])}</a>' for n in names)
    return f'<figure><img src="{_e(names[0])}" alt="{_e(alt)}" loading="lazy"><figcaption>{links}</figcaption></figure>'


def _kv_table(d: dict) -> str:
    rows = "".join(f'<tr><td class="k">{_e(k)}</td><td style="text-align:left">{_value_html(v)}</td></tr>'
                   for k, v in d.items())
    return f"<table>{rows}</table>"


def _round_table(rows: List[dict]) -> str:
    if not rows:
        return "<p>No complete signature round.</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{_e(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_e(_fmt(r[c], 4))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _write_csv(path: Path, rows: List[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        if not rows:
            return
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _run_section(view: RunView, out: Path, prefix: str, picked: List[int], note: str, svg: bool,
                 heading: bool) -> str:
    """One run's figures and tables (shared by the single-run and the comparison report)."""
    parts = [f'<section><h2>{_e(view.label)}</h2><p><code>{_e(view.path)}</code></p>' if heading else "<section>"]
    parts.append(f"<pre>{_e(summary_text(view))}</pre>")
    for msg in view.notes:
        parts.append(f'<p class="note">{_e(msg)}</p>')
    if view.infos:
        parts.append("<h3>Community timeline</h3><p>Each round's communities are matched to the previous "
                     "round's by largest overlap: a community keeps its id (and colour) across rounds, the "
                     "smaller part of a split gets a new id, and a merge keeps the id of its larger part. "
                     "Dendrogram links use the same colours.</p>")
        parts.append(_img(_timeline_figure(view, out, f"{prefix}timeline", svg), "community timeline"))
    parts.append("<h3>Merge matrix</h3>")
    parts.append(_img(_merge_matrix_figure(view, out, f"{prefix}merge_matrix", svg), "merge matrix"))
    if view.n < 2:
        picked, note = [], "no dendrograms: a world of one rank has no tree"
    parts.append(f"<h3>Dendrograms</h3><p>{_e(note)}.</p>")
    pos = {int(r): k for k, r in enumerate(view.round_idx)}
    canvas = _DendrogramCanvas()
    try:
        for r in picked:
            names = _dendrogram_figure(view, pos[r], out, f"{prefix}dendrogram_round_{r:04d}", svg, canvas)
            parts.append(_img(names, f"dendrogram of round {r}"))
    finally:
        canvas.close()
    rows = round_rows(view)
    _write_csv(out / f"{prefix}rounds.csv", rows)
    parts.append(f'<h3>Rounds</h3><p><a href="{_e(prefix)}rounds.csv">rounds.csv</a></p>')
    parts.append(f"<details open><summary>{len(rows)} rounds</summary>{_round_table(rows)}</details>")
    if view.run.summary is not None:
        parts.append("<h3>summary.json</h3>" + _kv_table(view.run.summary))
    else:
        parts.append("<h3>summary.json</h3><p>Not written: the run has not finished (partial run).</p>")
    parts.append("<details><summary>meta.json</summary>" + _kv_table(view.run.meta) + "</details>")
    parts.append("</section>")
    return "\n".join(parts)


def _compare_table(views: Sequence[RunView]) -> str:
    keys: List[str] = []
    for v in views:
        for k in (v.run.summary or {}):
            if k not in keys:
                keys.append(k)
    head = "<tr><th></th>" + "".join(f"<th>{_e(v.label)}</th>" for v in views) + "</tr>"
    extra = [("status", [v.status for v in views]),
             ("rounds read", [len(v.infos) for v in views]),
             ("communities per round", [compress_counts([int(k) for k in v.n_comm]) for v in views])]
    body = "".join(f'<tr><td class="k">{_e(k)}</td>' + "".join(f"<td>{_value_html(x)}</td>" for x in vals) + "</tr>"
                   for k, vals in extra)
    for k in keys:
        body += f'<tr><td class="k">{_e(k)}</td>' + "".join(
            f"<td>{_value_html((v.run.summary or {}).get(k))}</td>" for v in views) + "</tr>"
    return f"<table>{head}{body}</table>"


def write_report(views: Sequence[RunView], out: Path, picks: Sequence[Tuple[List[int], str]], svg: bool = True) -> Path:
    """Write every figure and ``index.html`` into ``out``; return the index path."""
    out.mkdir(parents=True, exist_ok=True)
    compare = len(views) > 1
    title = "comparison: " + ", ".join(v.label for v in views) if compare else views[0].label
    body = [f"<h1>communities inspect: {_e(title)}</h1>"]
    body.append(f"<p>Generated {_e(time.strftime('%Y-%m-%d %H:%M:%S'))}. Virtual time t counts completed units.</p>")
    body.append("<h2>Curves</h2>" + _img(plot_curves(views, out, "curves", svg), "curves over t"))
    if compare:
        body.append("<h2>Summaries</h2>" + _compare_table(views))
        for k, (v, (picked, note)) in enumerate(zip(views, picks), 1):
            body.append(_run_section(v, out, f"run{k}_", picked, note, svg, heading=True))
    else:
        body.append(_run_section(views[0], out, "", picks[0][0], picks[0][1], svg, heading=False))
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
           f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    index = out / "index.html"
    index.write_text(doc, encoding="utf-8")
    return index


# --------------------------------------------------------------------------- command line


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="communities inspect",
        description="Inspect finished or partial runs: dendrograms, community timeline, curves, merge matrix, "
        "HTML report. Several RUN_DIRs are compared in one report.",
        epilog="--round, --every and --last choose which dendrograms are drawn (their union). Without them: "
        "one per complete round (a comparison: each run's first and last; --every 1 draws all). Curves, "
        "timeline and tables always cover every complete round. "
        "Exit status: 0 done, 2 a missing or damaged file or a bad argument, 1 the report could not be written.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="results/<name> directory of a run")
    p.add_argument("--round", dest="rounds", type=int, action="append", metavar="N",
                   help="draw the dendrogram of round N (the NNNN of rounds/round_NNNN); repeatable")
    p.add_argument("--every", type=_positive, metavar="K",
                   help="draw every K-th saved round's dendrogram, from the first")
    p.add_argument("--last", action="store_true", help="draw the last complete round's dendrogram")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="report directory (default RUN_DIR/report; for several runs FIRST_RUN/../compare_report)")
    p.add_argument("--no-svg", action="store_true", help="PNG only (SVG copies are otherwise written where small)")
    return p


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def main_inspect(argv: Optional[List[str]] = None) -> int:
    """``communities inspect``: returns 0 on success, 2 for a missing/damaged file or a bad argument."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error: return the code instead of exiting the caller
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_DAMAGED)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("communities inspect: error: matplotlib is needed for the report: pip install 'communities[inspect]'",
              file=sys.stderr)
        return EXIT_ERROR
    start = time.perf_counter()
    try:
        views = [load_view(Path(p)) for p in args.run_dirs]
    except ResultsError as exc:
        print(f"communities inspect: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_DAMAGED
    _disambiguate(views)
    picks = []
    for v in views:
        try:
            # One run: a dendrogram per round. A comparison shows each run's first and last tree
            # unless told otherwise (its point is the overlaid curves).
            cap = 0 if len(views) > 1 else None
            picks.append(select_rounds([int(r) for r in v.round_idx], args.rounds, args.every, args.last, cap=cap))
        except ValueError as exc:
            print(f"communities inspect: error: {v.path}: {_one_line(exc)}", file=sys.stderr)
            return EXIT_DAMAGED
    if args.out is not None:
        out = args.out
    elif len(views) == 1:
        out = views[0].path / "report"
    else:
        out = views[0].path.resolve().parent / "compare_report"
    for v, (_, note) in zip(views, picks):
        print(summary_text(v))
        for msg in v.notes:
            print(f"warning: {msg}", file=sys.stderr)
        if v.infos:
            print(note)
    try:
        index = write_report(views, out, picks, svg=not args.no_svg)
    except OSError as exc:
        print(f"communities inspect: error: cannot write the report to {out}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    print(f"report: {index} ({time.perf_counter() - start:.1f} s)")
    return EXIT_OK


def _disambiguate(views: Sequence[RunView]) -> None:
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


if __name__ == "__main__":
    sys.exit(main_inspect(sys.argv[1:]))
