"""Vectorized training: a process trains its replicas as one stacked model (``train.vectorize``).

The R replicas of one process share one architecture, so their weights stack
into one (R, P) buffer and one ``torch.func.vmap`` of ``grad_and_value`` over
``functional_call`` trains them all in a single forward and backward per step,
where the sequential path runs R small ones (the Python and dispatch overhead
of a small model dominates, not the arithmetic).

What stays exactly as on the sequential path (``train.train_unit``): each
replica draws its batches from ``train.batches`` with its own rank, so batch
contents match; the loss is the mean cross-entropy of each replica's batch; the
unit's loss, accuracy, samples and steps are reported the same way. Replicas
with different shard sizes take different numbers of batches in epoch mode and
their last batches are smaller: step k pads every batch to the largest and
masks the padding out of the loss, and a replica with no k-th batch is not
updated (its weights and optimizer state stay as they are). The optimizer is
SGD (momentum, Nesterov, weight decay) or AdamW computed as ``torch.optim``
computes them, on flat per-replica state, convertible to and from each
replica's ``torch.optim`` state dict (checkpoints, ``merge.optimizer_state``).
Per-replica hyperparameters (population-based training) come from each member's
optimizer ``param_groups`` (``train_members`` hands them to ``StackedOptimizer.set_rows``);
when they all equal the shared config, the scalar step runs, bitwise as before.

Equal within a tolerance, not bitwise: the batched kernels sum in another order
(tests pin max abs weight difference <= 1e-5 after a few units).

Refused, with a ``ConfigError`` naming ``train.vectorize``: a model with
buffers (BatchNorm running statistics would need per-replica stacking), and a
model whose forward fails under ``vmap`` (found by a dry run on one batch).
Dropout is supported with ``vmap(randomness="different")``: each replica gets
its own masks, but from another random stream than the sequential path draws,
so a model with dropout is equal in distribution only; ``auto`` therefore
leaves such a model on the sequential path.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from ..core import protocol
from ..core.groups import tree_sum_rows
from ..errors import ConfigError
from . import train

KEY = "train.vectorize"
MODES = ("off", "on", "auto")


# --------------------------------------------------------------------------- eligibility


def _has_dropout(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules())


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot be trained stacked (None: it can, subject to the dry run)."""
    buffers = [n for n, _ in model.named_buffers()]
    if buffers:
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            return (f"{type(model).__name__} has BatchNorm running statistics ({', '.join(buffers[:3])}"
                    f"{', ...' if len(buffers) > 3 else ''}): buffers cannot be stacked across replicas; "
                    "use model.batchnorm: false or train.vectorize: off")
        return (f"{type(model).__name__} has buffers ({', '.join(buffers[:3])}{', ...' if len(buffers) > 3 else ''})"
                ", which cannot be stacked across replicas; use train.vectorize: off")
    params = list(model.parameters())
    if not params:
        return f"{type(model).__name__} has no parameters"
    if len({p.dtype for p in params}) != 1:
        return f"{type(model).__name__} mixes parameter dtypes {sorted({str(p.dtype) for p in params})}"
    return None


def resolve_vectorize(mode: str, model: nn.Module, replicas_per_process: int,
                      sample: Optional[Tuple[torch.Tensor, torch.Tensor]] = None, name: Optional[str] = None) -> bool:
    """Whether to train stacked. ``on`` raises when the model cannot be; ``auto`` is on for >= 2 replicas per
    process and a model that qualifies without dropout (so that auto stays equal to the sequential path).

    With ``sample`` (a few training examples and their labels) the model also passes a dry run under
    ``vmap`` first: ``on`` raises if it fails, ``auto`` falls back to the sequential path.
    """
    if mode not in MODES:
        raise ConfigError(f"{KEY}={mode!r} is not one of {', '.join(MODES)}")
    if mode == "off" or (mode == "auto" and replicas_per_process < 2):
        return False
    reason = unsupported_reason(model)
    if mode == "auto" and (reason is not None or _has_dropout(model)):
        return False
    if reason is not None:
        raise ConfigError(f"{KEY}=on cannot apply: {reason}")
    if sample is not None:
        try:
            dry_run(model, sample[0], sample[1], name)
        except ConfigError:
            if mode == "on":
                raise
            return False
    return True


def dry_run(model: nn.Module, x: torch.Tensor, y: torch.Tensor, name: Optional[str] = None) -> None:
    """One stacked step of two copies of ``model`` on (x, y), on copies of its weights: ConfigError if it fails."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    cfg = SimpleNamespace(optimizer="sgd", lr=0.0, momentum=0.0, nesterov=False, weight_decay=0.0,
                          betas=[0.9, 0.999], batch_size=max(len(y), 1), unit="epoch", steps_per_unit=1)
    trainer = StackedTrainer(model, torch.stack([flat, flat]), cfg, name=name)
    mask = torch.ones(2, len(y), dtype=flat.dtype)
    trainer._dry_run(torch.stack([x, x]), torch.stack([y, y]), mask, mask.sum(1))


# --------------------------------------------------------------------------- the stacked trainer


class StackedTrainer:
    """Trains R replicas of ``model`` whose weights are the rows of ``flats`` (R, F), in place.

    ``flats[:, :n_params]`` are the parameters in ``model.parameters()`` order, as
    ``models.flatten_`` lays them out (the rows may be views of the replicas' own
    flat buffers: a stacked (R, F) tensor whose rows the replicas hold). ``cfg`` is
    a TrainConfig (optimizer, lr, momentum, nesterov, weight_decay, betas,
    batch_size, unit, steps_per_unit).
    """

    def __init__(self, model: nn.Module, flats: torch.Tensor, cfg: Any, *, name: Optional[str] = None):
        self.name = name or type(model).__name__
        reason = unsupported_reason(model)
        if reason is not None:
            raise ConfigError(f"{KEY}: cannot train model {self.name!r} stacked: {reason}")
        if flats.ndim != 2 or not flats.is_contiguous():
            raise ConfigError(f"{KEY}: the stacked weights must be one contiguous (replicas, size) tensor, got shape "
                              f"{tuple(flats.shape)}")
        self.model, self.flats, self.cfg = model, flats, cfg
        self.R = flats.shape[0]
        self.names: List[str] = []
        self.shapes: List[Tuple[int, ...]] = []
        self.offsets: List[int] = []
        off = 0
        for n, p in model.named_parameters():
            self.names.append(n)
            self.shapes.append(tuple(p.shape))
            self.offsets.append(off)
            off += p.numel()
        self.n_params = off
        if flats.shape[1] < off:
            raise ConfigError(f"{KEY}: the stacked weights have {flats.shape[1]} columns, the model {off} parameters")
        self.randomness = "different" if _has_dropout(model) else "error"
        self.optimizer = StackedOptimizer(model, flats, cfg, names=self.names, shapes=self.shapes,
                                          offsets=self.offsets)
        self._checked = False
        self._cache: Optional[Tuple[Tuple[int, ...], torch.Tensor, torch.Tensor, List[int]]] = None
        self._keep: Tuple[List[torch.Tensor], List[torch.Tensor]] = ([], [])
        self._step_fn = self._build_step()
        self._params = self.params()  # views stay bound: every update is in place

    # ------------------------------------------------------------------ the vmapped step

    def params(self) -> Dict[str, torch.Tensor]:
        """Per-parameter stacked views (R, *shape) of the flat buffer: no copies."""
        return {n: self.flats[:, o: o + int(np.prod(s, dtype=np.int64))].view(self.R, *s)
                for n, s, o in zip(self.names, self.shapes, self.offsets)}

    @torch.no_grad()
    def evaluate(self, weights: Sequence[torch.Tensor], x: torch.Tensor, y: torch.Tensor, batch_size: int = 512,
                 chunk: int = 32) -> List[Tuple[float, float]]:
        """(accuracy, mean cross-entropy) on (x, y) of each of ``weights`` (flat buffers whose first ``n_params``
        values are the parameters), as ``train.evaluate`` gives one by one: a process's replicas scored as one
        stacked model, ``chunk`` replicas and ``batch_size`` examples at a time (about chunk x batch_size
        activations held). Equal to the one-by-one path within float rounding: the stacked convolutions and
        matrix products sum in another order, so a loss may differ in its last bits and an example whose top two
        logits tie within that rounding may flip (the tests bound both)."""
        n, P = len(y), self.n_params
        out: List[Tuple[float, float]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            fn = vmap(lambda params, xb: functional_call(self.model, params, (xb,)), in_dims=(0, None),
                      randomness="same")
            for lo in range(0, len(weights), chunk):
                part = weights[lo: lo + chunk]
                own = self.flats[lo: lo + len(part)]
                # a process's replicas re-homed into the trainer's rows are scored there, without a stacked copy
                rows = own if own.shape[1] == P and are_rows(own, part) else torch.stack([w[:P] for w in part])
                params = {k: rows[:, o: o + int(np.prod(s, dtype=np.int64))].view(len(rows), *s)
                          for k, s, o in zip(self.names, self.shapes, self.offsets)}
                loss = torch.zeros(len(rows), dtype=torch.float64)
                correct = torch.zeros(len(rows), dtype=torch.int64)
                for b in range(0, n, batch_size):
                    logits = fn(params, x[b: b + batch_size])  # (replicas, batch, classes)
                    yb = y[b: b + batch_size]
                    ce = -logits.log_softmax(-1).gather(2, yb.expand(len(rows), -1)[:, :, None]).squeeze(2)
                    loss += ce.sum(1).double()
                    correct += (logits.argmax(2) == yb).sum(1)
                m = max(n, 1)
                out += [(int(c) / m, float(v) / m) for c, v in zip(correct, loss)]
        finally:
            self.model.train(was_training)
        return out

    def _build_step(self) -> Tuple[Callable, Callable]:
        """(full, masked): a step on equal batches (the mean, as train.train_unit), and on padded ones."""
        model = self.model

        # cross-entropy as log_softmax and a gather: the same loss as F.cross_entropy, whose nll_loss
        # decomposes under vmap into several more ops (about 15% of a step on the quickstart MLP)
        def loss_full(params, xb, yb):
            out = functional_call(model, params, (xb,))
            return -out.log_softmax(-1).gather(1, yb[:, None]).mean(), out

        def loss_masked(params, xb, yb, mask, count):
            out = functional_call(model, params, (xb,))
            ce = -out.log_softmax(-1).gather(1, yb[:, None]).squeeze(1)
            return (ce * mask).sum() / count, out

        return (vmap(grad_and_value(loss_full, has_aux=True), randomness=self.randomness),
                vmap(grad_and_value(loss_masked, has_aux=True), randomness=self.randomness))

    def _dry_run(self, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                params = {k: v.detach().clone() for k, v in self.params().items()}
            self._step_fn[1](params, xb, yb, mask, count)
        except Exception as exc:  # the user's forward() under vmap
            raise ConfigError(f"{KEY}: model {self.name!r} fails under torch.func.vmap ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); use train.vectorize: off") from exc
        self._checked = True

    # ------------------------------------------------------------------ data

    def _stacked_data(self, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]):
        """All shards concatenated once (kept while the same tensors come back), with each one's offset."""
        key = tuple(id(x) for x in xs) + tuple(id(y) for y in ys)
        if self._cache is None or self._cache[0] != key:
            offs = [0]
            for y in ys:
                offs.append(offs[-1] + len(y))
            self._cache = (key, torch.cat(list(xs)), torch.cat(list(ys)), offs)
            self._keep = (list(xs), list(ys))  # ids stay valid while the tensors live
        return self._cache[1], self._cache[2], self._cache[3]

    # ------------------------------------------------------------------ training

    def train_unit(self, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], ranks: Sequence[int], seed: int,
                   t: int, *, steps: Optional[int] = None, group_size: int = 1,
                   across: Optional[Callable[[torch.Tensor], Any]] = None) -> List[train.UnitResult]:
        """Train unit t of every replica r on (xs[r], ys[r]) with the batches of rank ranks[r].

        ``group_size`` G > 1 (data-parallel groups, or strategy allreduce: one group of every replica): every G
        consecutive rows average their gradients at every step (a pairwise tree in row order, as the members' own
        Allreduce adds them), so they take the same steps. A group larger than these R rows spans processes: the
        rows' sum goes through ``across`` (an in-place sum over the group's processes) before the division."""
        R, cfg = self.R, self.cfg
        if not (len(xs) == len(ys) == len(ranks) == R):
            raise ValueError(f"train_unit needs {R} shards and ranks, got {len(xs)}, {len(ys)}, {len(ranks)}")
        local = min(group_size, R)  # the members of a group among these rows
        if R % local or group_size % local or (group_size > R and across is None):
            raise ValueError(f"{R} replicas do not form groups of {group_size}"
                             + (" (a group across processes needs their sum: across)" if group_size > R else ""))
        if steps is None and cfg.unit == "steps":
            steps = cfg.steps_per_unit
        X, Y, offs = self._stacked_data(xs, ys)
        dev = self.flats.device
        self.model.train()  # as train.train_unit does: the template may have been left in eval mode by a score
        keyed = protocol.Rekeyed()  # each replica's shuffle consumed at once: one generator re-keyed, the same draws
        plans = [list(train.batches(len(ys[r]), cfg.batch_size, seed, int(ranks[r]), t, steps=steps, keyed=keyed))
                 for r in range(R)]
        idx, sizes = _index_plan(plans, offs)  # (K, R, B) rows of X, (K, R) batch sizes
        K, B = idx.shape[0], idx.shape[2]
        total_loss = torch.zeros(R, dtype=torch.float64, device=dev)
        correct = torch.zeros(R, dtype=torch.int64, device=dev)
        if K and B:
            ix = torch.as_tensor(idx, device=dev)
            size_t = torch.as_tensor(sizes, device=dev)
            masks = (torch.arange(B, device=dev)[None, None, :] < size_t[:, :, None])
            maskf = masks.to(self.flats.dtype)
            counts = size_t.clamp(min=1).to(self.flats.dtype)
            for k in range(K):
                b = int(sizes[k].max())  # this step's largest batch: pad to it, not to B
                rows, mask, maskf_k = ix[k, :, :b], masks[k, :, :b], maskf[k, :, :b]
                xb, yb = X[rows], Y[rows]
                if not self._checked:
                    self._dry_run(xb, yb, maskf_k, counts[k])
                if bool((sizes[k] == b).all()):
                    grads, (loss, out) = self._step_fn[0](self._params, xb, yb)
                else:
                    grads, (loss, out) = self._step_fn[1](self._params, xb, yb, maskf_k, counts[k])
                g = torch.cat([grads[n].reshape(R, -1) for n in self.names], dim=1)
                if group_size > 1:  # each group's mean gradient, the same for all its members
                    summed = tree_sum_rows(g, local)
                    if group_size > R:
                        assert across is not None
                        across(summed)
                    g = (summed / group_size).repeat_interleave(local, dim=0)
                active = None if bool((sizes[k] > 0).all()) else size_t[k] > 0
                with torch.no_grad():
                    self.optimizer.update(g, active)
                    total_loss += loss.double() * size_t[k]
                    correct += ((out.argmax(-1) == yb) & mask).sum(1)
        seen = sizes.sum(0) if K else np.zeros(R, dtype=np.int64)
        n_steps = (sizes > 0).sum(0) if K else np.zeros(R, dtype=np.int64)
        return [train.UnitResult(lo / max(n, 1), c / max(n, 1), n, k) for lo, c, n, k in
                zip(total_loss.tolist(), correct.tolist(), seen.tolist(), n_steps.tolist())]

class StackedOptimizer:
    """SGD (momentum, Nesterov, weight decay) or AdamW on the rows of a ``StackedTrainer``'s weights, as
    ``torch.optim`` computes them for each replica: flat (R, P) moments, each row convertible to and from the
    replica's own ``torch.optim`` state dict, and per-replica hyperparameters (``set_rows``)."""

    def __init__(self, model: nn.Module, flats: torch.Tensor, cfg: Any, *, names: List[str],
                 shapes: List[Tuple[int, ...]], offsets: List[int]):
        if cfg.optimizer not in ("sgd", "adamw"):
            raise ConfigError(f"train.optimizer={cfg.optimizer!r} is not one of sgd, adamw")
        self.flats, self.cfg = flats, cfg
        self.names, self.shapes, self.offsets = names, shapes, offsets
        self.R = flats.shape[0]
        self.n_params = sum(int(np.prod(sh, dtype=np.int64)) for sh in shapes)
        # torch.optim's param_groups, for state dicts in its own format
        self._groups = train.make_optimizer(cfg, [p.detach().clone() for p in model.parameters()]
                                            ).state_dict()["param_groups"]
        R, P, dt, dev = self.R, self.n_params, flats.dtype, flats.device
        self.has_state = torch.zeros(R, dtype=torch.bool, device=dev)  # False: torch.optim's empty state
        self.momentum = torch.zeros(R, P, dtype=dt, device=dev)  # SGD momentum_buffer / AdamW exp_avg
        self.second = torch.zeros(R, P, dtype=dt, device=dev) if cfg.optimizer == "adamw" else None  # exp_avg_sq
        self.step = torch.zeros(R, dtype=torch.float64, device=dev)  # AdamW step count
        self._rows: Optional[_Rows] = None  # per-replica hyperparameters (set_rows); None: the cfg scalars

    def set_rows(self, groups: Optional[Sequence[Mapping[str, Any]]]) -> bool:
        """Each replica's own hyperparameters, one torch.optim param group (or a dict with its keys) per row:
        'lr', 'momentum', 'nesterov' and 'weight_decay' for SGD, 'lr', 'weight_decay' and 'betas' for AdamW (a
        missing key: the cfg's value). Until the next call, every step uses them. When every row equals the cfg
        (or ``groups`` is None) the scalar step runs, bitwise as without this call; returns whether rows differ."""
        self._rows = None
        if groups is None:
            return False
        if len(groups) != self.R:
            raise ValueError(f"set_rows needs {self.R} param groups, got {len(groups)}")
        cfg = self.cfg
        base = _hyper(cfg.optimizer, {}, cfg)
        rows = [_hyper(cfg.optimizer, gr, cfg) for gr in groups]
        if all(r == base for r in rows):
            return False
        dev = self.flats.device
        lr, mom, wd, b1, b2 = (torch.tensor([r[i] for r in rows], dtype=torch.float64, device=dev) for i in range(5))
        self._rows = _Rows(lr=lr, momentum=mom, weight_decay=wd, beta1=b1, beta2=b2,
                           nesterov=torch.tensor([bool(r[5]) for r in rows], dtype=torch.bool, device=dev),
                           groups=[{k: v for k, v in gr.items() if k != "params"} for gr in groups])
        return True

    def row_momentum(self, r: int) -> float:
        """Replica r's SGD momentum (the cfg's, or its own after set_rows)."""
        return float(self.cfg.momentum) if self._rows is None else float(self._rows.momentum[r])

    def update(self, g: torch.Tensor, active: Optional[torch.Tensor]) -> None:
        """One step of every active replica, as torch.optim computes it; inactive rows are left untouched."""
        if self._rows is not None:
            self._update_rows(g, active, self._rows)
            return
        cfg, w = self.cfg, self.flats[:, : self.n_params]
        if cfg.optimizer == "sgd":
            if cfg.weight_decay != 0:
                g = g.add(w, alpha=cfg.weight_decay)
            if cfg.momentum != 0 and active is None and bool(self.has_state.all()):
                self.momentum.mul_(cfg.momentum).add_(g)
                g = g.add(self.momentum, alpha=cfg.momentum) if cfg.nesterov else self.momentum
                w.add_(g, alpha=-cfg.lr)
                return
            if cfg.momentum != 0:
                fresh = ~self.has_state if active is None else (~self.has_state & active)
                buf = torch.where(fresh[:, None], g, self.momentum * cfg.momentum + g)
                self._put(self.momentum, buf, active)
                self._set_has(active)
                g = g.add(self.momentum, alpha=cfg.momentum) if (cfg.nesterov and cfg.momentum > 0) else self.momentum
            self._put(w, w - cfg.lr * g, active)
            return
        assert self.second is not None
        beta1, beta2 = (float(b) for b in cfg.betas)
        eps = float(self._groups[0]["eps"])
        step = self._adamw_count(active)
        bc1 = 1 - beta1 ** step
        bc2_sqrt = (1 - beta2 ** step).sqrt()
        step_size = (cfg.lr / bc1).to(w.dtype)[:, None]
        new_w = w * (1 - cfg.lr * cfg.weight_decay) if cfg.weight_decay != 0 else w
        m = self.momentum.lerp(g, 1 - beta1)
        v = self.second * beta2 + g * g * (1 - beta2)
        denom = (v.sqrt() / bc2_sqrt.to(w.dtype)[:, None]).add_(eps)
        new_w = new_w - step_size * (m / denom)
        self._put(self.momentum, m, active)
        self._put(self.second, v, active)
        self._put(w, new_w, active)

    def _update_rows(self, g: torch.Tensor, active: Optional[torch.Tensor], rows: "_Rows") -> None:
        """``update`` with each row's own hyperparameters, (R, 1) columns: what torch.optim computes
        for each replica with its own param group (within float rounding)."""
        w = self.flats[:, : self.n_params]
        dt = w.dtype
        lr, wd = rows.lr.to(dt)[:, None], rows.weight_decay.to(dt)[:, None]
        act = torch.ones(self.R, dtype=torch.bool, device=w.device) if active is None else active
        if self.cfg.optimizer == "sgd":
            g = g + wd * w  # a row without weight decay adds 0 * w: g unchanged
            mom = rows.momentum.to(dt)[:, None]
            uses = rows.momentum != 0  # torch keeps no buffer (nor touches one) where momentum is 0: the step is g
            fresh = ~self.has_state
            buf = torch.where(fresh[:, None], g, self.momentum * mom + g)
            upd = act & uses
            self.momentum.copy_(torch.where(upd[:, None], buf, self.momentum))
            self.has_state |= upd
            d = torch.where(rows.nesterov[:, None], g + mom * buf, buf)
            d = torch.where(uses[:, None], d, g)
            self._put(w, w - lr * d, active)
            return
        assert self.second is not None
        eps = float(self._groups[0]["eps"])
        step = self._adamw_count(active)
        bc1 = 1 - rows.beta1.pow(step)
        bc2_sqrt = (1 - rows.beta2.pow(step)).sqrt()
        step_size = (rows.lr / bc1).to(dt)[:, None]
        decay = (1 - rows.lr * rows.weight_decay).to(dt)[:, None]
        new_w = w * decay
        m = self.momentum.lerp(g, (1 - rows.beta1).to(dt)[:, None])
        b2 = rows.beta2.to(dt)[:, None]
        v = self.second * b2 + g * g * (1 - rows.beta2).to(dt)[:, None]
        denom = (v.sqrt() / bc2_sqrt.to(dt)[:, None]).add_(eps)
        new_w = new_w - step_size * (m / denom)
        self._put(self.momentum, m, active)
        self._put(self.second, v, active)
        self._put(w, new_w, active)

    def _adamw_count(self, active: Optional[torch.Tensor]) -> torch.Tensor:
        """AdamW's bookkeeping before a step: rows without state start from zero moments and step 0, every active
        row counts one more step; returns each row's step count (at least 1, for the bias corrections)."""
        assert self.second is not None
        act = torch.ones(self.R, dtype=torch.bool, device=self.step.device) if active is None else active
        self.momentum[~self.has_state] = 0
        self.second[~self.has_state] = 0
        self.step[~self.has_state] = 0
        self.step += act.double()
        self._set_has(active)
        return self.step.clamp(min=1)

    @staticmethod
    def _put(dst: torch.Tensor, src: torch.Tensor, active: Optional[torch.Tensor]) -> None:
        if active is None:
            dst.copy_(src)
        else:
            dst.copy_(torch.where(active[:, None], src, dst))

    def _set_has(self, active: Optional[torch.Tensor]) -> None:
        if active is None:
            self.has_state.fill_(True)
        else:
            self.has_state |= active

    # ------------------------------------------------------------------ optimizer state

    def reset_state(self, r: Optional[int] = None) -> None:
        """Forget replica r's optimizer state (all replicas' with None): ``merge.optimizer_state: reset``."""
        if r is None:
            self.has_state.fill_(False)
        else:
            self.has_state[r] = False

    def state_tensors(self, r: int) -> List[torch.Tensor]:
        """Replica r's moment rows (views), empty without state: what ``merge.optimizer_state: average`` lerps."""
        if not bool(self.has_state[r]) or (self.cfg.optimizer == "sgd" and self.row_momentum(r) == 0):
            return []
        rows = [self.momentum[r]]
        if self.second is not None:
            rows.append(self.second[r])
        return rows

    def optimizer_state_dict(self, r: int) -> Dict[str, Any]:
        """Replica r's optimizer state as ``torch.optim`` (SGD or AdamW over ``model.parameters()``) saves it."""
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        if bool(self.has_state[r]) and not (self.cfg.optimizer == "sgd" and self.row_momentum(r) == 0):
            for i, (s, o) in enumerate(zip(self.shapes, self.offsets)):
                n = int(np.prod(s, dtype=np.int64))
                if self.cfg.optimizer == "sgd":
                    state[i] = {"momentum_buffer": self.momentum[r, o: o + n].view(s).clone()}
                else:
                    assert self.second is not None
                    state[i] = {"step": torch.tensor(float(self.step[r]), dtype=torch.float32),
                                "exp_avg": self.momentum[r, o: o + n].view(s).clone(),
                                "exp_avg_sq": self.second[r, o: o + n].view(s).clone()}
        own = {} if self._rows is None else self._rows.groups[r]
        groups = [dict(g, **own, params=list(range(len(self.names)))) for g in self._groups]
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, r: int, sd: Dict[str, Any]) -> None:
        """Replica r's state from a ``torch.optim`` state dict (SGD or AdamW over ``model.parameters()``)."""
        state = sd["state"]
        if not state:
            self.has_state[r] = False
            return
        key = "momentum_buffer" if self.cfg.optimizer == "sgd" else "exp_avg"
        for i, o in enumerate(self.offsets):
            st = state.get(i, state.get(str(i)))
            if st is None or st.get(key) is None:
                raise ConfigError(f"{KEY}: the optimizer state has no {key!r} for parameter {self.names[i]}")
            n = st[key].numel()
            self.momentum[r, o: o + n].copy_(st[key].reshape(-1))
            if self.second is not None:
                self.second[r, o: o + n].copy_(st["exp_avg_sq"].reshape(-1))
                self.step[r] = float(st["step"])
        self.has_state[r] = True

    def state_dict(self) -> Dict[str, Any]:
        """Every replica's optimizer state, stacked (a checkpoint of this optimizer)."""
        return {"has_state": self.has_state.clone(), "momentum": self.momentum.clone(), "step": self.step.clone(),
                "second": None if self.second is None else self.second.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.has_state.copy_(state["has_state"])
        self.momentum.copy_(state["momentum"])
        self.step.copy_(state["step"])
        if self.second is not None:
            self.second.copy_(state["second"])



@dataclass
class _Rows:
    """Per-replica hyperparameters (float64 (R,) columns; SGD rows carry betas, AdamW rows momentum, unused)."""

    lr: torch.Tensor
    momentum: torch.Tensor
    weight_decay: torch.Tensor
    beta1: torch.Tensor
    beta2: torch.Tensor
    nesterov: torch.Tensor  # bool
    groups: List[Dict[str, Any]]  # the param groups as given, less 'params' (optimizer_state_dict reports them)


def _hyper(optimizer: str, group: Mapping[str, Any], cfg: Any) -> Tuple[float, float, float, float, float, bool]:
    """(lr, momentum, weight_decay, beta1, beta2, nesterov) of one param group as ``optimizer`` uses them (a missing
    key: the cfg's value): the keys the other optimizer ignores are fixed, and Nesterov counts only with momentum."""
    lr = float(group.get("lr", cfg.lr))
    wd = float(group.get("weight_decay", cfg.weight_decay))
    if optimizer == "sgd":
        mom = float(group.get("momentum", cfg.momentum))
        nesterov = bool(group.get("nesterov", cfg.nesterov)) and mom != 0
        return lr, mom, wd, 0.0, 0.0, nesterov
    b1, b2 = (float(b) for b in group.get("betas", cfg.betas))
    return lr, 0.0, wd, b1, b2, False


def _index_plan(plans: List[List[np.ndarray]], offs: List[int]) -> Tuple[np.ndarray, np.ndarray]:
    """Every replica's batches of the unit as one (K, R, B) array of rows into the concatenated shards.

    K is the most batches any replica takes, B the largest batch; a shorter batch is padded with
    the replica's first row (masked out of the loss), a missing one has size 0 (no update).
    """
    R = len(plans)
    K = max((len(p) for p in plans), default=0)
    B = max((len(b) for p in plans for b in p), default=0)
    idx = np.zeros((K, R, B), dtype=np.int64)
    sizes = np.zeros((K, R), dtype=np.int64)
    for r, plan in enumerate(plans):
        idx[:, r, :] = offs[r]
        if not plan:
            continue
        lens = np.fromiter((len(b) for b in plan), dtype=np.int64, count=len(plan))
        sizes[: len(plan), r] = lens
        rows = np.concatenate(plan) + offs[r]
        first = np.repeat(np.cumsum(lens) - lens, lens)
        col = np.arange(len(rows)) - first
        kk = np.repeat(np.arange(len(plan)), lens)
        idx[kk, r, col] = rows
    return idx, sizes


# --------------------------------------------------------------------------- benchmark


def benchmark(replicas: Sequence[int] = (64, 256), units: int = 3, shard_size: Optional[int] = 168,
              hidden: Sequence[int] = (64,), batch_size: int = 32, *, seed: int = 0,
              threads: int = 1) -> List[Dict[str, float]]:
    """Replica-units per second, the sequential loop vs stacked, on digits with the quickstart MLP (SGD momentum).

    Each replica trains one epoch per unit on its own ``shard_size`` training images
    (168 by default: the quickstart's shard, 1347 images over 8 ranks; None: the
    training set split into R shards). Both paths run side by side in this process,
    after one warm-up unit each, from the same initial weights; returns one dict per R.
    """
    from . import data, models

    torch.set_num_threads(threads)
    ds = data.load_digits(0.25, seed)
    data.standardize_(ds, ds.x_train.mean(axis=0), ds.x_train.std(axis=0))  # as the engine does (data.standardize)
    cfg = SimpleNamespace(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.0, betas=[0.9, 0.999],
                          batch_size=batch_size, unit="epoch", steps_per_unit=10)
    x_all, y_all = torch.as_tensor(ds.x_train), torch.as_tensor(ds.y_train)
    n_classes = int(y_all.max()) + 1
    out = []
    for R in replicas:
        if shard_size is None:
            shards = [torch.as_tensor(s.indices) for s in data.partition(ds.y_train, R, "iid", seed)]
        else:
            rng = np.random.default_rng([seed, R])
            shards = [torch.as_tensor(np.sort(rng.choice(len(y_all), min(shard_size, len(y_all)), replace=False)))
                      for _ in range(R)]
        xs, ys = [x_all[s] for s in shards], [y_all[s] for s in shards]
        torch.manual_seed(seed)
        template = models.MLP(x_all.shape[1], n_classes, hidden)
        ms = []
        for _ in range(R):
            m = models.MLP(x_all.shape[1], n_classes, hidden)
            m.load_state_dict(template.state_dict())
            ms.append(m)
        opts = [train.make_optimizer(cfg, m.parameters()) for m in ms]
        flats = torch.stack([torch.cat([p.detach().reshape(-1) for p in template.parameters()])] * R)
        trainer = StackedTrainer(template, flats, cfg, name="mlp")
        ranks = list(range(R))
        seq = vec = 0.0
        for t in range(units + 1):  # unit 0 warms both paths up (and runs the dry run)
            t0 = time.perf_counter()
            for r in ranks:
                train.train_unit(ms[r], opts[r], xs[r], ys[r], cfg, seed=seed, rank=r, t=t)
            t1 = time.perf_counter()
            trainer.train_unit(xs, ys, ranks, seed, t)
            t2 = time.perf_counter()
            if t:
                seq, vec = seq + t1 - t0, vec + t2 - t1
        ref = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in ms])
        copied, in_place, same = _population_paths(template, xs, ys, cfg, units=units, seed=seed)
        out.append({"replicas": R, "units": units, "shard_size": int(np.mean([len(y) for y in ys])),
                    "sequential_rps": R * units / seq, "vectorized_rps": R * units / vec, "speedup": seq / vec,
                    "max_abs_diff": float((ref - flats).abs().max()),
                    "population_copy_rps": R * units / copied, "population_rows_rps": R * units / in_place,
                    "rows_equal_copy": same})
    return out


def _population_paths(template: nn.Module, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], cfg: Any, *,
                      units: int, seed: int) -> Tuple[float, float, bool]:
    """The engine's stacked unit (``train_members``) with each replica's weights and torch.optim state in buffers of
    its own (copied in and back: the engine before replicas were rows) and as rows of one block (in place): the
    seconds of each over ``units`` timed units (interleaved, after a warm-up), and whether their weights are equal."""
    from . import models

    R = len(xs)
    paths = []
    for rows in (False, True):
        block = torch.zeros(R, sum(p.numel() for p in template.parameters()))
        members = []
        for r in range(R):
            m = copy.deepcopy(template)
            flat, _ = models.flatten_(m, out=block[r] if rows else None)
            members.append(Member(m, train.make_optimizer(cfg, m.parameters()), flat, xs[r], ys[r], r))
        trainer = StackedTrainer(template, block if rows else torch.zeros_like(block), cfg, name="mlp")
        paths.append((trainer, members))
    spent = [0.0, 0.0]
    for t in range(units + 1):
        for i, (trainer, members) in enumerate(paths):
            t0 = time.perf_counter()
            train_members(trainer, members, seed, t)
            spent[i] += (time.perf_counter() - t0) if t else 0.0
    same = all(torch.equal(a.flat, b.flat) for a, b in zip(paths[0][1], paths[1][1]))
    return spent[0], spent[1], same


# --------------------------------------------------------------------------- replicas that keep their own state


@dataclass
class Member:
    """One replica's part in a stacked unit: its model and optimizer (whose state it keeps), weights and shard."""

    model: nn.Module
    opt: torch.optim.Optimizer
    flat: torch.Tensor  # the replica's flat buffer; its first ``n_params`` values are the parameters
    x: torch.Tensor
    y: torch.Tensor
    rank: int


def train_members(trainer: StackedTrainer, members: Sequence[Member], seed: int, t: int,
                  steps: Optional[int] = None, *, group_size: int = 1,
                  across: Optional[Callable[[torch.Tensor], Any]] = None) -> List[Tuple[train.UnitResult, float]]:
    """Unit t of every member as one stacked model. Where the members' flat buffers are the trainer's rows, in
    order (``are_rows``: a process's replicas re-homed into one block), the step trains them in place and each
    member's optimizer moments become views of its rows of the stacked moments: nothing is copied in or back.
    Otherwise their weights and optimizer states are copied in, trained, and copied back into each member's own
    buffers. Either way a checkpoint, a merge or an exchange sees them as always.

    Each member's hyperparameters are its optimizer's ``param_groups[0]`` (``StackedOptimizer.set_rows``): equal to
    the trainer's cfg, the scalar step runs; otherwise every row steps with its own.
    Returns each member's (result, its share of the seconds the stacked step took).
    """
    start = time.perf_counter()
    n = trainer.n_params
    in_place = are_rows(trainer.flats, [m.flat for m in members])
    trainer.optimizer.set_rows([m.opt.param_groups[0] for m in members])  # each member's own lr, momentum, ... (PBT)
    with torch.no_grad():
        for r, m in enumerate(members):
            if not in_place:
                trainer.flats[r].copy_(m.flat[:n])
            _state_in(trainer.optimizer, r, m)
    results = trainer.train_unit([m.x for m in members], [m.y for m in members], [m.rank for m in members],
                                 seed, t, steps=steps, group_size=group_size, across=across)
    with torch.no_grad():
        for r, m in enumerate(members):
            if not in_place:
                m.flat[:n].copy_(trainer.flats[r])
            _state_out(trainer.optimizer, r, m, bind=in_place)
    share = (time.perf_counter() - start) / max(len(members), 1)
    return [(res, share) for res in results]


def are_rows(stacked: torch.Tensor, flats: Sequence[torch.Tensor]) -> bool:
    """Whether ``flats`` are the rows of ``stacked`` (R, F), in order, each whole: then a stacked step on
    ``stacked`` is a step on them, with nothing to copy."""
    if stacked.ndim != 2 or len(flats) != stacked.shape[0]:
        return False
    return all(f.numel() == stacked.shape[1] and f.is_contiguous() and f.data_ptr() == stacked[r].data_ptr()
               for r, f in enumerate(flats))


def _state_in(stacked: StackedOptimizer, r: int, m: Member) -> None:
    """Member r's torch.optim state into the stacked rows (none yet: its first step starts it, as torch's); a
    moment that already is a view of its row (``_state_out`` with ``bind``) is not copied."""
    sgd = stacked.cfg.optimizer == "sgd"
    params = list(m.model.parameters())
    states = [m.opt.state.get(p) for p in params]
    if not all(states) or (sgd and any(s.get("momentum_buffer") is None for s in states)):  # type: ignore[union-attr]
        stacked.has_state[r] = False
        return
    for st, o, p in zip(states, stacked.offsets, params):
        k = p.numel()
        assert st is not None
        for key, dst in _moments(stacked, sgd).items():
            row = dst[r, o: o + k]
            if st[key].data_ptr() != row.data_ptr():
                row.copy_(st[key].reshape(-1))
        if not sgd:
            stacked.step[r] = float(st["step"])
    stacked.has_state[r] = True


def _state_out(stacked: StackedOptimizer, r: int, m: Member, *, bind: bool = False) -> None:
    """The stacked optimizer's rows back into member r's torch.optim state, in torch's own keys and types: as
    copies, or (``bind``: the member's weights are the trainer's rows) as views of its rows, copied no more."""
    if not bool(stacked.has_state[r]):
        return
    sgd = stacked.cfg.optimizer == "sgd"
    if sgd and stacked.row_momentum(r) == 0:  # torch keeps (and touches) no buffer without momentum
        return
    for p, o in zip(m.model.parameters(), stacked.offsets):
        k = p.numel()
        st = m.opt.state[p]
        for key, src in _moments(stacked, sgd).items():
            value = src[r, o: o + k].view_as(p)
            if bind:
                st[key] = value
            elif st.get(key) is None:
                st[key] = value.clone()
            else:
                st[key].copy_(value)
        if not sgd:
            st["step"] = torch.tensor(float(stacked.step[r]), dtype=torch.float32)


def _moments(stacked: StackedOptimizer, sgd: bool) -> Dict[str, torch.Tensor]:
    """The stacked moments under torch.optim's keys."""
    if sgd:
        return {"momentum_buffer": stacked.momentum}
    assert stacked.second is not None
    return {"exp_avg": stacked.momentum, "exp_avg_sq": stacked.second}
