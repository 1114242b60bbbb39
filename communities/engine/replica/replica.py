"""One rank's replica: its model as one flat buffer, its optimizer, and its training progress, on the data it holds.

The flat buffer *is* the model (``models.flatten_``): an exchange sends it as
one buffer and a merge is one ``lerp_`` over it. Everything a later unit
depends on (weights, optimizer moments, torch's RNG for dropout, the example
table) is in ``state_dict``, so a resumed run continues bit for bit. The data
(``data``, a frozen ``ReplicaData``) is placed once, before the model is built.
"""
from __future__ import annotations

import copy
import logging
import math
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ...config import SYNCS_GRADIENTS
from ...core import merge, privacy, protocol, robust
from ...errors import ConfigError
from ...results import MetricRow
from ...runtime.collective import on_every_rank
from ...runtime.view import WorldView
from ...workload import models, train, vectorized
from ...workload.private import DPPlan, PrivateGradient, check_model, plan, require_opacus
from ..faults import NoFaults
from ..timer import Timer
from . import block, stacked
from .data import ReplicaData, load_replica_data
from .examples import ExampleTracker
from .group import GroupMember
from .hyper import Hyperparameters

if TYPE_CHECKING:
    from ...config import Config
    from ...runtime.groups import GroupWorld

log = logging.getLogger(__name__)


class Replica:
    """This rank's model on its data. Build with ``Replica.build`` (a collective: every rank calls it)."""

    cfg: "Config"
    world: WorldView
    device: torch.device
    timer: Timer
    faults: NoFaults
    rank: int
    data: ReplicaData  # what this rank holds of the data (replaced, never changed: ``adopt``)
    model: torch.nn.Module
    flat: torch.Tensor  # the model's parameters and buffers, one buffer (models.flatten_)
    n_params: int  # how many leading values of ``flat`` are parameters
    opt: torch.optim.Optimizer
    tracker: Optional[ExampleTracker]  # examples.track: which examples each unit trains on
    vectorized: bool  # train.vectorize: the replicas of this process train as one stacked model
    rows: Optional[torch.Tensor]  # vectorized: the process's (R, F) block whose row ``flat`` is (block.py)
    # training progress, what a partner is told at an exchange and what the summary reports
    samples: int
    recent_loss: float
    first_loss: float
    test_acc: float
    test_loss: float
    diverged: bool
    outlier: bool  # robust.enabled: the latest round left this rank out
    outer: Optional[merge.OuterOptimizer]  # merge.outer or diloco (``enable_outer``)
    anchor: Optional[torch.Tensor]  # diloco: the weights all ranks held after the last global step
    private: Optional[PrivateGradient]  # privacy.enabled: DP-SGD's clipped, noised gradients
    dp: Optional[DPPlan]  # privacy.enabled: the sampling rate and noise this replica's accounting uses
    dp_steps: int  # DP-SGD steps taken so far (the accountant's step count)
    hyper: Optional[Hyperparameters]  # pbt.enabled: the hyperparameters this replica owns (its group's)
    group: Optional[GroupMember]  # train.group_size > 1: this replica in its data-parallel group

    def __init__(self, cfg: "Config", world: WorldView, device: torch.device, *, timer: Timer, faults: NoFaults,
                 placed: ReplicaData, model: torch.nn.Module, flat: torch.Tensor, n_params: int,
                 tracker: Optional[ExampleTracker], vectorized: bool = False, dp: Optional[DPPlan] = None,
                 groups: Optional["GroupWorld"] = None, rows: Optional[torch.Tensor] = None):
        self.cfg, self.world, self.device, self.timer, self.faults = cfg, world, device, timer, faults
        self.rank, self.data, self.tracker, self.vectorized = world.rank, placed, tracker, vectorized
        self.model, self.flat, self.n_params, self.rows = model, flat, n_params, rows
        self.opt = train.make_optimizer(cfg.train, model.parameters())
        self.samples = 0
        self.recent_loss = self.first_loss = self.test_acc = self.test_loss = float("nan")
        self.diverged = self.outlier = False
        self.outer, self.anchor = None, None
        self.dp, self.dp_steps, self.private = dp, 0, None
        self.group = None if groups is None else GroupMember(
            groups, shard_sizes=[s.indices.size for s in placed.shards], train_cfg=cfg.train, timer=timer)
        # pbt: this replica's own values (a group's members hold their group's)
        owner, owners = (self.group.owner, self.group.owners) if self.group is not None else (self.rank, world.size)
        self.hyper = Hyperparameters(cfg, owner, owners) if cfg.pbt.enabled else None
        if self.hyper is not None:
            self.hyper.apply(self.opt)
        if dp is not None:
            pc = cfg.privacy
            self.private = PrivateGradient(model, max_grad_norm=pc.max_grad_norm, noise_multiplier=dp.noise_multiplier,
                                           noise=pc.noise, seed=cfg.seed, rank=self.rank,
                                           poisson=pc.sampling == "poisson", per_example=pc.per_example)

    @property
    def told_loss(self) -> float:
        """The training loss partners are told (merge.rule loss; a group's: its members' mean); none under privacy,
        where it is not noised."""
        if self.dp is not None:
            return float("nan")
        return self.group.loss if self.group is not None else self.recent_loss

    @property
    def told_samples(self) -> int:
        """The samples partners are told (merge.rule clock): this replica's, or its group's in all."""
        return self.group.samples if self.group is not None else self.samples

    def group_mean(self, value: float) -> float:
        """The mean of ``value`` over this replica's group (itself without groups): what a group tells partners."""
        return value if self.group is None else self.group.mean(value)

    @property
    def epsilon(self) -> float:
        """This replica's epsilon so far at privacy.delta (Opacus's RDP accountant); nan without privacy."""
        if self.dp is None:
            return float("nan")
        return privacy.epsilon(self.dp.noise_multiplier, self.dp.sample_rate, self.dp_steps, self.cfg.privacy.delta)

    @classmethod
    def build(cls, cfg: "Config", world: WorldView, device: torch.device, timer: Timer, faults: NoFaults,
              *, groups: Optional["GroupWorld"] = None) -> "Replica":
        """Load and place the data, build the model and share rank 0's initial weights (with groups of
        ``train.group_size``, a group's own initial weights among its members)."""
        placed = load_replica_data(cfg, world, device)
        tracker, model, flat, n_params = on_every_rank(world, lambda: _build_model(cfg, world, device, placed))
        shapes = models.shape_signature(model)
        world.agree(protocol.digest(np.frombuffer(shapes.encode(), dtype=np.uint8)),
                    f"model parameter shapes and dtypes (this rank: {len(flat)} values)")
        if cfg.model.init == "shared":
            world.bcast_(flat)
        elif groups is not None:  # a group is one model: its lead's initial weights
            groups.intra.bcast_(flat, groups.lead_member)  # (GroupMember.share_initial, before the replica exists)
        vectorized = on_every_rank(world, lambda: _stacked(cfg, world, model, placed))
        placed_rows = block.onto_row(world, model, flat) if vectorized else None  # trained in place, as rows
        rows, flat = placed_rows if placed_rows is not None else (None, flat)
        dp = on_every_rank(world, lambda: _dp_plan(cfg, model, placed))
        if dp is not None and world.leads:
            _announce(cfg, dp)
        torch.manual_seed(cfg.seed * 104729 + world.rank)  # dropout and other stochastic layers
        return cls(cfg, world, device, timer=timer, faults=faults, placed=placed, model=model, flat=flat,
                   n_params=n_params, tracker=tracker, vectorized=vectorized, dp=dp, groups=groups, rows=rows)

    def adopt(self, ranks: List[int]) -> None:
        """comm.lost_shard adopt: train on the shards of lost ``ranks`` too (appended to this rank's own)."""
        self.data = self.data.adopt(ranks)

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
        if self.group is not None:  # a data-parallel group: its own average at every step, as many steps each
            grad_sync, steps = self.group.gradients(self.model), self.group.steps if steps is None else steps
        if self.vectorized:
            res = stacked.train_together(self, t, steps)
        with self.timer("train"):
            if not self.vectorized:
                x, y, rows = self.data.x, self.data.y, None
                if self.tracker is not None:
                    rows = self.tracker.training_rows(t)
                    x, y = self.tracker.view(rows)
                hook = _batch_hook(self.faults, t, between_batches)
                res = train.train_unit(self.model, self.opt, x, y, cfg.train, seed=cfg.seed, rank=self.rank, t=t,
                                       steps=steps, grad_sync=grad_sync, between_batches=hook, private=self.private)
                if self.tracker is not None and rows is not None:
                    self.tracker.trained(rows)
            self.faults.during_unit(t)
        self.faults.after_unit(t, self.flat)
        self.samples += res.samples
        self.dp_steps += res.steps if self.dp is not None else 0
        self.recent_loss = res.loss
        if t == 1 or not math.isfinite(self.first_loss):
            self.first_loss = res.loss
        weight_sum = float(self.flat.sum())
        if self.dp is None:
            diverged = robust.is_diverged(weight_sum, res.loss, self.first_loss, cfg.robust.loss_factor)
        else:  # the flag travels to partners, so under privacy it reads the weights only: the loss is not noised
            diverged = not math.isfinite(weight_sum)
        if self.group is not None:  # the group's figures; its members take their lead's buffers
            buffers = self.flat[self.n_params:] if self.n_params < self.flat.numel() else None
            diverged = self.group.unit_end(res.samples, res.loss, diverged, buffers)
        if not self.diverged and diverged:
            self.diverged = True
            log.warning(f"communities: rank {self.rank} diverged at t={t} (loss {res.loss:.4g}); it will not be "
                        f"merged into partners ({cfg.robust.diverged})")
        if self.tracker is not None:
            with self.timer("eval"):
                self.tracker.maybe_evaluate(self.model, t)
        test_acc = test_loss = local_acc = local_loss = float("nan")
        if t % cfg.train.eval_every == 0 or t == cfg.train.budget:
            m = cfg.train.eval_samples  # (None: the whole split)
            if self.vectorized:
                test_acc, test_loss = stacked.evaluate_together(self, t, m)
            with self.timer("eval"):
                if not self.vectorized:
                    test_acc, test_loss = train.evaluate(self.model, self.data.x_test[:m], self.data.y_test[:m])
                if self.has_local_test:
                    local_acc, local_loss = train.evaluate(self.model, self.data.x_local, self.data.y_local)
            self.test_acc, self.test_loss = test_acc, test_loss
        loss, acc = res.loss, res.accuracy
        if self.dp is not None and not cfg.privacy.report_train_loss:
            loss = acc = float("nan")  # not noised: kept on this replica (privacy.report_train_loss)
        return MetricRow(t, loss, acc, test_acc, test_loss, self.samples, self.world.bytes_sent,
                         self.timer.elapsed(), local_acc, local_loss, self.epsilon)

    def evaluate(self, flat: Optional[torch.Tensor] = None) -> Tuple[float, float]:
        """(accuracy, loss) on the shared test split, of these weights (default: this rank's own)."""
        return self.evaluate_on(self.data.x_test, self.data.y_test, flat)

    @property
    def has_local_test(self) -> bool:
        """Whether this run holds out local test data (data.local_test_fraction > 0)."""
        return self.cfg.data.local_test_fraction > 0

    def evaluate_local(self, flat: Optional[torch.Tensor] = None) -> Tuple[float, float]:
        """(accuracy, loss) on this rank's local test data (its own group's distribution), of these weights."""
        return self.evaluate_on(self.data.x_local, self.data.y_local, flat)

    def evaluate_on(self, x: torch.Tensor, y: torch.Tensor, flat: Optional[torch.Tensor] = None
                    ) -> Tuple[float, float]:
        """(accuracy, loss) on (x, y) of ``flat`` (default: this rank's own weights, left as they are)."""
        if flat is None:
            return train.evaluate(self.model, x, y)
        with self.holding(flat):
            return train.evaluate(self.model, x, y)

    def state_dict_of(self, flat: torch.Tensor) -> dict:
        """The model's ``state_dict`` (CPU copies) with ``flat`` as its weights."""
        with self.holding(flat):
            return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    @contextmanager
    def holding(self, weights: torch.Tensor, fresh_optimizer: bool = False) -> Iterator[None]:
        """The model holds ``weights`` inside the block, this rank's own again after it (an error too); with
        ``fresh_optimizer`` the optimizer starts the block with no state and gets its own back after it."""
        saved = self.flat.clone()
        saved_opt = copy.deepcopy(self.optimizer_state()) if fresh_optimizer else None
        self.flat.copy_(weights)
        if fresh_optimizer:
            self.opt.state.clear()
        try:
            yield
        finally:
            self.flat.copy_(saved)
            if saved_opt is not None:
                self.opt.load_state_dict(saved_opt)

    # ------------------------------------------------------------------ averages

    def set_outlier(self, outlier: bool) -> None:
        """robust.enabled: whether the latest signature round left this rank out of averages."""
        self.outlier = outlier

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

    def optimizer_state(self) -> dict:
        """The optimizer's state dict, its tensors this replica's own: trained as rows, its moments are views of
        the process's stacked ones, which a copy or a save would otherwise carry whole (block.py)."""
        state = self.opt.state_dict()
        return state if self.rows is None else block.compact_optimizer_state(state)

    def state_dict(self) -> dict:
        return {
            "flat": self.flat.detach().cpu().clone(),
            "optimizer": self.optimizer_state(),
            "torch_rng": torch.get_rng_state(),
            "outer_m": self.outer.m.detach().cpu().clone() if self.outer is not None else None,
            "anchor": self.anchor.detach().cpu().clone() if self.anchor is not None else None,
            "samples": self.samples, "recent_loss": self.recent_loss, "first_loss": self.first_loss,
            "test_acc": self.test_acc, "test_loss": self.test_loss, "diverged": self.diverged,
            "outlier": self.outlier, "dp_steps": self.dp_steps,
            "pbt": None if self.hyper is None else self.hyper.state_dict(),
            "examples": None if self.tracker is None else self.tracker.state_dict(),
            **({} if self.group is None else {"group": self.group.state_dict()}),
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
        self.dp_steps = int(state.get("dp_steps", 0))  # (checkpoints from before privacy existed)
        if self.hyper is not None:
            self.hyper.load_state_dict(state["pbt"], self.opt)
        if self.group is not None:
            self.group.load_state_dict(state["group"])
        if self.tracker is not None:
            if state["examples"] is None:
                raise ValueError("it has no example table, but examples.track is on")
            self.tracker.load_state_dict(state["examples"])


def _batch_hook(faults: NoFaults, t: int, serve: Optional[Callable[[], None]]) -> Optional[Callable[[int], None]]:
    """What runs between batches: an injected slowdown of this batch, then serving partners."""
    slow = faults.batch_hook(t)
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


def _stacked(cfg: "Config", world: WorldView, model: torch.nn.Module, placed: ReplicaData) -> bool:
    """train.vectorize: whether this process's replicas train as one stacked model (a ConfigError for ``on``
    where they cannot: what acts inside one replica's own batches, or a model vmap cannot stack)."""
    mode = cfg.train.vectorize
    if mode == "off":
        return False
    # (protocol async in a population serves between stacked units: the process's replicas train together; with
    # one replica per process it serves between batches. faults.speed and jitter slow a stacked unit as a whole.)
    population = world.processes < world.size
    inside = [key for key, on in (("examples.track", cfg.examples.track),
                                  ("protocol=async", cfg.protocol == "async" and not population),
                                  ("privacy.enabled", cfg.privacy.enabled),
                                  ("train.schedule or train.warmup", train.scheduled(cfg.train)),
                                  (f"data.dataset={cfg.data.dataset}", placed.dataset.sequence))
              if on]
    if inside:
        if mode == "on":
            raise ConfigError(f"train.vectorize=on cannot apply with {', '.join(inside)}: each acts inside one "
                              "replica's own batches (use train.vectorize: off or auto)")
        return False
    per = world.size // world.processes
    if per == 1 and stacked.group_size(cfg, world.size) > 1:  # every step is an Allreduce between processes
        if mode == "on":
            raise ConfigError("train.vectorize=on has nothing to stack with one replica per process and gradients "
                              "averaged at every step (strategy allreduce or train.group_size > 1): use auto or off")
        return False
    return world.shared(("vectorize",), lambda: vectorized.resolve_vectorize(
        mode, model, per, sample=(placed.x[:4], placed.y[:4]), name=cfg.model.name))


def _announce(cfg: "Config", dp: DPPlan) -> None:
    """Rank 0's start-up line on privacy: the noise, the sampling and the epsilon the budget plans."""
    pc = cfg.privacy
    log.info(f"communities: privacy: DP-SGD with noise multiplier {dp.noise_multiplier:.4g}, clipping "
             f"{pc.max_grad_norm:g}, {pc.sampling} sampling at q={dp.sample_rate:.4g} (rank 0); "
             f"{dp.planned_steps} steps plan epsilon {dp.planned_epsilon:.3g} at delta {pc.delta:g}")
    if pc.noise == "seeded":
        log.warning("communities: privacy.noise=seeded: the noise is keyed by the config's seed, so anyone "
                    "who knows the config can remove it; use privacy.noise=secret to protect data")


def _dp_plan(cfg: "Config", model: torch.nn.Module, placed: ReplicaData) -> Optional[DPPlan]:
    """privacy.enabled: this replica's sampling rate and noise (a ConfigError for what DP-SGD cannot train)."""
    pc = cfg.privacy
    if not pc.enabled:
        return None
    require_opacus()
    check_model(model, cfg.model.name, placed.x, placed.y, cfg.privacy.per_example)
    return plan(pc, cfg.train, len(placed.y), [s.indices.size for s in placed.shards],
                lockstep=cfg.strategy in SYNCS_GRADIENTS)


def _build_model(cfg: "Config", world: WorldView, device: torch.device, placed: ReplicaData
                 ) -> Tuple[Optional[ExampleTracker], torch.nn.Module, torch.Tensor, int]:
    """This rank's example tracker (examples.track), and its model as one flat buffer (not yet shared)."""
    ds = placed.dataset
    tracker = None
    if cfg.examples.track:
        tracker = ExampleTracker(cfg.examples, np.asarray(placed.shard.indices, dtype=np.int64),
                                 x_pool=ds.x_train, y_pool=ds.y_train, world=world.size, rank=world.rank,
                                 seed=cfg.seed, device=device, n_classes=ds.n_classes)
    torch.manual_seed(models.init_seed(cfg.seed, world.rank, cfg.model.init))
    model = models.build(cfg.model, ds.input_shape, ds.n_classes).to(device)
    models.check_output(model, placed.x_test[:4], ds.n_classes, cfg.model.name, ds.sequence)
    flat, n_params = models.flatten_(model)
    return tracker, model, flat, n_params
