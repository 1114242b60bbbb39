"""Per-replica hyperparameters on the stacked path (population-based training): each member's optimizer
param_groups give its own lr, momentum, weight decay and betas, and the stacked step computes what its own
torch.optim optimizer computes (max abs weight difference <= 1e-5, as tests/unit/test_vectorized.py states).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from communities.workload import models, train
from communities.workload import vectorized as vz

TOL = 1e-5
SIZES = [37, 50, 11, 5]  # unequal shards: some replicas sit out the later steps (the active mask)

# per replica: replica 1 has lr 0 (its weights must stay exactly as they are)
ROWS = {
    "sgd": [dict(lr=0.05, momentum=0.9, weight_decay=0.0), dict(lr=0.0, momentum=0.5, weight_decay=1e-2),
            dict(lr=0.1, momentum=0.0, weight_decay=1e-3), dict(lr=0.02, momentum=0.7, weight_decay=0.0)],
    "sgd_nesterov": [dict(lr=0.05, momentum=0.9, weight_decay=1e-2), dict(lr=0.0, momentum=0.0, weight_decay=0.0),
                     dict(lr=0.1, momentum=0.0, weight_decay=0.0), dict(lr=0.02, momentum=0.5, weight_decay=1e-3)],
    "adamw": [dict(lr=1e-2, betas=(0.9, 0.999), weight_decay=1e-2), dict(lr=0.0, betas=(0.8, 0.99), weight_decay=0.1),
              dict(lr=3e-3, betas=(0.5, 0.9), weight_decay=0.0), dict(lr=1e-2, betas=(0.95, 0.999), weight_decay=0.0)],
}
# a PBT "explore" between units: new values, momentum switched on and off
EXPLORE = {
    "sgd": [dict(lr=0.03, momentum=0.0), dict(lr=0.0, momentum=0.9), dict(lr=0.1, momentum=0.8), dict(lr=0.02)],
    "sgd_nesterov": [dict(momentum=0.0), dict(lr=0.0, momentum=0.9), dict(lr=0.05, momentum=0.6), dict(lr=0.04)],
    "adamw": [dict(lr=5e-3, betas=(0.8, 0.99)), dict(lr=0.0), dict(lr=1e-2, betas=(0.9, 0.999)), dict()],
}
CFGS = {
    "sgd": dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.0),
    "sgd_nesterov": dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "adamw": dict(optimizer="adamw", lr=1e-2, momentum=0.0, nesterov=False, weight_decay=1e-2),
}


def _cfg(kind):
    return SimpleNamespace(**CFGS[kind], betas=[0.9, 0.999], batch_size=16, unit="epoch", steps_per_unit=4)


def _data():
    g = torch.Generator().manual_seed(0)
    return ([torch.randn(n, 10, generator=g) for n in SIZES], [torch.randint(0, 3, (n,), generator=g) for n in SIZES])


def _set(opt, values):
    for group in opt.param_groups:
        group.update(values)


def _weights(ms):
    return torch.stack([torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in ms])


def _population(cfg):
    ms = []
    for r in range(len(SIZES)):
        torch.manual_seed(100 + r)
        ms.append(models.MLP(10, 3, (8,)))
    return ms, [train.make_optimizer(cfg, m.parameters()) for m in ms]


@pytest.mark.parametrize("kind", list(ROWS))
def test_each_member_steps_with_its_own_param_groups(kind):
    cfg = _cfg(kind)
    xs, ys = _data()
    seq, seq_opts = _population(cfg)
    ms, opts = _population(cfg)
    flats = [models.flatten_(m)[0] for m in ms]
    trainer = vz.StackedTrainer(ms[0], torch.zeros(len(ms), flats[0].numel()), cfg, name="mlp")
    members = [vz.Member(m, o, f, x, y, r) for r, (m, o, f, x, y) in enumerate(zip(ms, opts, flats, xs, ys))]
    for o, so, values in zip(opts, seq_opts, ROWS[kind]):
        _set(o, values)
        _set(so, values)
    before = flats[1].clone()
    for t in range(2):
        if t == 1:
            for o, so, values in zip(opts, seq_opts, EXPLORE[kind]):
                _set(o, values)
                _set(so, values)
        want = [train.train_unit(m, o, x, y, cfg, seed=3, rank=r, t=t)
                for r, (m, o, x, y) in enumerate(zip(seq, seq_opts, xs, ys))]
        got = vz.train_members(trainer, members, 3, t)
        assert trainer.optimizer._rows is not None  # the per-row step ran
        for (g, _), w in zip(got, want):
            assert (g.samples, g.steps) == (w.samples, w.steps)
            assert g.loss == pytest.approx(w.loss, abs=TOL)
        assert float((torch.stack(flats) - _weights(seq)).abs().max()) <= TOL
    assert torch.equal(flats[1], before)  # lr 0: not one bit moved
    key = "momentum_buffer" if cfg.optimizer == "sgd" else "exp_avg"
    for o, so, m, sm in zip(opts, seq_opts, ms, seq):
        for p, sp in zip(m.parameters(), sm.parameters()):
            assert (o.state[p].get(key) is None) == (so.state[sp].get(key) is None)
            if so.state[sp].get(key) is not None:
                assert torch.allclose(o.state[p][key], so.state[sp][key], atol=TOL)
            if cfg.optimizer == "adamw":
                assert torch.allclose(o.state[p]["exp_avg_sq"], so.state[sp]["exp_avg_sq"], atol=TOL)
                assert float(o.state[p]["step"]) == float(so.state[sp]["step"])


@pytest.mark.parametrize("kind", list(ROWS))
def test_members_equal_to_the_cfg_keep_the_scalar_step(kind):
    """Unchanged param groups (or ones equal to the cfg) select the scalar step: bitwise as a plain train_unit."""
    cfg = _cfg(kind)
    xs, ys = _data()
    ms, opts = _population(cfg)
    flats = [models.flatten_(m)[0] for m in ms]
    ref = vz.StackedTrainer(ms[0], torch.stack(flats).clone(), cfg, name="mlp")
    trainer = vz.StackedTrainer(ms[0], torch.zeros(len(ms), flats[0].numel()), cfg, name="mlp")
    members = [vz.Member(m, o, f, x, y, r) for r, (m, o, f, x, y) in enumerate(zip(ms, opts, flats, xs, ys))]
    for t in range(2):
        ref.train_unit(xs, ys, list(range(len(ms))), 3, t)
        vz.train_members(trainer, members, 3, t)
        assert trainer.optimizer._rows is None
        assert torch.equal(torch.stack(flats), ref.flats)
    assert not trainer.optimizer.set_rows([dict(cfg.__dict__)] * len(ms))  # a dict with the cfg's values: no rows
    assert trainer.optimizer.set_rows([dict(lr=cfg.lr * 2)] + [{}] * (len(ms) - 1))
    with pytest.raises(ValueError):
        trainer.optimizer.set_rows([{}])
