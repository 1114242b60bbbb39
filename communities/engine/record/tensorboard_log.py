"""TensorBoard scalars of a run (``logging.tensorboard: true``): where ML users look for metrics.

Rank 0 alone writes, and only what the run log already holds: the rows gathered
at each signature round (and at the end), the round's record, the consensus
evaluations and the summary. Nothing is added to a rank's unit, and the event
file is written by TensorBoard's own background thread. Each round's dendrogram
is drawn as an image at the end, after the summary (about 36 ms of CPU each on
rank 0, which the other ranks wait for; ``logging.dendrograms: false`` skips them).

Tags (step: the unit t):

- ``accuracy/consensus_test``, ``loss/consensus_test``: the consensus model's evaluations;
- ``accuracy/rank_test_{mean,min,max}``, ``loss/rank_test_mean``, ``loss/rank_train_mean``: over the ranks;
- a language model's run (losses in nats per token, accuracy next-token accuracy) with known bytes per token:
  ``bpb/consensus_test`` and ``bpb/rank_test_mean``, bits per byte;
- ``communities/{count,dispersion,p_cross,temperature,relative_update,ari}``: each signature round;
- ``bytes/sent_per_rank_mean_mb``, ``time/elapsed_s``: the ranks' cumulative traffic and the slowest rank's wall;
- ``time/{train,exchange,signature,idle,eval,other}_s``, ``final/*``: the wall split and the summary, at the end;
- ``dendrogram``: an image per round;
- with ``logging.per_rank``: ``rank_NNN/{train_loss,test_acc,bytes_sent_mb}`` for every rank.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from importlib.util import find_spec
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...config import Config
from ...errors import ConfigError

log = logging.getLogger(__name__)

TB_DIR = "tensorboard"  # under the run directory


def check_available(cfg: Config) -> None:
    """A ConfigError before anything is written when ``logging.tensorboard`` is on but the package is not there."""
    if cfg.logging.tensorboard and find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard=true needs the tensorboard package: "
                          "pip install 'communities[tensorboard]' (or set logging.tensorboard=false)")


def _finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


class TensorBoardLog:
    """Rank 0's event file in ``RUN_DIR/tensorboard``; fed by the run log."""

    def __init__(self, cfg: Config, run_dir: Path, start_t: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.cfg = cfg
        self.path = Path(run_dir) / TB_DIR
        # a resumed run drops what the interrupted one wrote past its checkpoint
        self.writer = SummaryWriter(log_dir=str(self.path), purge_step=start_t + 1 if start_t > 0 else None)
        self.trees: List[Tuple[int, int, np.ndarray, Optional[float]]] = []  # (round, t, Z, cut height)

    def _scalar(self, tag: str, value, step: int) -> None:
        if _finite(value):
            self.writer.add_scalar(tag, float(value), step)

    def metrics(self, rows: List[dict]) -> None:
        """``metrics.jsonl`` rows of every rank (as gathered): aggregates per unit, and per rank on request."""
        by_t: Dict[int, List[dict]] = defaultdict(list)
        for r in rows:
            by_t[r["t"]].append(r)
        for t, group in sorted(by_t.items()):
            losses = [r["loss"] for r in group if _finite(r["loss"])]
            accs = [r["test_acc"] for r in group if _finite(r["test_acc"])]
            test_losses = [r["test_loss"] for r in group if _finite(r["test_loss"])]
            bpbs = [r["test_bpb"] for r in group if _finite(r.get("test_bpb"))]  # a language model's
            if losses:
                self._scalar("loss/rank_train_mean", np.mean(losses), t)
            if accs:
                self._scalar("accuracy/rank_test_mean", np.mean(accs), t)
                self._scalar("accuracy/rank_test_min", min(accs), t)
                self._scalar("accuracy/rank_test_max", max(accs), t)
            if test_losses:
                self._scalar("loss/rank_test_mean", np.mean(test_losses), t)
            if bpbs:
                self._scalar("bpb/rank_test_mean", np.mean(bpbs), t)
            self._scalar("bytes/sent_per_rank_mean_mb", np.mean([r["bytes_sent"] for r in group]) / 1e6, t)
            self._scalar("time/elapsed_s", max(r["wall"] for r in group), t)
            eps = [r["epsilon"] for r in group if _finite(r.get("epsilon"))]
            if eps:
                self._scalar("privacy/epsilon_max", max(eps), t)
            for name in group[0].get("hyper") or {}:  # pbt: the population's spread of each learnt value
                values = [r["hyper"][name] for r in group]
                self._scalar(f"pbt/{name}_median", float(np.median(values)), t)
                self._scalar(f"pbt/{name}_min", min(values), t)
                self._scalar(f"pbt/{name}_max", max(values), t)
            if self.cfg.logging.per_rank:
                for r in group:
                    prefix = f"rank_{r['rank']:03d}"
                    self._scalar(f"{prefix}/train_loss", r["loss"], t)
                    for name, value in (r.get("hyper") or {}).items():
                        self._scalar(f"{prefix}/{name}", value, t)
                    self._scalar(f"{prefix}/test_acc", r["test_acc"], t)
                    self._scalar(f"{prefix}/bytes_sent_mb", r["bytes_sent"] / 1e6, t)

    def round(self, info: dict, Z: np.ndarray) -> None:
        """A signature round's record (``round.json``); its tree is drawn at the end."""
        t = info["t"]
        self._scalar("communities/count", info["n_communities"], t)
        for key in ("dispersion", "p_cross", "temperature", "relative_update", "ari"):
            self._scalar(f"communities/{key}", info.get(key), t)
        if self.cfg.logging.dendrograms and len(Z):
            self.trees.append((info["round"], t, np.array(Z, dtype=np.float64), info.get("cut_height")))

    def consensus(self, rows: List[dict]) -> None:
        for row in rows:
            self._scalar("accuracy/consensus_test", row.get("test_acc"), row["t"])
            self._scalar("loss/consensus_test", row.get("test_loss"), row["t"])
            self._scalar("bpb/consensus_test", row.get("test_bpb"), row["t"])

    def finish(self, summary) -> None:
        """The summary's figures and the wall split at the last unit, the dendrograms, then close the file."""
        t = int(summary.units)
        for key in ("consensus_test_acc", "best_rank_acc", "worst_rank_acc", "mean_rank_acc", "consensus_distance",
                    "final_dispersion", "wall_time"):
            self._scalar(f"final/{key}", getattr(summary, key), t)
        for key in ("consensus_test_loss", "consensus_test_bpb", "mean_rank_loss", "mean_rank_bpb"):
            if summary.task is not None:  # a language model's: lower is better
                self._scalar(f"final/{key}", getattr(summary, key), t)
        self._scalar("final/bytes_sent_per_rank_mean_mb", summary.bytes_sent_mean / 1e6, t)
        for category, seconds in summary.time_split.items():
            self._scalar(f"time/{category}_s", seconds, t)
        self._dendrograms()
        self.close()

    def _dendrograms(self) -> None:
        if not self.trees:
            return
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            log.warning("communities: note: no dendrogram images in TensorBoard without matplotlib "
                        "(pip install 'communities[inspect]')")
            return
        from scipy.cluster.hierarchy import dendrogram

        for index, t, Z, cut in self.trees:
            n = len(Z) + 1
            fig = Figure(figsize=(max(4.0, min(16.0, 0.25 * n)), 3.0), dpi=72)
            canvas = FigureCanvasAgg(fig)  # drawn off-screen, without pyplot
            ax = fig.add_axes((0.14, 0.1, 0.83, 0.8))
            dendrogram(Z, ax=ax, color_threshold=cut if _finite(cut) else None, no_labels=n > 64,
                       leaf_font_size=7)
            if cut is not None and _finite(cut):
                ax.axhline(cut, color="0.5", linestyle="--", linewidth=0.8)
            ax.set_title(f"round {index} (t={t})", fontsize=9)
            ax.set_ylabel("distance", fontsize=8)
            canvas.draw()
            image = np.asarray(canvas.buffer_rgba())[..., :3]
            self.writer.add_image("dendrogram", image, global_step=t, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()
