"""Concept shift between planted groups of ranks (``data.shift``): one fixed, seeded transform per group.

Why: clustered federated learning (IFCA, CFL) exists because groups of clients
may hold *conflicting* data, where one model cannot serve everyone. These
transforms make such groups from any built-in dataset, reproducibly:

- ``label_permutation``: group g relabels class c as ``perm_g[c]`` (the same
  inputs, conflicting labels: no single model can be right for two groups);
- ``input_permutation``: group g shuffles the input features by ``perm_g``
  (the same labels, inputs in another order);
- ``rotation``: group g rotates its inputs: images by ``90°·g`` (square inputs,
  e.g. digits as 8×8; groups 4..7 are also transposed, so up to 8 distinct
  groups), 1-D signals (MNIST-1D, synthetic) cyclically by ``g·L/G`` positions.

Group 0 keeps the identity. Every training example is transformed by the group
of the rank that owns it, so a rank's shard and its local test data come from
its own group's distribution. The shared test split is *pooled*: each test
example is assigned to one group (a seeded, balanced assignment) and carries
that group's transform, so a model is scored on every group's distribution at
once (a model that serves one group of G scores about 1/G of its accuracy there).

Pure functions of arrays: the same seed gives the same transforms on every rank.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np

from ..errors import DataError

KINDS = ("none", "label_permutation", "input_permutation", "rotation")
MAX_IMAGE_ROTATIONS = 8  # the 8 symmetries of a square: 4 rotations, each also transposed


def _permutation(n: int, group: int, seed: int, purpose: int) -> np.ndarray:
    """A fixed permutation of n items for ``group``: the identity for group 0, never the identity otherwise."""
    if group == 0 or n < 2:
        return np.arange(n)
    rng = np.random.default_rng([seed, purpose, group])
    while True:
        perm = rng.permutation(n)
        if not np.array_equal(perm, np.arange(n)):
            return perm


def label_permutation(n_classes: int, group: int, seed: int) -> np.ndarray:
    """``perm[c]``: the label group ``group`` gives class c."""
    return _permutation(n_classes, group, seed, 37)


def input_permutation(n_features: int, group: int, seed: int) -> np.ndarray:
    """The feature order of group ``group``'s inputs (flattened)."""
    return _permutation(n_features, group, seed, 41)


def image_side(n_features: int, dataset: str) -> Optional[int]:
    """The side of a square image whose flattened pixels are the features (digits: 8), else None."""
    side = int(math.isqrt(n_features))
    return side if dataset == "digits" and side * side == n_features else None


def rotate(x: np.ndarray, group: int, groups: int, side: Optional[int]) -> np.ndarray:
    """Group ``group``'s rotation of inputs ``x`` (n, features...)."""
    if group == 0:
        return x
    if side is not None:
        if groups > MAX_IMAGE_ROTATIONS:
            raise DataError(f"data.shift='rotation' rotates square images in at most {MAX_IMAGE_ROTATIONS} "
                            f"distinct ways; data.groups={groups}")
        img = x.reshape(len(x), side, side)
        img = np.rot90(img, k=group % 4, axes=(1, 2))
        if group >= 4:
            img = np.swapaxes(img, 1, 2)
        return np.ascontiguousarray(img).reshape(x.shape)
    flat = x.reshape(len(x), -1)
    shift = int(round(group * flat.shape[1] / groups))
    return np.ascontiguousarray(np.roll(flat, shift, axis=1)).reshape(x.shape)


def transform(kind: str, x: np.ndarray, y: np.ndarray, group: int, groups: int, *, seed: int, n_classes: int,
              side: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """(x, y) as group ``group`` sees them under shift ``kind``."""
    if kind == "none" or group == 0:
        return x, y
    if kind == "label_permutation":
        return x, label_permutation(n_classes, group, seed)[y]
    if kind == "input_permutation":
        flat = x.reshape(len(x), -1)
        perm = input_permutation(flat.shape[1], group, seed)
        return np.ascontiguousarray(flat[:, perm]).reshape(x.shape), y
    if kind == "rotation":
        return rotate(x, group, groups, side), y
    raise DataError(f"data.shift={kind!r} is not one of {', '.join(KINDS)}")


def pooled_test_groups(n_test: int, groups: int, seed: int) -> np.ndarray:
    """The group of each shared test example: a seeded, balanced assignment (sizes differ by at most one)."""
    order = np.random.default_rng([seed, 43]).permutation(n_test)
    out = np.empty(n_test, dtype=np.int64)
    for g, part in enumerate(np.array_split(order, groups)):
        out[part] = g
    return out


def apply(kind: str, x: np.ndarray, y: np.ndarray, example_group: np.ndarray, groups: int, *, seed: int,
          n_classes: int, side: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Every example (x[i], y[i]) under the transform of its group ``example_group[i]``; new arrays."""
    x_out, y_out = x.copy(), y.copy()
    for g in range(1, groups):
        idx = np.flatnonzero(example_group == g)
        if idx.size:
            x_out[idx], y_out[idx] = transform(kind, x[idx], y[idx], g, groups, seed=seed, n_classes=n_classes,
                                               side=side)
    return x_out, y_out
