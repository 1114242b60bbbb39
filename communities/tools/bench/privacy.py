"""``communities bench privacy``: a DP-SGD step (ours, each ``privacy.per_example`` method) against the plain step
and Opacus's own (``GradSampleModule`` + ``DPOptimizer``), timed in CPU time (a shared machine's other processes
do not count) and in wall time."""
from __future__ import annotations

import functools
import statistics
import time
from typing import Callable, Dict, List, Tuple

from .common import fmt_table, machine_load, write_json

METHODS = ("ghost", "hooks", "vmap")  # privacy.per_example's methods (workload/clipping.py)


def _max_rel_diff_vs_opacus(build, x, y, seed: int) -> float:
    """Exactness first: the clipped mean gradient without noise (clipping 0.5), ours (both ways) against Opacus's
    grad samples with Opacus's clipping factor, over its largest entry."""
    import warnings

    import torch
    from opacus import GradSampleModule
    from torch.nn import functional as F

    from ...workload.private import PrivateGradient

    batch = x.shape[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = GradSampleModule(build())
        F.cross_entropy(ref(x), y, reduction="sum").backward()
    per = torch.cat([p.grad_sample.reshape(batch, -1) for p in ref.parameters()], dim=1)
    factor = (0.5 / (per.norm(dim=1) + 1e-6)).clamp(max=1.0)  # Opacus's clipping factor
    theirs_sum = (per * factor[:, None]).sum(0) / batch
    diff = 0.0
    for how in METHODS:
        probe = build()
        check = PrivateGradient(probe, max_grad_norm=0.5, noise_multiplier=0.0, noise="seeded", seed=seed, rank=0,
                                per_example=how)
        check.backward(x, y, float(batch), torch.optim.SGD(probe.parameters(), lr=0.0), check.generator(0),
                       set_to_none=True)
        mine = torch.cat([p.grad.reshape(-1) for p in probe.parameters() if p.grad is not None])
        diff = max(diff, float((mine - theirs_sum).abs().max() / theirs_sum.abs().max()))
    return diff


def _interleaved(fns: Dict[str, Callable[[], None]], steps: int) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Median CPU seconds (this thread's: a shared machine's other processes do not count) and wall seconds of each
    step kind over ``steps`` rounds that run every kind once, after 3 warm-ups."""
    cpu: Dict[str, List[float]] = {k: [] for k in fns}
    wall: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(3):  # warm-up
        for fn in fns.values():
            fn()
    for _ in range(steps):
        for name, fn in fns.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            fn()
            cpu[name].append(time.thread_time() - c0)
            wall[name].append(time.perf_counter() - t0)
    return ({k: statistics.median(v) for k, v in cpu.items()}, {k: statistics.median(v) for k, v in wall.items()})


def _privacy_case(model_name: str, batch: int, steps: int, seed: int) -> dict:
    """One model and batch size: seconds per step of the plain step, ours, and Opacus's, interleaved."""
    import warnings

    import torch
    from torch.nn import functional as F

    from ...config import ModelConfig
    from ...workload import models
    from ...workload.private import PrivateGradient, per_example_method

    shape, classes = ((64,), 10) if model_name == "mlp" else ((40,), 10)
    cfg = ModelConfig.model_validate({"name": model_name, "hidden": [64]})
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, *shape, generator=g)
    y = torch.randint(0, classes, (batch,), generator=g)

    def build():
        torch.manual_seed(seed)
        return models.build(cfg, shape, classes)

    plain = build()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    ours = {}
    for how in METHODS:
        m = build()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        dp = PrivateGradient(m, max_grad_norm=1.0, noise_multiplier=1.0, noise="seeded", seed=seed, rank=0,
                             per_example=how)
        ours[how] = (dp, opt, dp.generator(0))
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = GradSampleModule(build())
        their_opt = DPOptimizer(torch.optim.SGD(theirs.parameters(), lr=0.01), noise_multiplier=1.0,
                                max_grad_norm=1.0, expected_batch_size=batch)

    def step_plain():
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    def step_ours(how):
        dp, opt, gen = ours[how]
        dp.backward(x, y, float(batch), opt, gen, set_to_none=True)
        opt.step()

    def step_opacus():
        their_opt.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            F.cross_entropy(theirs(x), y).backward()
        their_opt.step()

    diff = _max_rel_diff_vs_opacus(build, x, y, seed)

    def share_clipped() -> float:  # of the batch whose bound binds at ghost's current weights
        share = float((ours["ghost"][0].norms(x, y) > 1.0).double().mean())
        ours["ghost"][1].zero_grad(set_to_none=True)
        return share

    first = share_clipped()
    fns: Dict[str, Callable[[], None]] = {"plain": step_plain}
    fns.update({how: functools.partial(step_ours, how) for how in METHODS})
    fns["opacus"] = step_opacus
    med, wall = _interleaved(fns, steps)
    clipped = (first, share_clipped())
    auto = per_example_method(plain)
    return {"model": model_name, "batch": batch, "params": sum(p.numel() for p in plain.parameters()),
            **{f"{k}_ms": 1e3 * v for k, v in med.items()},
            **{f"{k}_wall_ms": 1e3 * v for k, v in wall.items()},
            "auto": auto, "auto_over_plain": med[auto] / med["plain"], "opacus_over_auto": med["opacus"] / med[auto],
            "max_rel_diff_vs_opacus": diff, "share_clipped": clipped,
            "auto_wall_over_plain": wall[auto] / wall["plain"], "opacus_wall_over_auto": wall["opacus"] / wall[auto]}


def bench_privacy(args) -> int:
    import torch

    from ...workload.private import require_opacus

    require_opacus()
    torch.set_num_threads(args.threads)
    results = [_privacy_case(m, b, args.steps, args.seed) for m in args.models for b in args.batches]
    rows = [[r["model"], r["params"], r["batch"], *(f"{r[f'{k}_ms']:.2f}" for k in ("plain", *METHODS, "opacus")),
             r["auto"], f"{r['auto_over_plain']:.2f}x", f"{r['opacus_over_auto']:.2f}x",
             f"{r['auto_wall_over_plain']:.2f}x", f"{r['opacus_wall_over_auto']:.2f}x",
             f"{r['max_rel_diff_vs_opacus']:.1e}", "{:.0f}%, {:.0f}%".format(*(100 * v for v in r["share_clipped"]))]
            for r in results]
    print(f"bench privacy: one DP-SGD step (clip 1, noise 1, SGD) against the plain step; median of {args.steps} "
          f"interleaved steps after 3 warm-ups, {args.threads} thread(s); {machine_load()}")
    print()
    print(fmt_table(["model", "params", "batch", "plain ms", *(f"{k} ms" for k in METHODS), "opacus ms", "auto",
                      "auto / plain", "opacus / auto", "wall: auto / plain", "opacus / auto", "max rel diff",
                      "clipped first, last"], rows))
    print()
    print("ms = the median step's CPU time (time.thread_time: what the step computes, not the time other processes "
          "of a shared machine hold the CPU; wall-clock ratios beside). ghost, hooks, vmap = workload/private.py "
          "(privacy.per_example, workload/clipping.py): ghost norms and book-keeping (workload/ghost.py: per-example "
          "norms without per-example gradients, the clipped sum without a second backward), Opacus's per-example "
          "gradients in the one backward (the clipped sum from them), torch.func's vmap of grad then the backward of "
          "the clipped loss; plus noise. "
          "auto = what privacy.per_example=auto picks for the model; opacus = Opacus's own step (GradSampleModule + "
          "DPOptimizer). max rel diff = the noiseless clipped mean gradient at clipping 0.5, ours (every way) "
          "against Opacus's grad samples with Opacus's factor C / (||g|| + 1e-6), over its largest entry. "
          "clipped = the share of the batch whose bound (1) binds at the first and the last timed step's weights "
          "(ghost's): the steps timed clip, so their clipped sum is computed.")
    write_json(args.json, {"bench": "privacy", "threads": args.threads, "steps": args.steps, "results": results})
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("privacy", help="a DP-SGD step (ours, each way) against the plain step and Opacus's")
    p.add_argument("--models", nargs="+", default=["mlp", "cnn1d"], choices=["mlp", "cnn1d"])
    p.add_argument("--batches", type=int, nargs="+", default=[50, 200])
    p.add_argument("--steps", type=int, default=50, help="timed steps of each kind")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    p.set_defaults(handler=bench_privacy)
