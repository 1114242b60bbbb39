"""``communities bench overhead``: real engine runs; the orchestration share of wall time, and with
``--profile`` where the signature rounds spend it."""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from ..jobs import child_env, engine_cmd, require_mpiexec
from .common import fmt_table, machine_load, median, write_json

# what --profile breaks down: a signature round of the virtual clock, and the clustering inside it
PROFILED = ("signature_rounds.py:run", "find_communities")


def profile_rank(args) -> int:
    """Run ``communities ARGV`` under cProfile, dumping ``OUT/rank<r>.prof`` per rank."""
    import cProfile
    import runpy

    prof = cProfile.Profile()
    prof.enable()
    argv, sys.argv = sys.argv, ["communities", *args.argv]
    try:  # what ``python -m communities ARGV`` runs (the command line imports the benchmarks: no import here)
        runpy.run_module("communities", run_name="__main__", alter_sys=True)
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
        prof.disable()
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else 0
        Path(args.out).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(args.out) / f"rank{rank}.prof"))
    return rc


def _callee_breakdown(stats, parent_name: str, depth: int = 2, min_share: float = 0.02):
    """(total s, [(level, label, s)]): callees of the function named ``parent_name``, heaviest first.

    ``parent_name`` is a function name, or ``file.py:name`` to pick one of several of that name.

    pstats keeps caller->callee edges, not call paths, so a callee's own callees are
    listed only when that callee is called from nowhere else (otherwise their time
    could belong to another caller).
    """
    table = stats.stats
    file, _, name = parent_name.rpartition(":")
    parents = [f for f in table if f[2] == name and (not file or Path(f[0]).name == file)]
    if not parents:
        return 0.0, []
    total = sum(table[p][3] for p in parents)
    lines = []

    def walk(funcs, level):
        agg: Dict[tuple, float] = {}
        for f, (_cc, _nc, _tt, _ct, callers) in table.items():
            for p in funcs:
                if p in callers:
                    agg[f] = agg.get(f, 0.0) + callers[p][3]
        for f, sec in sorted(agg.items(), key=lambda kv: -kv[1]):
            if sec < min_share * total:
                continue
            where = f"{Path(f[0]).name}:{f[1]}" if f[0] != "~" else "builtin"
            lines.append((level, f"{f[2]} ({where})", sec))
            if level + 1 < depth and set(table[f][4]) <= set(funcs):
                walk([f], level + 1)

    walk(parents, 0)
    return total, lines


def _launcher(env: dict):
    """A function that runs an engine command line: its seconds from launch to exit, None where it failed."""
    def launch(cmd, config) -> Optional[float]:
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(f"bench overhead: {config} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                  f"{proc.stderr[-3000:]}", file=sys.stderr)
            return None
        return time.perf_counter() - t0
    return launch


def _run_row(summary, *, config: str, name: str, rep: int, n: int, outer: float) -> dict:
    """One timed run's figures (compare.json's row) from its summary."""
    ts, wall = summary.time_split, summary.wall_time
    split_sum = sum(ts.values())
    return {"config": config, "name": name, "repeat": rep, "world_size": n, "units": summary.units,
            "rounds": summary.rounds, "wall_time": wall, "launch_to_exit_s": outer, "time_split": ts,
            "signature_share_of_wall": ts["signature"] / wall,
            "signature_share_of_split": ts["signature"] / split_sum if split_sum else None,
            "signature_ms_per_round": 1e3 * ts["signature"] / max(1, summary.rounds)}


def _profiled(prof_dir: Path, depth: int) -> dict:
    """Where the profiled run's signature rounds spent their time, per rank (its ``rank*.prof`` files)."""
    import pstats

    files = sorted(prof_dir.glob("rank*.prof"))
    st = pstats.Stats(*[str(f) for f in files])
    out: dict = {"ranks": len(files)}
    for fn in PROFILED:
        tot, lines = _callee_breakdown(st, fn, depth=depth)
        out[fn] = {"s_per_rank": tot / max(1, len(files)),
                   "callees": [{"level": lv, "function": lab, "s_per_rank": sec / max(1, len(files))}
                               for lv, lab, sec in lines]}
    return out


def bench_overhead(args) -> int:
    import yaml

    from ...results import TIME_CATEGORIES, Summary

    machine = machine_load()
    launcher = [require_mpiexec(args.mpiexec, "communities bench overhead")]
    rows, results, profiles = [], [], {}
    root = Path(args.output_root or tempfile.mkdtemp(prefix="communities-bench-"))
    launch = _launcher(child_env())
    for config in args.configs:
        raw = yaml.safe_load(Path(config).read_text()) or {}
        n = args.np or raw.get("world_size") or 8
        name = raw.get("name", Path(config).stem)
        shares = []
        for rep in range(args.repeat):
            outer = launch(engine_cmd(launcher, n, config, str(root), args.overrides), config)
            if outer is None:
                return 1
            r = _run_row(Summary.read(root / name), config=config, name=name, rep=rep, n=n, outer=outer)
            shares.append(r["signature_share_of_wall"])
            results.append(r)
            ts = r["time_split"]
            rows.append([name if args.repeat == 1 else f"{name} #{rep + 1}", n, r["units"], r["rounds"],
                         f"{r['wall_time']:.2f}", f"{outer:.1f}", *[f"{ts[c]:.3f}" for c in TIME_CATEGORIES],
                         f"{r['signature_ms_per_round']:.1f}", f"{100 * r['signature_share_of_wall']:.2f}%",
                         f"{100 * r['signature_share_of_split']:.2f}%"])
        if args.repeat > 1:
            rows.append([f"{name} median", *[""] * (6 + len(TIME_CATEGORIES) + 1),
                         f"{100 * median(shares):.2f}%", ""])
        if args.profile:
            prof_dir = root / f"{name}.profile"
            wrap = ["communities.tools.bench", "_profile-rank", "--out", str(prof_dir), "--"]
            if launch(engine_cmd(launcher, n, config, str(root), args.overrides, wrap=wrap), config) is None:
                return 1
            profiles[name] = _profiled(prof_dir, args.profile_depth)
    _print_report(launcher, machine, rows, profiles)
    if args.output_root is not None:
        print(f"runs kept under {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    write_json(args.json, {"bench": "overhead", "results": results, "profiles": profiles})
    return 0


def _print_report(launcher: List[str], machine: str, rows: List[list], profiles: dict) -> None:
    from ...results import TIME_CATEGORIES

    print("bench overhead: real engine runs (" + " ".join(launcher) + "); time_split = mean over ranks (s), "
          f"wall = slowest rank's loop (s), from summary.json; {machine}")
    print()
    print(fmt_table(["run", "ranks", "units", "rounds", "wall s", "launch s", *TIME_CATEGORIES,
                      "sig ms/round", "sig / wall", "sig / split"], rows))
    print()
    print("signature = the 'signature' time of a signature round (engine/rounds/signature_rounds.py): sketch + "
          "clustering (linkage, cut) + dispersion + digest; the allgathers and the hash check are 'idle'. launch s = "
          "mpiexec start to exit (process start, imports, data, writing). Target: sig / wall <= 2%.")
    for name, p in profiles.items():
        for fn in PROFILED:
            print()
            print(f"profile of {name} (one more run, under cProfile, so slower than the rows above): {fn}, "
                  f"cumulative s per rank (mean of {p['ranks']} ranks): {p[fn]['s_per_rank']:.3f} s in all")
            for c in p[fn]["callees"]:
                print(f"  {'  ' * c['level']}{c['s_per_rank']:8.3f}  {c['function']}")


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="orchestration share of real engine runs")
    p.add_argument("configs", nargs="*", default=["configs/quickstart.yaml", "configs/mnist1d.yaml"])
    p.add_argument("--override", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeatable)")
    p.add_argument("--np", type=int, default=None, help="ranks (default: the config's world_size, else 8)")
    p.add_argument("--mpiexec", default=None, help="launcher (default: mpiexec next to python, else on PATH)")
    p.add_argument("--output-root", default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per config")
    p.add_argument("--profile", action="store_true",
                   help="one more run with cProfile on every rank; break down the signature rounds "
                        "(engine/rounds/signature_rounds.py run)")
    p.add_argument("--profile-depth", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_overhead)

    p = sub.add_parser("_profile-rank", help=argparse.SUPPRESS)
    p.add_argument("--out", required=True)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(handler=profile_rank)
