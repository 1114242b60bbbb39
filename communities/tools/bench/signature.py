"""``communities bench signature``: count-sketch and Gaussian signature throughput against ``torch.sum`` over the
same buffer, peak memory overhead, distance distortion (each size in a process of its own)."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

from ..jobs import child_env
from .common import MB, fmt_table, machine_load, median, proc_status, reset_peak_rss, write_json


def signature_one(args) -> int:
    """One (kind, size) measurement in this fresh process; prints one JSON line."""
    import numpy as np
    import torch

    from ...core import signature

    torch.set_num_threads(args.threads)
    P, d = int(args.params), int(args.dim)
    model_bytes = P * 4
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(P, generator=g)  # the shared initialisation == the model buffer
    rep_fn = lambda: float(w0.sum())  # noqa: E731
    rep_fn()
    sum_times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        rep_fn()
        sum_times.append(time.perf_counter() - t0)
    # Page in the code paths first (MKL gemv, index_add_, randn): a first call maps library pages into the
    # RSS, a one-off cost of the process that is not memory the sketch holds.
    small = signature.make_sketch(args.kind, 4 * signature.COLUMNS + 3, d, seed=1)
    small(torch.randn(4 * signature.COLUMNS + 3, generator=g))
    del small
    reset = reset_peak_rss()
    before = proc_status()
    t0 = time.perf_counter()
    sketch = signature.make_sketch(args.kind, P, d, seed=0)
    signer = signature.Signer(sketch, sketch(w0).numpy())
    build_s = time.perf_counter() - t0
    reps = args.reps if args.kind == "countsketch" else max(1, min(args.reps, args.gaussian_reps))
    sig_times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        signer(w0)
        sig_times.append(time.perf_counter() - t0)
    after = proc_status()
    base = before.get("VmRSS", 0) if reset else before.get("VmHWM", 0)
    overhead = max(0, after.get("VmHWM", 0) - base) if after else None
    # distortion: ||S(x - y)|| against ||x - y|| (linearity: S x - S y = S(x - y))
    distort = {}
    for kind in args.pairs:
        errs = []
        for p in range(args.n_pairs):
            gp = torch.Generator().manual_seed(100 + p)
            if kind == "dense":
                diff = torch.randn(P, generator=gp)
            else:  # a contiguous block of 1% of the parameters (one layer drifting), iid or a rank-2 update
                L = max(1, P // 100)
                lo = int(torch.randint(0, P - L + 1, (1,), generator=gp))
                diff = torch.zeros(P)
                if kind == "block":
                    diff[lo: lo + L] = torch.randn(L, generator=gp)
                else:
                    rows = max(1, min(1024, L // 4))
                    cols = L // rows
                    u, v = torch.randn(rows, 2, generator=gp), torch.randn(2, cols, generator=gp)
                    diff[lo: lo + rows * cols] = (u @ v).reshape(-1)
            true = float(torch.linalg.vector_norm(diff, dtype=torch.float64))
            est = float(np.linalg.norm(sketch(diff).numpy()))
            errs.append(abs(est / true - 1.0))
            del diff
        distort[kind] = {"mean_rel_err": float(np.mean(errs)), "max_rel_err": float(np.max(errs))}
    out = {"kind": args.kind, "params": P, "dim": d, "threads": args.threads, "reps": reps,
           "sum_s": median(sum_times), "sketch_s": median(sig_times), "build_s": build_s,
           "model_bytes": model_bytes, "peak_overhead_bytes": overhead, "peak_reset": reset,
           "distortion": distort}
    print("RESULT " + json.dumps(out), flush=True)
    return 0


def _parse_count(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _human(n: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:g}{unit}"
    return f"{n:g}"


def bench_signature(args) -> int:
    machine = machine_load()
    sizes = [_parse_count(s) for s in args.params]
    results, rows, skipped = [], [], []
    gauss_rate = None  # params/s of the Gaussian sketch, from its smallest size
    for P in sizes:
        for kind in args.kinds:
            if kind == "gaussian" and gauss_rate is not None:
                predicted = P / gauss_rate
                if predicted * (1 + max(1, min(args.reps, args.gaussian_reps)) + args.n_pairs * len(args.pairs)) \
                        > args.gaussian_budget:
                    skipped.append((kind, P, predicted))
                    continue
            cmd = [sys.executable, "-m", "communities.tools.bench", "_signature-one", "--kind", kind,
                   "--params", str(P),
                   "--dim", str(args.dim), "--threads", str(args.threads), "--reps", str(args.reps),
                   "--gaussian-reps", str(args.gaussian_reps), "--n-pairs", str(args.n_pairs),
                   "--pairs", *args.pairs]
            env = child_env(OMP_NUM_THREADS=str(args.threads))
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(f"bench signature: {kind} at {P} params failed (exit {proc.returncode}):\n"
                      f"{proc.stderr[-2000:]}", file=sys.stderr)
                return 1
            r = json.loads(line[len("RESULT "):])
            if kind == "gaussian" and gauss_rate is None:
                gauss_rate = P / r["sketch_s"]
            r["sum_rate"] = P / r["sum_s"]
            r["sketch_rate"] = P / r["sketch_s"]
            r["ratio_vs_sum"] = r["sketch_rate"] / r["sum_rate"]
            ov = r["peak_overhead_bytes"]
            r["overhead_x_model"] = None if ov is None else ov / r["model_bytes"]
            results.append(r)
            dist = r["distortion"]
            rows.append([_human(P), kind, f"{r['sum_rate'] / 1e9:.2f}", f"{r['sketch_rate'] / 1e9:.4f}",
                         f"{r['ratio_vs_sum']:.3f}", f"{r['sketch_s'] * 1e3:.1f}", f"{r['build_s'] * 1e3:.0f}",
                         "-" if ov is None else f"{ov / MB:.1f}", "-" if ov is None else f"{r['overhead_x_model']:.3f}",
                         *[f"{dist[k]['mean_rel_err']:.3f} / {dist[k]['max_rel_err']:.3f}" for k in args.pairs]])
            print(f"  measured {kind} at {_human(P)} params", file=sys.stderr, flush=True)
    print(f"bench signature: d={args.dim}, float32 flat buffer, torch threads={args.threads}; each (kind, size) "
          f"in a fresh subprocess; {machine}")
    print(f"rates in G params/s (median of {args.reps} calls of Signer(flat) = S w - S w0; Gaussian at most "
          f"{args.gaussian_reps}); sum = torch.sum over the same buffer, the memory-bandwidth stand-in")
    print()
    print(fmt_table(["params", "kind", "sum Gp/s", "sketch Gp/s", "ratio", "sketch ms", "build ms", "peak +MiB",
                      "x model", *[f"{k} rel.err mean/max" for k in args.pairs]], rows, align="ll" + "r" * 11))
    print()
    print("ratio = sketch rate / sum rate (target >= 0.25 for countsketch). peak +MiB = peak RSS (VmHWM) while "
          "building the sketch (including S w0) and signing, minus the RSS just before, with the peak reset by "
          "writing 5 to /proc/self/clear_refs; a fresh process per size, its code paths paged in by a small sketch "
          "first, so the figure is memory the sketch itself allocates "
          "(target <= 1x model size). rel.err = |‖S(x-y)‖/‖x-y‖ - 1| over "
          f"{args.n_pairs} pairs: dense = Gaussian x-y; block = x-y on one contiguous 1% of the parameters; "
          f"lowrank = a rank-2 update (u v^T, up to 1024 rows) on such a block, the shape of a layer's drift "
          f"(JL scale for d={args.dim}: about {1 / math.sqrt(2 * args.dim):.3f}).")
    for kind, P, pred in skipped:
        print(f"skipped {kind} at {_human(P)} params: predicted {pred:.0f} s per call from the smallest size "
              f"(P x d random draws), over --gaussian-budget {args.gaussian_budget:g} s for the whole measurement")
    write_json(args.json, {"bench": "signature", "dim": args.dim, "threads": args.threads, "results": results,
                            "skipped": [{"kind": k, "params": p, "predicted_s_per_call": s} for k, p, s in skipped]})
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("signature", help="count-sketch / Gaussian throughput, memory, distortion")
    p.add_argument("--params", nargs="+", default=["1M", "10M", "100M"], help="sizes, e.g. 1M 10M 100M")
    p.add_argument("--kinds", nargs="+", default=["countsketch", "gaussian"], choices=["countsketch", "gaussian"])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--gaussian-reps", type=int, default=2, help="timed calls of the (slow) Gaussian sketch")
    p.add_argument("--gaussian-budget", type=float, default=120.0,
                   help="skip Gaussian sizes predicted to take longer than this many seconds in all")
    p.add_argument("--n-pairs", type=int, default=3)
    p.add_argument("--pairs", nargs="+", default=["dense", "block", "lowrank"], choices=["dense", "block", "lowrank"])
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_signature)

    p = sub.add_parser("_signature-one", help=argparse.SUPPRESS)
    p.add_argument("--kind", required=True)
    p.add_argument("--params", type=int, required=True)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--gaussian-reps", type=int, default=2)
    p.add_argument("--n-pairs", type=int, default=3)
    p.add_argument("--pairs", nargs="+", default=["dense", "block"])
    p.set_defaults(handler=signature_one)
