"""DP-SGD (privacy.enabled): clipping bounds every example's gradient, the noise has the configured scale, the
accounting is Opacus's, noiseless unclipped DP-SGD is the plain step bit for bit, and what would break the guarantee
is refused by name."""
from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from communities import config as config_mod
from communities.core import privacy
from communities.errors import ConfigError
from communities.workload import train
from communities.workload.private import PrivateGradient, check_model, per_example_method, refuse_model

opacus = pytest.importorskip("opacus")


def _model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 3))


def _batch(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


def _per_example_grads(model: nn.Module, x, y) -> torch.Tensor:
    """Each example's gradient by its own backward: the reference the vmap pass must match."""
    rows = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i: i + 1]), y[i: i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return torch.stack(rows)


def _grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("per_example", ["vmap", "hooks", "ghost"])
@pytest.mark.parametrize("max_norm", [0.05, 0.5, 1e6])
def test_clipping_bounds_every_example_and_the_step_is_their_clipped_mean(max_norm, per_example):
    model = _model()
    x, y = _batch(24)
    g = _per_example_grads(model, x, y)
    norms = g.double().norm(dim=1)
    dp = PrivateGradient(model, max_grad_norm=max_norm, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                         per_example=per_example)
    assert torch.allclose(dp.norms(x, y), norms, rtol=1e-5)  # the per-example norms are the exact ones
    factors = privacy.clip_factors(norms, max_norm)
    clipped = g.double() * factors[:, None]
    assert bool((clipped.norm(dim=1) <= max_norm * (1 + 1e-9)).all())
    if max_norm < 1:
        assert bool((factors < 1).any())  # the bound binds for some examples in this case
    else:
        assert bool((factors == 1).all())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dp.backward(x, y, float(len(y)), opt, dp.generator(0), set_to_none=True)
    assert torch.allclose(_grad(model).double(), clipped.sum(0) / len(y), atol=1e-6)


def test_noise_has_the_configured_scale_and_is_keyed_under_seeded_noise():
    model = _model(width=2000)  # about 24,000 coordinates: the sample standard deviation is within 2%
    sigma, c, denom = 1.3, 0.7, 10.0
    dp = PrivateGradient(model, max_grad_norm=c, noise_multiplier=sigma, noise="seeded", seed=3, rank=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    empty_x, empty_y = torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64)
    dp.backward(empty_x, empty_y, denom, opt, dp.generator(7), set_to_none=True)  # an empty Poisson batch
    noise = _grad(model).double()
    assert float(noise.std()) == pytest.approx(sigma * c / denom, rel=0.02)
    assert abs(float(noise.mean())) < 4 * sigma * c / denom / math.sqrt(noise.numel())
    dp.backward(empty_x, empty_y, denom, opt, dp.generator(7), set_to_none=True)
    assert torch.equal(_grad(model).double(), noise)  # seeded: keyed by (seed, unit, replica)
    dp.backward(empty_x, empty_y, denom, opt, dp.generator(8), set_to_none=True)
    assert not torch.equal(_grad(model).double(), noise)
    secret = [PrivateGradient(model, max_grad_norm=c, noise_multiplier=sigma, noise="secret", seed=3, rank=5)
              for _ in range(2)]
    draws = [torch.randn(4, generator=s.generator(7)) for s in secret]
    assert not torch.equal(*draws)  # secret: seeded from the OS, not the config


@settings(max_examples=25, deadline=None)
@given(sigma=st.floats(0.3, 5.0), q=st.floats(0.001, 0.5), steps=st.integers(1, 5000),
       delta=st.sampled_from([1e-5, 1e-6, 1e-3]))
def test_epsilon_equals_opacus_rdp_accountant(sigma, q, steps, delta):
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(sigma, q, steps)]
    assert privacy.epsilon(sigma, q, steps, delta) == pytest.approx(acc.get_epsilon(delta), rel=1e-12)


def test_epsilon_edges_and_derived_noise_meets_its_target():
    assert privacy.epsilon(1.0, 0.1, 0, 1e-5) == 0.0
    assert privacy.epsilon(0.0, 0.1, 3, 1e-5) == math.inf
    sigma = privacy.noise_for_epsilon(3.0, 1e-5, 0.02, 2000)
    eps = privacy.epsilon(sigma, 0.02, 2000, 1e-5)
    assert 2.95 <= eps <= 3.0
    assert privacy.epsilon(sigma * 0.9, 0.02, 2000, 1e-5) > 3.0  # less noise would overspend


@pytest.mark.parametrize("per_example", ["vmap", "hooks", "ghost"])
@pytest.mark.parametrize("conv", [False, True])
def test_noiseless_unclipped_dp_sgd_is_the_plain_step_bit_for_bit(per_example, conv):
    x, y = _batch(100, seed=4)
    build = _conv_model if conv else _model

    class Cfg:
        lr, batch_size, unit, steps_per_unit = 0.05, 16, "epoch", 10

    results = []
    for private in (False, True):
        model = build(seed=9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        dp = PrivateGradient(model, max_grad_norm=1e9, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                             poisson=False, per_example=per_example) if private else None
        res = [train.train_unit(model, opt, x, y, Cfg, seed=0, rank=1, t=t, private=dp) for t in (1, 2, 3)]
        results.append((torch.cat([p.detach().reshape(-1) for p in model.parameters()]), res))
    (wa, ra), (wb, rb) = results
    assert torch.equal(wa, wb)
    assert [(r.loss, r.accuracy, r.steps) for r in ra] == [(r.loss, r.accuracy, r.steps) for r in rb]


def test_poisson_batches_sample_each_example_at_rate_q_and_are_keyed():
    n, b = 400, 20
    sizes = [len(ix) for t in range(50) for ix in train.batches(n, b, seed=1, rank=2, t=t, steps=None, poisson=True)]
    assert len(sizes) == 50 * 20  # an epoch's worth of steps: n / batch size
    assert np.mean(sizes) == pytest.approx(b, rel=0.05)
    assert np.std(sizes) > 1  # sizes vary, as Poisson sampling must
    again = [list(ix) for ix in train.batches(n, b, seed=1, rank=2, t=3, steps=5, poisson=True)]
    assert again == [list(ix) for ix in train.batches(n, b, seed=1, rank=2, t=3, steps=5, poisson=True)]


def _cfg(*overrides: str):
    return config_mod.load("configs/mnist1d.yaml", list(overrides))


@pytest.mark.parametrize("overrides, key", [
    (["examples.track=true", "examples.pass_hard=true"], "examples.pass_hard"),
    (["examples.track=true"], "examples.track"),
    (["signature.kind=cka"], "signature.kind"),
    (["signature.kind=logits"], "signature.kind"),
    (["strategy=ifca"], "strategy='ifca'"),
    (["merge.rule=loss"], "merge.rule='loss'"),
    (["model.batchnorm=true"], "model.batchnorm"),
    (["model.dropout=0.1", "model.name=mlp"], "model.dropout"),
    (["comm.fault_tolerance=shrink", "comm.lost_shard=adopt"], "comm.lost_shard"),
])
def test_combinations_that_break_the_guarantee_are_refused_by_name(overrides, key):
    with pytest.raises(ConfigError, match="privacy.enabled=true is refused with") as err:
        _cfg("privacy.enabled=true", "privacy.epsilon=8", *overrides)
    assert key in str(err.value)


def test_noise_settings_are_checked():
    with pytest.raises(ConfigError, match="neither is set"):
        _cfg("privacy.enabled=true")
    with pytest.raises(ConfigError, match="both are set"):
        _cfg("privacy.enabled=true", "privacy.epsilon=8", "privacy.noise_multiplier=1")
    with pytest.raises(ConfigError, match="privacy.epsilon has no effect"):
        _cfg("privacy.epsilon=8")
    with pytest.raises(ConfigError, match="privacy.delta"):
        _cfg("privacy.enabled=true", "privacy.epsilon=8", "privacy.delta=1.5")
    assert _cfg("privacy.enabled=true", "privacy.noise_multiplier=0").privacy.noise_multiplier == 0


class _Scale(nn.Module):
    """A layer Opacus has no per-example gradient for."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w


def test_auto_picks_ghost_where_opacus_takes_every_layer_and_vmap_for_the_rest():
    assert per_example_method(_model()) == "ghost"
    conv = nn.Sequential(nn.Conv1d(1, 4, 3), nn.Flatten(), nn.Linear(24, 3))
    assert per_example_method(conv) == "ghost"
    assert per_example_method(nn.Sequential(nn.Linear(8, 3), _Scale())) == "vmap"


def _conv_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Unflatten(1, (1, 8)), nn.Conv1d(1, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16, 3))


def _opacus_clipped_mean(build, x, y, max_norm: float, denom: float) -> torch.Tensor:
    """Opacus's own step, noiseless: GradSampleModule, DPOptimizer's clipping, its sum over the expected batch."""
    import warnings

    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = GradSampleModule(build())
        opt = DPOptimizer(torch.optim.SGD(module.parameters(), lr=0.0), noise_multiplier=0.0,
                          max_grad_norm=max_norm, expected_batch_size=int(denom))
        F.cross_entropy(module(x), y).backward()
        opt.pre_step()  # clip, accumulate, (no) noise, scale by the expected batch size
    return torch.cat([p.grad.reshape(-1) for p in module.parameters()])


@pytest.mark.parametrize("per_example", ["vmap", "hooks", "ghost"])
@pytest.mark.parametrize("conv", [False, True])
@pytest.mark.parametrize("max_norm, denom", [(0.05, 24), (0.3, 30)])
def test_every_method_gives_opacus_clipped_gradient_within_rounding(per_example, conv, max_norm, denom):
    """The clipped sum of each method equals Opacus's own (whose factor is C / (||g|| + 1e-6): a relative
    1e-6 / ||g|| from ours), also over an expected batch size that is not the batch's (Poisson sampling),
    and into gradients that are not set to None (a data-parallel group binds them to one buffer)."""
    build = _conv_model if conv else _model
    x, y = _batch(24, seed=5)
    theirs = _opacus_clipped_mean(build, x, y, max_norm, denom)
    for set_to_none in (True, False):
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        dp = PrivateGradient(model, max_grad_norm=max_norm, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                             per_example=per_example)
        if not set_to_none:
            for p in model.parameters():
                p.grad = torch.full_like(p, 7.0)  # stale: must be cleared, not added to
        held = [p.grad for p in model.parameters()]
        dp.backward(x, y, float(denom), opt, dp.generator(0), set_to_none=set_to_none)
        mine = _grad(model)
        assert float((mine - theirs).abs().max()) <= 2e-6 * float(theirs.abs().max())
        if not set_to_none:
            assert all(p.grad is h for p, h in zip(model.parameters(), held))
        assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in model.parameters())


@pytest.mark.parametrize("layer", [nn.BatchNorm1d(4), nn.Dropout(0.2), nn.LayerNorm(4)])
def test_user_models_with_batch_norm_or_dropout_are_refused(layer):
    model = nn.Sequential(nn.Linear(8, 4), layer, nn.Linear(4, 3))
    if isinstance(layer, nn.LayerNorm):  # per-example: allowed
        refuse_model(model, "pkg:net")
        return
    with pytest.raises(ConfigError, match="privacy.enabled=true cannot train model.name='pkg:net'"):
        refuse_model(model, "pkg:net")


def test_an_unreachable_epsilon_says_so():
    with pytest.raises(ValueError, match="no noise keeps 100000 steps at sampling rate 1 within epsilon 0.01"):
        privacy.noise_for_epsilon(0.01, 1e-5, 1.0, 100000)


def test_a_missing_opacus_is_a_config_error_that_says_how_to_install_it(monkeypatch):
    import sys

    from communities.workload.private import require_opacus

    monkeypatch.setitem(sys.modules, "opacus", None)  # import opacus now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '.\[privacy\]'"):
        require_opacus()


def test_the_plan_counts_the_steps_units_take_and_names_an_unreachable_epsilon():
    from communities.workload.private import plan

    cfg = _cfg("privacy.enabled=true", "privacy.epsilon=8", "train.budget=10")  # epoch units, batch 50
    own = plan(cfg.privacy, cfg.train, 480, [480, 520], lockstep=False)
    assert own.sample_rate == 50 / 480 and own.planned_steps == 10 * 10  # round(480 / 50) Poisson steps
    lock = plan(cfg.privacy, cfg.train, 480, [480, 520], lockstep=True)
    assert lock.planned_steps == 10 * 11  # allreduce: the longest shard's epoch, as the mixer steps
    assert lock.noise_multiplier > own.noise_multiplier and 7.9 <= lock.planned_epsilon <= 8.0
    tight = _cfg("privacy.enabled=true", "privacy.epsilon=0.001", "train.budget=10")
    with pytest.raises(ConfigError, match="privacy.epsilon=0.001: no noise keeps"):
        plan(tight.privacy, tight.train, 480, [480], lockstep=False)


def test_ghost_takes_the_layers_opacus_samples_and_names_a_shared_layer_at_start_up():
    def normed():
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 3))

    x, y = _batch(20, seed=6)
    theirs = _opacus_clipped_mean(normed, x, y, 0.1, 20)
    model = normed()
    dp = PrivateGradient(model, max_grad_norm=0.1, noise_multiplier=0.0, noise="seeded", seed=0, rank=0)
    assert dp.per_example == "ghost"
    dp.backward(x, y, 20.0, torch.optim.SGD(model.parameters(), lr=0.1), dp.generator(0), set_to_none=True)
    assert float((_grad(model) - theirs).abs().max()) <= 2e-6 * float(theirs.abs().max())

    class Shared(nn.Module):  # one Linear called twice: no layer's per-example gradient is one sample
        def __init__(self):
            super().__init__()
            self.a, self.head = nn.Linear(8, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.a(torch.relu(self.a(x))))

    with pytest.raises(ConfigError, match="privacy.per_example"):
        check_model(Shared(), "pkg:shared", x, y, "auto")


def _builtin(name: str):
    """The bench's models (``communities bench privacy``): the MLP of 4,810 parameters, the MNIST-1D CNN of 5,210."""
    from communities.config import ModelConfig
    from communities.workload import models

    shape = (64,) if name == "mlp" else (40,)

    def build():
        torch.manual_seed(0)
        return models.build(ModelConfig.model_validate({"name": name, "hidden": [64]}), shape, 10)
    return build, shape[0]


@pytest.mark.parametrize("name", ["mlp", "cnn1d"])
@pytest.mark.parametrize("batch", [16, 64])
@pytest.mark.parametrize("quantile", [0.25, 0.75])
def test_the_builtin_models_clipped_gradient_is_opacus_when_some_bounds_bind(name, batch, quantile):
    """Ghost norms and book-keeping (and the other methods) against Opacus's own step on the bench's models, at a
    bound that binds for some examples and not for others."""
    build, features = _builtin(name)
    g = torch.Generator().manual_seed(batch)
    x, y = torch.randn(batch, features, generator=g) * 2, torch.randint(0, 10, (batch,), generator=g)
    model = build()
    probe = PrivateGradient(model, max_grad_norm=1.0, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                            per_example="ghost")
    norms = probe.norms(x, y)
    max_norm = float(norms.quantile(quantile))
    binds = privacy.clip_factors(norms, max_norm) < 1
    assert 0 < int(binds.sum()) < batch  # some examples are clipped, some are not
    theirs = _opacus_clipped_mean(build, x, y, max_norm, batch)
    for per_example in ("ghost", "hooks", "vmap"):
        model = build()
        dp = PrivateGradient(model, max_grad_norm=max_norm, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                             per_example=per_example)
        dp.backward(x, y, float(batch), torch.optim.SGD(model.parameters(), lr=0.1), dp.generator(0),
                    set_to_none=True)
        assert float((_grad(model) - theirs).abs().max()) <= 2e-6 * float(theirs.abs().max()), per_example


def _conv_net(seed: int = 0, **conv) -> nn.Module:
    """Two channels of 4 into 4 channels of 4 (padding 1), a linear head."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Unflatten(1, (2, 4)), nn.Conv1d(2, 4, 3, padding=1, **conv), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16, 3))


def _clipped(model: nn.Module, x, y, max_norm: float, per_example: str) -> torch.Tensor:
    dp = PrivateGradient(model, max_grad_norm=max_norm, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                         per_example=per_example)
    dp.backward(x, y, float(len(y)), torch.optim.SGD(model.parameters(), lr=0.1), dp.generator(0), set_to_none=True)
    return _grad(model)


def test_ghost_takes_what_opacus_gets_wrong_falls_back_for_grouped_convolutions_and_refuses_the_rest():
    x, y = _batch(20, seed=7)
    # a Conv1d that pads circularly: ghost's unfolded windows are right, Opacus's sampler pads with zeros
    circular = dict(padding_mode="circular")
    want = _clipped(_conv_net(**circular), x, y, 0.3, "vmap")
    assert float((_clipped(_conv_net(**circular), x, y, 0.3, "ghost") - want).abs().max()) <= 2e-6 * float(
        want.abs().max())
    with pytest.raises(ConfigError, match="privacy.per_example=hooks.*pad with zeros"):
        check_model(_conv_net(**circular), "pkg:circular", x, y, "hooks")
    # a grouped Conv1d: Opacus's grad sampler inside ghost, as Opacus's own step
    grouped = dict(groups=2)
    build = functools.partial(_conv_net, **grouped)
    theirs = _opacus_clipped_mean(build, x, y, 0.3, 20)
    assert per_example_method(build()) == "ghost"
    assert float((_clipped(build(), x, y, 0.3, "ghost") - theirs).abs().max()) <= 2e-6 * float(theirs.abs().max())
    # grouped and circular: neither ghost.py nor Opacus: auto takes vmap, ghost is refused by name
    both = _conv_net(groups=2, padding_mode="circular")
    assert per_example_method(both) == "vmap"
    with pytest.raises(ConfigError, match=r"privacy.per_example=ghost.*Conv1d"):
        check_model(both, "pkg:both", x, y, "ghost")
    with pytest.raises(ConfigError, match=r"privacy.per_example=ghost.*_Scale"):
        check_model(nn.Sequential(nn.Linear(8, 3), _Scale()), "pkg:scale", x, y, "ghost")


def test_a_linear_layer_on_a_4d_input_counts_in_the_norms():
    """Opacus's ghost norm sampler returns nothing for a Linear layer on (B, T1, T2, d) inputs; ghost.py takes it."""

    class Grid(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(4)
            self.a, self.head = nn.Linear(2, 5), nn.Linear(20, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.a(x.view(-1, 2, 2, 2))).flatten(1))

    x, y = _batch(16, seed=8)
    want = _per_example_grads(Grid(), x, y).double().norm(dim=1)
    dp = PrivateGradient(Grid(), max_grad_norm=1.0, noise_multiplier=0.0, noise="seeded", seed=0, rank=0,
                         per_example="ghost")
    assert torch.allclose(dp.norms(x, y), want, rtol=1e-5)
    assert float((_clipped(Grid(), x, y, float(want.median()), "ghost") - _clipped(
        Grid(), x, y, float(want.median()), "vmap")).abs().max()) <= 1e-6


@pytest.mark.parametrize("per_example", ["ghost", "hooks", "vmap"])
def test_every_method_leaves_a_frozen_weight_out_of_the_norms_and_the_noise(per_example):
    """As Opacus does: only the parameters that train have per-example gradients to clip, and noise; a frozen
    weight gets no gradient, so no optimizer moves it (it used to get the noise alone)."""
    import warnings

    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    def frozen():
        model = _model(seed=3)
        model[1].weight.requires_grad_(False)  # its bias still trains
        return model

    x, y = _batch(20, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = GradSampleModule(frozen())
        opt = DPOptimizer(torch.optim.SGD(module.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=0.2,
                          expected_batch_size=20)
        F.cross_entropy(module(x), y).backward()
        opt.pre_step()
    theirs = torch.cat([p.grad.reshape(-1) for p in module.parameters() if p.requires_grad])
    model = frozen()
    _clipped(model, x, y, 0.2, per_example)
    mine = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad])
    assert float((mine - theirs).abs().max()) <= 2e-6 * float(theirs.abs().max())
    model = frozen()
    before = model[1].weight.detach().clone()
    dp = PrivateGradient(model, max_grad_norm=0.2, noise_multiplier=1.0, noise="seeded", seed=0, rank=0,
                         per_example=per_example)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1)
    dp.backward(x, y, float(len(y)), opt2, dp.generator(0), set_to_none=True)
    opt2.step()
    assert model[1].weight.grad is None and torch.equal(model[1].weight, before)
