"""Ghost norms and book-keeping (workload/ghost.py), tensors in and out: each layer's per-example gradient norms
and clipped sum equal those of its per-example gradients taken one example at a time, on plain batches, sequences
(both the Gram and the materialised branch) and a Conv1d's unfolded windows (every padding mode, stride,
dilation)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from communities.workload import ghost


def _per_example(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Each example's gradient of ``sum(layer(x_i) * w)`` (a fixed random readout), by its own backward."""
    torch.manual_seed(3)
    readout = torch.randn_like(layer(x))
    rows = []
    for i in range(x.shape[0]):
        layer.zero_grad(set_to_none=True)
        (layer(x[i: i + 1]) * readout[i: i + 1]).sum().backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in layer.parameters()]))
    return torch.stack(rows).double()


def _view(layer: nn.Module, x: torch.Tensor):
    """The (a, g) pair of ``layer`` for the loss of ``_per_example``, through the hooks' inputs and output grad."""
    out = layer(x)
    torch.manual_seed(3)
    readout = torch.randn_like(out)
    return ghost.layer_view(layer, (x,), readout, x.shape[0])


CASES = {
    "linear": (lambda: nn.Linear(6, 4), (9, 6)),
    "linear, no bias": (lambda: nn.Linear(6, 4, bias=False), (9, 6)),
    "sequence, Gram": (lambda: nn.Linear(12, 10), (9, 3, 12)),  # 3 x 22 < 120
    "sequence, materialised": (lambda: nn.Linear(2, 3), (9, 7, 2)),  # 7 x 5 > 6
    "4-d input": (lambda: nn.Linear(4, 5), (9, 2, 3, 4)),
    "conv": (lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1), (9, 2, 11)),
    "conv, circular": (lambda: nn.Conv1d(2, 3, 3, padding=2, padding_mode="circular"), (9, 2, 11)),
    "conv, same, dilated, reflect": (lambda: nn.Conv1d(2, 3, 3, padding="same", dilation=2, padding_mode="reflect"),
                                     (9, 2, 11)),
    "conv, valid, no bias": (lambda: nn.Conv1d(1, 4, 5, stride=3, bias=False), (9, 1, 16)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_norms_and_clipped_sums_are_those_of_the_per_example_gradients(case):
    build, shape = CASES[case]
    torch.manual_seed(0)
    layer = build()
    x = torch.randn(*shape)
    per = _per_example(layer, x)
    a, g = _view(layer, x)
    has_bias = layer.bias is not None
    sq = ghost.squared_norms(a, g, bias=has_bias)
    assert torch.allclose(sq.double(), per.square().sum(1), rtol=1e-5)
    factors = torch.rand(shape[0], generator=torch.Generator().manual_seed(1))
    weight, bias = ghost.clipped_sums(a, g, factors, bias=has_bias)
    mine = torch.cat([weight.reshape(-1)] + ([bias] if bias is not None else [])).double()
    want = (per * factors.double()[:, None]).sum(0)
    assert float((mine - want).abs().max()) <= 1e-6 * float(want.abs().max())
    assert (bias is None) == (not has_bias)


@pytest.mark.parametrize("kw", [dict(stride=2, padding=1), dict(padding=2, padding_mode="circular"),
                                dict(padding="same", dilation=2, padding_mode="replicate"), dict(dilation=3)])
def test_the_unfolded_windows_times_the_kernel_are_the_convolution(kw):
    torch.manual_seed(0)
    conv = nn.Conv1d(3, 4, 3, bias=False, **kw)
    x = torch.randn(5, 3, 13)
    windows = ghost.conv1d_unfold(conv, x)
    assert windows.is_contiguous()
    assert torch.allclose(windows @ conv.weight.reshape(4, -1).t(), conv(x).transpose(1, 2), atol=1e-5)


def test_the_cheaper_way_to_the_norms_is_picked():
    assert ghost.gram_is_cheaper(1, 64, 10)  # a plain batch: T (d_in + d_out) <= d_in d_out
    assert ghost.gram_is_cheaper(10, 75, 25)  # the MNIST-1D CNN's second convolution
    assert not ghost.gram_is_cheaper(19, 5, 25)  # its first: long windows of few inputs


def test_what_ghost_takes_and_what_it_refuses():
    assert ghost.handles(nn.Linear(2, 3)) and ghost.handles(nn.Conv1d(2, 3, 3))
    assert not ghost.handles(nn.Conv1d(2, 4, 3, groups=2))  # grouped: Opacus's sampler, or vmap
    assert not ghost.handles(nn.Conv2d(2, 3, 3)) and not ghost.handles(nn.LayerNorm(3))
    with pytest.raises(RuntimeError, match="not a batch of 4 examples first"):
        ghost.layer_view(nn.Linear(3, 2), (torch.randn(3),), torch.randn(2), 4)  # an unbatched call
    with pytest.raises(RuntimeError, match="not a batch"):
        ghost.layer_view(nn.Conv1d(1, 2, 3), (torch.randn(2, 8),), torch.randn(2, 6), 4)
    with pytest.raises(ValueError, match="no layer"):
        ghost.total_norms([], 1.0)


def test_total_norms_add_the_layers_in_float64_and_scale():
    sq = [torch.tensor([9.0, 16.0]), torch.tensor([16.0, 9.0])]
    total = ghost.total_norms(sq, 2.0)
    assert total.dtype == torch.float64 and torch.equal(total, torch.tensor([10.0, 10.0], dtype=torch.float64))


def test_a_frozen_weight_or_bias_is_left_out_of_the_norm():
    torch.manual_seed(0)
    layer = nn.Linear(6, 4)
    x = torch.randn(9, 3, 6)
    per = _per_example(layer, x)  # weight (24 entries), then bias (4)
    a, g = _view(layer, x)
    assert torch.allclose(ghost.squared_norms(a, g, bias=True, weight=False).double(), per[:, 24:].square().sum(1),
                          rtol=1e-5)
    assert torch.allclose(ghost.squared_norms(a[:, 0], g[:, 0], bias=False, weight=False), torch.zeros(9))
