"""Experiment trackers (TensorBoard, Weights & Biases, MLflow): one set of scalars, images and summary for all.

Rank 0 alone writes, and only what the run log already holds: the rows gathered at each
signature round (and at the end), the round's record, the consensus evaluations and the
summary. Nothing is added to a rank's unit. ``Tracker`` turns those into scalars (the tags
below), images and the summary; a backend (tensorboard_log.py, wandb_log.py, mlflow_log.py)
says how to write each. Each round's dendrogram and the community timeline are drawn as
images at the end, after the summary (``logging.dendrograms: false`` skips them).

Tags (step: the unit t):

- ``accuracy/consensus_test``, ``loss/consensus_test``: the consensus model's evaluations;
- ``accuracy/rank_test_{mean,min,max}``, ``loss/rank_test_mean``, ``loss/rank_train_mean``: over the ranks;
- a language model's run (losses in nats per token, accuracy next-token accuracy) with known bytes per token:
  ``bpb/consensus_test`` and ``bpb/rank_test_mean``, bits per byte;
- ``communities/{count,dispersion,p_cross,temperature,relative_update,ari}``: each signature round;
- ``bytes/sent_per_rank_mean_mb``, ``time/elapsed_s``: the ranks' cumulative traffic and the slowest rank's wall;
- ``privacy/epsilon_max`` (privacy.enabled), ``pbt/<key>_{median,min,max}`` (pbt.enabled);
- ``time/{train,exchange,signature,idle,eval,other}_s``, ``final/*``: the wall split and the summary, at the end;
- images ``dendrogram`` (one per round, at its unit) and ``timeline`` (at the last unit);
- with ``logging.per_rank``: ``rank_NNN/{train_loss,test_acc,bytes_sent_mb}`` for every rank.

A backend that fails (a tracking server gone, a full disk) is dropped with a warning: a tracker never stops
a run, and rank 0 never stops alone.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections import defaultdict
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from ...config import Config
from ...errors import ConfigError

log = logging.getLogger(__name__)

# config key -> (the module a backend needs, the extra that installs it)
NEEDS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def enabled(cfg: Config) -> List[str]:
    """The trackers the config switches on, in a fixed order."""
    return [name for name in NEEDS if getattr(cfg.logging, name)]


def check_available(cfg: Config) -> None:
    """A ConfigError before anything is written when a tracker is on but its package is not there."""
    for name in enabled(cfg):
        module, extra = NEEDS[name]
        if find_spec(module) is None:
            raise ConfigError(f"logging.{name}=true needs the {module} package: pip install "
                              f"'communities[{extra}]' (or set logging.{name}=false)")


def finite(value) -> bool:
    """A real number (numpy's too) that is neither NaN nor infinite."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class Tracker:
    """What every tracker logs, computed once from the run log's records; subclasses write it."""

    name = "tracker"

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.trees: List[Tuple[int, int, np.ndarray, Optional[float]]] = []  # (round, t, Z, cut height)
        self.labels: List[Tuple[int, np.ndarray]] = []  # (t, each rank's community) per round: the timeline

    # ------------------------------------------------------------------ what a backend writes

    def write_scalars(self, values: Dict[str, float], step: int) -> None:
        raise NotImplementedError

    def write_image(self, tag: str, image: np.ndarray, step: int) -> None:
        """``image``: height x width x 3, uint8."""
        raise NotImplementedError

    def write_summary(self, summary: dict) -> None:
        """summary.json's record (the scalars among it are logged as ``final/*`` already)."""

    def close(self, status: str = "complete") -> None:
        """``status``: complete, interrupted (a stop with a checkpoint) or failed."""

    def identity(self) -> Optional[dict]:
        """Where the tracker's run is (for meta.json's ``tracking``), or None."""
        return None

    # ------------------------------------------------------------------ what the run log feeds

    def _emit(self, values: Dict[str, object], step: int) -> None:
        kept = {k: float(v) for k, v in values.items() if finite(v)}  # type: ignore[arg-type]
        if kept:
            self.write_scalars(kept, step)

    def metrics(self, rows: List[dict]) -> None:
        """``metrics.jsonl`` rows of every rank (as gathered): aggregates per unit, and per rank on request."""
        by_t: Dict[int, List[dict]] = defaultdict(list)
        for r in rows:
            by_t[r["t"]].append(r)
        for t, group in sorted(by_t.items()):
            self._emit(self._unit_scalars(group), t)

    def _unit_scalars(self, group: List[dict]) -> Dict[str, object]:
        out: Dict[str, object] = {}
        losses = [r["loss"] for r in group if finite(r["loss"])]
        accs = [r["test_acc"] for r in group if finite(r["test_acc"])]
        test_losses = [r["test_loss"] for r in group if finite(r["test_loss"])]
        bpbs = [r["test_bpb"] for r in group if finite(r.get("test_bpb"))]  # a language model's
        if losses:
            out["loss/rank_train_mean"] = np.mean(losses)
        if accs:
            out.update({"accuracy/rank_test_mean": np.mean(accs), "accuracy/rank_test_min": min(accs),
                        "accuracy/rank_test_max": max(accs)})
        if test_losses:
            out["loss/rank_test_mean"] = np.mean(test_losses)
        if bpbs:
            out["bpb/rank_test_mean"] = np.mean(bpbs)
        out["bytes/sent_per_rank_mean_mb"] = np.mean([r["bytes_sent"] for r in group]) / 1e6
        out["time/elapsed_s"] = max(r["wall"] for r in group)
        eps = [r["epsilon"] for r in group if finite(r.get("epsilon"))]
        if eps:
            out["privacy/epsilon_max"] = max(eps)
        for name in group[0].get("hyper") or {}:  # pbt: the population's spread of each learnt value
            values = [r["hyper"][name] for r in group]
            out.update({f"pbt/{name}_median": float(np.median(values)), f"pbt/{name}_min": min(values),
                        f"pbt/{name}_max": max(values)})
        if self.cfg.logging.per_rank:
            for r in group:
                prefix = f"rank_{r['rank']:03d}"
                out[f"{prefix}/train_loss"] = r["loss"]
                for name, value in (r.get("hyper") or {}).items():
                    out[f"{prefix}/{name}"] = value
                out[f"{prefix}/test_acc"] = r["test_acc"]
                out[f"{prefix}/bytes_sent_mb"] = r["bytes_sent"] / 1e6
        return out

    def round(self, info: dict, Z: np.ndarray, labels: Optional[np.ndarray] = None) -> None:
        """A signature round's record (``round.json``), its tree and communities: drawn at the end."""
        values: Dict[str, object] = {"communities/count": info["n_communities"]}
        for key in ("dispersion", "p_cross", "temperature", "relative_update", "ari"):
            values[f"communities/{key}"] = info.get(key)
        self._emit(values, info["t"])
        if self.cfg.logging.dendrograms and len(Z):
            self.trees.append((info["round"], info["t"], np.array(Z, dtype=np.float64), info.get("cut_height")))
        if self.cfg.logging.dendrograms and labels is not None:
            self.labels = [(t, a) for t, a in self.labels if t < info["t"]]  # a rewind redoes later rounds
            self.labels.append((info["t"], np.array(labels, dtype=np.int64)))

    def consensus(self, rows: List[dict]) -> None:
        for row in rows:
            self._emit({"accuracy/consensus_test": row.get("test_acc"), "loss/consensus_test": row.get("test_loss"),
                        "bpb/consensus_test": row.get("test_bpb")}, row["t"])

    def finish(self, summary) -> None:
        """The summary's figures and the wall split at the last unit, the images, the summary; then close."""
        t = int(summary.units)
        values: Dict[str, object] = {f"final/{key}": getattr(summary, key) for key in (
            "consensus_test_acc", "best_rank_acc", "worst_rank_acc", "mean_rank_acc", "consensus_distance",
            "final_dispersion", "wall_time")}
        if summary.task is not None:  # a language model's: lower is better
            values.update({f"final/{key}": getattr(summary, key) for key in (
                "consensus_test_loss", "consensus_test_bpb", "mean_rank_loss", "mean_rank_bpb")})
        values["final/bytes_sent_per_rank_mean_mb"] = summary.bytes_sent_mean / 1e6
        values.update({f"time/{category}_s": seconds for category, seconds in summary.time_split.items()})
        self._emit(values, t)
        for tag, image, step in self.images(t):
            self.write_image(tag, image, step)
        self.write_summary(summary.to_dict())
        self.close("complete")

    # ------------------------------------------------------------------ images

    def images(self, t_end: int) -> List[Tuple[str, np.ndarray, int]]:
        """``(tag, HxWx3 uint8, step)``: each round's dendrogram, and the community timeline at ``t_end``."""
        if not self.cfg.logging.dendrograms or not self.trees:
            return []
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
        except ImportError:
            log.warning("communities: note: no dendrogram or timeline images for the trackers without matplotlib "
                        "(pip install 'communities[inspect]')")
            return []
        out = [("dendrogram", dendrogram_image(Z, index, t, cut), t) for index, t, Z, cut in self.trees]
        if len(self.labels) > 1:
            out.append(("timeline", timeline_image(self.labels, self.cfg.name), t_end))
        return out


def dendrogram_image(Z: np.ndarray, index: int, t: int, cut: Optional[float]) -> np.ndarray:
    """One round's tree, drawn off-screen without pyplot (about 36 ms of CPU)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from scipy.cluster.hierarchy import dendrogram

    n = len(Z) + 1
    fig = Figure(figsize=(max(4.0, min(16.0, 0.25 * n)), 3.0), dpi=72)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_axes((0.14, 0.1, 0.83, 0.8))
    dendrogram(Z, ax=ax, color_threshold=cut if finite(cut) else None, no_labels=n > 64, leaf_font_size=7)
    if cut is not None and finite(cut):
        ax.axhline(cut, color="0.5", linestyle="--", linewidth=0.8)
    ax.set_title(f"round {index} (t={t})", fontsize=9)
    ax.set_ylabel("distance", fontsize=8)
    canvas.draw()
    return np.ascontiguousarray(np.asarray(canvas.buffer_rgba())[..., :3])


def timeline_image(rounds: List[Tuple[int, np.ndarray]], name: str) -> np.ndarray:
    """Ranks x rounds coloured by community, ids kept across rounds (``communities inspect``'s timeline, plain)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ...core.clustering import stable_labels

    S = stable_labels([labels for _, labels in rounds])  # rounds x N
    R, n = S.shape
    order = np.lexsort(S[::-1])  # rows grouped by their whole history, so a split shows as a block dividing
    fig = Figure(figsize=(min(12.0, max(5.0, 0.15 * R + 2.5)), min(10.0, max(3.0, 0.1 * n + 1.2))), dpi=72)
    canvas = FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.imshow(S[:, order].T, aspect="auto", interpolation="nearest", cmap="tab20", vmin=-0.5, vmax=19.5)
    step = max(1, -(-R // 20))
    ax.set_xticks(np.arange(0, R, step), [str(t) for t, _ in rounds[::step]], fontsize=7)
    ax.set_xlabel("unit t of the signature round", fontsize=8)
    ax.set_ylabel(f"{n} ranks (grouped by community history)", fontsize=8)
    if n <= 32:
        ax.set_yticks(np.arange(n), [str(int(r)) for r in order], fontsize=6)
    ax.set_title(f"{name}: communities per round (ids matched across rounds)", fontsize=9)
    fig.tight_layout()
    canvas.draw()
    return np.ascontiguousarray(np.asarray(canvas.buffer_rgba())[..., :3])


class Trackers:
    """Rank 0's trackers, fed together; one that raises is closed as failed and dropped, with a warning."""

    def __init__(self, trackers: List[Tracker]):
        self.trackers = list(trackers)

    def _each(self, call: Callable[[Tracker], None], doing: str) -> None:
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:
                log.warning(f"communities: warning: {tracker.name} failed while {doing} ({type(exc).__name__}: "
                            f"{exc}); the run goes on without it")
                self.trackers.remove(tracker)
                try:
                    tracker.close("failed")
                except Exception:
                    pass

    def metrics(self, rows: List[dict]) -> None:
        self._each(lambda tr: tr.metrics(rows), "logging metrics")

    def round(self, info: dict, Z: np.ndarray, labels: Optional[np.ndarray] = None) -> None:
        self._each(lambda tr: tr.round(info, Z, labels), "logging a round")

    def consensus(self, rows: List[dict]) -> None:
        self._each(lambda tr: tr.consensus(rows), "logging a consensus evaluation")

    def finish(self, summary) -> None:
        self._each(lambda tr: tr.finish(summary), "logging the summary")
        self.trackers.clear()

    def close(self, status: str) -> None:
        """At a stop or a failure (finish closes them after a complete run); idempotent."""
        self._each(lambda tr: tr.close(status), f"closing ({status})")
        self.trackers.clear()

    def identities(self) -> Dict[str, dict]:
        out = {}
        for tracker in self.trackers:
            ident = tracker.identity()
            if ident:
                out[tracker.name] = ident
        return out
