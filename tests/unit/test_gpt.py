"""The GPT workload (workload/gpt.py) and the language model's training pieces: the tied head is one parameter of
the flat buffer, attention is causal, a tiny GPT overfits a short text, the sequence cross-entropy, and the
learning-rate schedule (core/schedule.py) as train_unit applies it step by step."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from communities.config import ModelConfig, TrainConfig
from communities.core import schedule
from communities.workload import models, train
from communities.workload.gpt import GPT


def _tiny(vocab: int = 50, context: int = 12, layers: int = 2, heads: int = 2, embed: int = 16, seed: int = 0):
    torch.manual_seed(seed)
    return GPT(vocab, context, layers=layers, heads=heads, embed=embed)


# --------------------------------------------------------------------------- the model


def test_the_head_is_tied_to_the_embedding_and_flattened_once():
    vocab, context, layers, embed = 50, 12, 2, 16
    model = _tiny(vocab, context, layers, 2, embed)
    assert model.head.weight is model.tokens.weight
    params = list(model.parameters())
    assert sum(p is model.tokens.weight for p in params) == 1
    block = 4 * embed + (3 * embed * embed + 3 * embed) + (embed * embed + embed) + 2 * (4 * embed * embed) \
        + 4 * embed + embed  # two LayerNorms, qkv, proj, up, down
    expected = vocab * embed + context * embed + layers * block + 2 * embed  # the head adds nothing
    assert sum(p.numel() for p in params) == expected
    flat, n_params = models.flatten_(model)
    assert n_params == expected and flat.numel() == expected  # no floating buffer
    assert model.head.weight is model.tokens.weight
    lo = model.head.weight.data_ptr() - flat.data_ptr()
    assert 0 <= lo < flat.numel() * flat.element_size()
    idx = torch.randint(0, vocab, (2, context))
    before = model(idx)
    start = lo // flat.element_size()
    flat[start: start + vocab * embed].mul_(2.0)  # the flat buffer moves the head and the embedding together
    assert torch.equal(model.head.weight, model.tokens.weight)
    assert not torch.allclose(model(idx), before)
    with torch.no_grad():
        model.tokens.weight.zero_()
    assert torch.all(flat[start: start + vocab * embed] == 0) and torch.all(model.head.weight == 0)


def test_gpt_is_built_from_the_config_and_its_state_dict_round_trips():
    cfg = ModelConfig(name="gpt", gpt={"layers": 1, "heads": 2, "embed": 8})
    model = models.build(cfg, (24,), 300)
    assert isinstance(model, GPT) and model.context == 24 and model.tokens.weight.shape == (300, 8)
    models.check_output(model, torch.randint(0, 300, (3, 24)), 300, "gpt", sequence=True)
    other = models.build(cfg, (24,), 300)
    other.load_state_dict(model.state_dict())
    assert other.head.weight is other.tokens.weight and torch.equal(other.head.weight, model.tokens.weight)
    with pytest.raises(ValueError, match="exceeds the model's context of 24"):
        model(torch.zeros(1, 25, dtype=torch.long))


def test_attention_is_causal():
    model = _tiny().eval()
    idx = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(idx)
        for j in (0, 5, 11):
            changed = idx.clone()
            changed[:, j] = (changed[:, j] + 7) % 50
            out = model(changed)
            assert torch.allclose(out[:, :j], base[:, :j], atol=1e-6, rtol=0), j
            assert not torch.allclose(out[:, j], base[:, j], atol=1e-4), j  # the changed position itself sees it


def test_a_prefix_gets_the_logits_of_the_full_window():
    model = _tiny().eval()
    idx = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(model(idx[:, :5]), model(idx)[:, :5], atol=1e-6, rtol=0)


TEXT = (b"It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
        b"foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
        b"it was the season of Darkness. ")


def test_a_tiny_gpt_overfits_a_short_text():
    """230 bytes repeated, 1 layer, embed 32, AdamW, 200 steps of 16 windows of 32 bytes (~4 s on one core).

    Bound: 1.0 nat per byte. A model of the bytes' frequencies alone scores the text's unigram entropy, 2.71 nats
    (asserted below), and the untrained one ln 256 = 5.55; under 1.0 the model predicts from the context. The
    text is deterministic given about a dozen bytes, so a memorising model tends to 0 (0.25 to 0.42 here over 14 init
    and batch seeds, so the bound has room)."""
    counts = np.bincount(np.frombuffer(TEXT, dtype=np.uint8), minlength=256)
    p = counts[counts > 0] / len(TEXT)
    assert -(p * np.log(p)).sum() > 2.7
    context = 32
    stream = torch.tensor(list(TEXT * 4), dtype=torch.long)
    n = (len(stream) - 1) // context
    x_all, y_all = stream[: n * context].view(n, context), stream[1: n * context + 1].view(n, context)
    model = _tiny(256, context, layers=1, heads=2, embed=32, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        first = float(train.cross_entropy(model(x_all), y_all))
    assert abs(first - math.log(256)) < 0.1  # GPT-2's init: nearly uniform
    for _ in range(200):
        starts = torch.randint(0, len(stream) - context - 1, (16,), generator=gen)
        rows = starts[:, None] + torch.arange(context)
        loss = train.cross_entropy(model(stream[rows]), stream[rows + 1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc, final = train.evaluate(model, x_all, y_all)
    assert final < 1.0, final
    assert acc > 0.7 and model.training  # evaluate restores the mode


# --------------------------------------------------------------------------- loss and accuracy


def test_sequence_cross_entropy_is_the_flat_one():
    gen = torch.Generator().manual_seed(3)
    out, y = torch.randn(4, 7, 11, generator=gen), torch.randint(0, 11, (4, 7), generator=gen)
    flat = F.cross_entropy(out.reshape(-1, 11), y.reshape(-1))
    assert torch.allclose(train.cross_entropy(out, y), flat, atol=1e-6, rtol=0)
    per = train.cross_entropy(out, y.int(), reduction="none")  # int32 targets as data.rows gives
    assert per.shape == (4,)
    want = F.cross_entropy(out.reshape(-1, 11), y.reshape(-1), reduction="none").view(4, 7).mean(1)
    assert torch.allclose(per, want, atol=1e-6, rtol=0)
    assert torch.allclose(train.cross_entropy(out, y, reduction="sum"), want.sum(), atol=1e-5, rtol=0)
    assert torch.allclose(per.mean(), flat, atol=1e-6, rtol=0)  # windows of one length: the mean of means
    logits, labels = torch.randn(5, 3, generator=gen), torch.tensor([0, 1, 2, 1, 0])  # a classifier's, unchanged
    assert torch.equal(train.cross_entropy(logits, labels), F.cross_entropy(logits, labels))


def test_sequence_accuracy_is_each_windows_share_of_right_tokens():
    out = torch.zeros(2, 4, 3)
    out[..., 1] = 1.0  # always predicts 1
    y = torch.tensor([[1, 1, 0, 2], [1, 1, 1, 1]])
    assert float(train.correct(out, y)) == pytest.approx(0.5 + 1.0)
    assert int(train.correct(out[:, 0], y[:, 0])) == 2


# --------------------------------------------------------------------------- the learning-rate schedule


def test_lr_factor():
    f = schedule.lr_factor
    assert f(0.0, "cosine", 0.1, 0.1) == 0.0 and f(0.0, "constant", 0.2) == 0.0
    assert f(0.05, "cosine", 0.1, 0.1) == pytest.approx(0.5) and f(0.1, "constant", 0.2) == pytest.approx(0.5)
    assert f(0.1, "cosine", 0.1, 0.1) == pytest.approx(1.0) and f(0.2, "constant", 0.2) == 1.0
    assert f(1.0, "cosine", 0.1, 0.1) == pytest.approx(0.1) and f(1.0, "cosine", 0.0, 0.0) == pytest.approx(0.0)
    assert f(0.55, "cosine", 0.1, 0.1) == pytest.approx(0.55)  # half way down the cosine: the mean of 1 and floor
    assert f(0.0, "cosine") == 1.0 and f(-1.0, "cosine", 0.0, 0.3) == 1.0 and f(2.0, "cosine", 0.0, 0.3) == 0.3
    grid = np.linspace(0, 1, 201)
    for warmup in (0.0, 0.1, 0.5):
        after = [f(u, "cosine", warmup, 0.2) for u in grid if u >= warmup]
        assert all(a >= b for a, b in zip(after, after[1:])) and min(after) == pytest.approx(0.2)
        rise = [f(u, "cosine", warmup, 0.2) for u in grid if u <= warmup]
        assert all(a <= b for a, b in zip(rise, rise[1:]))
    assert all(f(u) == 1.0 for u in grid) and all(f(u, "constant", 0.0, 0.0) == 1.0 for u in grid)
    with pytest.raises(ValueError, match="linear"):
        f(0.5, "linear")


def test_the_step_factor_is_a_function_of_virtual_time():
    cfg = TrainConfig(budget=4, schedule="cosine", warmup=0.25, min_lr=0.1)
    assert train.lr_factor(cfg, 1, 1, 5) == pytest.approx(schedule.lr_factor(0.05, "cosine", 0.25, 0.1))
    assert train.lr_factor(cfg, 1, 5, 5) == pytest.approx(1.0)  # the end of unit 1 is the end of the warmup
    assert train.lr_factor(cfg, 4, 5, 5) == pytest.approx(0.1)  # the last step of the last unit: the floor
    assert train.lr_factor(cfg, 3, 5, 5) == pytest.approx(train.lr_factor(cfg, 3, 10, 10))
    assert not train.scheduled(TrainConfig()) and train.scheduled(TrainConfig(warmup=0.1))
    assert train.scheduled(TrainConfig(schedule="cosine"))


class Recording(torch.optim.SGD):
    """SGD that records each param group's learning rate at every step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list = []

    def step(self, closure=None):
        self.seen.append([g["lr"] for g in self.param_groups])
        return super().step(closure)


def _classifier():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    gen = torch.Generator().manual_seed(0)
    return model, torch.randn(40, 4, generator=gen), torch.randint(0, 3, (40,), generator=gen)


@pytest.mark.parametrize("t", [1, 2, 3])
def test_train_unit_steps_with_the_scheduled_lr_and_restores_the_peak(t):
    cfg = TrainConfig(unit="steps", steps_per_unit=4, budget=3, batch_size=8, schedule="cosine", warmup=0.2,
                      min_lr=0.1)
    model, x, y = _classifier()
    opt = Recording([{"params": model[0].parameters(), "lr": 0.1}, {"params": model[2].parameters(), "lr": 0.4}],
                    lr=0.1, momentum=0.9)
    res = train.train_unit(model, opt, x, y, cfg, seed=1, rank=0, t=t)
    assert res.steps == 4 and len(opt.seen) == 4
    for k, lrs in enumerate(opt.seen, 1):
        factor = train.lr_factor(cfg, t, k, 4)
        assert lrs == pytest.approx([0.1 * factor, 0.4 * factor]), (t, k)
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.4]  # the peak again, as checkpoints and pbt read it


def test_a_constant_lr_is_left_alone():
    cfg = TrainConfig(unit="steps", steps_per_unit=3, budget=3, batch_size=8)
    model, x, y = _classifier()
    opt = Recording(model.parameters(), lr=0.05)
    train.train_unit(model, opt, x, y, cfg, seed=1, rank=0, t=2)
    assert opt.seen == [[0.05]] * 3 and opt.param_groups[0]["lr"] == 0.05


def test_the_peak_is_restored_when_a_unit_fails():
    cfg = TrainConfig(unit="steps", steps_per_unit=4, budget=3, batch_size=8, schedule="cosine", warmup=0.5)
    model, x, y = _classifier()
    opt = Recording(model.parameters(), lr=0.2)

    def fail(k):
        if k == 2:
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError, match="stop"):
        train.train_unit(model, opt, x, y, cfg, seed=1, rank=0, t=1, between_batches=fail)
    assert len(opt.seen) == 2 and opt.param_groups[0]["lr"] == 0.2


def test_train_unit_trains_a_gpt_on_token_windows():
    cfg = TrainConfig(unit="steps", steps_per_unit=5, budget=2, batch_size=4, optimizer="adamw", lr=0.01)
    model = _tiny(vocab=20, context=8, layers=1)
    stream = torch.arange(200) % 20
    x, y = stream[:192].view(24, 8).int(), stream[1:193].view(24, 8).int()
    opt = train.make_optimizer(cfg, model.parameters())
    res = train.train_unit(model, opt, x, y, cfg, seed=0, rank=0, t=1)
    assert res.steps == 5 and res.samples == 20 and 0.0 <= res.accuracy <= 1.0
    assert res.loss < math.log(20) + 0.5
    acc, loss = train.evaluate(model, x, y)
    assert 0.0 <= acc <= 1.0 and math.isfinite(loss)
