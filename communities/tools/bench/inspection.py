"""``communities bench inspect``: ``communities inspect`` on a synthetic run directory
(``communities.tools.synthetic.make_run``, 64 ranks and 50 rounds by default)."""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from .common import fmt_table, machine_load, write_json


def bench_inspect(args) -> int:
    """Time ``inspection.main_inspect([run])`` on a synthetic run: wall and CPU seconds, dendrograms drawn."""
    import contextlib
    import io
    import shutil

    from .. import synthetic

    machine = machine_load()
    keep = args.output_root is not None
    root = Path(args.output_root or tempfile.mkdtemp(prefix="communities-bench-inspect-"))
    run = root / f"synthetic_{args.ranks}x{args.rounds}"
    t0 = time.perf_counter()
    synthetic.make_run(run, n_ranks=args.ranks, n_rounds=args.rounds, groups=args.groups or None, dim=args.dim,
                       seed=args.seed)
    make_s = time.perf_counter() - t0
    from ...report.inspection import main_inspect

    results, rows = [], []
    for rep in range(args.repeat):
        shutil.rmtree(run / "report", ignore_errors=True)
        argv = [str(run)] + (["--no-svg"] if args.no_svg else [])
        out = io.StringIO()
        w0, c0 = time.perf_counter(), time.process_time()
        with contextlib.redirect_stdout(out):
            rc = main_inspect(argv)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        if rc != 0:
            print(f"bench inspect: main_inspect({argv}) exited {rc}:\n{out.getvalue()[-2000:]}", file=sys.stderr)
            return 1
        drawn = len(list((run / "report").glob("dendrogram_round_*.png")))
        results.append({"repeat": rep, "wall_s": wall, "cpu_s": cpu, "dendrograms": drawn})
        rows.append([rep + 1, f"{wall:.2f}", f"{cpu:.2f}", drawn])
    print(f"bench inspect: communities.report.inspection.main_inspect([run{' --no-svg' if args.no_svg else ''}]) on a "
          f"synthetic run of {args.ranks} ranks x {args.rounds} rounds (groups={args.groups}, d={args.dim}, "
          f"seed={args.seed}; made in {make_s:.2f} s by communities.tools.synthetic.make_run); {machine}")
    print()
    print(fmt_table(["run", "wall s", "CPU s", "dendrograms"], rows))
    print()
    print("wall = perf_counter, CPU = process_time of this process around main_inspect (the first run includes "
          "importing matplotlib); dendrograms = dendrogram_round_*.png files in the report. No target is asserted.")
    if keep:
        print(f"run kept at {run}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, {"bench": "inspect", "ranks": args.ranks, "rounds": args.rounds, "groups": args.groups,
                            "dim": args.dim, "make_run_s": make_s, "results": results})
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="time communities inspect on a synthetic run directory")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--rounds", type=int, default=50)
    p.add_argument("--groups", type=int, default=4, help="planted groups (0: none)")
    p.add_argument("--dim", type=int, default=32, help="signature dimension of the synthetic rounds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="timed inspections of the same run")
    p.add_argument("--no-svg", action="store_true", help="pass --no-svg to inspect (PNG figures only)")
    p.add_argument("--output-root", default=None, help="keep the run and its report here (default: a temporary "
                                                      "directory, removed)")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_inspect)
