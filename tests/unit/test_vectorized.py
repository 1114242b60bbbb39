"""Vectorized training (workload/vectorized.py) against the sequential path, a loop of train.train_unit.

Stated tolerance: max abs weight difference <= 1e-5 after three units (the batched kernels sum
in another order, so the two paths are equal within rounding, not bitwise).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from communities.errors import ConfigError
from communities.workload import models, train
from communities.workload import vectorized as vz

TOL = 1e-5
SIZES = [37, 50, 64, 11, 5]  # unequal shards: different numbers of batches, short last batches, one below batch 16


def _cfg(**kw):
    base = dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.0, betas=[0.9, 0.999],
                batch_size=16, unit="epoch", steps_per_unit=4)
    base.update(kw)
    return SimpleNamespace(**base)


def _data(sizes=SIZES, features=10, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, features, generator=g) for n in sizes]
    ys = [torch.randint(0, classes, (n,), generator=g) for n in sizes]
    return xs, ys


def _replicas(cfg, R, features=10, classes=3, model=None):
    """R sequential replicas (different initialisations) and a trainer over a stacked copy of their weights."""
    ms = []
    for r in range(R):
        torch.manual_seed(100 + r)
        ms.append(models.MLP(features, classes, (8,)) if model is None else model())
    opts = [train.make_optimizer(cfg, m.parameters()) for m in ms]
    flats = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in ms])
    return ms, opts, vz.StackedTrainer(ms[0], flats, cfg, name="mlp")


def _weights(ms):
    return torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in ms])


def _run(ms, opts, trainer, xs, ys, cfg, ranks, units, seed=3):
    for t in range(units):
        seq = [train.train_unit(m, o, x, y, cfg, seed=seed, rank=rk, t=t)
               for m, o, x, y, rk in zip(ms, opts, xs, ys, ranks)]
        vec = trainer.train_unit(xs, ys, ranks, seed, t)
        for a, b in zip(seq, vec):
            assert (a.samples, a.steps) == (b.samples, b.steps)
            assert b.loss == pytest.approx(a.loss, abs=TOL)
            assert b.accuracy == pytest.approx(a.accuracy, abs=0.05)


OPTIMIZERS = {
    "sgd_momentum": dict(optimizer="sgd", momentum=0.9),
    "sgd_nesterov_wd": dict(optimizer="sgd", momentum=0.8, nesterov=True, weight_decay=1e-2),
    "sgd_plain": dict(optimizer="sgd", momentum=0.0, lr=0.1),
    "adamw": dict(optimizer="adamw", lr=1e-2, weight_decay=1e-2),
}


@pytest.mark.parametrize("unit", ["epoch", "steps"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_equal_to_the_sequential_path(opt, unit):
    cfg = _cfg(unit=unit, **OPTIMIZERS[opt])
    xs, ys = _data()
    ms, opts, trainer = _replicas(cfg, len(SIZES))
    ranks = [4, 9, 2, 7, 0]  # logical ranks, not positions: each replica's own batch stream
    _run(ms, opts, trainer, xs, ys, cfg, ranks, units=3)
    assert float((_weights(ms) - trainer.flats).abs().max()) <= TOL


def test_written_into_the_replicas_buffers():
    """The stacked buffer's rows may be the replicas' own flat buffers: training updates them in place."""
    cfg = _cfg()
    xs, ys = _data()
    ms, opts, _ = _replicas(cfg, len(SIZES))
    before = _weights(ms)
    flats = before.clone()
    rows = [models.flatten_(m)[0] for m in ms]
    for r, m in enumerate(ms):  # every replica's model now lives in a row of one stacked tensor
        flats[r].copy_(rows[r])
        for p, v in zip(m.parameters(), _views(flats[r], m)):
            p.data = v
    trainer = vz.StackedTrainer(ms[0], flats, cfg)
    trainer.train_unit(xs, ys, list(range(len(SIZES))), 0, 0)
    assert not torch.equal(_weights(ms), before)
    assert torch.equal(_weights(ms), flats)


def _views(row, m):
    off = 0
    for p in m.parameters():
        yield row[off: off + p.numel()].view_as(p)
        off += p.numel()


@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw"])
def test_optimizer_state_converts_to_and_from_torch_optim(opt):
    cfg = _cfg(**OPTIMIZERS[opt])
    xs, ys = _data()
    R = len(SIZES)
    ms, opts, trainer = _replicas(cfg, R)
    empty = trainer.optimizer.optimizer_state_dict(0)
    assert empty["state"] == {} and empty["param_groups"][0]["lr"] == cfg.lr
    _run(ms, opts, trainer, xs, ys, cfg, list(range(R)), units=2)
    for r in range(R):
        ours, theirs = trainer.optimizer.optimizer_state_dict(r), opts[r].state_dict()
        assert ours["state"].keys() == theirs["state"].keys()
        for i in theirs["state"]:
            assert ours["state"][i].keys() == theirs["state"][i].keys()
            for k, v in theirs["state"][i].items():
                assert ours["state"][i][k].shape == v.shape and ours["state"][i][k].dtype == v.dtype
                assert torch.allclose(ours["state"][i][k], v, atol=1e-4), (r, i, k)
        assert ours["param_groups"] == theirs["param_groups"]
        # torch.optim accepts ours; a trainer accepts torch's
        o = train.make_optimizer(cfg, ms[r].parameters())
        o.load_state_dict(ours)
        trainer.optimizer.load_optimizer_state_dict(r, theirs)
    # round trip of the stacked form
    saved = trainer.optimizer.state_dict()
    _, _, other = _replicas(cfg, R)
    other.optimizer.load_state_dict(saved)
    for r in range(R):
        a, b = other.optimizer.optimizer_state_dict(r)["state"], trainer.optimizer.optimizer_state_dict(r)["state"]
        assert all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])


def test_reset_of_one_replica_matches_clearing_its_torch_state():
    """merge.optimizer_state: reset on one replica (opt.state.clear()) and keep on the others."""
    cfg = _cfg(optimizer="adamw", lr=1e-2)
    xs, ys = _data()
    R = len(SIZES)
    ms, opts, trainer = _replicas(cfg, R)
    _run(ms, opts, trainer, xs, ys, cfg, list(range(R)), units=2)
    opts[1].state.clear()
    trainer.optimizer.reset_state(1)
    assert trainer.optimizer.optimizer_state_dict(1)["state"] == {} and trainer.optimizer.state_tensors(1) == []
    assert len(trainer.optimizer.state_tensors(0)) == 2
    _run(ms, opts, trainer, xs, ys, cfg, list(range(R)), units=2)
    assert float((_weights(ms) - trainer.flats).abs().max()) <= TOL


def test_index_plan_pads_and_marks_missing_batches():
    plans = [[np.array([2, 0]), np.array([1])], [np.array([0, 1])]]
    idx, sizes = vz._index_plan(plans, [0, 3])
    assert idx.shape == (2, 2, 2)
    assert sizes.tolist() == [[2, 2], [1, 0]]
    assert idx[0].tolist() == [[2, 0], [3, 4]]
    assert idx[1, 0, 0] == 1 and idx[1, 1].tolist() == [3, 3]  # padding: the replica's first row


# --------------------------------------------------------------------------- refusals and the resolver


def test_batchnorm_is_refused_with_the_reason():
    m = models.MLP(10, 3, (8,), batchnorm=True)
    with pytest.raises(ConfigError, match=r"train\.vectorize.*BatchNorm running statistics"):
        vz.resolve_vectorize("on", m, 4)
    with pytest.raises(ConfigError, match="BatchNorm"):
        vz.StackedTrainer(m, torch.zeros(2, sum(p.numel() for p in m.parameters())), _cfg())
    assert vz.resolve_vectorize("auto", m, 4) is False


class NotVmappable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(10, 3)

    def forward(self, x):
        if float(x.sum()) > 1e9:  # data-dependent Python control flow: fails under vmap
            return x[:, :3]
        return self.fc(x)


def test_a_model_that_fails_under_vmap_is_refused_naming_it():
    cfg = _cfg()
    xs, ys = _data(sizes=[20, 20])
    _, _, trainer = _replicas(cfg, 2, model=NotVmappable)
    trainer.name = "mypkg:make_net"
    with pytest.raises(ConfigError, match=r"train\.vectorize.*'mypkg:make_net' fails under torch\.func\.vmap"):
        trainer.train_unit(xs, ys, [0, 1], 0, 0)


def test_the_resolver_dry_runs_a_sample():
    x, y = torch.randn(4, 10), torch.randint(0, 3, (4,))
    assert vz.resolve_vectorize("auto", NotVmappable(), 4, sample=(x, y)) is False
    with pytest.raises(ConfigError, match=r"'mypkg:f' fails under torch\.func\.vmap \(RuntimeError"):
        vz.resolve_vectorize("on", NotVmappable(), 4, sample=(x, y), name="mypkg:f")
    assert vz.resolve_vectorize("auto", models.MLP(10, 3, (8,)), 4, sample=(x, y)) is True


def test_dropout_is_trained_with_different_masks_but_auto_stays_sequential():
    m = models.MLP(10, 3, (8,), dropout=0.5)
    assert vz.resolve_vectorize("auto", m, 8) is False
    assert vz.resolve_vectorize("on", m, 8) is True
    cfg = _cfg()
    xs, ys = _data(sizes=[32, 32])
    flats = torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()])] * 2)
    trainer = vz.StackedTrainer(m, flats, cfg)
    assert trainer.randomness == "different"
    m.eval()  # as train.evaluate leaves a replica's model: training must still drop out
    torch.manual_seed(0)
    trainer.train_unit([xs[0], xs[0]], [ys[0], ys[0]], [0, 0], 0, 0)  # same data and batches, other masks
    assert not torch.equal(flats[0], flats[1])


def test_resolver_modes():
    m = models.MLP(10, 3, (8,))
    assert vz.resolve_vectorize("off", m, 64) is False
    assert vz.resolve_vectorize("auto", m, 1) is False
    assert vz.resolve_vectorize("auto", m, 2) is True
    assert vz.resolve_vectorize("on", m, 1) is True
    with pytest.raises(ConfigError, match=r"train\.vectorize='yes' is not one of off, on, auto"):
        vz.resolve_vectorize("yes", m, 2)


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_members_keep_their_own_weights_and_torch_optim_state(opt):
    """A population's step (train_members): each replica's own flat buffer and torch.optim state go in and come
    back, so that between units a replica looks exactly as the sequential path leaves it (within TOL)."""
    cfg = _cfg(**OPTIMIZERS[opt])
    xs, ys = _data()
    seq, seq_opts, _ = _replicas(cfg, len(SIZES))
    ms, opts, _ = _replicas(cfg, len(SIZES))
    flats = []
    for m in ms:  # bind each model's parameters to one flat buffer, as the engine's replicas hold them
        flat, _n = models.flatten_(m)
        flats.append(flat)
    trainer = vz.StackedTrainer(ms[0], torch.zeros(len(ms), flats[0].numel()), cfg, name="mlp")
    members = [vz.Member(m, o, f, x, y, r) for m, o, f, x, y, r in zip(ms, opts, flats, xs, ys, range(len(ms)))]
    for t in range(3):
        want = [train.train_unit(m, o, x, y, cfg, seed=3, rank=r, t=t) for m, o, x, y, r in zip(seq, seq_opts, xs, ys,
                                                                                     range(len(ms)))]
        got = vz.train_members(trainer, members, 3, t)
        assert [g.samples for g, _ in got] == [w.samples for w in want]
        if t == 1:  # a merge between units resets one replica's optimizer (merge.optimizer_state: reset)
            opts[2].state.clear()
            seq_opts[2].state.clear()
    assert float((torch.stack(flats) - _weights(seq)).abs().max()) <= TOL
    if cfg.optimizer == "sgd" and cfg.momentum == 0:
        assert all(not o.state for o in opts)
        return
    key = "momentum_buffer" if cfg.optimizer == "sgd" else "exp_avg"
    for o, so, m, sm in zip(opts, seq_opts, ms, seq):
        for p, sp in zip(m.parameters(), sm.parameters()):
            assert torch.allclose(o.state[p][key], so.state[sp][key], atol=TOL)
            if cfg.optimizer == "adamw":
                assert float(o.state[p]["step"]) == float(so.state[sp]["step"])


@pytest.mark.parametrize("model", ["mlp", "cnn1d"])
def test_stacked_evaluation_scores_each_replica_as_train_evaluate_does(model):
    """Every replica's (accuracy, loss) from the stacked evaluation equals train.evaluate's within float rounding,
    over chunks of replicas and batches of examples that do not divide the counts, and the model's mode is kept."""
    cfg = _cfg()
    if model == "mlp":
        ms, _, trainer = _replicas(cfg, 7)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(203, 10, generator=g), torch.randint(0, 3, (203,), generator=g)
    else:
        def make():
            return models.CNN1D(40, 10, 8)
        ms, _, trainer = _replicas(cfg, 7, model=make)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(203, 40, generator=g), torch.randint(0, 10, (203,), generator=g)
    flats = [torch.cat([_weights([m])[0], torch.full((3,), 7.0)]) for m in ms]  # a tail past the parameters
    trainer.model.train()
    got = trainer.evaluate(flats, x, y, batch_size=64, chunk=3)
    assert trainer.model.training
    want = [train.evaluate(m, x, y) for m in ms]
    assert len({round(a, 4) for a, _ in want}) > 1  # the replicas differ: a mix-up of rows would show
    for (acc, loss), (acc0, loss0) in zip(got, want):
        assert acc == pytest.approx(acc0, abs=1 / 203 + 1e-12)
        assert loss == pytest.approx(loss0, rel=1e-5)
