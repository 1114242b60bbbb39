"""The built-in datasets' stratified train/test split, drawn as scikit-learn draws it, without importing it.

``train_test_split(x, y, test_size=f, random_state=seed, stratify=y)`` is one draw of
``StratifiedShuffleSplit``: per class, its share of the train and test sizes (``approximate_mode``,
ties broken at random), a permutation of each class's examples, then a permutation of each side.
Importing scikit-learn for it costs every rank 1.3 s of start-up on the project's machine (its
``sklearn.base`` loads scipy.stats and pandas), a quarter of a tiny run's process time. This module
repeats the draw with the same ``numpy.random.RandomState`` calls in the same order, so the splits
(and the golden runs) are scikit-learn's bit for bit: ``tests/unit/test_stratified_split.py``
checks it against the installed scikit-learn over random labelings, seeds and fractions.
"""
from __future__ import annotations

import math
from typing import Tuple

import numpy as np


def approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``n_draws`` each class gets: its floored proportional share, the remainder given to the
    largest fractional parts, ties drawn at random (scikit-learn's ``_approximate_mode``)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need_to_add = int(n_draws - floored.sum())
    if need_to_add > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (inds,) = np.where(remainder == value)
            add_now = min(len(inds), need_to_add)
            floored[rng.choice(inds, size=add_now, replace=False)] += 1
            need_to_add -= add_now
            if need_to_add == 0:
                break
    return floored.astype(int)


def split_sizes(n_samples: int, test_fraction: float) -> Tuple[int, int]:
    """(train, test) sizes: the test side rounded up, as scikit-learn rounds a float ``test_size``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must be in (0, 1)")
    n_test = math.ceil(test_fraction * n_samples)
    n_train = n_samples - n_test
    if n_train <= 0:
        raise ValueError(f"test_fraction={test_fraction} of {n_samples} samples leaves no training sample")
    return n_train, n_test


def stratified_indices(y: np.ndarray, test_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """(train, test) example indices: each class split in proportion, as ``train_test_split(stratify=y)``."""
    y = np.asarray(y)
    n_train, n_test = split_sizes(len(y), test_fraction)
    classes, y_indices, class_counts = np.unique(y, return_inverse=True, return_counts=True)
    if class_counts.min() < 2:
        raise ValueError(f"a stratified split needs 2 examples of every class; classes "
                         f"{classes[class_counts < 2].tolist()} have 1")
    if min(n_train, n_test) < len(classes):
        raise ValueError(f"a stratified split of {len(y)} examples into {n_train} and {n_test} cannot hold "
                         f"each of the {len(classes)} classes on both sides")
    class_indices = np.split(np.argsort(y_indices, kind="stable"), np.cumsum(class_counts)[:-1])
    rng = np.random.RandomState(seed)
    n_i = approximate_mode(class_counts, n_train, rng)
    t_i = approximate_mode(class_counts - n_i, n_test, rng)
    train, test = [], []
    for i, members in enumerate(class_indices):
        shuffled = members.take(rng.permutation(class_counts[i]), mode="clip")
        train.append(shuffled[:n_i[i]])
        test.append(shuffled[n_i[i]:n_i[i] + t_i[i]])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def train_test_split(x: np.ndarray, y: np.ndarray, test_fraction: float, seed: int
                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, y_train, y_test), as scikit-learn's ``train_test_split(x, y, test_size=test_fraction,
    random_state=seed, stratify=y)`` returns them."""
    train, test = stratified_indices(y, test_fraction, seed)
    return x[train], x[test], y[train], y[test]
