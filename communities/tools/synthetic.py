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
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
from scipy.cluster.hierarchy import fcluster, linkage

from ..core.clustering import adjusted_rand
from ..results import RunWriter

N_PARAMS = 4810  # the made-up model's parameters (the quickstart MLP's)
PARAM_BYTES = 4 * N_PARAMS  # bytes of one exchange's weights, float32


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


@dataclass
class _Traffic:
    """What the made-up ranks have done so far: bytes sent, samples seen, merges, their last evaluation."""

    bytes_sent: np.ndarray
    samples: np.ndarray
    merges: int = 0
    last_acc: Optional[np.ndarray] = None


def _unit_merges(rng: np.random.Generator, t: int, *, s: float, p_cross: float, labels: np.ndarray,
                 done: _Traffic, norms: List[float]) -> List[dict]:
    """Unit t's merges (two lines per exchange): initiators pick partners mostly inside their community."""
    n = labels.size
    fire = np.flatnonzero(rng.random(n) < 0.5) if n > 1 else np.zeros(0, dtype=np.int64)
    rows = []
    for i in fire:
        same = np.flatnonzero((labels == labels[i]) & (np.arange(n) != i))
        if same.size and rng.random() > p_cross:
            j = int(rng.choice(same))
        else:
            j = int(rng.choice(np.delete(np.arange(n), i)))
        dist = float(0.5 * (1 - 0.9 * s) + 0.05 * rng.random())
        for a, b in ((int(i), j), (j, int(i))):
            u = dist / 2 * (1 + 0.01 * rng.random())
            norms.append(u)
            rows.append({"t": t, "i": a, "j": b, "initiator": int(i), "a": 0.5, "update_norm": u,
                         "distance": dist, "bytes": PARAM_BYTES, "rule": "constant", "event": "merge"})
            done.bytes_sent[a] += PARAM_BYTES
        done.merges += 1
    return rows


def _unit_metrics(rng: np.random.Generator, t: int, *, horizon: float, evaluated: bool, shard: Sequence[int],
                  done: _Traffic) -> List[dict]:
    """Every rank's metrics.jsonl row of unit t (accuracy rising towards 0.95 over ``horizon`` units)."""
    n = len(shard)
    done.samples += np.asarray(shard)
    acc = np.clip(0.5 + 0.45 * (1 - math.exp(-t / horizon)) + 0.02 * rng.normal(size=n), 0, 1)
    if evaluated:
        done.last_acc = acc
    return [{"t": t, "rank": k, "loss": float(1.5 * math.exp(-t / 20) + 0.1), "train_acc": float(acc[k]),
             "test_acc": float(acc[k]) if evaluated else None, "test_loss": float(1 - acc[k]) if evaluated else None,
             "samples": int(done.samples[k]), "bytes_sent": int(done.bytes_sent[k]),
             "wall": round(0.19 * t + 0.001 * k, 4)} for k in range(n)]


def _planted_space(rng: np.random.Generator, n: int, n_groups: int, dim: int) -> Tuple[np.ndarray, ...]:
    """The hierarchy the signatures are drawn around: a common direction, super-groups (pairs of groups), groups
    and each rank's own direction."""
    base = rng.normal(size=dim)
    base /= np.linalg.norm(base)
    sup = rng.normal(size=(max(1, (n_groups + 1) // 2), dim))
    grp = rng.normal(size=(n_groups, dim))
    own = rng.normal(size=(n, dim))
    sup /= np.linalg.norm(sup, axis=1, keepdims=True)
    grp /= np.linalg.norm(grp, axis=1, keepdims=True)
    return base, sup, grp, own


def _write_start(w: RunWriter, cfg, *, n: int, strategy: str, planted: Optional[List[int]],
                 rng: np.random.Generator) -> Tuple[dict, List[int]]:
    """config.yaml, meta.json (running) and partition.json; (the meta, the shard sizes)."""
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
    return meta, shard


def _communities(sig: np.ndarray, k: int, method: str, metric: str) -> Tuple[np.ndarray, np.ndarray]:
    """The linkage and a maxclust cut at k, as the engine computes them (a world of one: an empty tree)."""
    if sig.shape[0] > 1:
        Z = linkage(sig.astype(np.float64), method=method, metric=metric)
        return Z, first_appearance(fcluster(Z, k, criterion="maxclust"))
    return np.zeros((0, 4)), np.zeros(1, dtype=np.int64)


def _write_round(w: RunWriter, r: int, t_round: int, sig: np.ndarray, *, s: float, planted: Optional[np.ndarray],
                 n_groups: int, law: str, method: str, metric: str, p_cross: float, norms: List[float]
                 ) -> Tuple[np.ndarray, float, Optional[float]]:
    """Round r's directory, its communities cut from the signatures as the engine cuts them: (labels,
    dispersion, ARI against the planted groups)."""
    n = sig.shape[0]
    k = min(_k_schedule(s, n_groups), n)
    Z, labels = _communities(sig, k, method, metric)
    centroid = sig.mean(axis=0)
    disp = float(np.mean(np.sum((sig - centroid) ** 2, axis=1)) / np.mean(np.sum(sig ** 2, axis=1)))
    ari = adjusted_rand(labels, planted) if planted is not None else None
    w.write_round(r, sig, Z, labels, {
        "round": r, "t": t_round, "n_communities": int(labels.max()) + 1, "law": law, "k": k,
        "p_cross": p_cross if law == "flat" else None,
        "temperature": 0.05 * (20 / 0.05) ** s if law == "hierarchical" else None,
        "cut": "maxclust", "cut_height": _cut_height(Z, k) if n > 1 else 0.0, "linkage": method, "metric": metric,
        "dispersion": disp, "mean_update_norm": float(np.mean(norms)) if norms else None, "ari": ari,
        "hash": hashlib.sha256(labels.tobytes()).hexdigest()[:16],
    })
    return labels, disp, ari


def _tear(root: Path, n_rounds: int) -> None:
    """What a SIGKILL mid-run leaves: torn appends and a round directory being built."""
    for fname in ("metrics.jsonl", "merges.jsonl"):
        with open(root / fname, "a", encoding="utf-8") as fh:
            fh.write('{"t": 999, "rank": 0, "loss": 0.4')
    tmp = root / "rounds" / f".round_{n_rounds:04d}.k3j9x2"
    tmp.mkdir()
    (tmp / "signatures.npy").write_bytes(b"\x93NUMPY\x01\x00partial")


def _summary(name: str, strategy: str, *, units: int, n_rounds: int, eval_every: int, done: _Traffic,
             counts: List[int], first_ari: Optional[float], disp: float, t_reached: Optional[int]) -> dict:
    last_acc = done.last_acc if done.last_acc is not None else np.zeros(done.samples.size)
    return {
        "name": name, "strategy": strategy, "world_size": int(done.samples.size), "n_params": N_PARAMS,
        "units": units, "rounds": n_rounds, "merges": done.merges,
        "consensus_test_acc": float(min(1.0, last_acc.mean() + 0.01)),
        "consensus_test_loss": float(1 - last_acc.mean()),
        "rank_test_acc": [float(x) for x in last_acc], "best_rank_acc": float(last_acc.max()),
        "worst_rank_acc": float(last_acc.min()), "mean_rank_acc": float(last_acc.mean()),
        "communities_per_round": counts, "first_round_ari": first_ari, "final_dispersion": disp,
        "consensus_reached_t": t_reached, "consensus_distance": 0.003,
        "bytes_sent_per_rank": [int(x) for x in done.bytes_sent], "bytes_sent_mean": float(done.bytes_sent.mean()),
        "wall_time": 95.0, "monitoring_bytes_mean": float(8 * N_PARAMS * units / eval_every), "data_bytes_mean": 0.0,
        "time_split": {"train": 80.0, "exchange": 3.0, "signature": 0.5, "idle": 9.0, "eval": 2.0},
    }


def _config(name: str, *, seed: int, strategy: str, planted: bool, n_groups: int, dim: int, every: int,
            method: str, metric: str, law: str, budget: int, eval_every: int):
    """The run's config.yaml: what such a run of the engine would have resolved."""
    from ..config import from_dict

    return from_dict({
        "name": name if all(c.isalnum() or c in "_.-" for c in name) else "run", "seed": seed, "strategy": strategy,
        "data": {"partition": "label_groups" if planted else "iid", "groups": max(1, n_groups)},
        "signature": {"dim": dim, "every": every},
        "clustering": {"linkage": method, "metric": metric, "cut": "maxclust"},
        "partners": {"law": law}, "train": {"budget": budget, "eval_every": eval_every},
    })


def make_run(
    root: Union[str, Path],
    n_ranks: int = 8,
    n_rounds: int = 6,
    groups: Union[int, Sequence[int], None] = 4,
    dim: int = 32,
    *, every: int = 5,
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
    root = Path(root)
    name = name or root.name
    rng = np.random.default_rng(seed)
    n = n_ranks
    eval_every = eval_every or every
    planted = planted_groups(n, groups, interleave)
    g = np.asarray(planted) if planted is not None else np.zeros(n, dtype=int)
    n_groups = int(g.max()) + 1 if planted is not None else 1

    cfg = _config(name, seed=seed, strategy=strategy, planted=planted is not None, n_groups=n_groups, dim=dim,
                  every=every, method=method, metric=metric, law=law, budget=n_rounds * every, eval_every=eval_every)
    w = RunWriter(root, overwrite=True)
    meta, shard = _write_start(w, cfg, n=n, strategy=strategy, planted=planted, rng=rng)
    base, sup, grp, own = _planted_space(rng, n, n_groups, dim)
    done = _Traffic(bytes_sent=np.zeros(n, dtype=np.int64), samples=np.zeros(n, dtype=np.int64))
    prev_labels = np.zeros(n, dtype=np.int64) if planted is None else g.copy()
    counts: List[int] = []
    first_ari, disp, t_reached = None, 1.0, None
    for r in range(n_rounds):
        s = r / (n_rounds - 1) if n_rounds > 1 else 0.0  # progress: the planted structure dissolves with it
        p_cross = 0.02 + 0.98 * (1 - math.cos(math.pi * s)) / 2
        norms: List[float] = []
        merge_rows, metric_rows = [], []
        for t in range(r * every + 1, (r + 1) * every + 1):
            merge_rows += _unit_merges(rng, t, s=s, p_cross=p_cross, labels=prev_labels, done=done,
                                       norms=norms)
            metric_rows += _unit_metrics(rng, t, horizon=every * n_rounds / 3, evaluated=t % eval_every == 0,
                                         shard=shard, done=done)
        # Like the engine: JSONL lines are appended once per signature round.
        w.append_jsonl("merges.jsonl", merge_rows)
        w.append_jsonl("metrics.jsonl", metric_rows)
        t_round = (r + 1) * every
        sig = (base[None, :] * (1.0 + s) + 1.2 * max(0.0, 1 - 1.5 * s) * sup[g // 2]
               + 1.2 * max(0.0, 1 - 3 * s) * grp[g] + 0.08 * (1 - 0.7 * s) * own
               + 0.01 * rng.normal(size=(n, dim))).astype(np.float32)
        done.bytes_sent += dim * 4 * (n - 1)
        labels, disp, ari = _write_round(w, r, t_round, sig, s=s, planted=g if planted is not None else None,
                                         n_groups=n_groups, law=law, method=method, metric=metric, p_cross=p_cross,
                                         norms=norms)
        first_ari = ari if first_ari is None else first_ari
        counts.append(int(labels.max()) + 1)
        last = done.last_acc if done.last_acc is not None else np.zeros(n)
        w.append_jsonl("consensus.jsonl", [{"t": t_round, "test_acc": float(min(1.0, last.mean() + 0.01)),
                                            "test_loss": float(1 - last.mean())}])
        if t_reached is None and disp < 0.05 and s > 2 / 3:
            t_reached = t_round
        prev_labels = labels
    if partial:
        _tear(root, n_rounds)
        w.close()
        return root
    w.write_json("summary.json", _summary(name, strategy, units=n_rounds * every, n_rounds=n_rounds,
                                          eval_every=eval_every, done=done, counts=counts, first_ari=first_ari,
                                          disp=disp, t_reached=t_reached))
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
