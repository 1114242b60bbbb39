"""The pairwise exchange as the engine performs it: Sendrecv of the flat buffer, then merge.

Kept as one function so the engine and ``communities bench exchange`` run the
same code.
"""
from __future__ import annotations

import torch

from . import merge
from .comm import World


def swap_and_merge(world: World, flat: torch.Tensor, recv: torch.Tensor, peer: int, a: float, tag: int = 2,
                   distance: bool = True) -> float:
    """Exchange ``flat`` with ``peer`` into ``recv`` and merge in place; returns ||w_mine - w_peer|| (or nan)."""
    world.sendrecv(flat, recv, peer, tag=tag)
    d = float(torch.dist(flat, recv)) if distance else float("nan")
    merge.interpolate_(flat, recv, a)
    return d
