"""The run directory from Python: ``cx.open_run(path)`` for notebooks, one run or several stacked.

Why: people who inspect training runs do it in Jupyter, with pandas and their own cuts of the
trees; ``communities inspect`` writes fixed figures. This is the same reading (``load.load_view``:
the same checks, errors and notes, on finished, running, interrupted or damaged runs) handed out
as pandas DataFrames and numpy arrays instead of PNGs. Like the rest of the report it never imports
torch or mpi4py; pandas is imported when a frame is first asked for, matplotlib when a tree is drawn,
torch (through ``communities.model_files``) only by ``models()``.

The frames (columns in order; a missing number is NaN, a missing id ``<NA>``):

- ``metrics`` (metrics.jsonl, one row per rank per unit): ``t``, ``rank``, ``loss``, ``train_acc``,
  ``test_acc``, ``test_loss`` (NaN on units without an evaluation), ``samples`` and ``bytes_sent``
  (cumulative), ``wall`` (seconds since the start), and ``local_acc``, ``local_loss`` when the run
  held out local test data. A language model's run (``RunData.language_model``) measures losses in
  nats per token and accuracy as next-token accuracy, and adds ``test_bpb`` (bits per byte) where its
  bytes per token are known.
- ``merges`` (merges.jsonl, one row per rank side of each mixing step): ``t``, ``i`` (the rank that
  logged it), ``j`` (the partner, -1 for a global average), ``initiator``, ``a``, ``update_norm``,
  ``distance``, ``bytes``, ``rule``, ``event`` (``merge``, ``average``, ``skip_diverged``, ...), then
  ``round`` (the last round saved before unit t, ``<NA>`` before the first), ``community_i`` and
  ``community_j`` (both ranks' communities in that round, as stable ids: the ``community`` column of
  ``communities_over_time()``) and ``within`` (whether they were one community; ``<NA>`` without a
  round or a partner). A lagged signature round (``signature.overlap``) takes effect one round later
  than the round named here.
- ``consensus`` (consensus.jsonl, one row per evaluation of the consensus model): ``t``, ``test_acc``,
  ``test_loss``, ``final`` and ``local_acc`` with local test data (and a language model's ``test_bpb``).
  A finished run's last row is its final evaluation (``final`` true: summary.json's
  ``consensus_test_acc`` at ``t = units``), added where the evaluations every
  ``output.consensus_every`` units stop short of it.
- ``rounds`` (one row per complete round): ``round``, ``t``, ``n_communities``, ``cut_height``,
  ``dispersion``, ``mean_update_norm``, ``p_cross``, ``temperature``, ``cophenetic`` (how well the tree
  keeps the signature distances), ``ari`` (against the planted groups; NaN without them), ``law``,
  ``k``, ``cut``, ``linkage``, ``metric``, ``hash``: the per-round table of ``inspect``'s rounds.csv
  and round.json's fields.
- ``communities_over_time()`` (one row per round per rank): ``round``, ``t``, ``rank``, ``label`` (the
  round's own numbering, labels.npy), ``community`` (an id kept across rounds, so splits and merges
  read as such: inspect's timeline) and ``group`` (the planted group, ``<NA>`` without one).

``open_runs`` stacks the frames of several runs with a first column ``run``, so that a comparison
is one ``groupby("run")``, and its ``table()`` has one row per run: the run, its status, the config
keys that differ between the runs (a sweep's) and the summary's figures (``SUMMARY_COLUMNS``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np
from scipy.cluster import hierarchy

from ..results import LanguageModel, ResultsError, Summary, load_round, read_jsonl
from . import load as _load
from .figures import recursion_limit

METRIC_COLUMNS = ("t", "rank", "loss", "train_acc", "test_acc", "test_loss", "samples", "bytes_sent", "wall")
MERGE_COLUMNS = ("t", "i", "j", "initiator", "a", "update_norm", "distance", "bytes", "rule", "event")
CONSENSUS_COLUMNS = ("t", "test_acc", "test_loss", "final")
ROUND_COLUMNS = ("round", "t", "n_communities", "cut_height", "dispersion", "mean_update_norm", "p_cross",
                 "temperature", "cophenetic", "ari", "law", "k", "cut", "linkage", "metric", "hash")
TIMELINE_COLUMNS = ("round", "t", "rank", "label", "community", "group")
# Runs.table's figures of each run (summary.json; missing until a run finishes), after its status and config keys
SUMMARY_COLUMNS = ("consensus_test_acc", "consensus_test_loss", "consensus_test_bpb", "mean_rank_acc",
                   "best_rank_acc", "units", "rounds", "merges", "consensus_reached_t", "first_round_ari",
                   "final_dispersion", "bytes_sent_mean", "wall_time")
_COUNTS = {"units", "rounds", "merges", "consensus_reached_t"}
_TEXT = {"rule", "event", "law", "cut", "linkage", "metric", "hash"}
_FLAGS = {"final"}  # true on one row, false on the others
_IDS = {"t", "rank", "i", "j", "initiator", "samples", "bytes_sent", "bytes", "round", "n_communities", "k"}


def _pandas():
    try:
        import pandas
    except ImportError:
        raise ImportError("pandas is needed for the run's frames: pip install 'communities[inspect]'") from None
    return pandas


def _frame(rows: List[dict], columns: Sequence[str]):
    """Rows as a DataFrame with the documented columns first (absent ones all missing), extra fields after."""
    pd = _pandas()
    df = pd.DataFrame(rows)
    extra = [c for c in df.columns if c not in columns]
    df = df.reindex(columns=list(columns) + extra)
    for c in df.columns:
        if c in _TEXT:
            continue
        if c in _FLAGS:
            df[c] = df[c].eq(True)
            continue
        if c in _IDS:
            df[c] = pd.to_numeric(df[c]).astype("Int64")
        elif c in columns:
            df[c] = pd.to_numeric(df[c]).astype("float64")
    return df


@dataclass
class RoundData:
    """One signature round: what the engine wrote in rounds/round_NNNN/, checked."""

    round: int
    t: int
    signatures: np.ndarray  # (N, d) float32: row r is rank r's signature
    Z: np.ndarray  # (N-1, 4) float64: scipy's linkage matrix
    labels: np.ndarray  # (N,) int64: the round's communities, numbered by first appearance
    communities: np.ndarray  # (N,) int64: the same partition with ids kept across rounds
    outliers: Optional[np.ndarray]  # ranks left out by robust.enabled; None when it is off
    law: Optional[str]  # the partner law in force: flat, hierarchical, frozen
    cut_height: Optional[float]  # the tree height the cut corresponds to
    info: Dict[str, Any]  # round.json as written


class RunData:
    """One run directory opened for reading (``cx.open_run``); frames are read once, when first asked for."""

    def __init__(self, path: Union[str, Path]):
        self._view = _load.load_view(Path(path))

    # ------------------------------------------------------------------ what the run is

    @property
    def path(self) -> Path:
        return self._view.path

    @property
    def name(self) -> str:
        return self._view.name

    @property
    def label(self) -> str:
        """``name (strategy)``: how inspect's legends name the run."""
        return self._view.label

    @property
    def config(self) -> dict:
        """config.yaml as resolved by the run."""
        return self._view.run.config

    @property
    def meta(self) -> dict:
        return self._view.run.meta

    @property
    def summary(self) -> Optional[Summary]:
        """summary.json as a ``Summary`` (attributes: ``consensus_test_acc``, ...); None until the run finished."""
        return self._view.run.record

    @property
    def language_model(self) -> Optional[LanguageModel]:
        """A language model's run: its bytes per token (``bpb(loss)`` converts) and context; None: a classifier's."""
        return self._view.lm

    @property
    def status(self) -> str:
        """meta.json's status, ``interrupted`` for a ``running`` run whose process is gone."""
        return self._view.status

    @property
    def notes(self) -> List[str]:
        """What inspect prints as warnings: damage that was left out, rounds read up to, lost ranks."""
        return list(self._view.notes)

    @property
    def world_size(self) -> int:
        return self._view.n

    @property
    def groups(self) -> Optional[np.ndarray]:
        """The planted group of each rank, or None."""
        return self._view.groups

    @property
    def round_numbers(self) -> List[int]:
        """The complete rounds, in order (the NNNN of rounds/round_NNNN)."""
        return [int(r) for r in self._view.round_idx]

    def __repr__(self) -> str:
        return (f"<communities run {self.label}: {self.status}, {self.world_size} ranks, "
                f"{len(self.round_numbers)} rounds, {self.path}>")

    def __str__(self) -> str:
        """The terminal summary ``communities inspect`` prints."""
        return _load.summary_text(self._view)

    # ------------------------------------------------------------------ frames

    @cached_property
    def metrics(self):
        rows = [r for r in read_jsonl(self.path / "metrics.jsonl") if int(r["rank"]) >= 0]
        return _frame(rows, METRIC_COLUMNS)

    @cached_property
    def consensus(self):
        return _frame(self._view.run.consensus_evals(), CONSENSUS_COLUMNS)

    @cached_property
    def rounds(self):
        rows = _load.round_rows(self._view)
        for row, info in zip(rows, self._view.infos):
            row.update({c: info.get(c) for c in ROUND_COLUMNS if c not in row})
        return _frame(rows, ROUND_COLUMNS)

    @cached_property
    def merges(self):
        pd = _pandas()
        df = _frame(read_jsonl(self.path / "merges.jsonl"), MERGE_COLUMNS)
        view = self._view
        t = df["t"].to_numpy(dtype=np.int64, na_value=-1)
        pos = np.searchsorted(view.round_t, t, side="left") - 1  # the last round saved before unit t
        has_round = pos >= 0
        rnd = pd.array(view.round_idx[np.maximum(pos, 0)] if view.round_idx.size else np.zeros(len(df), np.int64),
                       dtype="Int64")
        rnd[~has_round] = pd.NA
        df.insert(len(MERGE_COLUMNS), "round", rnd)
        for k, side in enumerate(("i", "j")):
            rank = df[side].to_numpy(dtype=np.int64, na_value=-1)
            ok = has_round & (rank >= 0) & (rank < view.n)
            ids = np.zeros(len(df), dtype=np.int64)
            if view.stable.size:
                ids[ok] = view.stable[pos[ok], rank[ok]]
            col = pd.array(ids, dtype="Int64")
            col[~ok] = pd.NA
            df.insert(len(MERGE_COLUMNS) + 1 + k, f"community_{side}", col)
        df.insert(len(MERGE_COLUMNS) + 3, "within", (df["community_i"] == df["community_j"]).astype("boolean"))
        return df

    def communities_over_time(self):
        """One row per round per rank: its community (label and stable id) and planted group."""
        pd = _pandas()
        view = self._view
        k, n = len(view.infos), view.n
        group = pd.array(np.tile(view.groups, k) if view.groups is not None else [pd.NA] * (k * n), dtype="Int64")
        return pd.DataFrame({
            "round": pd.array(np.repeat(view.round_idx, n), dtype="Int64"),
            "t": pd.array(np.repeat(view.round_t, n), dtype="Int64"),
            "rank": pd.array(np.tile(np.arange(n), k), dtype="Int64"),
            "label": pd.array(np.concatenate(view.labels) if k else [], dtype="Int64"),
            "community": pd.array(view.stable.reshape(-1), dtype="Int64"),
            "group": group,
        }, columns=list(TIMELINE_COLUMNS))

    # ------------------------------------------------------------------ one round

    def _position(self, r: int) -> int:
        rounds = self.round_numbers
        if not rounds:
            raise ValueError(f"{self.path}: no complete signature round")
        if r < 0 and -r <= len(rounds):
            return len(rounds) + r
        if r in rounds:
            return rounds.index(r)
        raise ValueError(f"round {r}: no such complete round (saved rounds: {rounds[0]}..{rounds[-1]}, "
                         f"{len(rounds)} in all; a negative number counts from the last)")

    def round(self, r: int) -> RoundData:
        """Round ``r`` (its number; -1 is the last complete round): signatures, linkage Z, labels, outliers, law."""
        k = self._position(r)
        view = self._view
        rnd = load_round(view.run.round_paths[k])
        info = view.infos[k]
        outliers = info.get("outliers")
        cut = info.get("cut_height")
        return RoundData(round=int(view.round_idx[k]), t=int(view.round_t[k]), signatures=rnd.signatures,
                         Z=view.Zs[k], labels=view.labels[k], communities=view.stable[k],
                         outliers=None if outliers is None else np.asarray(outliers, dtype=np.int64),
                         law=info.get("law"), cut_height=None if cut is None else float(cut), info=dict(info))

    def dendrogram(self, r: int, ax=None, **scipy_kwargs) -> dict:
        """Draw round ``r``'s tree with ``scipy.cluster.hierarchy.dendrogram`` on ``ax``; return scipy's dict.

        Defaults, each overridden by a keyword of the same name: links below the round's cut coloured
        (``color_threshold=cut_height``), the rest grey, leaves labelled by rank. The cut is drawn as a
        dashed line. Without ``ax`` a new pyplot figure is made (shown inline in a notebook).
        """
        rd = self.round(r)
        if self.world_size < 2:
            raise ValueError(f"{self.path}: a world of one rank has no tree to draw")
        if ax is None:
            import matplotlib.pyplot as plt

            _, ax = plt.subplots(figsize=(min(18.0, max(7.0, 0.14 * self.world_size + 2)), 4.5))
        cut = rd.cut_height if rd.cut_height is not None and np.isfinite(rd.cut_height) else 0.0
        kw: Dict[str, Any] = dict(color_threshold=cut, above_threshold_color="#666666", leaf_rotation=90)
        kw.update(scipy_kwargs)
        with recursion_limit(2 * self.world_size + 1000):
            out = hierarchy.dendrogram(rd.Z, ax=ax, **kw)
        if cut > 0:
            ax.axhline(cut, color="k", linestyle="--", linewidth=1, label=f"cut {cut:.3g}")
        ax.set_title(f"{self.label}: round {rd.round} (t={rd.t}), {int(np.unique(rd.labels).size)} communities",
                     fontsize=9)
        ax.set_ylabel("linkage height")
        return out

    # ------------------------------------------------------------------ models

    def models(self) -> "Models":
        """The consensus and community models as state_dicts (needs torch; digests checked where recorded).

        ``consensus.pt`` and ``models/community_<c>.pt`` are checked against meta.json's ``files``
        (sizes and BLAKE2b digests) before they are loaded; ``exports/*/`` carry no digests.
        """
        from ..model_files import load_state_dict

        listed = self.meta.get("files")
        files = listed if isinstance(listed, dict) else {}
        meta_p = self.path / "meta.json"

        def one(rel: str) -> dict:
            return load_state_dict(self.path / rel, files.get(rel), meta_p)

        consensus = one("consensus.pt") if (self.path / "consensus.pt").exists() or "consensus.pt" in files else None
        communities: Dict[int, dict] = {}
        exports: Dict[str, Dict[int, dict]] = {}
        for record in self._view.community_models:
            source = str(record["source"])
            for e in record["models"]:
                rel = str(e.get("file") or f"community_{int(e['community'])}.pt")
                if source == "models":  # models/communities.json names files relative to the run
                    sd = one(rel if rel.startswith("models/") else f"models/{rel}")
                    communities[int(e["community"])] = sd
                else:  # exports/<dir>/communities.json: relative to its directory
                    sd = load_state_dict(self.path / source / Path(rel).name)
                    exports.setdefault(Path(source).name, {})[int(e["community"])] = sd
        return Models(consensus=consensus, communities=communities, exports=exports)


@dataclass
class Models:
    """A run's models as state_dicts (``RunData.models()``)."""

    consensus: Optional[dict]  # consensus.pt; None when the run has not finished
    communities: Dict[int, dict]  # models/community_<c>.pt by community id; empty unless delivered
    exports: Dict[str, Dict[int, dict]]  # exports/<dir>/ (communities export) by directory name, then community


class Runs:
    """Several runs opened together (``cx.open_runs``); their frames stacked with a first column ``run``."""

    def __init__(self, runs: Sequence[RunData], labels: Optional[Sequence[str]] = None):
        self.runs = list(runs)
        if labels is None:
            views = [r._view for r in self.runs]
            _load.disambiguate(views)  # two runs of one name and strategy get their directories in the label
            labels = [v.label for v in views]
        if len(labels) != len(self.runs) or len(set(labels)) != len(labels):
            raise ValueError(f"labels must be {len(self.runs)} distinct names, one per run; got {list(labels)}")
        self.labels = list(labels)

    def __len__(self) -> int:
        return len(self.runs)

    def __iter__(self) -> Iterator[RunData]:
        return iter(self.runs)

    def __getitem__(self, key: Union[int, str]) -> RunData:
        """A run by position or by label."""
        return self.runs[self.labels.index(key) if isinstance(key, str) else key]

    def __repr__(self) -> str:
        return f"<communities runs: {', '.join(self.labels)}>"

    def _stack(self, frames: List[Any]):
        pd = _pandas()
        parts = [f.assign(run=label)[["run"] + list(f.columns)] for f, label in zip(frames, self.labels)]
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame({"run": []})

    @property
    def metrics(self):
        return self._stack([r.metrics for r in self.runs])

    @property
    def merges(self):
        return self._stack([r.merges for r in self.runs])

    @property
    def consensus(self):
        return self._stack([r.consensus for r in self.runs])

    @property
    def rounds(self):
        return self._stack([r.rounds for r in self.runs])

    def communities_over_time(self):
        return self._stack([r.communities_over_time() for r in self.runs])

    def table(self, keys: Optional[Sequence[str]] = None):
        """One row per run, for comparing a sweep: ``run``, ``status``, config keys as dotted columns, then the
        summary's figures (``SUMMARY_COLUMNS``; missing until a run finished, ``consensus_test_bpb`` a language
        model's). ``keys`` (default: every key whose value differs between the runs, ``name`` aside) picks the
        config columns; a key a run's config lacks is missing there."""
        pd = _pandas()
        flat = [_flatten(r.config) for r in self.runs]
        if keys is None:
            every = list(dict.fromkeys(k for f in flat for k in f))
            keys = [k for k in every if k != "name" and len({_hashable(f.get(k)) for f in flat}) > 1]
        rows = []
        for label, run, f in zip(self.labels, self.runs, flat):
            s = run.summary
            row: Dict[str, Any] = {"run": label, "status": run.status}
            row.update({k: f.get(k) for k in keys})
            row.update({c: getattr(s, c, None) if s is not None else None for c in SUMMARY_COLUMNS})
            rows.append(row)
        df = pd.DataFrame(rows, columns=["run", "status", *keys, *SUMMARY_COLUMNS])
        for c in SUMMARY_COLUMNS:
            df[c] = pd.to_numeric(df[c]).astype("Int64" if c in _COUNTS else "float64")
        return df


def _flatten(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """A config as dotted keys (``train.lr``); lists and the free-form tables' entries stay values."""
    if not isinstance(tree, dict) or not tree:
        return {prefix.rstrip("."): tree} if prefix else {}
    out: Dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v and all(isinstance(x, str) and not x.isdigit() for x in v):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _hashable(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, default=str)


def open_run(path: Union[str, Path]) -> RunData:
    """Open a finished, running, interrupted or damaged run directory; ResultsError as ``inspect`` gives it."""
    return RunData(path)


def open_runs(paths: Sequence[Union[str, Path]], labels: Optional[Sequence[str]] = None) -> Runs:
    """Open several runs; their frames stack with a ``run`` column (``labels``, default ``name (strategy)``)."""
    if isinstance(paths, (str, Path)):
        raise TypeError("open_runs takes a list of run directories; open one with open_run")
    return Runs([RunData(p) for p in paths], labels)


__all__ = ["open_run", "open_runs", "RunData", "RoundData", "Runs", "Models", "ResultsError"]
