"""User functions the MPI tests load by ``module:function``."""
import numpy as np


def fails_on_rank_1():
    """A dataset that raises on rank 1 only: the whole job must abort, not hang."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 1:
        raise RuntimeError("injected failure on rank 1")
    rng = np.random.default_rng(0)
    return rng.normal(size=(200, 4)), rng.integers(0, 2, 200), rng.normal(size=(50, 4)), rng.integers(0, 2, 50)
