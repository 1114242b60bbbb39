"""``communities bench calibration``: how often the community test splits clouds without communities, and how often
it finds planted groups, on simulated clouds and on the saved first rounds of real runs.

The test (``core/significance.py``) is run with the engine's clustering keys (the defaults, or ``--alpha``,
``--draws``, ``--null``, ``--metric``) on:

- simulated clouds (``--n``, ``--reps`` each): Gaussian clouds with a decaying spectrum, clouds of independent
  uniform coordinates (the null's own shape), and 4 planted Gaussian groups;
- the rounds of real runs (``--runs [LABEL=]GLOB ...``, run directories): each run's round ``--round`` (default 0,
  the first, found before any merge), re-decided from its saved ``signatures.npy`` with the run's own seed and t,
  so a run recorded before the test, or with other keys, is decided as the engine would decide it now. A run
  with planted groups (``partition.json``) counts as found when the test finds communities; its ARI is that of
  the delivered communities (the tree's cut at the test's k, refined) against the groups.

Rates come with a 95% Wilson interval. Nothing is asserted: the level is printed beside the rates.
"""
from __future__ import annotations

import glob
import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from .common import fmt_table, machine_load, median, write_json

# The seed offset between the blocks of one run (--blocks): far from any run's own seed
BLOCK_SEEDS = 1_000_003


def wilson(hits: int, n: int, z: float = 1.96) -> tuple:
    """The 95% Wilson score interval of a rate hits / n."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def _rate(hits: int, n: int) -> str:
    lo, hi = wilson(hits, n)
    return f"{hits}/{n} = {hits / n:.3f} [{lo:.3f}, {hi:.3f}]" if n else "-"


def decide(signatures, cc, *, seed: int, t: int, groups=None) -> dict:
    """What the engine's auto cut decides on these rows: the test's outcome, the communities and their ARI."""
    import numpy as np

    from ...core import clustering

    S = np.asarray(signatures, dtype=np.float64)
    t0 = time.perf_counter()
    com = clustering.find_communities(S, cc.linkage, cc.metric, "auto", max_k=min(cc.max_communities, len(S) - 1),
                                      min_silhouette=cc.min_silhouette, min_separation=cc.min_separation,
                                      alpha=cc.alpha, draws=cc.draws, null=cc.null, test_rows=cc.test_rows,
                                      refined=cc.refine, seed=seed, t=t)
    seconds = time.perf_counter() - t0
    return {"communities": com.count, "p_value": None if com.test is None else com.test.p_value,
            "ari": clustering.adjusted_rand(com.labels, groups), "seconds": seconds}


def simulated(kind: str, n: int, d: int, rng):
    """(rows, planted groups or None) of one simulated cloud."""
    import numpy as np

    scale = 1.0 / np.sqrt(np.arange(1, d + 1))  # a decaying spectrum, as signatures have
    if kind == "gaussian":
        return rng.normal(size=(n, d)) * scale + 1.0, None
    if kind == "uniform":
        return rng.uniform(-1.0, 1.0, size=(n, 4)) * [1.6, 1.3, 1.1, 1.0], None
    groups = np.arange(n) % 4  # planted: 4 groups, centres 6 noise deviations apart on average
    centres = rng.normal(size=(4, d))
    centres *= 6.0 / np.linalg.norm(centres, axis=1, keepdims=True)
    return centres[groups] + rng.normal(size=(n, d)) + 1.0, groups


def _row(label: str, n: int, decisions: List[dict], planted: bool, alpha: Optional[float]) -> list:
    found = sum(1 for r in decisions if r["communities"] > 1)
    ks: Dict[int, int] = {}
    for r in decisions:
        ks[r["communities"]] = ks.get(r["communities"], 0) + 1
    aris = [r["ari"] for r in decisions if r["ari"] is not None]
    return [label, n, len(decisions), "planted" if planted else "none", alpha, _rate(found, len(decisions)),
            " ".join(f"{k}:{c}" for k, c in sorted(ks.items())),
            f"{sum(aris) / len(aris):.3f}" if aris else "-",
            f"{median([r['seconds'] for r in decisions]) * 1e3:.0f}"]


def run_dirs(spec: str):
    """(label, sorted run directories) of ``[LABEL=]GLOB``."""
    label, _, pattern = spec.rpartition("=") if "=" in spec else (spec, "", spec)
    paths = sorted((Path(p) for p in glob.glob(pattern) if (Path(p) / "rounds").is_dir()),
                   key=lambda p: (len(p.name), p.name))
    return label, paths


def real_decisions(paths, cc, round_index: int, blocks: int = 0):
    """The decision of each run's round ``round_index`` (``blocks``: of each block of that many consecutive
    replicas, as if they were a world of their own); (decisions, N, planted)."""
    import numpy as np

    decisions, sizes, planted = [], set(), False
    for path in paths:
        rd = path / "rounds" / f"round_{round_index:04d}"
        if not (rd / "signatures.npy").is_file() or not (rd / "round.json").is_file():
            print(f"bench calibration: {path} has no complete round {round_index}: left out", file=sys.stderr)
            continue
        S = np.load(rd / "signatures.npy", allow_pickle=False)
        info = json.loads((rd / "round.json").read_text())
        seed = int(_run_seed(path))
        groups = json.loads((path / "partition.json").read_text()).get("groups") \
            if (path / "partition.json").is_file() else None
        planted = planted or (groups is not None and len(set(groups)) > 1)
        size = blocks if 0 < blocks < S.shape[0] else S.shape[0]
        for block, lo in enumerate(range(0, S.shape[0] - size + 1, size)):
            part = None if groups is None else groups[lo: lo + size]
            # each block's null draws keyed apart (a world of its own), the first block's as the run's
            decisions.append(decide(S[lo: lo + size], cc, seed=seed + BLOCK_SEEDS * block, t=int(info["t"]),
                                    groups=part))
        sizes.add(size)
    return decisions, (sizes.pop() if len(sizes) == 1 else "/".join(str(s) for s in sorted(sizes))), planted


def _run_seed(path: Path) -> int:
    import yaml

    return int((yaml.safe_load((path / "config.yaml").read_text()) or {}).get("seed", 0))


def bench_calibration(args) -> int:
    import numpy as np

    from ... import config

    overrides = {k: v for k, v in {"alpha": args.alpha, "draws": args.draws, "null": args.null,
                                   "metric": args.metric}.items() if v is not None}
    cc = config.from_dict({"clustering": overrides}).clustering
    rows, results = [], []
    for kind in args.kinds:
        for n in args.n:
            rng = np.random.default_rng(n)
            decisions = []
            # the null's own shape is a box in the euclidean geometry (unit rows would bend it onto a sphere)
            kc = cc.model_copy(update={"metric": "euclidean"}) if kind == "uniform" else cc
            for rep in range(args.reps):
                S, groups = simulated(kind, n, args.dim, rng)
                decisions.append(decide(S, kc, seed=rep, t=5, groups=groups))
            rows.append(_row(f"simulated {kind}" + (" (euclidean)" if kind == "uniform" else ""), n, decisions,
                             kind == "planted", cc.alpha))
            results.append({"source": f"simulated {kind}", "n": n, "decisions": decisions})
            print(f"  measured simulated {kind} N={n}", file=sys.stderr, flush=True)
    for spec in args.runs or []:
        label, paths = run_dirs(spec)
        if not paths:
            print(f"bench calibration: no run directory matches {spec!r}", file=sys.stderr)
            return 2
        decisions, n, planted = real_decisions(paths, cc, args.round, args.blocks)
        label = f"{label} (blocks of {n})" if args.blocks and str(n) == str(args.blocks) else label
        rows.append(_row(label, n, decisions, planted, cc.alpha))
        results.append({"source": label, "n": n, "runs": [str(p) for p in paths], "planted": planted,
                        "decisions": decisions})
        print(f"  measured {label} ({len(paths)} runs)", file=sys.stderr, flush=True)
    print(f"bench calibration: the community test (clustering.cut auto) at level alpha={cc.alpha}, {cc.draws} null "
          f"draws ({cc.null} scores), linkage {cc.linkage}, metric {cc.metric}, at most {cc.test_rows} rows tested; "
          f"simulated clouds d={args.dim}, {args.reps} each; real runs: round {args.round}; {machine_load()}")
    print()
    print(fmt_table(["source", "N", "runs", "groups", "level", "communities found: rate [95% CI]", "k: count",
                     "mean ARI", "median ms"], rows, align="lrrlrllrr"))
    print()
    print("A cloud without planted groups split into communities is a false positive: its rate is what the level "
          "bounds. simulated gaussian: a decaying spectrum (sd 1/sqrt(j)); uniform: independent uniform coordinates "
          "in 4 dimensions (the null's own shape: the rate is the level); planted: 4 Gaussian groups whose centres "
          "are 6 noise deviations from the origin. ARI: the delivered communities against the planted groups. "
          "ms: the whole auto cut (tree, test, refinement).")
    write_json(args.json, {"bench": "calibration", "alpha": cc.alpha, "draws": cc.draws, "null": cc.null,
                           "metric": cc.metric, "results": results})
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("calibration", help="the community test's false-positive and detection rates")
    p.add_argument("--runs", nargs="+", metavar="[LABEL=]GLOB", help="run directories whose round is re-decided")
    p.add_argument("--round", type=int, default=0, help="the round of each run (default 0, the first)")
    p.add_argument("--blocks", type=int, default=0, metavar="M", help="decide each block of M consecutive replicas "
                   "of a run apart, as a world of M (default: the whole run)")
    p.add_argument("--kinds", nargs="*", default=["gaussian", "uniform", "planted"],
                   choices=["gaussian", "uniform", "planted"], help="simulated clouds (none: --kinds with no value)")
    p.add_argument("--n", type=int, nargs="+", default=[8, 64, 256], help="rows of the simulated clouds")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--reps", type=int, default=40, help="simulated clouds of each kind and N")
    p.add_argument("--alpha", type=float, help="the level (default: clustering.alpha's)")
    p.add_argument("--draws", type=int, help="null draws (default: clustering.draws')")
    p.add_argument("--null", choices=["uniform", "gaussian"], help="the null's scores (default: clustering.null's)")
    p.add_argument("--metric", choices=["cosine", "euclidean"], help="default: clustering.metric's")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_calibration)
