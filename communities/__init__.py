"""communities: decentralized data-parallel PyTorch training over MPI.

Ranks train on their own shards, allgather random-projection signatures of their
weights, cluster them into communities, and gossip-merge mostly within their
community while the probability of a cross-community partner anneals upward
until one consensus model emerges.
"""
__version__ = "0.1.0"

from . import console as _console  # noqa: E402

_console.configure()  # what the modules log is printed, as the command line shows it


def __getattr__(name: str):
    """``cx.open_run`` / ``cx.open_runs`` (communities/report/api.py), imported on first use: ``import
    communities`` stays light (no torch, mpi4py or pandas)."""
    if name in ("open_run", "open_runs"):
        from .report import api

        return getattr(api, name)
    raise AttributeError(f"module 'communities' has no attribute {name!r}")
