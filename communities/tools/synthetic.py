"""Synthetic run directories in the exact results layout, for testing and timing readers and tools.

Why: the inspection tool (and anything else that reads ``results/<name>/``) must be
testable and timeable without MPI, torch or a real training run. ``make_run`` imports
only what the package itself needs (numpy, scipy, scikit-learn, ``communities``), never
pytest or test helpers: it makes the input of ``communities bench inspect`` as well as
of the tests (``tests/helpers/synthetic_run.py`` re-exports it). It writes, through
``communities.results.RunWriter``, every file of docs/reference/results-layout.md with made-up
but structured content:

- signatures with a planted hierarchical cluster structure that dissolves over the
  rounds: ``groups`` well separated clusters at first, then pairs of groups merge,
  then one community (so timelines show merges, and the first round's ARI is 1);
- linkage, community cut (``maxclust`` with a falling k) and ``cut_height``
  computed with scipy exactly as the engine would;
- metrics (with the per-rank ``wall`` clock), merges (two lines per exchange),
  consensus evaluations, summary.

``make_run(..., partial=True)`` leaves the run as a crash would: no summary.json,
``meta.json`` status ``running``, torn last lines in the JSONL files and a
half-built hidden ``rounds/.round_NNNN.xxxx`` directory.

Run as a module to make one: ``python -m communities.tools.synthetic /tmp/run64 --ranks 64 --rounds 50``.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage

from ..core.clustering import adjusted_rand
from ..results import RunWriter


def first_appearance(labels: np.ndarray) -> np.ndarray:
    """Renumber labels 0.. in order of first appearance by rank (the layout's convention)."""
    _, first, inv = np.unique(labels, return_index=True, return_inverse=True)
    code = np.empty(first.size, dtype=np.int64)
    code[np.argsort(first, kind="stable")] = np.arange(first.size)
    return code[inv.ravel()]


def planted_groups(n_ranks: int, groups: Union[int, Sequence[int], None],
                   interleave: bool = False) -> Optional[List[int]]:
    if groups is None:
        return None
    if not isinstance(groups, int):
        g = [int(x) for x in groups]
        if len(g) != n_ranks:
            raise ValueError(f"{len(g)} planted groups for {n_ranks} ranks")
        return g
    if interleave:
        return [r % groups for r in range(n_ranks)]
    return [r * groups // n_ranks for r in range(n_ranks)]


def _k_schedule(s: float, n_groups: int) -> int:
    """Communities the cut asks for at progress s in [0, 1]: G, then G/2, then 1."""
    if s < 1 / 3:
        return n_groups
    if s < 2 / 3:
        return max(1, math.ceil(n_groups / 2))
    return 1


def _cut_height(Z: np.ndarray, k: int) -> float:
    """A height between the merges that leave k clusters (monotone linkages)."""
    n = Z.shape[0] + 1
    h = Z[:, 2]
    if k <= 1:
        return float(h[-1] * 1.05 + 1e-12)
    if k >= n:
        return float(h[0] / 2)
    return float((h[n - k - 1] + h[n - k]) / 2)


def make_run(
    root: Union[str, Path],
    n_ranks: int = 8,
    n_rounds: int = 6,
    groups: Union[int, Sequence[int], None] = 4,
    dim: int = 32,
    every: int = 5,
    seed: int = 0,
    method: str = "average",
    metric: str = "cosine",
    strategy: str = "community",
    law: str = "flat",
    name: Optional[str] = None,
    interleave: bool = False,
    eval_every: Optional[int] = None,
    partial: bool = False,
) -> Path:
    """Write a complete (or, with ``partial``, crashed) run directory at ``root``; return its path."""
    from ..config import from_dict

    root = Path(root)
    name = name or root.name
    rng = np.random.default_rng(seed)
    n = n_ranks
    eval_every = eval_every or every
    planted = planted_groups(n, groups, interleave)
    g = np.asarray(planted) if planted is not None else np.zeros(n, dtype=int)
    n_groups = int(g.max()) + 1 if planted is not None else 1

    cfg = from_dict(
        {
            "name": name if all(c.isalnum() or c in "_.-" for c in name) else "run",
            "seed": seed,
            "strategy": strategy,
            "data": {"partition": "label_groups" if planted is not None else "iid", "groups": max(1, n_groups)},
            "signature": {"dim": dim, "every": every},
            "clustering": {"linkage": method, "metric": metric, "cut": "maxclust"},
            "partners": {"law": law},
            "train": {"budget": n_rounds * every, "eval_every": eval_every},
        }
    )
    w = RunWriter(root, overwrite=True)
    w.write_text("config.yaml", cfg.to_yaml())
    meta = {
        "package_version": "0.1.0", "python": "3.11.7", "torch": "2.13.0+cpu", "numpy": np.__version__,
        "scipy": "synthetic", "mpi4py": "4.1.2", "mpi_library": "synthetic", "world_size": n,
        "hosts": ["node1"], "device": "cpu", "strategy": strategy,
        "command": ["communities", "run", "synthetic"], "start_time": "2026-11-22T10:00:00+00:00",
        "end_time": None, "status": "running",
    }
    w.write_json("meta.json", meta)
    shard = [int(x) for x in rng.integers(100, 200, n)]
    label_counts = [[int(x) for x in rng.multinomial(s, np.ones(10) / 10)] for s in shard]
    w.write_json("partition.json", {
        "partition": "label_groups" if planted is not None else "iid", "n_classes": 10,
        "n_train": int(sum(shard)), "n_test": 450, "groups": planted,
        "shard_sizes": shard, "label_counts": label_counts,
    })

    # Hierarchical planted structure: super-groups (pairs of groups), groups, ranks.
    base = rng.normal(size=dim)
    base /= np.linalg.norm(base)
    sup = rng.normal(size=(max(1, (n_groups + 1) // 2), dim))
    grp = rng.normal(size=(n_groups, dim))
    own = rng.normal(size=(n, dim))
    sup /= np.linalg.norm(sup, axis=1, keepdims=True)
    grp /= np.linalg.norm(grp, axis=1, keepdims=True)

    bytes_sent = np.zeros(n, dtype=np.int64)
    samples = np.zeros(n, dtype=np.int64)
    n_merges = 0
    prev_labels = np.zeros(n, dtype=np.int64) if planted is None else g.copy()
    counts = []
    first_ari = None
    disp = 1.0
    last_acc = np.zeros(n)
    t_reached = None
    param_bytes = 4 * 4810
    for r in range(n_rounds):
        s = r / (n_rounds - 1) if n_rounds > 1 else 0.0
        a_sup = 1.2 * max(0.0, 1 - 1.5 * s)
        a_grp = 1.2 * max(0.0, 1 - 3 * s)
        noise = 0.08 * (1 - 0.7 * s)
        p_cross = 0.02 + 0.98 * (1 - math.cos(math.pi * s)) / 2
        temperature = 0.05 * (20 / 0.05) ** s
        norms = []
        merge_rows, metric_rows = [], []
        for t in range(r * every + 1, (r + 1) * every + 1):
            # merges of this unit: initiators pick partners mostly inside their community
            fire = np.flatnonzero(rng.random(n) < 0.5) if n > 1 else []
            rows = []
            for i in fire:
                same = np.flatnonzero((prev_labels == prev_labels[i]) & (np.arange(n) != i))
                if same.size and rng.random() > p_cross:
                    j = int(rng.choice(same))
                else:
                    j = int(rng.choice(np.delete(np.arange(n), i)))
                dist = float(0.5 * (1 - 0.9 * s) + 0.05 * rng.random())
                for a, b in ((int(i), j), (j, int(i))):
                    u = dist / 2 * (1 + 0.01 * rng.random())
                    norms.append(u)
                    rows.append({"t": t, "i": a, "j": b, "initiator": int(i), "a": 0.5, "update_norm": u,
                                 "distance": dist, "bytes": param_bytes, "rule": "constant", "event": "merge"})
                    bytes_sent[a] += param_bytes
                n_merges += 1
            merge_rows += rows
            samples += np.asarray(shard)
            acc = np.clip(0.5 + 0.45 * (1 - math.exp(-t / (every * n_rounds / 3))) + 0.02 * rng.normal(size=n), 0, 1)
            evald = t % eval_every == 0
            if evald:
                last_acc = acc
            metric_rows += [
                {"t": t, "rank": k, "loss": float(1.5 * math.exp(-t / 20) + 0.1), "train_acc": float(acc[k]),
                 "test_acc": float(acc[k]) if evald else None, "test_loss": float(1 - acc[k]) if evald else None,
                 "samples": int(samples[k]), "bytes_sent": int(bytes_sent[k]),
                 "wall": round(0.19 * t + 0.001 * k, 4)}
                for k in range(n)
            ]
        # Like the engine: JSONL lines are appended once per signature round.
        w.append_jsonl("merges.jsonl", merge_rows)
        w.append_jsonl("metrics.jsonl", metric_rows)
        t_round = (r + 1) * every
        sig = (base[None, :] * (1.0 + s)
               + a_sup * sup[g // 2] + a_grp * grp[g]
               + noise * own + 0.01 * rng.normal(size=(n, dim))).astype(np.float32)
        bytes_sent += dim * 4 * (n - 1)
        k = min(_k_schedule(s, n_groups), n)
        if n > 1:
            Z = linkage(sig.astype(np.float64), method=method, metric=metric)
            labels = first_appearance(fcluster(Z, k, criterion="maxclust"))
        else:  # a world of one, as the engine writes it: an empty tree
            Z, labels = np.zeros((0, 4)), np.zeros(1, dtype=np.int64)
        centroid = sig.mean(axis=0)
        disp = float(np.mean(np.sum((sig - centroid) ** 2, axis=1)) / np.mean(np.sum(sig ** 2, axis=1)))
        ari = adjusted_rand(labels, g) if planted is not None else None
        if first_ari is None:
            first_ari = ari
        counts.append(int(labels.max()) + 1)
        info = {
            "round": r, "t": t_round, "n_communities": int(labels.max()) + 1, "law": law, "k": k,
            "p_cross": p_cross if law == "flat" else None,
            "temperature": temperature if law == "hierarchical" else None,
            "cut": "maxclust", "cut_height": _cut_height(Z, k) if n > 1 else 0.0, "linkage": method, "metric": metric,
            "dispersion": disp, "mean_update_norm": float(np.mean(norms)) if norms else None, "ari": ari,
            "hash": hashlib.sha256(labels.tobytes()).hexdigest()[:16],
        }
        w.write_round(r, sig, Z, labels, info)
        w.append_jsonl("consensus.jsonl", [{"t": t_round, "test_acc": float(min(1.0, last_acc.mean() + 0.01)),
                                            "test_loss": float(1 - last_acc.mean())}])
        if t_reached is None and disp < 0.05 and s > 2 / 3:
            t_reached = t_round
        prev_labels = labels

    if partial:
        # What a SIGKILL mid-run leaves: torn appends and a round directory being built.
        for fname in ("metrics.jsonl", "merges.jsonl"):
            with open(root / fname, "a", encoding="utf-8") as fh:
                fh.write('{"t": 999, "rank": 0, "loss": 0.4')
        tmp = root / "rounds" / f".round_{n_rounds:04d}.k3j9x2"
        tmp.mkdir()
        (tmp / "signatures.npy").write_bytes(b"\x93NUMPY\x01\x00partial")
        w.close()
        return root

    units = n_rounds * every
    w.write_json("summary.json", {
        "name": name, "strategy": strategy, "world_size": n, "n_params": 4810, "units": units,
        "rounds": n_rounds, "merges": n_merges,
        "consensus_test_acc": float(min(1.0, last_acc.mean() + 0.01)),
        "consensus_test_loss": float(1 - last_acc.mean()),
        "rank_test_acc": [float(x) for x in last_acc], "best_rank_acc": float(last_acc.max()),
        "worst_rank_acc": float(last_acc.min()), "mean_rank_acc": float(last_acc.mean()),
        "communities_per_round": counts, "first_round_ari": first_ari, "final_dispersion": disp,
        "consensus_reached_t": t_reached, "consensus_distance": 0.003,
        "bytes_sent_per_rank": [int(x) for x in bytes_sent], "bytes_sent_mean": float(bytes_sent.mean()),
        "wall_time": 95.0, "monitoring_bytes_mean": float(8 * 4810 * units / eval_every), "data_bytes_mean": 0.0,
        "time_split": {"train": 80.0, "exchange": 3.0, "signature": 0.5, "idle": 9.0, "eval": 2.0},
    })
    w.write_json("meta.json", {**meta, "end_time": "2026-11-22T10:01:35+00:00", "status": "complete"})
    w.close()
    return root


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description="write a synthetic run directory")
    p.add_argument("root")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--partial", action="store_true")
    a = p.parse_args(argv)
    make_run(a.root, n_ranks=a.ranks, n_rounds=a.rounds, groups=a.groups or None, dim=a.dim,
             every=a.every, seed=a.seed, partial=a.partial)
    print(a.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
