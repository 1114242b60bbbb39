"""``communities lm-reference CONFIG``: the language model of CONFIG trained centrally, the distributed arms' yardstick.

The same model (same init seed), optimizer and learning-rate schedule as CONFIG, trained
by a plain single-process PyTorch loop (no MPI, no engine) on the whole training split,
every window the world's shards together hold, in batches drawn uniformly at random
(successive seeded permutations), for as many tokens as the distributed run trains on:
``world_size x budget x steps_per_unit x batch_size x context`` under ``train.unit: steps``,
and under ``epoch`` ``budget`` passes over every shard (the longest shard's steps for
each replica under ``strategy: allreduce``). The batch is by default the per-replica batch
times world_size, what allreduce averages in one step, so the steps are the run's
``budget x steps_per_unit``; ``--batch-size B`` picks another and the steps follow, the
tokens kept equal (the last batch is cut to fit). The held-out split is scored every
``--eval-every`` steps and at the end: loss in nats per token, bits per byte, next-token
accuracy. The figures go to a table and, atomically, to ``--out`` (JSON; default
``<output.root>/<name>_reference.json``, never overwritten without ``--overwrite``).

    communities lm-reference configs/lm.yaml --threads 2
    communities lm-reference configs/lm.yaml train.lr=0.001 --batch-size 64 --out results/lm_b64.json
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..errors import EXIT_USER, ConfigError, DataError, ResultsError, UserError

SAMPLER_SALT = 0x1A7E  # the batch sampler's seed is [cfg.seed, SAMPLER_SALT]: apart from every stream of the engine


@dataclass
class Plan:
    """What the reference trains on and for how long, derived from the config alone."""

    world: int
    replica_batch: int  # train.batch_size, each replica's
    batch: int  # the reference's batch, in windows
    windows: int  # windows to train on in all (tokens / context)
    steps: int  # ceil(windows / batch): the last batch holds the rest
    context: int
    basis: str  # how the token count follows from the config, for the output

    @property
    def tokens(self) -> int:
        return self.windows * self.context

    def batch_at(self, j: int) -> int:
        """Windows in step j (1-based): the batch, the last step the remainder."""
        return self.batch if j < self.steps else self.windows - (self.steps - 1) * self.batch


def replica_windows(cfg, shard_sizes: List[int]) -> Tuple[int, str]:
    """Windows the distributed run trains on, summed over its replicas, and how they follow from the config."""
    from ..config import SYNCS_GRADIENTS
    from ..workload import train

    tc, world = cfg.train, len(shard_sizes)
    b = tc.batch_size
    if tc.unit == "steps":
        total = sum(tc.budget * tc.steps_per_unit * min(b, n) for n in shard_sizes)
        small = "" if min(shard_sizes) >= b else " (a shard smaller than the batch takes all its windows per step)"
        return total, (f"train.unit=steps: {world} replicas x {tc.budget} units x {tc.steps_per_unit} steps x "
                       f"{b} windows{small}")
    if cfg.strategy in SYNCS_GRADIENTS:  # every step a collective: every replica takes the longest shard's steps
        lock = train.lockstep_steps(shard_sizes, b)
        total = sum(tc.budget * lock * min(b, n) for n in shard_sizes)
        return total, (f"train.unit=epoch under strategy={cfg.strategy}: {world} replicas x {tc.budget} units x "
                       f"{lock} steps (the longest shard's epoch) x {b} windows")
    steps = [-(-n // b) for n in shard_sizes]
    return tc.budget * sum(shard_sizes), (f"train.unit=epoch: {tc.budget} passes over each of {world} shards "
                                          f"({min(steps)} to {max(steps)} steps of {b} windows per epoch)")


def make_plan(cfg, shard_sizes: List[int], batch: Optional[int]) -> Plan:
    total, basis = replica_windows(cfg, shard_sizes)
    world, b = len(shard_sizes), cfg.train.batch_size
    size = batch if batch is not None else world * b
    return Plan(world, b, size, total, -(-total // size), cfg.data.lm.context, basis)


def lr_share(tc, j: int, steps: int) -> float:
    """The learning rate's share of its peak at reference step j of ``steps``: ``train.lr_factor`` at the same
    virtual time (j / steps of the budget), by unit and step where the steps divide into the budget's units."""
    from ..core import schedule
    from ..workload import train

    if steps % tc.budget == 0:
        per = steps // tc.budget
        return train.lr_factor(tc, (j - 1) // per + 1, (j - 1) % per + 1, per)
    return schedule.lr_factor(j / steps, tc.schedule, tc.warmup, tc.min_lr)


def batches(pool: np.ndarray, plan: Plan, seed: int) -> Iterator[np.ndarray]:
    """The windows of every step: successive seeded permutations of ``pool``, cut into the plan's batches."""
    rng = np.random.default_rng([seed, SAMPLER_SALT])
    queue = np.zeros(0, dtype=np.int64)
    for j in range(1, plan.steps + 1):
        size = plan.batch_at(j)
        while len(queue) < size:
            queue = np.concatenate([queue, pool[rng.permutation(len(pool))]])
        yield queue[:size]
        queue = queue[size:]


def select_device(device: str) -> torch.device:
    """The config's ``device``, as the engine picks it for rank 0."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"device='cuda' but torch {torch.__version__} sees no CUDA device on host "
                          f"{platform.node()}")
    return torch.device("cuda", 0)


def default_out(cfg) -> Path:
    return Path(cfg.output.root) / f"{cfg.name}_reference.json"


def refuse_existing(out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        raise ResultsError(f"{out} exists; pass --overwrite to replace it, or --out another path")


def load_config(args):
    """The config as ``communities run`` reads it, refused unless it trains a language model on a text corpus."""
    from ..config import LM_DATASETS, load
    from ..workload import plugins

    cfg = load(args.config, args.overrides)
    if cfg.data.dataset not in LM_DATASETS:
        raise ConfigError(f"data.dataset={cfg.data.dataset!r} is not a text corpus: lm-reference trains a "
                          f"language model on {', '.join(LM_DATASETS)} (see data.lm)")
    world = args.world_size if args.world_size is not None else cfg.world_size
    if world is None:
        raise ConfigError("world_size is not set: the token count is the world's; set world_size or pass "
                          "--world-size N")
    if args.world_size is not None:
        cfg.check_world(args.world_size)
    for flag, value in (("--batch-size", args.batch_size), ("--eval-every", args.eval_every),
                        ("--threads", args.threads), ("--world-size", args.world_size)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}={value} must be at least 1")
    plugins.add_search_path(os.getcwd(), Path(args.config).resolve().parent)  # a module:function model
    return cfg, world


def fmt(v: Optional[float], spec: str) -> str:
    """``v`` formatted, or a dash as wide where it is unknown."""
    return format("-", spec.split(".")[0].rstrip(",")) if v is None or not math.isfinite(v) else format(v, spec)


def reference(cfg, world: int, batch: Optional[int] = None, eval_every: Optional[int] = None,
              say=print) -> Dict[str, Any]:
    """Train the reference; return its record (what ``--out`` holds, less the command line)."""
    from ..workload import data, models, train

    ds = data.load(cfg.data, cfg.seed)
    if ds.text is None:  # a guard: the config names a text corpus
        raise DataError(f"data.dataset={cfg.data.dataset!r} gave no text corpus")
    prepared = data.arrange(ds, cfg.data, cfg.seed, world)  # the world's shards, local tests held out
    shard_sizes = [int(s.indices.size) for s in prepared.shards]
    pool = np.sort(np.concatenate([s.indices for s in prepared.shards]))
    plan = make_plan(cfg, shard_sizes, batch)
    device = select_device(cfg.device)
    tc = cfg.train
    every = eval_every or max(1, round(tc.eval_every * plan.steps / tc.budget))

    xt, yt = data.rows(ds.x_test, slice(None)).to(device), data.rows(ds.y_test, slice(None)).to(device)
    torch.manual_seed(models.init_seed(cfg.seed, 0, cfg.model.init))
    model = models.build(cfg.model, ds.input_shape, ds.n_classes).to(device)
    models.check_output(model, xt[:4], ds.n_classes, cfg.model.name, True)
    opt = train.make_optimizer(tc, model.parameters())
    peaks = [g["lr"] for g in opt.param_groups]
    scheduled = train.scheduled(tc)
    bpt = ds.text.bytes_per_token
    n_params = sum(p.numel() for p in model.parameters())

    say(f"lm-reference {cfg.name}: {ds.text.source}; {len(pool)} training windows (the {world} shards'), "
        f"{len(yt)} held-out windows of {plan.context} tokens; {cfg.model.name} of {n_params:,} parameters on {device}")
    say(f"tokens: {plan.basis} x {plan.context} tokens = {plan.tokens:,}; reference: {plan.steps} steps of "
        f"{plan.batch} windows" + ("" if plan.batch_at(plan.steps) == plan.batch
                                   else f" (the last of {plan.batch_at(plan.steps)})"))
    curve: List[Dict[str, Any]] = []

    def score(step: int, tokens: int, train_loss: Optional[float], lr: float) -> Dict[str, Any]:
        acc, loss = train.evaluate(model, xt, yt)
        row = {"step": step, "tokens": tokens, "lr": lr, "train_loss": train_loss, "test_loss": loss,
               "test_bpb": loss / math.log(2) / bpt if bpt else None, "test_acc": acc}
        curve.append(row)
        say(f"{step:>7} {tokens:>12,} {lr:>9.2e} {fmt(train_loss, '>10.4f')} {loss:>9.4f} "
            f"{fmt(row['test_bpb'], '>9.4f')} {acc:>7.4f}")
        return row

    say(f"{'step':>7} {'tokens':>12} {'lr':>9} {'train loss':>10} {'test loss':>9} {'bits/byte':>9} {'acc':>7}")
    score(0, 0, None, peaks[0] * (lr_share(tc, 0, plan.steps) if scheduled else 1.0))
    seen, trained, cpu, wall = _train(model, opt, ds=ds, pool=pool, plan=plan, cfg=cfg, device=device, every=every,
                                       score=score)
    assert seen == plan.windows, (seen, plan.windows)
    return _record(cfg, ds, plan, world=world, device=device, n_params=n_params, pool=pool, shard_sizes=shard_sizes,
                   test_windows=int(len(yt)), every=every, trained=trained, cpu=cpu, wall=wall, curve=curve)


def _train(model, opt, *, ds, pool: np.ndarray, plan: Plan, cfg, device: torch.device, every: int,
           score: Callable[[int, int, Optional[float], float], Any]) -> Tuple[int, float, float, float]:
    """The reference's steps, scored every ``every`` steps and after the last: (windows seen, seconds training,
    CPU seconds training, wall seconds in all)."""
    from ..workload import data, train

    tc = cfg.train
    peaks = [g["lr"] for g in opt.param_groups]
    scheduled = train.scheduled(tc)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    trained = cpu = 0.0
    seen = 0
    run_loss = torch.zeros((), dtype=torch.float64, device=device)
    run_n = 0
    start = time.perf_counter()
    tick, cpu_tick = time.perf_counter(), time.process_time()
    model.train()
    for j, idx in enumerate(batches(pool, plan, cfg.seed), 1):
        if scheduled:
            for g, peak in zip(opt.param_groups, peaks):
                g["lr"] = peak * lr_share(tc, j, plan.steps)
        xb, yb = data.rows(ds.x_train, idx).to(device), data.rows(ds.y_train, idx).to(device)
        loss = train.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        run_loss += loss.detach().double() * len(idx)
        run_n += len(idx)
        seen += len(idx)
        if j % every == 0 or j == plan.steps:
            sync()
            trained += time.perf_counter() - tick
            cpu += time.process_time() - cpu_tick
            score(j, seen * plan.context, float(run_loss) / run_n, opt.param_groups[0]["lr"])
            run_loss.zero_()
            run_n = 0
            tick, cpu_tick = time.perf_counter(), time.process_time()
    return seen, trained, cpu, time.perf_counter() - start


def _record(cfg, ds, plan: Plan, *, world: int, device: torch.device, n_params: int, pool: np.ndarray,
            shard_sizes: List[int], test_windows: int, every: int, trained: float, cpu: float, wall: float,
            curve: List[Dict[str, Any]]) -> Dict[str, Any]:
    """What ``--out`` holds, less the command line."""
    tc = cfg.train
    last = curve[-1]
    return {
        "name": cfg.name, "dataset": cfg.data.dataset, "source": ds.text.source, "model": cfg.model.name,
        "parameters": n_params, "device": str(device), "threads": torch.get_num_threads(), "seed": cfg.seed,
        "world_size": world, "strategy": cfg.strategy, "unit": tc.unit, "basis": plan.basis,
        "replica_batch_size": plan.replica_batch, "batch_size": plan.batch, "steps": plan.steps,
        "context": plan.context, "tokens": plan.tokens, "train_windows": int(len(pool)),
        "shard_windows": shard_sizes, "test_windows": test_windows, "bytes_per_token": ds.text.bytes_per_token,
        "optimizer": tc.optimizer, "lr": tc.lr, "schedule": tc.schedule, "warmup": tc.warmup,
        "eval_every": every, "tokens_per_second": plan.tokens / trained if trained > 0 else None,
        "train_seconds": trained, "train_cpu_seconds": cpu, "wall_seconds": wall,
        "final": {k: last[k] for k in ("test_loss", "test_bpb", "test_acc", "train_loss")},
        "initial": {k: curve[0][k] for k in ("test_loss", "test_bpb", "test_acc")},
        "curve": curve, "torch": torch.__version__,
    }


def write(out: Path, record: Dict[str, Any], overwrite: bool) -> None:
    """The record as JSON at ``out``: a temporary beside it, then ``os.replace``; an existing file only with
    ``overwrite``."""
    from ..results import atomic_write_json, disk_error

    refuse_existing(out, overwrite)  # again: it may have appeared while training
    try:
        atomic_write_json(out, record)
    except OSError as exc:
        raise disk_error(out, exc) from None


def main_lm_reference(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="communities lm-reference", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key.path=value")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="windows per step (default: train.batch_size x world_size); the steps follow, the tokens stay")
    p.add_argument("--eval-every", type=int, default=None, metavar="STEPS",
                   help="steps between held-out evaluations (default: train.eval_every units' worth); also at the end")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="the world whose tokens to match (default: the config's world_size)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--out", type=Path, default=None,
                   help="the JSON record (default: <output.root>/<name>_reference.json)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--debug", action="store_true", help="show the traceback of a user error")
    args = p.parse_intermixed_args(argv)
    try:
        cfg, world = load_config(args)
        out = args.out if args.out is not None else default_out(cfg)
        refuse_existing(out, args.overwrite)
        torch.set_num_threads(args.threads)
        record = reference(cfg, world, args.batch_size, args.eval_every)
        record.update(config=str(args.config), overrides=list(args.overrides))
        write(out, record, args.overwrite)
    except UserError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"communities lm-reference: error: {exc}", file=sys.stderr)
        return EXIT_USER
    fin = record["final"]
    tps = record["tokens_per_second"]
    print(f"final: test loss {fin['test_loss']:.4f} nats/token, {fmt(fin['test_bpb'], '.4f')} bits/byte, "
          f"accuracy {fin['test_acc']:.4f}; {record['tokens']:,} tokens in {record['train_seconds']:.1f}s "
          f"({fmt(tps, ',.0f')} tokens/s; {record['train_cpu_seconds']:.1f} CPU-seconds, {record['threads']} "
          f"thread(s)); wrote {out}")
    return 0
