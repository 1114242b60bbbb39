"""``communities bench exchange`` (under ``mpiexec -n 2``, or any even number of ranks paired 0-1, 2-3, ...):
the engine's own ``exchange.PairExchange`` (the header ``Sendrecv``, then the payload swap and merge) against a
raw mpi4py ``Sendrecv`` of the same weight bytes, plus its variants."""
from __future__ import annotations

import json
import sys
import time
from typing import Dict

from .common import MB, fmt_table, machine_load, median, write_json


class _PairTimer:
    """Timings for ``bench exchange``: each repetition starts after a barrier; the slowest rank counts."""

    def __init__(self, world):
        self.world = world

    def timed(self, fn, reps: int, warmup: int) -> Dict[str, float]:
        """Median over reps of the slowest rank's time."""
        for _ in range(warmup):
            fn()
        worst = []
        for _ in range(reps):
            self.world.comm.Barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            worst.append(self.world.allreduce_scalar(dt, op="max"))
        return {"median_s": median(worst), "min_s": min(worst), "max_s": max(worst)}

    def local(self, fn, reps: int, warmup: int) -> float:
        """Median of a rank-local operation (no communication), slowest rank."""
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return self.world.allreduce_scalar(median(ts), op="max")


def _exchange_checks(world, peer: int):
    """Correctness first: a = 0.5 leaves both ranks of a pair holding the pair's mean, bitwise lerp_'s."""
    import torch

    from ...core import merge
    from ...engine.mixing import exchange

    gen = torch.Generator().manual_seed(1234)
    base = [torch.randn(100_003, generator=gen) for _ in range(2)]
    mine, theirs = base[world.rank % 2], base[1 - world.rank % 2]
    checks = {}
    small = exchange.ChunkBuffers(mine.numel(), mine.dtype, chunk=4096)  # many chunks and a short tail
    variants = (("swap_and_merge", lambda f: exchange.swap_and_merge(world, f, torch.empty_like(f), peer, 0.5)),
                ("swap_and_merge_chunked", lambda f: exchange.swap_and_merge_chunked(world, f, peer, 0.5, small)))
    for label, fn in variants:
        f = mine.clone()
        d = fn(f)
        ref = mine.clone()
        merge.interpolate_(ref, theirs, 0.5)
        mean = (mine.double() + theirs.double()) / 2
        true_d = float(torch.dist(mine.double(), theirs.double()))
        checks[label] = {"equals_reference_merge": bool(torch.equal(f, ref)),
                         "max_err_vs_mean": float((f.double() - mean).abs().max()),
                         "distance_rel_err": abs(d - true_d) / true_d}
    ok = all(c["equals_reference_merge"] and c["max_err_vs_mean"] < 1e-6 for c in checks.values())
    return world.allreduce_scalar(float(ok), op="min") > 0, checks  # buffers only: nothing unpickled


def _exchange_one_size(world, peer: int, size_mb: float, reps: int, warm: int, clock: _PairTimer) -> dict:
    """Raw Sendrecv, the engine's PairExchange and its variants, on one buffer size."""
    import numpy as np
    import torch

    from ...engine.mixing import exchange

    n = int(size_mb * MB) // 4
    g = torch.Generator().manual_seed(world.rank + 1)
    flat = torch.randn(n, generator=g)
    recv = torch.empty_like(flat)
    send_np, recv_np = flat.numpy().copy(), np.empty(n, dtype=np.float32)
    r: dict = {"size_mb": size_mb, "bytes": n * 4}
    r["raw"] = clock.timed(lambda: world.comm.Sendrecv(send_np, dest=peer, sendtag=7, recvbuf=recv_np, source=peer,
                                                       recvtag=7), reps, warm)
    pair = exchange.PairExchange(world, n, flat.dtype)  # the engine's own exchange object
    header = exchange.Header(samples=1000.0, loss=0.5, size=n, state=0, diverged=False)

    def engine():
        """What the mixer runs per exchange: the header Sendrecv, then the chunked swap and merge."""
        pair.swap_headers(header, peer)
        pair.swap(exchange.Payload(flat), peer, 0.5)

    r["engine"] = clock.timed(engine, reps, warm)
    r["meta"] = clock.timed(lambda: pair.swap_headers(header, peer), reps, warm)
    r["engine_nodist"] = clock.timed(lambda: pair.swap(exchange.Payload(flat), peer, 0.5, distance=False), reps, warm)
    r["whole"] = clock.timed(lambda: exchange.swap_and_merge(world, flat, recv, peer, 0.5), reps, warm)
    # the local pieces of the engine exchange, each rank alone (no communication)
    other = torch.randn(n, generator=g)
    r["local_dist_s"] = clock.local(lambda: torch.dist(flat, other), reps, 1)
    r["local_lerp_s"] = clock.local(lambda: flat.lerp_(other, 0.5), reps, 1)
    r["local_sum_s"] = clock.local(lambda: flat.sum(), reps, 1)
    for key in ("raw", "engine", "engine_nodist", "whole"):
        r[key]["GBps"] = r["bytes"] / r[key]["median_s"] / 1e9
        if key != "raw":
            r[key]["ratio_vs_raw"] = r["raw"]["median_s"] / r[key]["median_s"]
    return r


def _exchange_row(r: dict) -> list:
    def cell(key):
        return f"{r[key]['median_s'] * 1e3:.2f} / {r[key]['GBps']:.2f}"

    return [f"{r['size_mb']:g}", cell("raw"), cell("engine"), f"{r['engine']['ratio_vs_raw']:.2f}",
            cell("engine_nodist"), f"{r['engine_nodist']['ratio_vs_raw']:.2f}",
            cell("whole"), f"{r['whole']['ratio_vs_raw']:.2f}",
            f"{r['local_dist_s'] * 1e3:.2f}", f"{r['local_lerp_s'] * 1e3:.2f}", f"{r['meta']['median_s'] * 1e3:.3f}"]


def bench_exchange(args) -> int:
    import torch

    from ...runtime.comm import World

    torch.set_num_threads(args.threads)
    world = World(timeout=600.0)  # armed as in the engine (comm.timeout's default)
    if world.size < 2 or world.size % 2:
        if world.rank == 0:
            print("communities bench exchange: run it under mpiexec with an even number of ranks, e.g. "
                  "mpiexec -n 2 python -m communities.tools.bench exchange", file=sys.stderr)
        return 2
    peer = world.rank ^ 1
    lead = world.rank == 0
    machine = machine_load()
    ok, checks = _exchange_checks(world, peer)
    clock = _PairTimer(world)
    results = [_exchange_one_size(world, peer, size_mb, args.reps, args.warmup, clock) for size_mb in args.sizes_mb]
    rows = [_exchange_row(r) for r in results]

    if lead:
        print(f"bench exchange: {world.size} ranks in pairs, {World.library_version()}; {machine}")
        print(f"float32 buffers; per size {args.warmup} warm-ups, then the median of {args.reps} repetitions of the "
              "slowest rank's time (a barrier before each); GB/s = bytes each rank sends / time "
              "(it receives as many).")
        print("The flat buffer IS the model: the engine exchange has no flatten/unflatten step. "
              "engine = the mixer's exchange.PairExchange: a header Sendrecv of 5 float64 (40 bytes: samples, "
              "loss, size, optimizer state, diverged), then swap: the payload in one Sendrecv up to "
              "64 MiB (engine.mixing.exchange.WHOLE_MAX_BYTES, into a buffer kept between exchanges), above it one per "
              "1 MiB chunk into a chunk-sized buffer; distance and lerp_ fused per 1 MiB block.")
        print(f"check (a=0.5, both ranks end at the pair mean, equal to merge.interpolate_): "
              f"{'ok' if ok else 'FAILED'} {json.dumps(checks)}")
        print()
        print(fmt_table(
            ["MB", "raw Sendrecv ms / GB/s", "engine ms / GB/s", "ratio", "engine dist=False", "ratio",
             "whole-buffer ms / GB/s", "ratio",
             "torch.dist ms", "lerp_ ms", "meta Sendrecv ms"], rows))
        print()
        print("ratio = raw time / variant time (target >= 0.8 at 16 MB and above). engine dist=False = the "
              "payload swap without the update-norm distance; whole-buffer = exchange.swap_and_merge "
              "(one Sendrecv of the whole buffer, then torch.dist and lerp_; the path device tensors take); "
              "neither with the metadata Sendrecv. torch.dist and lerp_ are each rank alone, no communication; "
              "meta Sendrecv = the 40-byte header swap alone, included in engine.")
        write_json(args.json, {"bench": "exchange", "world_size": world.size, "mpi": World.library_version(),
                                "reps": args.reps, "warmup": args.warmup, "check_ok": ok, "checks": checks,
                                "results": results})
    return 0 if ok else 1


def add_parser(sub) -> None:
    p = sub.add_parser("exchange", help="pairwise exchange vs raw Sendrecv (run under mpiexec -n 2)")
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_exchange)
