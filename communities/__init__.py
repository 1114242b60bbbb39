"""communities: decentralized data-parallel PyTorch training over MPI.

Ranks train on their own shards, allgather random-projection signatures of their
weights, cluster them into communities, and gossip-merge mostly within their
community while the probability of a cross-community partner anneals upward
until one consensus model emerges.

The Python API (docs/guides/python-api.md) is what ``__all__`` names, each imported on
first use, so that ``import communities`` stays light (no torch, mpi4py or pandas). It
leaves the program's logging as it was: the ``communities`` logger gets only a
``NullHandler``; ``communities.console.configure()`` prints what the command line prints.
"""
import logging as _logging
from importlib import import_module as _import_module

__version__ = "0.1.0"

_logging.getLogger("communities").addHandler(_logging.NullHandler())

# name -> (module, attribute): the public API, imported on first use
_PUBLIC = {
    "open_run": (".report.api", "open_run"),
    "open_runs": (".report.api", "open_runs"),
    "RunData": (".report.api", "RunData"),
    "Runs": (".report.api", "Runs"),
    "RoundData": (".report.api", "RoundData"),
    "Models": (".report.api", "Models"),
    "Summary": (".results", "Summary"),
    "load_config": (".config", "load"),
    "Config": (".config", "Config"),
    "ConfigError": (".errors", "ConfigError"),
    "ResultsError": (".errors", "ResultsError"),
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str):
    """The public API's names, imported when first used (``communities.open_run``, ``communities.load_config``)."""
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = getattr(_import_module(module, __name__), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'communities' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
