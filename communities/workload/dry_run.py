"""``communities validate``'s dry run: the config's dataset and model, built for real in one process.

What would otherwise stop every rank after MPI start-up (a missing module, a wrong
signature, a wrong return shape, a partition the data cannot take) is found here,
in a second, with one message naming the function. A user's dataset function is
called twice (as rank 0 and as rank 1): data that differ between the calls is the
non-determinism the ranks would refuse at start-up.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np
import torch

from ..core import pbt
from ..errors import DataError
from . import data, models, plugins
from . import text as corpora

SAMPLE = 4  # test examples in the forward pass


def dry_run(cfg, world_size: Optional[int]) -> List[str]:
    """Load the dataset, partition it, build the model and run one forward pass; lines that say what was found."""
    n = world_size or 2  # without a world size, a sharded reader is still tried as two ranks
    ds = data.load(cfg.data, cfg.seed, 0, n)
    where = f"data.dataset={cfg.data.dataset!r}"
    if plugins.is_plugin(cfg.data.dataset):
        other = data.load(cfg.data, cfg.seed, min(1, n - 1), n)
        first, second = data.fingerprint(ds), data.fingerprint(other)
        differ = [what for what, a, b, checked in (("training sets", first[0], second[0], not ds.sharded),
                                                   ("test splits", first[1], second[1], True)) if checked and a != b]
        if differ:
            fn = cfg.data.dataset.partition(":")[2]
            raise DataError(f"{where}: two calls of {fn}() gave different {' and '.join(differ)}; is it "
                            "deterministic? It is called with seed= (use it for every random choice): every rank "
                            "must get the same " + ("test split" if ds.sharded else "data"))
    if ds.text is not None:
        T = ds.input_shape[0]
        lines = [f"data: {ds.name}: {len(ds.y_train)} training windows of {T} tokens ({len(ds.y_train) * T:,} "
                 f"tokens in {len(ds.text.domains)} domains) and {len(ds.y_test)} held-out windows, vocabulary "
                 f"{ds.n_classes}; {ds.text.source}"]
    else:
        lines = [f"data: {ds.name}: {len(ds.y_train)} training and {len(ds.y_test)} test examples of shape "
                 f"{ds.input_shape}, {ds.n_classes} classes"
                 + (f" (rank 0's shard of {n}: a sharded reader)" if ds.sharded else "")]
    sizes: Optional[List[int]] = None
    if not ds.sharded and world_size is not None:
        prepared = data.arrange(ds, cfg.data, cfg.seed, world_size)  # as the ranks will: shift, local tests
        groups = data.declared_groups(ds, prepared.shards)
        sizes = [s.indices.size for s in prepared.shards]
        planted = f", {cfg.data.groups} planted groups of ranks with disjoint labels" \
            if cfg.data.partition == "label_groups" else ""
        if cfg.data.partition == "by_domain" and ds.text is not None:
            of = corpora.domain_groups(ds.text.domain_bytes, cfg.data.groups)
            planted = ", groups of whole domains: " + "; ".join(
                f"{g}: " + ", ".join(d for d, k in zip(ds.text.domains, of) if k == g)[:60]
                for g in range(cfg.data.groups))
        local = [t.size for t in prepared.local_tests]
        lines.append(f"partition: {cfg.data.partition} over {world_size} ranks{planted}: {min(sizes)} to "
                     f"{max(sizes)} examples per rank" + (f"; declared groups {groups}" if groups else "")
                     + (f"; {min(local)} to {max(local)} held out as local test data" if any(local) else "")
                     + (f"; data.shift={cfg.data.shift} over {cfg.data.groups} groups of ranks"
                        if cfg.data.shift != "none" else ""))
    elif not ds.sharded:
        lines.append(f"partition: {cfg.data.partition} (set world_size, or pass --processes P, to check it against "
                     "the replicas)")
    torch.manual_seed(models.init_seed(cfg.seed, 0, cfg.model.init))
    model = models.build(cfg.model, ds.input_shape, ds.n_classes)
    sample = torch.as_tensor(np.ascontiguousarray(ds.x_test[:SAMPLE]))
    models.check_output(model, sample, ds.n_classes, cfg.model.name, ds.sequence)
    with torch.no_grad():
        shape = tuple(model.eval()(sample).shape)
    flat, n_params = models.flatten_(model)
    lines.append(f"model: {cfg.model.name}: {n_params} parameters ({flat.numel()} values merged); a forward pass of "
                 f"{len(sample)} test examples gave {shape} logits")
    if cfg.privacy.enabled:
        lines.append(_privacy_line(cfg, model, ds, sizes))
    if cfg.pbt.enabled:
        lines.append(_pbt_line(cfg, world_size))
    return lines


def _pbt_line(cfg, world_size: Optional[int]) -> str:
    """What the replicas start from (pbt): each learnable value's range over the first draws."""
    pc = cfg.pbt
    space = pbt.Space.of(pc.params)
    n = world_size or 16
    first = np.array([pbt.first_values(space, cfg.seed, i, pc.start.get(i)) for i in range(n)])
    spans = ", ".join(f"{name} {first[:, k].min():.3g} to {first[:, k].max():.3g} "
                      f"({'log-uniform' if space.log[k] else 'uniform'} in [{space.low[k]:g}, {space.high[k]:g}])"
                      for k, name in enumerate(space.names))
    yours = "" if world_size else " (set world_size or pass --processes P for yours)"
    return (f"pbt: the first values of {n} replicas{yours}"
            + f": {spans}; adoption at most every {pc.ready} units, perturbed by {pc.factors}")


def _privacy_line(cfg, model, ds, sizes: Optional[List[int]]) -> str:
    """What DP-SGD will do: the noise and epsilon planned for the smallest and largest shard."""
    from .private import check_model, plan, require_opacus

    require_opacus()
    x = torch.as_tensor(np.ascontiguousarray(ds.x_train[:2]))
    check_model(model, cfg.model.name, x, torch.as_tensor(ds.y_train[:2], dtype=torch.int64), cfg.privacy.per_example)
    if not sizes:
        return "privacy: DP-SGD checked on the model (pass --processes P for the noise each shard gets)"
    pc = cfg.privacy
    parts = []
    for n in sorted({min(sizes), max(sizes)}):
        p = plan(pc, cfg.train, n, sizes, lockstep=cfg.strategy == "allreduce")
        parts.append(f"shard {n}: q={p.sample_rate:.4g}, noise multiplier {p.noise_multiplier:.4g}, epsilon "
                     f"{p.planned_epsilon:.3g} after {p.planned_steps} steps")
    return f"privacy: DP-SGD at delta {pc.delta:g}, clipping {pc.max_grad_norm:g}, {pc.sampling} sampling; " + \
        "; ".join(parts)
