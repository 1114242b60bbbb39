"""``communities dp-reference CONFIG``: single-process DP-SGD with Opacus on the pooled data, the privacy reference.

The reference a distributed private run is measured against: the same model,
data, optimizer and batch size as CONFIG, trained in one process on the whole
training split by Opacus's own ``PrivacyEngine`` (Poisson sampling, per-example
clipping, its RDP accountant), for the same number of passes over the data as
the run's replicas make over their shards (``train.budget`` epochs). Each
epsilon gets the noise Opacus derives for that schedule (``make_private_with_epsilon``);
``inf`` trains without privacy. Nothing here is the engine's own DP-SGD: that is
what makes it a check of it.

    communities dp-reference configs/mnist1d.yaml train.budget=100 --epsilon 1 3 8 inf --seeds 0 1 \\
        --out results/privacy/reference.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..errors import EXIT_USER, ConfigError


def _epochs(cfg, n_train: int, world: int) -> int:
    """Passes over the pooled data that match the run's total examples (world x budget units of each replica)."""
    tc = cfg.train
    if tc.unit == "epoch":
        return tc.budget
    return max(1, round(world * tc.budget * tc.steps_per_unit * tc.batch_size / n_train))


def reference(cfg, epsilon: float, seed: int, world: int) -> dict:
    """One reference run; returns its figures."""
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from ..workload import data, models, train

    ds = data.load(cfg.data, seed)
    if cfg.data.standardize:
        data.standardize_by_moments_(ds, data.moments(ds.x_train))
    x, y = torch.as_tensor(ds.x_train, dtype=torch.float32), torch.as_tensor(ds.y_train, dtype=torch.int64)
    xt, yt = torch.as_tensor(ds.x_test, dtype=torch.float32), torch.as_tensor(ds.y_test, dtype=torch.int64)
    torch.manual_seed(models.init_seed(seed, 0, "shared"))
    model = models.build(cfg.model, ds.input_shape, ds.n_classes)
    opt = train.make_optimizer(cfg.train, model.parameters())
    loader = DataLoader(TensorDataset(x, y), batch_size=cfg.train.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    epochs = _epochs(cfg, len(y), world)
    pc = cfg.privacy
    delta, max_norm = pc.delta, pc.max_grad_norm
    engine, sigma = None, 0.0
    if math.isfinite(epsilon):
        engine = PrivacyEngine(accountant="rdp")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, loader = engine.make_private_with_epsilon(
                module=model, optimizer=opt, data_loader=loader, target_epsilon=epsilon, target_delta=delta,
                epochs=epochs, max_grad_norm=max_norm)
        sigma = float(opt.noise_multiplier)
    start, steps = time.perf_counter(), 0
    for _ in range(epochs):
        model.train()
        for xb, yb in loader:
            opt.zero_grad(set_to_none=True)
            if len(yb):
                F.cross_entropy(model(xb), yb).backward()
            opt.step()
            steps += 1
    wall = time.perf_counter() - start
    module: nn.Module = getattr(model, "_module", model)  # under Opacus, the model it wraps
    acc, loss = train.evaluate(module, xt, yt)
    spent = math.inf
    if engine is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            spent = float(engine.get_epsilon(delta))
    return {"epsilon": epsilon if math.isfinite(epsilon) else None, "seed": seed, "test_acc": acc,
            "test_loss": loss, "epsilon_spent": spent if math.isfinite(spent) else None, "delta": delta,
            "noise_multiplier": sigma, "max_grad_norm": max_norm, "epochs": epochs, "steps": steps,
            "sample_rate": cfg.train.batch_size / len(y), "wall": wall}


def main_dp_reference(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="communities dp-reference", description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("overrides", nargs="*", help="key.path=value")
    p.add_argument("--epsilon", nargs="+", default=["1", "3", "8", "inf"], help="targets (inf: no privacy)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    from ..config import load
    from ..workload.private import require_opacus

    try:
        cfg = load(args.config, args.overrides)
        require_opacus()
        targets = [float(e) for e in args.epsilon]
    except (ConfigError, ValueError) as exc:
        print(f"communities dp-reference: {exc}", file=sys.stderr)
        return EXIT_USER
    world = cfg.world_size or 1
    torch.set_num_threads(1)
    rows = []
    for eps in targets:
        for seed in args.seeds:
            row = reference(cfg, eps, seed, world)
            rows.append(row)
            print(f"epsilon {eps:g} seed {seed}: test acc {row['test_acc']:.4f} (noise {row['noise_multiplier']:.3g}, "
                  f"{row['steps']} steps, {row['wall']:.1f}s)", flush=True)
    for eps in targets:
        accs = [r["test_acc"] for r in rows if (r["epsilon"] or math.inf) == eps]
        print(f"epsilon {eps:g}: mean test acc {np.mean(accs):.4f} over {len(accs)} seeds")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"config": args.config, "overrides": args.overrides, "rows": rows},
                                       indent=2) + "\n")
    return 0
