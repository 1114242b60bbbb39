"""compare's two plots: each strategy's consensus curve against the bytes sent and against wall time."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List

import numpy as np

from .aggregate import plotted_metric, target_of

CURVE_LABELS = {"acc": "consensus test accuracy", "loss": "consensus test loss (nats/token)",
                "bpb": "consensus test loss (bits/byte)"}


def write_plots(agg: dict, out_dir: Path) -> List[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("communities compare: matplotlib is not installed; no plots (pip install matplotlib)", file=sys.stderr)
        return []
    written = []
    estimated = [c for curves in agg["_curves"].values() for c in curves if not c.get("wall_measured")]
    wall_label = ("wall time, s (slowest rank's metrics.jsonl wall)" if not estimated else
                  "wall time, s (estimated as wall_time * t / units for runs without metrics.jsonl wall)")
    target = target_of(agg)
    y = plotted_metric(target, any("task" in r for r in agg["runs"]))
    for key, xlabel, fname, scale in (("bytes", "MB sent per rank", f"{y}_vs_bytes.png", 1e-6),
                                       ("wall", wall_label, f"{y}_vs_wall.png", 1.0)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k, (label, curves) in enumerate(agg["_curves"].items()):
            color = f"C{k % 10}"
            for c in curves:
                ax.plot(c[key] * scale, c[y], color=color, alpha=0.25, lw=1)
            common = sorted(set.intersection(*[set(c["t"].tolist()) for c in curves]))
            if common:
                xs = np.mean([[c[key][list(c["t"]).index(t)] for t in common] for c in curves], axis=0) * scale
                ys = np.mean([[c[y][list(c["t"]).index(t)] for t in common] for c in curves], axis=0)
                ax.plot(xs, ys, color=color, lw=2, marker="o", ms=3, label=f"{label} (n={len(curves)})")
        if target.metric == y:
            ax.axhline(target.value, color="grey", ls=":", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(CURVE_LABELS[y])
        ax.set_title(f"{agg['name']}: {agg['world_size']} ranks, mean over seeds (thin: each seed)")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right" if y != "acc" else "lower right", fontsize=8)
        fig.tight_layout()
        p = out_dir / fname
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written
