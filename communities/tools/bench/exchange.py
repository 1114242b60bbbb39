"""``communities bench exchange`` (under ``mpiexec -n 2``, or any even number of ranks paired 0-1, 2-3, ...):
the engine's own ``exchange.PairExchange`` (the header ``Sendrecv``, then the payload swap and merge) against its
bound, a raw mpi4py ``Sendrecv`` of the same weight bytes plus one ``lerp_`` over the buffer, and its variants."""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable, Dict, cast

from .common import MB, fmt_table, machine_load, median, write_json


class _PairTimer:
    """Timings for ``bench exchange``: each repetition starts after a barrier; the slowest rank counts."""

    def __init__(self, world):
        self.world = world

    def interleaved(self, fns: Dict[str, Callable[[], object]], reps: int, warmup: int) -> Dict[str, dict]:
        """Median over reps of the slowest rank's time, the variants taking turns within each repetition (so
        that a machine whose load drifts weighs on all of them alike: their ratios are measured together)."""
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        worst: Dict[str, list] = {k: [] for k in fns}
        for _ in range(reps):
            for key, fn in fns.items():
                self.world.comm.Barrier()
                t0 = time.perf_counter()
                fn()
                dt = time.perf_counter() - t0
                worst[key].append(self.world.allreduce_scalar(dt, op="max"))
        return {k: {"median_s": median(v), "min_s": min(v), "max_s": max(v)} for k, v in worst.items()}

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
    """Correctness first: a = 0.5 leaves both ranks of a pair holding the pair's mean, bitwise lerp_'s; the
    engine's exchange of a model above ``SHARE_MIN`` (each side computing half the distance) gives both sides the
    same distance, equal to the true one within rounding."""
    import numpy as np
    import torch

    from ...core import merge
    from ...engine.mixing import exchange

    gen = torch.Generator().manual_seed(1234)
    base = [torch.randn(100_003, generator=gen) for _ in range(2)]
    big = [torch.randn(exchange.SHARE_MIN + 70_001, generator=gen) for _ in range(2)]
    checks = {}
    small = exchange.ChunkBuffers(base[0].numel(), base[0].dtype, chunk=4096)  # many chunks and a short tail

    def engine(f):
        return exchange.PairExchange(world, f.numel(), f.dtype).swap(exchange.Payload(f), peer, 0.5).distance

    variants = (("swap_and_merge", base, lambda f: exchange.swap_and_merge(world, f, torch.empty_like(f), peer, 0.5)),
                ("swap_and_merge_chunked", base,
                 lambda f: exchange.swap_and_merge_chunked(world, f, peer, 0.5, small)),
                ("PairExchange_halves", big, engine))
    ok = True
    for label, pair, fn in variants:
        mine, theirs = pair[world.rank % 2], pair[1 - world.rank % 2]
        f = mine.clone()
        d = fn(f)
        ref = mine.clone()
        merge.interpolate_(ref, theirs, 0.5)
        mean = (mine.double() + theirs.double()) / 2
        true_d = float(torch.dist(mine.double(), theirs.double()))
        other_d = float(world.allgather(np.array([d], dtype=np.float64)).reshape(-1)[world.rank ^ 1])
        checks[label] = {"equals_reference_merge": bool(torch.equal(f, ref)),
                         "max_err_vs_mean": float((f.double() - mean).abs().max()),
                         "distance_rel_err": abs(d - true_d) / true_d, "same_distance_both_sides": other_d == d}
        ok = ok and checks[label]["equals_reference_merge"] and checks[label]["max_err_vs_mean"] < 1e-6 \
            and checks[label]["distance_rel_err"] < 1e-5
    ok = ok and checks["PairExchange_halves"]["same_distance_both_sides"]
    return world.allreduce_scalar(float(ok), op="min") > 0, checks  # buffers only: nothing unpickled


class _Packing:
    """The world as one without ``sendrecv_parts``: PairExchange then packs its parts into a send buffer (what
    every payload with moments did before the parts went out from where they lie)."""

    def __init__(self, world):
        self._world = world

    def __getattr__(self, name):
        if name == "sendrecv_parts":
            raise AttributeError(name)
        return getattr(self._world, name)


def _exchange_one_size(world, peer: int, size_mb: float, reps: int, warm: int, *, clock: _PairTimer) -> dict:
    """The bound, raw Sendrecv, the engine's PairExchange and its variants, on one buffer size, interleaved."""
    import torch

    from ...core.fused_merge import MERGE_BLOCK, merge_blocks_
    from ...engine.mixing import exchange

    n = int(size_mb * MB) // 4
    g = torch.Generator().manual_seed(world.rank + 1)
    flat = torch.randn(n, generator=g)
    momentum = torch.randn(n, generator=g)
    recv = torch.empty_like(flat)
    send_np, recv_np = flat.numpy(), recv.numpy()  # the engine's own buffers, seen by mpi4py
    r: dict = {"size_mb": size_mb, "bytes": n * 4}
    pair = exchange.PairExchange(world, n, flat.dtype)  # the engine's own exchange object
    packing = exchange.PairExchange(cast(Any, _Packing(world)), n, flat.dtype)  # a World that packs its parts
    header = exchange.Header(samples=1000.0, loss=0.5, size=n, state=0, diverged=False)

    def raw():
        world.comm.Sendrecv(send_np, dest=peer, sendtag=7, recvbuf=recv_np, source=peer, recvtag=7)

    def bound():
        """The least an exchange can cost: the bytes moved once, the weights merged once."""
        raw()
        flat.lerp_(recv, 0.5)

    def engine():
        """What the mixer runs per exchange: the header Sendrecv, then the payload swap, merge and distance."""
        pair.swap_headers(header, peer)
        pair.swap(exchange.Payload(flat), peer, 0.5)

    def with_moments(px):
        def run():
            px.swap_headers(header, peer)
            px.swap(exchange.Payload(flat, state=[momentum]), peer, 0.5).merge_state_(0.5)
        return run

    times = clock.interleaved({
        "raw": raw, "bound": bound, "engine": engine,
        "engine_nodist": lambda: pair.swap(exchange.Payload(flat), peer, 0.5, distance=False),
        "whole": lambda: exchange.swap_and_merge(world, flat, recv, peer, 0.5),
        "moments": with_moments(pair), "moments_packed": with_moments(packing)}, reps, warm)
    r.update(times)
    r["meta"] = clock.interleaved({"meta": lambda: pair.swap_headers(header, peer)}, reps, warm)["meta"]
    # the local pieces of the engine exchange, each rank alone (no communication)
    other = torch.randn(n, generator=g)
    scratch = torch.empty(min(MERGE_BLOCK, n))
    r["local_dist_s"] = clock.local(lambda: torch.dist(flat, other), reps, 1)
    r["local_lerp_s"] = clock.local(lambda: flat.lerp_(other, 0.5), reps, 1)
    r["local_fused_s"] = clock.local(lambda: merge_blocks_(flat, other, 0.5, scratch), reps, 1)
    for key in ("raw", "bound", "engine", "engine_nodist", "whole", "moments", "moments_packed"):
        r[key]["GBps"] = r["bytes"] / r[key]["median_s"] / 1e9
        if key not in ("raw", "bound"):
            r[key]["ratio_vs_raw"] = r["raw"]["median_s"] / r[key]["median_s"]
            r[key]["ratio_vs_bound"] = r["bound"]["median_s"] / r[key]["median_s"]
    r["moments"]["packed_over_parts"] = r["moments_packed"]["median_s"] / r["moments"]["median_s"]
    return r


def _exchange_row(r: dict) -> list:
    def ms(key):
        return f"{r[key]['median_s'] * 1e3:.2f}"

    return [f"{r['size_mb']:g}", ms("raw"), ms("bound"), ms("engine"), f"{r['engine']['ratio_vs_bound']:.2f}",
            f"{r['engine']['ratio_vs_raw']:.2f}", f"{r['engine_nodist']['ratio_vs_bound']:.2f}",
            f"{r['whole']['ratio_vs_bound']:.2f}", ms("moments"), ms("moments_packed"),
            f"{r['moments']['packed_over_parts']:.2f}", f"{r['local_dist_s'] * 1e3:.2f}",
            f"{r['local_lerp_s'] * 1e3:.2f}", f"{r['local_fused_s'] * 1e3:.2f}",
            f"{r['local_fused_s'] / r['local_lerp_s']:.2f}", f"{r['meta']['median_s'] * 1e3:.3f}"]


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
    results = [_exchange_one_size(world, peer, size_mb, args.reps, args.warmup, clock=clock)
               for size_mb in args.sizes_mb]
    rows = [_exchange_row(r) for r in results]

    if lead:
        print(f"bench exchange: {world.size} ranks in pairs, {World.library_version()}; {machine}")
        print(f"float32 buffers; per size {args.warmup} warm-ups, then the median of {args.reps} repetitions of the "
              "slowest rank's time (a barrier before each), the variants taking turns within each repetition.")
        print("The flat buffer IS the model: the engine exchange has no flatten/unflatten step. "
              "engine = the mixer's exchange.PairExchange: a header Sendrecv of 5 float64 (40 bytes: samples, "
              "loss, size, optimizer state, diverged), then swap: the payload in one Sendrecv up to "
              "64 MiB (engine.mixing.exchange.WHOLE_MAX_BYTES, into a buffer kept between exchanges), above it one per "
              "1 MiB chunk into a chunk-sized buffer; the distance and the merge in one pass over memory "
              "(core.fused_merge), each side over its half from 2 MiB on, the halves' sums swapped (8 bytes).")
        print(f"check (a=0.5, both ranks end at the pair mean, equal to merge.interpolate_): "
              f"{'ok' if ok else 'FAILED'} {json.dumps(checks)}")
        print()
        print(fmt_table(
            ["MB", "raw ms", "bound ms", "engine ms", "/bound", "/raw", "nodist /bound", "whole /bound",
             "+moments ms", "packed ms", "packed/parts", "torch.dist ms", "lerp_ ms", "fused ms", "fused/lerp_",
             "meta ms"], rows))
        print()
        print("bound = raw + one lerp_: a raw mpi4py Sendrecv of the weights' own buffer into a receive buffer, then "
              "weights.lerp_(received, 0.5); /bound = the ratio bound time / engine time (target >= 0.8 at 16 MB and "
              "above); /raw = the ratio raw time / engine time. nodist = the payload swap without the distance (no "
              "header); whole = exchange.swap_and_merge (one Sendrecv, then torch.dist and lerp_: the path device "
              "tensors take). +moments = the engine's exchange of weights and as many momentum entries "
              "(merge.optimizer_state: average): each part of 1 MiB or more sent from where it lies, the rest packed, "
              "all in one round trip (World.sendrecv_parts), the moments merged in place; packed = the same with the "
              "whole payload packed into a send buffer first (what it did before). torch.dist, lerp_ and fused "
              "(core.fused_merge.merge_blocks_: the merge and the distance) are each rank alone, no communication; "
              "meta = the header swap alone.")
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
