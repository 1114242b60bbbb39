"""Your own data and model for communities: the worked example of docs/guides/own-model-and-data.md.

    mpiexec -n 4 communities run examples/plugins/config.yaml

The config names these functions as ``my_data:blobs`` and ``my_data:tiny_mlp``;
this file sits beside the config, so communities imports it from there.
"""
import numpy as np
import torch
from torch import nn


def blobs(seed):
    """Three Gaussian blobs in 2-D, drawn from ``seed``: the same arrays on every rank."""
    rng = np.random.default_rng(seed)
    centers = np.array([[0.0, 3.0], [-2.6, -1.5], [2.6, -1.5]])
    y = rng.integers(0, 3, size=1200)
    x = (centers[y] + rng.normal(size=(1200, 2))).astype(np.float32)
    return x[:900], y[:900], x[900:], y[900:]  # x_train, y_train, x_test, y_test


def blobs_as_datasets(seed):
    """The same data as two torch Datasets of (x, y) pairs: (train_set, test_set)."""
    x_train, y_train, x_test, y_test = blobs(seed)
    return (torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train)),
            torch.utils.data.TensorDataset(torch.from_numpy(x_test), torch.from_numpy(y_test)))


def blobs_sharded(seed, rank, world_size):
    """A sharded reader: it takes rank and world_size, and returns this rank's own training shard
    (here every world_size-th example) and the test split, which must be the same on every rank."""
    x_train, y_train, x_test, y_test = blobs(seed)
    return x_train[rank::world_size], y_train[rank::world_size], x_test, y_test


def tiny_mlp(input_shape, n_classes):
    """Any torch.nn.Module mapping a batch (batch, *input_shape) to logits (batch, n_classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 32), nn.ReLU(),
                         nn.Linear(32, n_classes))
