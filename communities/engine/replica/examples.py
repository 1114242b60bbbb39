"""The engine's side of data that moves: one rank's shard as an ``ExampleTable`` plus its tensors.

``example_table.ExampleTable`` holds the bookkeeping (confidence, status, visited
sets) as arrays; this class keeps the shard's features and labels aligned with
its rows, chooses what a unit trains on, evaluates confidence every E units,
and runs the hard-example hand-over with a partner as buffer Sendrecvs
(counts first, then two equal-size packets; nothing is unpickled, and a peer's
packet is validated by ``examples.unpack`` before it touches the shard).

Why hand-over (``examples.handover: true``) is the default: the data then moves
the way the models do, the total number of examples is conserved, and shard
sizes stay comparable; keeping copies instead makes every pass an
oversampling of hard examples and shards grow without bound.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Union

import numpy as np
import torch
import torch.nn.functional as F

from ...config import ExamplesConfig
from ...core import example_table, protocol
from ...runtime.comm import Tag


class ExampleTracker:
    """One rank's examples: ``table`` rows <-> ``x``/``y`` rows, plus the policies of ``cfg`` (ExamplesConfig)."""

    def __init__(self, cfg: ExamplesConfig, ids: np.ndarray, *, x_pool: np.ndarray, y_pool: np.ndarray, world: int,
                 rank: int, seed: int, device: Union[torch.device, str], n_classes: int):
        self.cfg, self.world, self.rank, self.seed = cfg, int(world), int(rank), int(seed)
        self.device, self.n_classes = device, int(n_classes)
        self.x_pool, self.y_pool = x_pool, y_pool  # the shared training pool: rebuilds a shard from its ids
        self.feature_shape = tuple(x_pool.shape[1:])
        self.feature_numel = int(np.prod(self.feature_shape, dtype=np.int64))
        self.table = example_table.ExampleTable(ids, y_pool[ids], self.world, visited=cfg.visited)
        self.bytes_per_example = example_table.example_bytes(self.feature_numel, self.world, cfg.visited)
        self.x: torch.Tensor  # this rank's examples, in table order (``_load_tensors``)
        self.y: torch.Tensor
        self._load_tensors()
        self.passed_out = self.passed_in = 0
        self.last_step: Dict[str, int] = {}

    def _load_tensors(self, x: Optional[np.ndarray] = None) -> None:
        ids = self.table.ids
        self.x = torch.as_tensor(np.ascontiguousarray(self.x_pool[ids] if x is None else x)).to(self.device)
        self.y = torch.as_tensor(self.table.labels.copy()).to(self.device)

    def __len__(self) -> int:
        return len(self.table)

    # ------------------------------------------------------------------ training and confidence

    def training_rows(self, t: int) -> np.ndarray:
        """Rows to train on in unit t: all of them, or ACTIVE plus a rho-sample of the reserve."""
        if not self.cfg.retire:
            return np.arange(len(self.table), dtype=np.int64)
        rows = self.table.training_rows(self.cfg.rho, protocol.rng(self.seed, protocol.Purpose.EX_TRAIN, t, self.rank))
        if rows.size == 0:  # everything retired or parked: train on the reserve rather than on nothing
            rows = np.flatnonzero(self.table.status != example_table.RETIRED)
            if rows.size == 0:
                rows = np.arange(len(self.table), dtype=np.int64)
        return rows

    def view(self, rows: np.ndarray):
        """(x, y) of these rows; the tensors themselves when the rows are all of them in order."""
        if rows.size == len(self.table):
            return self.x, self.y
        ix = torch.as_tensor(rows, device=self.x.device)
        return self.x[ix], self.y[ix]

    def trained(self, rows: np.ndarray) -> None:
        self.table.mark_visited(rows, self.rank)

    @torch.no_grad()
    def p_true(self, model: torch.nn.Module, rows: np.ndarray, batch: int = 1024) -> np.ndarray:
        """The model's probability of the true label for these rows (eval mode)."""
        was = model.training
        model.eval()
        out = []
        x_all, y_all = self.view(rows)
        try:
            for lo in range(0, rows.size, batch):
                x, y = x_all[lo: lo + batch], y_all[lo: lo + batch]
                p = F.softmax(model(x).double(), dim=1).gather(1, y.view(-1, 1)).view(-1)
                out.append(p.cpu().numpy())
        finally:
            model.train(was)
        return np.clip(np.concatenate(out) if out else np.zeros(0), 0.0, 1.0)

    def maybe_evaluate(self, model: torch.nn.Module, t: int) -> bool:
        """Every ``eval_every`` units: update the confidence EMA and, with retirement, take one step."""
        if t % self.cfg.eval_every:
            return False
        cfg = self.cfg
        if cfg.retire:
            rows = self.table.evaluation_rows(cfg.rho, protocol.rng(self.seed, protocol.Purpose.EX_EVAL, t, self.rank))
        else:
            rows = np.arange(len(self.table), dtype=np.int64)
        if rows.size:
            self.table.update_confidence(rows, self.p_true(model, rows), 1.0 - cfg.ema)
        if cfg.retire:
            self.last_step = self.table.step_retirement(cfg.tau_retire, cfg.patience, cfg.reserve_rounds, cfg.rho,
                                                        protocol.rng(self.seed, protocol.Purpose.EX_STEP, t, self.rank))
        return True

    # ------------------------------------------------------------------ hard-example passing

    def pass_count(self, partner: int, distance_factor: float) -> int:
        """How many rows this side offers ``partner``: fraction, count and byte caps, scaled by the policy."""
        cfg, table = self.cfg, self.table
        candidates = int(((table.status == example_table.ACTIVE) & np.isfinite(table.confidence)).sum())
        n = math.floor(cfg.pass_fraction * candidates * distance_factor)
        if cfg.pass_count is not None:
            n = min(n, int(math.floor(cfg.pass_count * distance_factor)))
        n = min(n, cfg.pass_max_bytes // self.bytes_per_example, max(0, candidates - 1))
        return max(0, int(n))

    def exchange(self, world, partner: int, distance_factor: float = 1.0) -> Dict[str, int]:
        """Swap hard examples with ``partner`` (both sides call it at the same point). Returns counts."""
        cfg, table = self.cfg, self.table
        n = self.pass_count(partner, distance_factor)
        rows = table.hardest(count=n, prefer=partner if cfg.pass_which == "unseen" else None)
        theirs = int(world.sendrecv_array(np.array([rows.size], dtype=np.int64), partner, tag=Tag.EXAMPLE_COUNT)[0])
        cap = cfg.pass_max_bytes // self.bytes_per_example
        if not 0 <= theirs <= min(cap, len(self.x_pool)):
            raise RuntimeError(f"rank {self.rank}: partner rank {partner} announced {theirs} examples, outside "
                               f"[0, {min(cap, len(self.x_pool))}] (examples.pass_max_bytes)")
        n_max = max(rows.size, theirs)
        if n_max == 0:
            return {"sent": 0, "received": 0}
        floats, ints = table.pack(rows, self.x, n_max=n_max)
        rf = world.sendrecv_array(floats, partner, tag=Tag.EXAMPLE_FLOATS)
        ri = world.sendrecv_array(ints, partner, tag=Tag.EXAMPLE_INTS)
        try:
            x_in, _, incoming = example_table.unpack(rf, ri, self.feature_shape, self.world, cfg.visited,
                                                n_total=len(self.x_pool), n_classes=self.n_classes)
        except ValueError as exc:
            raise RuntimeError(f"rank {self.rank}: bad example packet from rank {partner}: {exc}") from exc
        x_keep = self.x.cpu().numpy()
        if cfg.handover and rows.size:
            kept = table.remove(rows)
            x_keep = x_keep[kept]
        new = ~np.isin(incoming.ids, table.ids)  # keep-copy mode: an example may come back to a rank holding it
        if cfg.handover and not new.all():  # hand-over keeps every example on exactly one rank
            raise RuntimeError(f"rank {self.rank}: partner rank {partner} handed over examples this rank already "
                               f"holds (ids {incoming.ids[~new][:8].tolist()}): the shards overlap")
        if not new.all():
            incoming, x_in = incoming.take(np.flatnonzero(new)), x_in[new]
        table.append(incoming)
        self._load_tensors(np.concatenate([x_keep, x_in.astype(x_keep.dtype, copy=False)]))
        self.passed_out += int(rows.size)
        self.passed_in += int(new.sum())
        return {"sent": int(rows.size), "received": int(new.sum())}

    # ------------------------------------------------------------------ logs and checkpoints

    def stats(self) -> np.ndarray:
        """One float64 row for examples.jsonl: counts, forgetting events, passes and confidence quantiles."""
        c, q = self.table.counts(), self.table.quantiles()
        return np.array([c["active"], c["reserve"], c["retired"], c["total"], c["forgetting_events"],
                         self.passed_out, self.passed_in, q["q10"], q["q25"], q["q50"], q["q75"], q["q90"]],
                        dtype=np.float64)

    STATS_FIELDS = ("active", "reserve", "retired", "total", "forgetting_events", "passed_out", "passed_in",
                    "q10", "q25", "q50", "q75", "q90")

    def globally_hard(self) -> np.ndarray:
        """(ids, confidence) rows of examples every rank trained on and that are still below tau_hard."""
        rows = self.table.hard_rows(self.cfg.tau_hard)
        return np.stack([self.table.ids[rows].astype(np.float64),
                         self.table.confidence[rows].astype(np.float64)], axis=1).reshape(-1, 2)

    def state_dict(self) -> dict:
        return {"table": self.table.state_dict(), "passed_out": self.passed_out, "passed_in": self.passed_in}

    def load_state_dict(self, state: dict) -> None:
        self.table.load_state_dict(state["table"])
        self.passed_out, self.passed_in = int(state["passed_out"]), int(state["passed_in"])
        self._load_tensors()


def distance_factor(policy: str, d_ij: float, d_median: float) -> float:
    """Scale of the pass count for a pair at signature distance ``d_ij`` (the round's median ``d_median``).

    ``more_when_far``: d_ij / median, so dissimilar partners swap more (they
    disagree most on what is hard); ``more_when_near``: 2 - that, so similar
    partners swap more; both clipped to [0, 2]; ``none``: 1.
    """
    if policy == "none" or not (math.isfinite(d_ij) and math.isfinite(d_median)) or d_median <= 0:
        return 1.0
    r = d_ij / d_median
    return float(min(max(r if policy == "more_when_far" else 2.0 - r, 0.0), 2.0))
