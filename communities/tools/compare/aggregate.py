"""compare.json: each run's figures and each strategy's over its seeds."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from .curves import delivered, finite, idle_share, run_curve, time_to_target
from .runs import RunPlan, run_complete
from .spec import Spec, Target


def _stats(values: Sequence[Optional[float]]) -> dict:
    """mean and the sample standard deviation over seeds (ddof=1; null for a single seed)."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return {"mean": None, "std": None, "n": 0, "values": []}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if v.size > 1 else None, "n": int(v.size),
            "values": v.tolist()}


def aggregate(spec: Spec, plans: Sequence[RunPlan]) -> dict:
    """compare.json: each run's figures and each strategy's over its seeds (a language model's runs add their
    losses, bits per byte and tokens per second; ``_``-keys stay out of the file)."""
    target = spec.target
    arms: Dict[str, Dict[str, Any]] = {}
    runs: List[Dict[str, Any]] = []
    curves: Dict[str, List[dict]] = {}
    for p in plans:
        absent = "incomplete" if (p.path / "meta.json").exists() else "missing"
        entry: Dict[str, Any] = {"strategy": p.arm.label, "engine_strategy": p.arm.strategy, "seed": p.seed,
                                 "name": p.name, "path": str(p.path),
                                 "status": p.status if p.status != "pending" else absent}
        if p.error:
            entry["error"] = p.error
        if run_complete(p.path):
            c = run_curve(p.path)
            s = c["summary"]
            tt = time_to_target(c, target)
            entry.update(status="complete" if p.status == "pending" else p.status,
                         consensus_test_acc=s.consensus_test_acc, best_rank_acc=s.best_rank_acc,
                         bytes_sent_mean=s.bytes_sent_mean, wall_time=s.wall_time, units=s.units,
                         merges=s.merges, target=tt, data_bytes_mean=s.data_bytes_mean,
                         monitoring_bytes_mean=s.monitoring_bytes_mean, idle_share=idle_share(p.path, s),
                         retired_fraction=(s.examples or {}).get("retired_fraction"),
                         first_round_ari=s.first_round_ari, local_test_acc=(s.local_test or {}).get("mean_acc"),
                         delivered=delivered(s), epsilon=(s.privacy or {}).get("epsilon_max"))
            if s.task is not None:  # a language model's: lower is better
                entry.update(task=s.task, consensus_test_loss=finite(s.consensus_test_loss),
                             consensus_test_bpb=s.consensus_test_bpb, tokens_per_s_per_rank=c["tokens_per_s"])
            curves.setdefault(p.arm.label, []).append({"seed": p.seed, **c})
        runs.append(entry)
    language_models = any("task" in r for r in runs)
    for arm in spec.arms:
        mine = [r for r in runs if r["strategy"] == arm.label and "consensus_test_acc" in r]
        planned = [r for r in runs if r["strategy"] == arm.label]
        if not planned:
            continue
        hits = [r["target"] for r in mine if r["target"] is not None]
        lm = {}
        if language_models:  # the losses in both units, the training speed
            lm = {key: _stats([r.get(key) for r in mine])
                  for key in ("consensus_test_loss", "consensus_test_bpb", "tokens_per_s_per_rank")}
        target_stats = {target.name: target.value, **({"lower_is_better": True} if target.lower_is_better else {})}
        arms[arm.label] = {
            "strategy": arm.strategy, "overrides": arm.overrides, "runs": len(mine), "planned": len(planned),
            "seeds": [r["seed"] for r in mine],
            "consensus_test_acc": _stats([r["consensus_test_acc"] for r in mine]),
            "best_rank_acc": _stats([r["best_rank_acc"] for r in mine]),
            "bytes_sent_per_rank": _stats([r["bytes_sent_mean"] for r in mine]),
            "wall_time": _stats([r["wall_time"] for r in mine]),
            "idle_share": _stats([r["idle_share"] for r in mine if r["idle_share"] is not None]),
            "data_bytes_per_rank": _stats([r["data_bytes_mean"] for r in mine]),
            "retired_fraction": _stats([r["retired_fraction"] for r in mine if r["retired_fraction"] is not None]),
            "local_test_acc": _stats([r["local_test_acc"] for r in mine if r["local_test_acc"] is not None]),
            "first_round_ari": _stats([r["first_round_ari"] for r in mine if r["first_round_ari"] is not None]),
            "delivered": sorted({r["delivered"] for r in mine}),
            "epsilon": _stats([r["epsilon"] for r in mine if r.get("epsilon") is not None]),
            **lm,
            "target": {**target_stats, "reached": len(hits), "of": len(mine),
                       "t": _stats([h["t"] for h in hits]), "bytes": _stats([h["bytes"] for h in hits]),
                       "wall": _stats([h["wall"] for h in hits]),
                       "wall_measured": sum(1 for h in hits if h["wall_measured"])},
        }
    return {"name": spec.name, "base": str(spec.base), "world_size": spec.world_size, "seeds": spec.seeds,
            target.key: target.value, "overrides": spec.overrides, "strategies": arms, "runs": runs,
            "_curves": curves, "_target": target}


def target_of(agg: dict) -> Target:
    """An aggregate's target (``aggregate``'s, or compare.json's ``target_accuracy``/``_loss``/``_bpb``)."""
    if isinstance(agg.get("_target"), Target):
        return agg["_target"]
    for metric, name in Target.NAMES.items():
        if agg.get(f"target_{name}") is not None:
            return Target(metric, float(agg[f"target_{name}"]))
    raise KeyError("the aggregate names no target (target_accuracy, target_loss or target_bpb)")


def plotted_metric(target: Target, lm: bool) -> str:
    """The curve the plots draw: the target's, except a language model's accuracy target draws its loss."""
    return ("bpb" if target.metric == "bpb" else "loss") if lm else "acc"
