"""``communities bench scale``: real population runs at N replicas on P processes: throughput, overhead, bytes,
peak RSS, ARI, consensus, and the growth exponents."""
from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, cast

from ..jobs import child_env, engine_cmd, require_mpiexec, run_polled
from .common import MB, fmt_table, machine_load, median, pairwise_strategy, write_json
from .partners import SeenAtWorld

SCALE_GROWTH = (  # (row key, label) of the figures whose growth with N is fitted
    ("throughput_rps", "throughput r-units/s"),
    ("outside_share", "share outside training"),
    ("network_bytes_per_replica_unit", "network B / replica / unit"),
    ("peak_rss_max", "peak RSS per process"),
    ("partner_ms", "partner law + draws ms"),
    ("wall_s", "wall s"),
    ("consensus_t", "units to consensus"),
    ("consensus_acc", "consensus accuracy"),
    ("first_round_ari", "first-round ARI"),
)


def scale_row(n: int, summary: dict, launch_s: float, peak_rss: Sequence[int], partner_ms: Optional[float]) -> dict:
    """One N's figures from its ``summary.json`` (a dict), the launch time and each process's peak RSS (bytes)."""
    units = max(1, int(summary["units"]))
    wall = float(summary["wall_time"])
    place = summary.get("placement") or {}
    shares = place.get("train_share_per_process")
    if not shares:  # one replica per process: the ranks' own train time over their loop
        per = summary.get("time_split_per_rank") or {}
        shares = [a / b if b > 0 else 0.0 for a, b in zip(per.get("train", []), per.get("wall", []))]
    outside = [1.0 - s for s in shares]
    network = place.get("bytes_network_mean", summary.get("bytes_sent_mean", 0.0))
    return {"n": n, "processes": place.get("processes", n), "units": units, "wall_s": wall, "launch_s": launch_s,
            "throughput_rps": n * units / wall if wall > 0 else None,
            "outside_share": statistics.fmean(outside) if outside else None,
            "outside_share_max": max(outside) if outside else None,
            "network_bytes_per_replica_unit": float(network) / units,
            "peak_rss_per_process": [int(b) for b in peak_rss],
            "peak_rss_max": max(peak_rss) if peak_rss else None,
            "peak_rss_total": sum(peak_rss) if peak_rss else None,
            "partner_ms": partner_ms,
            "first_round_ari": summary.get("first_round_ari"),
            "consensus_t": summary.get("consensus_reached_t"),
            "consensus_acc": summary.get("consensus_test_acc")}


def fit_growth(ns: Sequence[float], ys: Sequence[Optional[float]]) -> Optional[dict]:
    """``y ~ c * N^b`` by least squares on (log N, log y) over the points with y > 0; None under two such N."""
    import numpy as np

    pts = [(float(n), float(y)) for n, y in zip(ns, ys) if y is not None and math.isfinite(y) and y > 0]
    if len({n for n, _ in pts}) < 2:
        return None
    x = np.log([n for n, _ in pts])
    v = np.log([y for _, y in pts])
    b, a = np.polyfit(x, v, 1)
    resid = v - (a + b * x)
    total = float(((v - v.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0
    return {"exponent": float(b), "coefficient": float(math.exp(a)), "r2": r2, "points": len(pts)}


def _gib(b: Optional[float]) -> Optional[str]:
    return None if b is None else f"{b / (1 << 30):.2f}"


def scale_table(rows: Sequence[dict]) -> str:
    """The per-N table, then the fitted exponents (plain text)."""
    def pct(x):
        return None if x is None else f"{100 * x:.1f}%"

    def num(x, f):
        return None if x is None else format(x, f)

    body = [[r["n"], r["processes"], r["units"], num(r["wall_s"], ".1f"), num(r["launch_s"], ".1f"),
             num(r["throughput_rps"], ".1f"), pct(r["outside_share"]), pct(r["outside_share_max"]),
             num(r["network_bytes_per_replica_unit"] / 1e3, ".1f"),
             "/".join(_gib(b) or "-" for b in r["peak_rss_per_process"]) or None, _gib(r["peak_rss_total"]),
             num(r["partner_ms"], ".1f"), num(r["first_round_ari"], ".3f"), r["consensus_t"],
             num(r["consensus_acc"], ".4f")] for r in rows]
    out = [fmt_table(["N", "P", "units", "wall s", "launch s", "r-units/s", "outside train", "(worst P)",
                       "net kB/r/unit", "peak RSS GiB/proc", "RSS GiB all", "partner ms", "ARI", "consensus t",
                       "consensus acc"], body)]
    fits = []
    ns = [r["n"] for r in rows]
    for key, label in SCALE_GROWTH:
        f = fit_growth(ns, [r[key] for r in rows])
        fits.append([label, None if f is None else f"{f['exponent']:+.2f}",
                     None if f is None else f"{f['r2']:.2f}", None if f is None else f["points"]])
    out += ["", "growth with N: y ~ c * N^b, least squares on log-log", "",
            fmt_table(["figure", "b", "R^2", "points"], fits)]
    return "\n".join(out)


def scale_targets(rows: Sequence[dict], n: int = 1024) -> List[str]:
    """The issue's targets at N = ``n`` (printed, never asserted)."""
    row = next((r for r in rows if r["n"] == n), None)
    if row is None:
        return [f"targets at N = {n}: not measured (add {n} to --sizes)"]

    def verdict(ok):
        return "met" if ok else "MISSED"

    out = [f"targets at N = {n} on P = {row['processes']} (printed, not asserted):"]
    s, rss, pm = row["outside_share"], row["peak_rss_total"], row["partner_ms"]
    if s is not None:
        worst = row["outside_share_max"]
        out.append(f"  share outside training <= 10%: {100 * s:.1f}% (worst process {100 * worst:.1f}%) "
                   f"{verdict(s <= 0.10)}")
    if rss is not None:
        out.append(f"  peak RSS <= 4 GiB in all: {rss / (1 << 30):.2f} GiB {verdict(rss <= 4 << 30)}")
    if pm is not None:
        out.append(f"  partner draws <= 50 ms per round: {pm:.1f} ms {verdict(pm <= 50)}")
    return out


def _partner_ms(run_dir: Path, reps: int = 3) -> Optional[float]:
    """One round's partner law plus every replica's draws (the worst unit), in this process, on the run's own
    config and first-round communities: median ms. None where the run saved no round."""
    import numpy as np

    from ... import config
    from ...core.clustering import Communities

    rd = run_dir / "rounds" / "round_0000"
    if not (rd / "labels.npy").exists():
        return None
    cfg = config.load(run_dir / "config.yaml")
    labels = np.load(rd / "labels.npy", allow_pickle=False)
    n = int(labels.size)
    info = json.loads((rd / "round.json").read_text())
    com = Communities(Z=np.load(rd / "Z.npy", allow_pickle=False), labels=labels,
                      cut_height=float(info.get("cut_height") or 0.0), distances=np.zeros(0))
    t = int(info["t"])
    mixer = SeenAtWorld(n, t)
    times = []
    for _ in range(reps + 1):
        strat = pairwise_strategy(cfg, n)
        t0 = time.perf_counter()
        strat.observe(com, cast(Any, mixer), t)
        strat.law(t)
        strat.exchanges(t, np.arange(n))
        times.append(time.perf_counter() - t0)
    return 1e3 * median(times[1:])


def _prepare_data(cfg, env: dict) -> Optional[float]:
    """Generate (and cache) an MNIST-1D set before the timed run, so its generator is in neither the launch time
    nor the ranks' peak RSS: seconds taken, None where there is nothing to generate."""
    if cfg.data.dataset != "mnist1d" or not cfg.data.root:
        return None
    code = ("import sys; from communities.workload.data import load_mnist1d; "
            "load_mnist1d(0, int(sys.argv[1]) if sys.argv[1] != 'None' else None, sys.argv[2])")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, str(cfg.data.samples), cfg.data.root], env=env, check=True)
    return time.perf_counter() - t0


def bench_scale(args) -> int:
    """Real ``mpiexec -n P communities run CONFIG world_size=N`` jobs, one per N; figures from each summary.json."""
    from ... import config

    machine = machine_load()
    launcher = [require_mpiexec(args.mpiexec, "communities bench scale")]
    keep = args.output_root is not None
    root = Path(args.output_root or tempfile.mkdtemp(prefix="communities-bench-scale-"))
    root.mkdir(parents=True, exist_ok=True)
    env = child_env()
    rows = []
    for n in args.sizes:
        if n % args.processes:
            print(f"bench scale: N={n} is not a multiple of --processes {args.processes}; skipped", file=sys.stderr)
            continue
        extra = [f"world_size={n}", f"name=scale_n{n}"]
        if args.samples_per_replica:
            extra.append(f"data.samples={args.samples_per_replica * n}")
        if args.budget is not None:
            extra.append(f"train.budget={args.budget}")
        if args.steps_per_unit:
            extra += ["train.unit=steps", f"train.steps_per_unit={args.steps_per_unit}"]
        extra += args.set
        cfg = config.load(args.config, extra)
        gen_s = _prepare_data(cfg, env)
        cmd = engine_cmd(launcher, args.processes, args.config, str(root), extra)
        print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
        log = root / f"scale_n{n}.log"
        rc, launch_s, peaks = run_polled(cmd, env, log, args.timeout)
        peaks = sorted(peaks, reverse=True)
        if len(peaks) != args.processes:  # seen once in a run of 128: a third, tiny one (not understood yet)
            print(f"bench scale: N={n}: {len(peaks)} rank processes seen under mpiexec, not {args.processes} "
                  f"(peaks {[round(b / MB) for b in peaks]} MiB); the {args.processes} largest are kept",
                  file=sys.stderr)
        if rc != 0:
            print(f"bench scale: N={n} failed (exit {rc}); the last of {log}:\n{log.read_text()[-3000:]}",
                  file=sys.stderr)
            return 1
        run_dir = root / f"scale_n{n}"
        row = scale_row(n, json.loads((run_dir / "summary.json").read_text()), launch_s, peaks[:args.processes],
                        _partner_ms(run_dir))
        row["rank_processes_seen"] = len(peaks)
        row["data_samples"] = cfg.data.samples
        row["data_generate_s"] = gen_s
        rows.append(row)
        print(f"  measured N={n}: {row['wall_s']:.1f} s loop, {launch_s:.1f} s launch", file=sys.stderr, flush=True)
    if not rows:
        return 1
    print(f"bench scale: {' '.join(launcher)} -n {args.processes} communities run {args.config} world_size=N "
          f"({rows[-1]['units']} units" + (f", data.samples = {args.samples_per_replica} x N" if
                                            args.samples_per_replica else "") +
          (f", {args.steps_per_unit} steps a unit" if args.steps_per_unit else "") +
          (f", {' '.join(args.set)}" if args.set else "") + f"); {machine}")
    print()
    print(scale_table(rows))
    print()
    print("r-units/s = N x units / wall (the slowest replica's loop); outside train = 1 - a process's training "
          "time over its wall (signatures, clustering, exchanges, waits, bookkeeping), mean over processes "
          "(worst P: the worst process); net kB/r/unit = bytes a replica sent across MPI per unit (pairs inside a "
          "process swap in memory); peak RSS = each rank's VmHWM polled from /proc (the data set generated "
          "beforehand, so the generator is not in it); partner ms = one round's partner law and every replica's "
          "draws (the worst unit), timed in this process on the run's config and first-round communities; "
          "consensus t = the unit consensus was reached (- : not within the budget). Timings on a shared machine "
          "are noisy.")
    print()
    print("\n".join(scale_targets(rows)))
    if keep:
        print(f"runs kept under {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    fits = {key: fit_growth([r["n"] for r in rows], [r[key] for r in rows]) for key, _ in SCALE_GROWTH}
    write_json(args.out, {"bench": "scale", "config": args.config, "processes": args.processes, "machine": machine,
                           "rows": rows, "growth": fits})
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("scale", help="real population runs at N replicas on P processes: throughput, overhead, "
                                     "bytes, peak RSS, ARI, consensus; growth exponents")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 128, 512, 1024], help="replicas N")
    p.add_argument("--processes", type=int, default=2, help="MPI processes P (each N a multiple of it)")
    p.add_argument("--budget", type=int, default=None, help="train.budget (default: the config's)")
    p.add_argument("--config", default="configs/population.yaml")
    p.add_argument("--samples-per-replica", type=int, default=320,
                   help="data.samples = this x N (mnist1d; 80%% training: >= 200 per replica in every group "
                        "of 4); 0 keeps the config's")
    p.add_argument("--steps-per-unit", type=int, default=10,
                   help="train.unit=steps with this many steps, so that every replica does the same work a unit "
                        "(default 10; 0 keeps the config's unit). population.yaml trains an epoch a unit, and its "
                        "groups 0 and 1 hold 3 labels to groups 2 and 3's 2: process 0 hosts them and trains 1.5x "
                        "the steps, so process 1 would wait a third of every unit on the data, not on the engine")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--mpiexec", default=None, help="launcher (default: mpiexec next to python, else on PATH)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run before it is killed")
    p.add_argument("--output-root", default=None, help="keep the runs here (default: a temporary directory)")
    p.add_argument("--out", metavar="PATH", help="write the rows and fits as JSON")
    p.set_defaults(handler=bench_scale)
