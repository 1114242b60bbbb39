"""``communities bench partners``: one round's partner law and one unit's exchange list at N replicas (flat,
hierarchical, least_recent), with the law's peak memory."""
from __future__ import annotations

import sys
import time
from typing import Any, Dict, List, cast

from .clustering import planted_signatures
from .common import MB, fmt_table, machine_load, median, pairwise_strategy, write_json


class SeenAtWorld:
    """A stand-in for the mixer's world and seen_at table: ``allgather`` returns a seeded (N, N) table."""

    def __init__(self, n: int, t: int, seed: int = 0):
        import numpy as np

        self.table = np.random.default_rng(seed).integers(-1, t + 1, size=(n, n)).astype(np.int64)
        self.world, self.seen_at = self, self.table[0]

    def allgather(self, _row):
        return self.table


def _law_reference(strat, law_name: str, com, seen_at, t: int):
    """The law as first written, for the before/after figures: condensed cophenetic heights, an N x N bias."""
    import numpy as np
    from scipy.cluster import hierarchy

    out = {}
    if law_name == "hierarchical":
        h = hierarchy.cophenet(com.Z)
        top = float(com.Z[-1, 2])
        out["heights"] = h / top if top > 0 else np.zeros_like(h)
    if law_name == "least_recent":
        W = (1.0 + float(t) - np.asarray(seen_at, dtype=np.float64)) ** 2.0
        np.fill_diagonal(W, 0.0)
        out["bias"] = W
    return out


def bench_partners(args) -> int:
    """One signature round's partner law and one unit's exchange list at N replicas, with the law's peak memory."""
    import tracemalloc

    import numpy as np

    from ... import config
    from ...core import clustering, protocol

    machine = machine_load()
    results, rows = [], []
    t = 50  # a unit after the first rounds (the schedules mid-way)
    for n in args.n:
        S = planted_signatures(n, 16, args.groups)
        com = clustering.find_communities(S, cut="maxclust", k=min(args.groups, n))
        for law in args.laws:
            overrides = {"strategy": "community", "partners": {"law": "flat" if law == "least_recent" else law},
                         "merge": {"partner_policy": "least_recent" if law == "least_recent" else "law"}}
            cfg = config.from_dict(overrides)
            mixer = SeenAtWorld(n, t)
            clock = protocol.MergeClock(n, cfg.seed, cfg.merge.lam)
            for u in range(1, t):  # the timers as they stand at t
                clock.fire(u)
            initiators = clock.fire(t)
            times: Dict[str, List[float]] = {k: [] for k in ("round", "unit", "all", "reference_round", "unit_cpu",
                                                              "all_cpu")}
            for rep in range(args.reps + 1):  # the first is a warm-up
                strat = pairwise_strategy(cfg, n)
                t0 = time.perf_counter()
                strat.observe(com, cast(Any, mixer), t)
                strat.law(t)
                t1, c1 = time.perf_counter(), time.process_time()
                strat.exchanges(t, initiators)
                t2, c2 = time.perf_counter(), time.process_time()
                strat.exchanges(t, np.arange(n))
                t3, c3 = time.perf_counter(), time.process_time()
                _law_reference(strat, law, com, mixer.table, t)
                t4 = time.perf_counter()
                if rep:
                    for key, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, c2 - c1, c3 - c2)):
                        times[key].append(v)
            # peak memory, traced apart (tracemalloc slows every allocation down)
            strat = pairwise_strategy(cfg, n)
            tracemalloc.start()
            strat.observe(com, cast(Any, mixer), t)
            strat.law(t)
            strat.exchanges(t, np.arange(n))
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            tracemalloc.start()
            _law_reference(strat, law, com, mixer.table, t)
            ref_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            med = {key: median(v) for key, v in times.items()}
            r = {"n": n, "law": law, "initiators": len(initiators), **{f"{k}_s": v for k, v in med.items()},
                 "peak_bytes": peak, "reference_peak_bytes": ref_peak}
            results.append(r)
            rows.append([n, law, len(initiators), f"{med['round'] * 1e3:.2f}",
                         f"{med['unit'] * 1e3:.1f} ({med['unit_cpu'] * 1e3:.1f})",
                         f"{med['all'] * 1e3:.1f} ({med['all_cpu'] * 1e3:.1f})", f"{peak / MB:.2f}",
                         f"{med['reference_round'] * 1e3:.2f}", f"{ref_peak / MB:.2f}"])
            print(f"  measured N={n} law={law}", file=sys.stderr, flush=True)
    print(f"bench partners: communities of {args.groups} planted groups (maxclust), unit t={t}, merge.lam=2; "
          f"median of {args.reps} repetitions after a warm-up; {machine}")
    print()
    print(fmt_table(["N", "law", "initiators", "round ms", "unit ms (cpu)", "all N ms (cpu)", "peak MiB",
                      "N x N law ms", "N x N peak MiB"], rows, align="ll" + "r" * 7))
    print()
    print("round = Strategy.observe + Strategy.law (hierarchical: the per-row cophenetic tree; least_recent: the "
          "gathered seen_at table, rows built when drawn); unit = Strategy.exchanges(t) for the ranks whose merge "
          "timer fires at t; all N = the same with every rank an initiator (the worst unit); (cpu) = this process's "
          "CPU time over the same span, the figure to read on a machine shared with other jobs; peak = tracemalloc's "
          "peak over the round and the all-N draws, past the gathered (N, N) int64 seen_at table the engine holds "
          "anyway. N x N = the law as first written (condensed cophenet heights, an (N, N) float64 bias), for "
          "comparison. Target: all N draws <= 50 ms at N = 1,024.")
    write_json(args.json, {"bench": "partners", "results": results})
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("partners", help="partner law and exchange list at N replicas (time, peak memory)")
    p.add_argument("--n", type=int, nargs="+", default=[8, 128, 1024])
    p.add_argument("--laws", nargs="+", default=["flat", "hierarchical", "least_recent"],
                   choices=["flat", "hierarchical", "least_recent"])
    p.add_argument("--groups", type=int, default=8, help="planted groups in the synthetic signatures")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_partners)
