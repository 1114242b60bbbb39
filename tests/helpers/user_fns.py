"""User functions the MPI tests load by ``module:function``."""
import numpy as np


def fails_on_rank_1():
    """A dataset that raises on rank 1 only: every rank must stop with one message naming rank 1, not hang."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    rng = np.random.default_rng(0)
    return rng.normal(size=(200, 4)), rng.integers(0, 2, 200), rng.normal(size=(50, 4)), rng.integers(0, 2, 50)


def model_differs_on_rank_1(input_shape, n_classes):
    """A user model whose shape depends on the rank: start-up must name the rank."""
    import torch
    from mpi4py import MPI

    width = 9 if MPI.COMM_WORLD.Get_rank() == 1 else 8
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(input_shape[0], width), torch.nn.ReLU(),
                               torch.nn.Linear(width, n_classes))


def wrong_logits(input_shape, n_classes):
    import torch

    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(input_shape[0], n_classes + 1))


def bug_in_setup_on_rank_0():
    """A dataset whose loading plants a bug in rank 0's run-directory set-up (a collective_check)."""
    from mpi4py import MPI

    from communities.workload import data

    if MPI.COMM_WORLD.Get_rank() == 0:
        def broken_describe(*args, **kwargs):
            raise ZeroDivisionError("injected set-up bug on rank 0")
        data.describe = broken_describe
    rng = np.random.default_rng(0)
    return rng.normal(size=(200, 4)), rng.integers(0, 2, 200), rng.normal(size=(50, 4)), rng.integers(0, 2, 50)


def strings():
    """A dataset whose labels are strings: one message naming the function, on every rank."""
    rng = np.random.default_rng(0)
    return rng.normal(size=(200, 4)), np.array(["a", "b"] * 100), rng.normal(size=(50, 4)), np.array(["a"] * 50)


def bug_on_rank_1():
    """A dataset whose loading plants a bug (not a user error) in the partition on rank 1: the job must abort."""
    from mpi4py import MPI

    from communities.workload import data

    if MPI.COMM_WORLD.Get_rank() == 1:
        def broken_partition(*args, **kwargs):
            raise RuntimeError("injected bug on rank 1")
        data.partition = broken_partition
    rng = np.random.default_rng(0)
    return rng.normal(size=(200, 4)), rng.integers(0, 2, 200), rng.normal(size=(50, 4)), rng.integers(0, 2, 50)


def _two_blobs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(400, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return x, y


def declared_rank_groups():
    """A dataset that declares its ranks' groups (4 ranks: {0, 1} and {2, 3}), for first_round_ari."""
    x, y = _two_blobs()
    return {"x_train": x[:300], "y_train": y[:300], "x_test": x[300:], "y_test": y[300:], "groups": [0, 0, 1, 1]}


def declared_example_groups():
    """Per-example groups: the first half of the training set is group 7, the rest group 9."""
    x, y = _two_blobs()
    return {"x_train": x[:300], "y_train": y[:300], "x_test": x[300:], "y_test": y[300:],
            "example_groups": np.repeat([7, 9], 150)}


def not_deterministic():
    """No seed: every rank draws different data (the test split differs by rank)."""
    rng = np.random.default_rng()
    x = rng.normal(size=(300, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return x[:240], y[:240], x[240:], y[240:]


def wrong_signature(width, depth):
    """A model function whose parameters are not (input_shape, n_classes): exit 2 naming it, no MPI_Abort."""
    import torch

    return torch.nn.Linear(width, depth)
