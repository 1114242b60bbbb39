"""One rank's replica: its shard, its model as one flat buffer, its optimizer, and its training progress.

The flat buffer *is* the model (``models.flatten_``): an exchange sends it as
one buffer and a merge is one ``lerp_`` over it. Everything a later unit
depends on (weights, optimizer moments, torch's RNG for dropout, the example
table) is in ``state_dict``, so a resumed run continues bit for bit.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, List, Optional

import numpy as np
import torch

from ..core import merge, protocol, robust
from ..errors import ConfigError, Disagreement
from ..results import MetricRow
from ..runtime.collective import on_every_rank
from ..runtime.comm import World
from ..workload import data, models, train
from .example_tracker import ExampleTracker
from .faults import NoFaults
from .timer import Timer

log = logging.getLogger(__name__)


class Replica:
    """This rank's model and data. Build with ``Replica.build`` (a collective: every rank calls it)."""

    def __init__(self, cfg, world: World, device: torch.device, timer: Timer, faults: NoFaults):
        self.cfg, self.world, self.device, self.timer, self.faults = cfg, world, device, timer, faults
        self.rank = world.rank
        # training progress, what a partner is told at an exchange and what the summary reports
        self.samples = 0
        self.recent_loss = float("nan")
        self.first_loss = float("nan")
        self.test_acc = float("nan")
        self.test_loss = float("nan")
        self.diverged = False
        self.outlier = False  # robust.enabled: the latest round left this rank out
        self.outer: Optional[merge.OuterOptimizer] = None
        self.anchor: Optional[torch.Tensor] = None  # diloco: the weights all ranks held after the last global step

    @classmethod
    def build(cls, cfg, world: World, device: torch.device, timer: Timer, faults: NoFaults) -> "Replica":
        """Load the data, partition it, build the model and share rank 0's initial weights."""
        self = cls(cfg, world, device, timer, faults)
        on_every_rank(world, self._read_data)
        self.test_split = self._check_same_data()
        if self.dataset.sharded:
            self._combine_shards()
        on_every_rank(world, self._place_data)
        model, flat, n_params = on_every_rank(world, self._build_model)
        shapes = models.shape_signature(model)
        world.agree(protocol.digest(np.frombuffer(shapes.encode(), dtype=np.uint8)),
                    f"model parameter shapes and dtypes (this rank: {len(flat)} values)")
        if cfg.model.init == "shared":
            world.bcast_(flat, root=0)
        torch.manual_seed(cfg.seed * 104729 + self.rank)  # dropout and other stochastic layers
        self.model, self.flat, self.n_params = model, flat, n_params
        self.opt = train.make_optimizer(cfg.train, model.parameters())
        return self

    def _read_data(self) -> None:
        """This rank's copy of the dataset (a sharded reader's: its own training shard), and its fingerprint."""
        cfg = self.cfg
        # mnist1d's generator reseeds numpy's global state, so load before seeding anything.
        ds = data.load(cfg.data, cfg.seed, self.rank, self.world.size)
        self.dataset, self.fingerprint = ds, data.fingerprint(ds)
        self.label_counts: Optional[List[List[int]]] = None
        if ds.sharded:
            self.own_group = data.own_group(ds, self.rank, self.world.size)
            needs_pool = [k for k, on in (("examples.track", cfg.examples.track),
                                          (f"signature.kind={cfg.signature.kind!r}",
                                           cfg.signature.kind in ("logits", "cka"))) if on]
            if needs_pool:
                raise ConfigError(f"{' and '.join(needs_pool)} need the whole training set on every rank, but "
                                  f"data.dataset={cfg.data.dataset!r} is a sharded reader (it takes rank or "
                                  "world_size) and gives each rank only its own shard")

    def _check_same_data(self) -> str:
        """A collective: the ranks compare their data's fingerprints; which test split the consensus is scored on.

        A dataset function that is not deterministic gives every rank different data. That is refused
        (``data.on_mismatch: refuse``, a Disagreement naming the ranks, before anything is written), or
        with ``warn`` trained on as it is, the consensus scored on rank 0's test split, as the summary says.
        A sharded reader's training shards differ by design; its test split must not.
        """
        cfg, ds = self.cfg, self.dataset
        train_fp, test_fp = self.fingerprint
        texts = self.world.allgather_text(f"{train_fp} {test_fp}", width=80)
        said = [(t if alive else texts[0]).split() for t, alive in zip(texts, self.world.alive)]  # (lost: as 0)
        test_differ = [r for r, (_, te) in enumerate(said) if te != said[0][1]]
        train_differ = [] if ds.sharded else [r for r, (tr, _) in enumerate(said) if tr != said[0][0]]
        if ds.sharded and self.world.size > 1 and len({tr for tr, _ in said}) == 1 and self.rank == 0:
            log.warning(f"communities: warning: data.dataset={cfg.data.dataset!r} gave every rank the same training "
                        "shard; a sharded reader (it takes rank or world_size) should return rank's own part")
        if not (test_differ or train_differ):
            return "shared"
        what = " and ".join(w for w, d in (("training set", train_differ), ("test split", test_differ)) if d)
        ranks = sorted(set(test_differ) | set(train_differ))
        if cfg.data.on_mismatch == "refuse":
            fn = cfg.data.dataset.partition(":")[2] or cfg.data.dataset
            raise Disagreement(
                f"data.dataset={cfg.data.dataset!r}: the ranks' data differ: ranks {ranks} hold another {what} than "
                f"rank 0. Is {fn}() deterministic? It is called with seed= (use it for every random choice)"
                + (" and must return the same test split on every rank" if ds.sharded else "")
                + "; data.on_mismatch=warn trains anyway")
        if not test_differ:
            if self.rank == 0:
                log.warning(f"communities: warning: the ranks' training sets differ (ranks {train_differ} from rank "
                            f"0's); data.dataset={cfg.data.dataset!r} is not deterministic? Each rank trains on its "
                            "own partition of its own copy")
            return "shared"
        if self.rank == 0:
            log.warning(f"communities: warning: the ranks' test splits differ (ranks {test_differ} from rank 0's); "
                        f"data.dataset={cfg.data.dataset!r} is not deterministic? The consensus is scored on "
                        "rank 0's, each rank on its own")
        return f"rank 0's (the test splits differ across ranks: {len(test_differ)} of {len(said)} from rank 0's)"

    def _combine_shards(self) -> None:
        """A collective, for a sharded reader: the class count, standardisation and shard records of every rank.

        Each rank holds out its own local test split (``data.split_local``, as ``data.hold_out`` would); the
        records are of the training part."""
        ds, w, cfg = self.dataset, self.world, self.cfg
        ds.classes = int(w.allreduce_array(np.array([max(ds.y_train.max(), ds.y_test.max())]), op="max")[0]) + 1
        if cfg.data.standardize:
            data.standardize_by_moments_(ds, w.allreduce_array(data.moments(ds.x_train)))
        kept, local = data.split_local(np.arange(len(ds.y_train), dtype=np.int64), cfg.data.local_test_fraction,
                                       cfg.seed, self.rank)
        own = np.concatenate([[len(kept), -1 if self.own_group is None else self.own_group, len(local)],
                              np.bincount(ds.y_train[kept], minlength=ds.classes)]).astype(np.int64)
        rows = w.allgather(own)
        self.label_counts = rows[:, 3:].tolist()
        self.local_test_sizes = rows[:, 2].tolist()
        self.shards = [data.Shard(np.arange(int(n), dtype=np.int64), None if self.own_group is None else int(g))
                       for n, g in rows[:, :2]]
        self.shards[self.rank] = data.Shard(kept, self.shards[self.rank].group)
        self.local_tests = [np.zeros(0, dtype=np.int64) for _ in rows]  # only this rank's own is known here
        self.local_tests[self.rank] = local

    def _place_data(self) -> None:
        """This rank's shard (the partition's, or a sharded reader's own) as tensors on the device, and its local
        test data (data.local_test_fraction) held out of it."""
        cfg, device = self.cfg, self.device
        if not self.dataset.sharded:
            # the partition, the shift of the planted groups and the local tests: the same on every rank
            prepared = data.arrange(self.dataset, cfg.data, cfg.seed, self.world.size)
            self.dataset, self.shards, self.local_tests = prepared.dataset, prepared.shards, prepared.local_tests
            self.local_test_sizes = [int(t.size) for t in self.local_tests]
        ds = self.dataset
        self.shard = self.shards[self.rank]
        idx = torch.as_tensor(self.shard.indices)
        self.x = torch.as_tensor(ds.x_train)[idx].to(device)
        self.y = torch.as_tensor(ds.y_train)[idx].to(device)
        self.x_test = torch.as_tensor(ds.x_test).to(device)
        self.y_test = torch.as_tensor(ds.y_test).to(device)
        local = torch.as_tensor(self.local_tests[self.rank])
        self.x_local = torch.as_tensor(ds.x_train)[local].to(device)  # this rank's local test data (may be empty)
        self.y_local = torch.as_tensor(ds.y_train)[local].to(device)
        log.debug(f"communities: rank {self.rank}: {len(self.shard.indices)} training examples (labels "
                  f"{np.bincount(ds.y_train[self.shard.indices], minlength=ds.n_classes).tolist()}), "
                  f"{len(ds.y_test)} test examples of shape {ds.input_shape}"
                  + (f", {len(local)} local test examples" if len(local) else ""))
        self.tracker: Optional[ExampleTracker] = None
        if cfg.examples.track:
            self.tracker = ExampleTracker(cfg.examples, np.asarray(self.shard.indices, dtype=np.int64),
                                          x_pool=ds.x_train, y_pool=ds.y_train, world=self.world.size, rank=self.rank,
                                          seed=cfg.seed, device=device, n_classes=ds.n_classes)
        if cfg.signature.kind in ("logits", "cka") and cfg.signature.probe_size > len(ds.y_train):
            raise ConfigError(f"signature.probe_size={cfg.signature.probe_size} exceeds the "
                              f"{len(ds.y_train)} training examples")

    def _build_model(self):
        cfg = self.cfg
        torch.manual_seed(models.init_seed(cfg.seed, self.rank, cfg.model.init))
        model = models.build(cfg.model, self.dataset.input_shape, self.dataset.n_classes).to(self.device)
        models.check_output(model, self.x_test[:4], self.dataset.n_classes, cfg.model.name)
        flat, n_params = models.flatten_(model)
        return model, flat, n_params

    def adopt(self, ranks: List[int]) -> None:
        """comm.lost_shard adopt: train on the shards of lost ``ranks`` too (appended to this rank's own)."""
        if self.dataset.sharded:  # a sharded reader's ranks know only their own shard
            log.warning(f"communities: rank {self.rank} cannot adopt the shards of lost ranks {ranks}: a sharded "
                        "reader's shards are not known here; they are dropped")
            return
        extra = [np.asarray(self.shards[r].indices, dtype=np.int64) for r in ranks]
        own = np.asarray(self.shard.indices, dtype=np.int64)
        self.shard = data.Shard(np.concatenate([own] + extra), self.shard.group)
        idx = torch.as_tensor(self.shard.indices)
        self.x = torch.as_tensor(self.dataset.x_train)[idx].to(self.device)
        self.y = torch.as_tensor(self.dataset.y_train)[idx].to(self.device)
        log.warning(f"communities: rank {self.rank} adopts the shards of lost rank{'s' if len(ranks) > 1 else ''} "
                    f"{', '.join(map(str, ranks))}: {len(own)} -> {len(self.shard.indices)} training examples")

    @property
    def groups(self) -> Optional[List[int]]:
        """The group of every rank: planted (data.partition: label_groups) or declared by a user dataset; else None."""
        return None if self.shard.group is None else [int(s.group) for s in self.shards]

    def enable_outer(self, outer_cfg, anchor: bool = False) -> None:
        """An outer optimizer on merges (merge.outer) or on global averages (diloco, with an anchor)."""
        if self.outer is None:
            self.outer = merge.OuterOptimizer(self.flat.numel(), lr=outer_cfg.lr, momentum=outer_cfg.momentum,
                                              nesterov=outer_cfg.nesterov, device=self.device, dtype=self.flat.dtype)
        if anchor and self.anchor is None:
            self.anchor = self.flat.clone()

    # ------------------------------------------------------------------ training

    def train_unit(self, t: int, grad_sync: Optional[Callable[[], None]] = None, steps: Optional[int] = None,
                   between_batches: Optional[Callable[[], None]] = None) -> MetricRow:
        """Train unit t on the shard, check for divergence, evaluate when due; returns the unit's metrics row.

        ``between_batches`` (the asynchronous mixer's serving) runs after every batch.
        """
        cfg = self.cfg
        with self.timer("train"):
            x, y, rows = self.x, self.y, None
            if self.tracker is not None:
                rows = self.tracker.training_rows(t)
                x, y = self.tracker.view(rows)
            res = train.train_unit(self.model, self.opt, x, y, cfg.train, cfg.seed, self.rank, t, steps=steps,
                                   grad_sync=grad_sync, between_batches=self._batch_hook(t, between_batches))
            if rows is not None:
                self.tracker.trained(rows)
            self.faults.during_unit(t)
        self.faults.after_unit(t, self.flat)
        self.samples += res.samples
        self.recent_loss = res.loss
        if t == 1 or not math.isfinite(self.first_loss):
            self.first_loss = res.loss
        if not self.diverged and robust.is_diverged(float(self.flat.sum()), res.loss, self.first_loss,
                                                    cfg.robust.loss_factor):
            self.diverged = True
            log.warning(f"communities: rank {self.rank} diverged at t={t} (loss {res.loss:.4g}); it will not be "
                        f"merged into partners ({cfg.robust.diverged})")
        if self.tracker is not None:
            with self.timer("eval"):
                self.tracker.maybe_evaluate(self.model, t)
        test_acc = test_loss = local_acc = local_loss = float("nan")
        if t % cfg.train.eval_every == 0 or t == cfg.train.budget:
            with self.timer("eval"):
                test_acc, test_loss = train.evaluate(self.model, self.x_test, self.y_test)
                if self.has_local_test:
                    local_acc, local_loss = train.evaluate(self.model, self.x_local, self.y_local)
            self.test_acc, self.test_loss = test_acc, test_loss
        return MetricRow(t, res.loss, res.accuracy, test_acc, test_loss, self.samples, self.world.bytes_sent,
                         self.timer.elapsed(), local_acc, local_loss)

    def _batch_hook(self, t: int, serve: Optional[Callable[[], None]]) -> Optional[Callable[[int], None]]:
        """What runs between batches: an injected slowdown of this batch, then serving partners."""
        slow = self.faults.batch_hook(t)
        if slow is None and serve is None:
            return None

        def hook(step: int) -> None:
            if slow is not None:
                slow(step)
            if serve is not None:
                serve()
                if slow is not None:
                    slow.restart()  # the time spent serving is not this rank's compute
        return hook

    def evaluate(self, flat: Optional[torch.Tensor] = None):
        """(accuracy, loss) on the shared test split, of these weights (default: this rank's own)."""
        return self.evaluate_on(self.x_test, self.y_test, flat)

    @property
    def has_local_test(self) -> bool:
        """Whether this run holds out local test data (data.local_test_fraction > 0)."""
        return self.cfg.data.local_test_fraction > 0

    def evaluate_local(self, flat: Optional[torch.Tensor] = None):
        """(accuracy, loss) on this rank's local test data (its own group's distribution), of these weights."""
        return self.evaluate_on(self.x_local, self.y_local, flat)

    def evaluate_on(self, x: torch.Tensor, y: torch.Tensor, flat: Optional[torch.Tensor] = None):
        """(accuracy, loss) on (x, y) of ``flat`` (default: this rank's own weights, left as they are)."""
        if flat is None:
            return train.evaluate(self.model, x, y)
        saved = self.flat.clone()
        self.flat.copy_(flat)
        try:
            return train.evaluate(self.model, x, y)
        finally:
            self.flat.copy_(saved)

    def state_dict_of(self, flat: torch.Tensor) -> dict:
        """The model's ``state_dict`` (CPU copies) with ``flat`` as its weights."""
        saved = self.flat.clone()
        self.flat.copy_(flat)
        try:
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        finally:
            self.flat.copy_(saved)

    # ------------------------------------------------------------------ averages

    @property
    def keep(self) -> bool:
        """Whether this rank's weights count in averages and the consensus model."""
        return not (self.outlier or self.diverged)

    def outgoing(self) -> torch.Tensor:
        """What this rank shows others: its weights, or an injected Byzantine lie."""
        return self.faults.outgoing(self.flat)

    def masked_mean(self) -> torch.Tensor:
        """Allreduce mean over the ranks that ``keep``; equals the plain mean (bit for bit) when all do."""
        keep = self.keep
        mean = self.outgoing().clone() if keep else torch.zeros_like(self.flat)
        with self.timer.collective("masked_mean"):  # waiting for the last rank becomes idle (Timer.settle)
            self.world.allreduce_sum_(mean)
        count = self.world.allreduce_scalar(float(keep))
        return mean.div_(count if count > 0 else self.world.size)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {
            "flat": self.flat.detach().cpu().clone(), "optimizer": self.opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "outer_m": self.outer.m.detach().cpu().clone() if self.outer is not None else None,
            "anchor": self.anchor.detach().cpu().clone() if self.anchor is not None else None,
            "samples": self.samples, "recent_loss": self.recent_loss, "first_loss": self.first_loss,
            "test_acc": self.test_acc, "test_loss": self.test_loss, "diverged": self.diverged,
            "outlier": self.outlier,
            "examples": None if self.tracker is None else self.tracker.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["flat"].numel() != self.flat.numel():
            raise ValueError(f"it holds {state['flat'].numel()} weights; this model has {self.flat.numel()}")
        self.flat.copy_(state["flat"].to(self.flat.device))
        self.opt.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if self.outer is not None:
            self.outer.m.copy_(state["outer_m"].to(self.outer.m.device))
        if self.anchor is not None:
            self.anchor.copy_(state["anchor"].to(self.anchor.device))
        for key in ("samples", "recent_loss", "first_loss", "test_acc", "test_loss", "diverged", "outlier"):
            setattr(self, key, state[key])
        if self.tracker is not None:
            if state["examples"] is None:
                raise ValueError("it has no example table, but examples.track is on")
            self.tracker.load_state_dict(state["examples"])
