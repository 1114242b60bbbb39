"""Built-in models (an MLP, the MNIST-1D 1-D CNN, a small GPT: gpt.py) and a user's ``module:function``.

A user's model function is called as ``fn(input_shape=..., n_classes=...)``
(``plugins.MODEL_SIGNATURE``; docs/guides/own-model-and-data.md) and must return an ``nn.Module``.

``flatten_`` moves every parameter and floating buffer into one contiguous flat
tensor and makes the modules' tensors views of it: the flat tensor *is* the
model, so an exchange sends it as one buffer with no packing, and a merge is one
``lerp_`` over it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from torch import nn

from ..errors import ModelError
from . import plugins


class MLP(nn.Module):
    def __init__(self, in_features: int, n_classes: int, hidden: Sequence[int] = (64,), *, dropout: float = 0.0,
                 batchnorm: bool = False):
        super().__init__()
        layers: List[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers.append(nn.Linear(width, h))
            if batchnorm:
                layers.append(nn.BatchNorm1d(h))
            layers.append(nn.ReLU())
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, n_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class CNN1D(nn.Module):
    """The MNIST-1D paper's ConvBase: three stride-2 convolutions and a linear head (~94% centrally)."""

    def __init__(self, length: int, n_classes: int, channels: int = 25, *, batchnorm: bool = False):
        super().__init__()

        def block(cin, k):
            mods: List[nn.Module] = [nn.Conv1d(cin, channels, k, stride=2, padding=1)]
            if batchnorm:
                mods.append(nn.BatchNorm1d(channels))
            mods.append(nn.ReLU())
            return mods

        self.features = nn.Sequential(*block(1, 5), *block(channels, 3), *block(channels, 3))
        with torch.no_grad():
            out = self.features(torch.zeros(1, 1, length)).numel()
        self.head = nn.Linear(out, n_classes)

    def forward(self, x):
        h = self.features(x.view(x.shape[0], 1, -1))
        return self.head(h.flatten(1))


def init_seed(seed: int, rank: int, init: str) -> int:
    """The torch seed a rank builds its model with: shared (rank 0's is broadcast anyway) or per rank."""
    return seed if init == "shared" else seed * 7919 + 1 + rank


def build(cfg, input_shape: Tuple[int, ...], n_classes: int) -> nn.Module:
    """The model named by ``cfg`` (a ModelConfig)."""
    features = 1
    for s in input_shape:
        features *= int(s)
    if cfg.name == "mlp":
        return MLP(features, n_classes, cfg.hidden, dropout=cfg.dropout, batchnorm=cfg.batchnorm)
    if cfg.name == "cnn1d":
        return CNN1D(features, n_classes, cfg.channels, batchnorm=cfg.batchnorm)
    if cfg.name == "gpt":
        from .gpt import GPT

        g = cfg.gpt
        return GPT(n_classes, int(input_shape[0]), layers=g.layers, heads=g.heads, embed=g.embed, dropout=cfg.dropout)
    key = "model.name"
    fn = plugins.resolve(cfg.name, key, ModelError)
    offered = {"input_shape": tuple(int(s) for s in input_shape), "n_classes": int(n_classes)}
    kwargs = plugins.keywords(fn, offered, cfg.name, key, plugins.MODEL_SIGNATURE, error=ModelError,
                              required=("input_shape", "n_classes"))
    model = plugins.call(fn, kwargs, cfg.name, key, ModelError)
    if not isinstance(model, nn.Module):
        raise ModelError(f"model.name={cfg.name!r} must return a torch.nn.Module ({plugins.MODEL_SIGNATURE}), "
                         f"got {type(model).__name__}")
    return model


def check_output(model: nn.Module, sample: torch.Tensor, n_classes: int, name: str, sequence: bool = False) -> None:
    """One forward pass on a small batch: the logits must be (batch, n_classes), a sequence model's
    (batch, time, vocabulary) for windows of (batch, time) tokens."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(sample)
    except Exception as exc:  # the user's forward(): one line naming the model
        raise ModelError(f"model.name={name!r}: a forward pass on a batch of shape {tuple(sample.shape)} raised "
                         f"{type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was)
    if not isinstance(out, torch.Tensor):
        raise ModelError(f"model.name={name!r}: forward() returns {type(out).__name__}; expected a tensor of logits "
                         f"({sample.shape[0]}, n_classes)")
    want = (tuple(sample.shape[:2]) if sequence else (sample.shape[0],)) + (n_classes,)
    if tuple(out.shape) != want:
        batch = f"shape {tuple(sample.shape)}" if sequence else str(sample.shape[0])
        raise ModelError(f"model.name={name!r} returns shape {tuple(out.shape)} for a batch of {batch}; "
                         f"expected {want}")


def _merged_tensors(model: nn.Module):
    """Parameters first, then floating buffers (BatchNorm running stats), in module order."""
    params = [p for p in model.parameters()]
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    return params, buffers


def flatten_(model: nn.Module, out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, int]:
    """Re-home parameters and floating buffers into one flat tensor; returns (flat, n_params).

    ``flat[:n_params]`` are the trainable parameters (what signatures sketch);
    ``flat[n_params:]`` are the floating buffers (merged alongside). With ``out`` (a contiguous 1-D tensor of
    the right size, dtype and device: a row of a process's stacked replicas) they are re-homed into it.
    """
    params, buffers = _merged_tensors(model)
    tensors = params + buffers
    if not tensors:
        raise ModelError("the model has no parameters")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ModelError(f"all parameters and floating buffers must share one dtype, got {sorted(map(str, dtypes))}")
    device = tensors[0].device
    total = sum(t.numel() for t in tensors)
    if out is None:
        flat = torch.empty(total, dtype=tensors[0].dtype, device=device)
    elif out.ndim != 1 or out.numel() != total or out.dtype != tensors[0].dtype or out.device != device \
            or not out.is_contiguous():
        raise ModelError(f"cannot re-home {total} {tensors[0].dtype} values on {device} into a tensor of shape "
                         f"{tuple(out.shape)}, {out.dtype} on {out.device}")
    else:
        flat = out
    offset = 0
    for t in tensors:
        n = t.numel()
        flat[offset: offset + n].copy_(t.detach().reshape(-1))
        t.data = flat[offset: offset + n].view_as(t)
        offset += n
    n_params = sum(p.numel() for p in params)
    return flat, n_params


def bind_flat_grad_(model: nn.Module) -> torch.Tensor:
    """Give every parameter a ``.grad`` that is a view of one flat buffer (one Allreduce per step)."""
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset: offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def shape_signature(model: nn.Module) -> str:
    """Names, shapes and dtypes of what is merged: ranks compare a hash of this at start-up."""
    params, buffers = _merged_tensors(model)
    names = [n for n, _ in model.named_parameters()] + [n for n, b in model.named_buffers() if b.is_floating_point()]
    return ";".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in zip(names, params + buffers))
