"""``communities bench clustering``: linkage + cut + partner law + partner draws for all ranks."""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, Optional, Tuple, cast

from .common import fmt_table, machine_load, median, pairwise_strategy, write_json


def planted_signatures(n: int, d: int, groups: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(groups, d))
    labels = np.arange(n) % groups
    return (centres[labels] + 0.3 * rng.normal(size=(n, d))).astype(np.float32)


def cut_auto_sklearn(Z, distances, max_k=16, min_silhouette=0.25, min_separation=0.0):
    """The auto cut as first written (sklearn's silhouette_score once per k): the reference for timing and labels."""
    import numpy as np
    from scipy.cluster import hierarchy
    from scipy.spatial.distance import squareform
    from sklearn.metrics import silhouette_score

    from ...core.clustering import cut_maxclust

    n = Z.shape[0] + 1
    if n < 3:
        return np.zeros(n, dtype=np.int64)
    D = squareform(distances)
    best_k, best_s = 1, -np.inf
    for k in range(2, min(max_k, n - 1) + 1):
        if Z[n - k, 2] < min_separation:
            break
        labels = hierarchy.fcluster(Z, t=k, criterion="maxclust")
        if len(np.unique(labels)) < 2:
            continue
        s = silhouette_score(D, labels, metric="precomputed")
        if s > best_s + 1e-12:
            best_k, best_s = len(np.unique(labels)), s
    if best_s < min_silhouette:
        return np.zeros(n, dtype=np.int64)
    return cut_maxclust(Z, best_k)


def _time_case(S, cfg, n: int, k: Optional[int], reps: int):
    """Median seconds of find_communities, the law and the draws (and of find_communities' pieces, each alone)
    over ``reps`` repetitions after a warm-up; with the last repetition's communities, exchanges, distances and
    tree."""
    import numpy as np

    from ...core import clustering
    from ...core.significance import detect_communities

    cc = cfg.clustering
    t_unit = 1
    times: Dict[str, List[float]] = {key: [] for key in ("pairwise", "linkage", "test", "cut", "find_communities",
                                                         "law", "draws")}
    for rep in range(reps + 1):  # the first is a warm-up
        strat = pairwise_strategy(cfg, n)
        t0 = time.perf_counter()
        com = clustering.find_communities(S, cc.linkage, cc.metric, cc.cut, k=k, threshold=cc.threshold,
                                          max_k=min(cc.max_communities, n - 1), min_silhouette=cc.min_silhouette,
                                          min_separation=cc.min_separation, alpha=cc.alpha, draws=cc.draws,
                                          null=cc.null, test_rows=cc.test_rows, refined=cc.refine, seed=0, t=t_unit)
        strat.observe(com, cast(Any, None), t_unit)  # no mixer: partner_policy law needs none
        t1 = time.perf_counter()
        strat.law(t_unit)
        t2 = time.perf_counter()
        plan = strat.exchanges(t_unit, np.arange(n))
        t3 = time.perf_counter()
        # the pieces of find_communities, timed apart
        p0 = time.perf_counter()
        d = clustering.pairwise(S, cc.metric)
        p1 = time.perf_counter()
        Z = clustering.hierarchy.linkage(d, method=cc.linkage)
        p2 = time.perf_counter()
        geo = clustering.geometry(S, cc.metric)
        count = k
        if k is None:
            count = detect_communities(geo, max_k=min(cc.max_communities, n - 1), alpha=cc.alpha, draws=cc.draws,
                                       seed=0, t=t_unit, null=cc.null, max_rows=cc.test_rows).k
        p3 = time.perf_counter()
        labels = clustering.cut_k(Z, int(count or 1), geo if cc.refine else None)
        if k is None:
            scale = float(np.sqrt(np.mean(np.sum(np.asarray(S, dtype=np.float64) ** 2, axis=1))))
            clustering.merge_closer_than(labels, d, cc.min_separation * scale)
        p4 = time.perf_counter()
        if rep == 0:
            continue
        for key, dt in zip(times, (p1 - p0, p2 - p1, p3 - p2, p4 - p3, t1 - t0, t2 - t1, t3 - t2)):
            times[key].append(dt)
    return {key: median(v) for key, v in times.items()}, com, plan, d, Z


def _against_first_written(S, cfg, n: int, *, d, Z, reps: int, med: dict) -> Tuple[dict, str]:
    """The auto cut and the distances as first written (sklearn's silhouette per k; scipy pdist) against now, on
    the same tree: their figures and the table's last cell."""
    import numpy as np

    from ...core import clustering

    cc = cfg.clustering
    repeat = max(1, min(reps, 3))

    def timed(fn):
        out, took = None, []
        for _ in range(repeat):
            q0 = time.perf_counter()
            out = fn()
            took.append(time.perf_counter() - q0)
        return out, median(took)

    args = (min(cc.max_communities, n - 1), 0.25, cc.min_separation)  # the silhouette cut as first written
    ref, ref_s = timed(lambda: cut_auto_sklearn(Z, d, *args))
    fast, fast_s = timed(lambda: clustering.cut_auto(Z, d, *args))
    ref_d, pdist_s = timed(lambda: clustering._pdist(clustering._rows(S, cc.metric), cc.metric))
    r = {"cut_reference_s": ref_s, "cut_current_s": fast_s, "cut_same_labels": bool(np.array_equal(ref, fast)),
         "pairwise_pdist_s": pdist_s,
         "pairwise_max_rel_diff": float(np.max(np.abs(d - ref_d) / np.maximum(ref_d, 1e-300)))}
    cell = (f"{r['pairwise_pdist_s'] * 1e3:.1f} -> {med['pairwise'] * 1e3:.1f} "
            f"(max rel. diff {r['pairwise_max_rel_diff']:.0e}); "
            f"{r['cut_reference_s'] * 1e3:.1f} -> {r['cut_current_s'] * 1e3:.1f} "
            f"({'same' if r['cut_same_labels'] else 'DIFFERENT'} labels)")
    return r, cell


def bench_clustering(args) -> int:
    import importlib

    from ... import config

    machine = machine_load()
    importlib.import_module("sklearn.metrics")  # the reference cut needs it: keep its import out of the timings

    results, rows = [], []
    for n in args.n:
        S = planted_signatures(n, args.dim, args.groups)
        for cut in args.cuts:
            for law in args.laws:
                cfg = config.from_dict({"strategy": "community", "partners": {"law": law},
                                        "clustering": {"cut": cut, "k": {"start": min(args.k, n), "end": 1,
                                                                         "horizon": 100}}})
                k = int(round(min(args.k, n))) if cut == "maxclust" else None
                med, com, plan, d, Z = _time_case(S, cfg, n, k, args.reps)
                total = med["find_communities"] + med["law"] + med["draws"]
                r = {"n": n, "dim": args.dim, "cut": cut, "law": law, "communities": com.count,
                     "p_value": com.test.p_value if com.test is not None else None, "exchanges": len(plan),
                     **{f"{key}_s": v for key, v in med.items()}, "total_s": total}
                ref_cell = "-"
                if cut == "auto" and args.reference and law == args.laws[0]:
                    ref, ref_cell = _against_first_written(S, cfg, n, d=d, Z=Z, reps=args.reps, med=med)
                    r.update(ref)
                results.append(r)
                p_value = "-" if com.test is None else f"{com.test.p_value:.3f}"
                rows.append([n, cut, law, com.count, p_value, *[f"{med[key] * 1e3:.1f}" for key in med],
                             f"{total * 1e3:.1f}", ref_cell])
                print(f"  measured N={n} cut={cut} law={law}", file=sys.stderr, flush=True)
    _print_table(args, rows, machine)
    write_json(args.json, {"bench": "clustering", "results": results})
    return 0


def _print_table(args, rows: List[list], machine: str) -> None:
    from ... import config

    cc = config.from_dict({}).clustering
    print(f"bench clustering: signatures N x d={args.dim} float32 with {args.groups} planted group(s); engine "
          "defaults (ward linkage, cosine: Ward's tree of the unit rows, cuts refined by Lloyd steps; auto: the "
          f"community test at level {cc.alpha} with {cc.draws} null draws, k <= 16, separation >= 0.1); "
          f"maxclust k={args.k}; median of {args.reps} repetitions after a warm-up; {machine}")
    print()
    print(fmt_table(["N", "cut", "law", "communities", "p-value", "pairwise ms", "linkage ms", "test ms", "cut ms",
                      "find_communities ms", "law ms", "draws ms", "total ms",
                      "legacy cut, ms: pairwise (pdist -> Gram); silhouette cut (sklearn per k -> one pass)"], rows,
                     align="lll" + "r" * 10 + "l"))
    print()
    print("find_communities = pairwise (float64 Gram blocks, clustering._gram_distances) + linkage (scipy) + test "
          "(the community test, significance.detect_communities: PCA, Ward on the top components of the rows and of "
          "each null draw) + cut (the tree's cut at the test's k, Lloyd refinement, separation floor), each also "
          "timed alone; total = find_communities + law + draws; law = "
          "Strategy.law(t) (hierarchical: cophenetic heights); draws = Strategy.exchanges(t, all N ranks) "
          "(one partner draw per rank, as if every timer fired; in the engine about N/lambda ranks draw every "
          "unit). Last column: scipy pdist (as first written) against the Gram distances now, with their largest "
          "relative difference; the best-silhouette cut (clustering.alpha=null, min_silhouette 0.25) with sklearn's "
          "silhouette_score per k (as first written) against clustering.cut_auto now, on the same tree. "
          "Target: total < 1 s at N=4096.")


def add_parser(sub) -> None:
    p = sub.add_parser("clustering", help="linkage + cut + partner law + draws at N ranks")
    p.add_argument("--n", type=int, nargs="+", default=[64, 512, 4096])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--groups", type=int, default=8, help="planted groups in the synthetic signatures")
    p.add_argument("--cuts", nargs="+", default=["auto", "maxclust"], choices=["auto", "maxclust"])
    p.add_argument("--laws", nargs="+", default=["flat", "hierarchical"], choices=["flat", "hierarchical"])
    p.add_argument("--k", type=int, default=8, help="k of the maxclust cut")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip timing the sklearn-per-k reference of the auto cut")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_clustering)
