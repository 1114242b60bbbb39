"""Reading one finished run for a comparison: its consensus curve (accuracy, loss, bits per byte against units,
bytes sent and wall time), when it reached the target, and what it delivered."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Union

import numpy as np

from .spec import Target


def _read_jsonl(path: Path) -> List[dict]:
    from ...results import read_jsonl

    return read_jsonl(path)


def run_curve(path: Path) -> dict:
    """One complete run's figures and its consensus curve: t, accuracy, loss (nats per token), bits per byte (NaN
    where unknown), bytes per rank, wall seconds; and a language model's training tokens per second per rank.

    ``wall`` is measured (the slowest rank's metrics.jsonl ``wall`` at that unit)
    when the run's rows carry the field, and ``wall_measured`` says so; a run
    written before the field existed gets the estimate ``wall_time * t / units``.
    """
    from ...results import Summary

    summary = Summary.read(path)
    units = int(summary.units)
    wall = float(summary.wall_time)
    lm = summary.language_model
    evals = sorted(_read_jsonl(path / "consensus.jsonl"), key=lambda r: r["t"])
    points = [(int(r["t"]), float(r["test_acc"]), *_losses(r.get("test_loss"), r.get("test_bpb"), lm))
              for r in evals if r.get("test_acc") is not None]
    if not points or points[-1][0] < units:
        points.append((units, float(summary.consensus_test_acc),
                       *_losses(summary.consensus_test_loss, summary.consensus_test_bpb, lm)))
    metrics = _read_jsonl(path / "metrics.jsonl")
    bytes_by_t = _bytes_after_unit(metrics, units, float(summary.bytes_sent_mean),
                                   trains_with_traffic=_sync_gradients(summary.strategy))
    wall_by_t = _wall_at_unit(metrics)
    ts = np.array([p[0] for p in points], dtype=np.float64)
    if evals and all("wall" in r for r in evals):  # protocol async: the consensus of wall-clock snapshots
        walls = np.array([float(r["wall"]) for r in evals if r.get("test_acc") is not None] + [wall])[: ts.size]
        measured = True
    elif wall_by_t is not None:
        walls, measured = np.array([wall_by_t(t) for t in ts]), True
    else:
        walls, measured = wall * ts / max(units, 1), False
    return {
        "summary": summary, "units": units, "wall_time": wall,
        "t": ts, "acc": np.array([p[1] for p in points]),
        "loss": np.array([p[2] for p in points]), "bpb": np.array([p[3] for p in points]),
        "bytes": np.array([bytes_by_t(t) for t in ts]),
        "wall": walls, "wall_measured": measured,
        "tokens_per_s": tokens_per_second(metrics, summary) if lm is not None else None,
    }


def _losses(loss, bpb, lm) -> tuple:
    """(loss, bits per byte) of a consensus evaluation as floats, NaN where unknown (bits per byte from the loss
    where the run's bytes per token are known and the row predates its ``test_bpb``)."""
    nats = float("nan") if loss is None else float(loss)
    if bpb is None and lm is not None:
        bpb = lm.bpb(nats)
    return nats, float("nan") if bpb is None else float(bpb)


def tokens_per_second(metrics: List[dict], summary) -> Optional[float]:
    """A language model's training tokens per second per rank: each rank's windows trained (its last metrics.jsonl
    ``samples``) x the context (summary ``context``), over its loop's wall time (summary ``time_split_per_rank``,
    else the slowest rank's ``wall_time``: evaluations, exchanges and waits included), averaged over the ranks.
    None without a context or a wall time."""
    context = summary.context
    if not context:
        return None
    samples: Dict[int, float] = {}
    for m in metrics:
        rank = int(m.get("rank", -1))
        if rank >= 0 and m.get("samples") is not None:
            samples[rank] = max(samples.get(rank, 0.0), float(m["samples"]))
    walls = (summary.time_split_per_rank or {}).get("wall") or []
    rates = []
    for rank, n in samples.items():
        wall = walls[rank] if rank < len(walls) else summary.wall_time
        if wall and wall > 0:
            rates.append(n * context / wall)
    return float(np.mean(rates)) if rates else None


def _sync_gradients(strategy: Optional[str]) -> bool:
    """Whether the engine strategy communicates inside a unit's training (allreduce: a gradient Allreduce per step)."""
    from ...config import SYNCS_GRADIENTS

    return strategy in SYNCS_GRADIENTS


def _per_unit(metrics: List[dict], key: str) -> Dict[int, List[float]]:
    out: Dict[int, List[float]] = {}
    for m in metrics:
        if m.get(key) is not None and m.get("rank", 0) >= 0:
            out.setdefault(int(m["t"]), []).append(float(m[key]))
    return out


def _bytes_after_unit(metrics: List[dict], units: int, final_mean: float, trains_with_traffic: bool = False):
    """bytes_per_rank(t): mean over ranks of the bytes sent up to and including unit t.

    ``Orchestrator._train`` appends a rank's metrics row for unit t right after
    training unit t, before that unit's exchanges, global average and signature
    round. So row t holds everything sent in units < t plus what unit t's
    training itself sent. For every strategy but ``allreduce`` training sends
    nothing, and the bytes by the end of unit t are row t+1. ``allreduce``
    (``trains_with_traffic``) sends its gradient Allreduces inside training, the
    same bytes c every unit (a fixed number of steps of one buffer); row t+1
    holds unit t+1's, so the end of unit t is row t+1 - c, with c the smallest
    increase between consecutive rows (a unit without a signature round). The
    end of the last unit is summary.json's final mean; between recorded units
    the figure is interpolated linearly.
    """
    per_t = {t: float(np.mean(v)) for t, v in _per_unit(metrics, "bytes_sent").items()}
    xs = sorted(per_t)
    c = 0.0
    if trains_with_traffic:
        steps = [per_t[b] - per_t[a] for a, b in zip(xs, xs[1:]) if b == a + 1]
        c = max(0.0, min(steps)) if steps else (per_t[xs[0]] / xs[0] if xs and xs[0] >= 1 else 0.0)
    ends = [(t - 1, per_t[t] - c) for t in xs if t >= 1]  # row t+1, less unit t+1's own training -> end of unit t
    ends.append((units, final_mean))
    ends = sorted(dict(ends).items())
    ex = np.array([e[0] for e in ends], dtype=np.float64)
    ey = np.array([e[1] for e in ends], dtype=np.float64)

    def at(t: float) -> float:
        return float(np.interp(t, ex, ey))

    return at


def _wall_at_unit(metrics: List[dict]):
    """wall(t): the largest metrics.jsonl ``wall`` over the ranks at unit t, or None when no row has the field.

    ``wall`` is a rank's seconds since its run started, taken when it appends
    the row (right after training unit t); the slowest rank's is when the
    whole world had trained unit t. Units without rows are interpolated, from
    0 s at t = 0.
    """
    per_t = _per_unit(metrics, "wall")
    if not per_t:
        return None
    known = {0: 0.0, **{t: max(v) for t, v in per_t.items()}}
    ex = np.array(sorted(known), dtype=np.float64)
    ey = np.array([known[int(t)] for t in ex], dtype=np.float64)

    def at(t: float) -> float:
        return float(np.interp(t, ex, ey))

    return at


def idle_share(path: Path, summary) -> Optional[float]:
    """The mean idle share of wall time over the ranks that were not slowed down on purpose (faults.speed); in a
    population, over the processes none of whose replicas was (the process's idle time: ``placement``)."""
    per = summary.time_split_per_rank
    if not per or "idle" not in per:
        return None
    try:
        import yaml

        slowed = set((yaml.safe_load((path / "config.yaml").read_text()) or {}).get("faults", {}).get("speed") or {})
    except (OSError, ValueError):
        slowed = set()
    place = getattr(summary, "placement", None)
    if place and place.get("idle_share_per_process"):  # a population: a slowed replica slows its whole process
        shares, block = place["idle_share_per_process"], int(place["replicas_per_process"])
        procs = [p for p in range(len(shares)) if p not in {r // block for r in slowed}] or list(range(len(shares)))
        return float(np.mean([shares[p] for p in procs]))
    ranks = [r for r in range(len(per["wall"])) if r not in slowed] or list(range(len(per["wall"])))
    return float(np.mean([per["idle"][r] / per["wall"][r] for r in ranks if per["wall"][r] > 0]))


def time_to_target(curve: dict, target: Union[float, Target]) -> Optional[dict]:
    """The first consensus evaluation that meets ``target`` (a float: an accuracy, at or above it; a loss or bits
    per byte: at or below it): its t, the bytes by then, the wall seconds by then, and its figure."""
    if not isinstance(target, Target):
        target = Target("acc", float(target))
    values = curve.get(target.metric)
    if values is None:
        return None
    hit = np.flatnonzero(target.reached(values))
    if hit.size == 0:
        return None
    k = int(hit[0])
    return {"t": float(curve["t"][k]), "bytes": float(curve["bytes"][k]), "wall": float(curve["wall"][k]),
            "wall_measured": bool(curve.get("wall_measured", False)), target.metric: float(values[k])}


def finite(x) -> Optional[float]:
    """A figure for JSON: None where missing or not finite."""
    return None if x is None or not math.isfinite(float(x)) else float(x)


def delivered(summary) -> str:
    """What a run hands each rank: ``consensus``, ``communities (C)``, ``ifca (k)``, ``finetuned`` or ``own``."""
    local = summary.local_test or {}
    kind = local.get("delivered")
    models = (summary.community_models or {}).get("models")
    if kind is None:
        kind = "communities" if (summary.consensus_mode or {}).get("decision") == "communities" else (
            "own" if summary.strategy == "isolated" else "consensus")
    if kind in ("communities", "ifca") and models is not None:
        used = sum(1 for m in models if m["members"])
        return f"{kind} ({used})"
    return kind
