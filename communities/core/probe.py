"""Functional signatures: what a model *does* on a shared probe batch, as one allgathered row.

The weight signatures (``signature.py``) see parameters; two models that compute
the same function with permuted hidden units look far apart there. The kinds
here look at behaviour instead, on the same ``probe_size`` training examples on
every rank (``similarity.probe_indices``, drawn by the config seed):

- ``logits``: the centred logits on the probe batch, flattened (n x C values);
  clustered with ``clustering.metric`` like any signature.
- ``cka``: the centred features of one layer on the probe batch, projected to
  k = min(dim, width) columns (exact when the layer is no wider than ``dim``).
  CKA is pairwise, so the row is the (n x k) block itself and every rank turns
  the allgathered blocks into the same N x N CKA matrix (``similarity``), whose
  ``1 - CKA`` are the distances the tree is built on.

Both give the engine the same interface as the weight signers: a row per rank
(``__call__``), optional precomputed distances (``distances``) and a
consensus measure (``dispersion``, 0 when every rank computes the same thing).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import nn

from . import signature, similarity

KINDS = ("logits", "cka")


def layer_name(model: nn.Module, name: Optional[str]) -> str:
    """The checked module name for ``signature.layer`` (null: the last nn.Linear), valid names in the error."""
    modules = dict(model.named_modules())
    if name is None:
        linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
        if not linear:
            raise ValueError("signature.kind='cka' with layer=null needs a model with an nn.Linear layer; "
                             "name one with signature.layer")
        return linear[-1]
    if name not in modules or name == "":
        valid = [n for n in modules if n]
        raise ValueError(f"signature.layer={name!r} is not a module of the model; valid names: {valid}")
    return name


class ProbeSigner:
    """The row a rank allgathers for a functional signature kind."""

    def __init__(self, kind: str, model: nn.Module, x_probe: torch.Tensor, *, dim: int, seed: int,
                 layer: Optional[str] = None, debias: bool = True):
        if kind not in KINDS:
            raise ValueError(f"unknown functional signature kind {kind!r}; expected one of {KINDS}")
        self.kind, self.x, self.seed = kind, x_probe, int(seed)
        self.layer = layer_name(model, layer) if kind == "cka" else None
        self.use_input = kind == "cka" and layer is None  # the input of the last Linear: the penultimate features
        self.k = int(dim)
        if kind == "cka":
            width = self._features(model).shape[1]
            self.exact = similarity.sketch_is_exact(width, dim)
            self.k = min(int(dim), width)
            self.debias = bool(debias) and not self.exact
        else:
            self.exact, self.debias = True, False

    @torch.no_grad()
    def _features(self, model: nn.Module) -> np.ndarray:
        captured = []

        def hook(module, inputs, output):
            captured.append((inputs[0] if self.use_input else output).detach())

        handle = dict(model.named_modules())[self.layer].register_forward_hook(hook)
        was_training = model.training
        try:
            model.eval()
            model(self.x)
        finally:
            handle.remove()
            model.train(was_training)
        return captured[0].reshape(len(self.x), -1).double().cpu().numpy()

    @torch.no_grad()
    def __call__(self, model: nn.Module) -> np.ndarray:
        if self.kind == "logits":
            was_training = model.training
            model.eval()
            try:
                out = model(self.x)
            finally:
                model.train(was_training)
            return similarity.logits_signature(out)
        block = similarity.cka_sketch(self._features(model), self.k, self.seed)
        return np.ascontiguousarray(block, dtype=np.float32).reshape(-1)

    def distances(self, S: np.ndarray) -> Optional[np.ndarray]:
        """Condensed ``1 - CKA`` for cka (identical on every rank for identical S); None: use the metric."""
        if self.kind != "cka":
            return None
        blocks = np.asarray(S, dtype=np.float64).reshape(S.shape[0], len(self.x), self.k)
        return similarity.cka_distances(blocks, debias=self.debias)

    def dispersion(self, S: np.ndarray, d: Optional[np.ndarray]) -> float:
        """logits: ``signature.dispersion`` of the rows; cka: the mean ``1 - CKA`` over pairs."""
        if self.kind == "cka":
            return float(np.mean(d)) if d is not None and d.size else 0.0
        return signature.dispersion(S)
