"""``communities bench vectorize``: replica-units per second of a process's replicas trained one after another
(``train.train_unit``) against stacked (``workload.vectorized``), side by side, on digits with the quickstart MLP."""
from __future__ import annotations

from .common import fmt_table, machine_load, write_json


def bench_vectorize(args) -> int:
    from ...workload import vectorized

    machine = machine_load()
    results = vectorized.benchmark(args.replicas, units=args.units, shard_size=args.shard_size or None,
                                   threads=args.threads, seed=args.seed)
    rows = [[r["replicas"], r["shard_size"], f"{r['sequential_rps']:.1f}", f"{r['vectorized_rps']:.1f}",
             f"{r['speedup']:.1f}x", f"{r['max_abs_diff']:.1e}", f"{r['population_copy_rps']:.1f}",
             f"{r['population_rows_rps']:.1f}", "yes" if r["rows_equal_copy"] else "NO"] for r in results]
    print(f"bench vectorize: digits 8x8 (standardized) -> MLP 64-64-10, batch 32, SGD momentum 0.9, "
          f"one epoch per unit, {args.threads} thread(s), {args.units} timed units after one warm-up, "
          f"the two paths interleaved unit by unit; {machine}")
    print()
    print(fmt_table(["replicas", "shard", "sequential r-units/s", "vectorized r-units/s", "speedup",
                      "max |w diff|", "population copy", "population rows", "rows = copy"], rows))
    print()
    print("r-units/s = replica-units per second (replicas x units / seconds). sequential = a loop of "
          "train.train_unit over the replicas, each with its own torch.optim; vectorized = one "
          "vectorized.StackedTrainer.train_unit (torch.func vmap). max |w diff| = the largest weight difference "
          "between the two at the end. Target: speedup >= 8x at 64 replicas (not asserted). population copy / rows = "
          "r-units/s of the engine's stacked unit (vectorized.train_members) with each replica's weights and "
          "optimizer state in buffers of its own, copied in and back, and as rows of one block the step trains in "
          "place (engine/replica/block.py); rows = copy: their weights are bitwise equal.")
    write_json(args.json, {"bench": "vectorize", "threads": args.threads, "units": args.units, "results": results})
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("vectorize", help="replicas trained one after another vs stacked (torch.func)")
    p.add_argument("--replicas", type=int, nargs="+", default=[64, 256], help="replicas per process")
    p.add_argument("--units", type=int, default=3, help="timed units (after one warm-up unit)")
    p.add_argument("--shard-size", type=int, default=168,
                   help="training images per replica (168: the quickstart's shard; 0: the set split into R)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_vectorize)
