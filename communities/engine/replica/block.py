"""A process's replicas as the rows of one (R, F) tensor (``train.vectorize``): the stacked step trains in place.

When the replicas of a process train as one stacked model, each replica's flat buffer (and so its model's
parameters, which are views of it: ``models.flatten_``) is re-homed into its row of one tensor the process owns,
in block order. The stacked step then updates the rows themselves: nothing is copied in before it or back after
it, and a merge, an exchange or a checkpoint, which read and write the flat buffer in place, see the rows.
Anything that rebinds a replica's ``flat`` instead of writing into it would break the view: the engine writes
(``copy_``, ``lerp_``) only.

A replica's optimizer moments are likewise views of its row of the stacked optimizer's moments
(``vectorized.train_members``), so a checkpoint compacts them (``compact_optimizer_state``): saved as a view,
a tensor would carry the whole (R, P) storage into every replica's file.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch

from ...runtime.view import WorldView
from ...workload import models


def onto_row(world: WorldView, model: torch.nn.Module, flat: torch.Tensor
             ) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """Re-home ``model`` (whose weights are ``flat``) into this replica's row of the process's block; returns
    (the block, the row): the row is its flat buffer from now on (None where the replica is not in its process's
    block: it keeps its own)."""
    block = list(world.process_block)
    if world.rank not in block:
        return None
    n, dtype, device = flat.numel(), flat.dtype, flat.device
    rows = world.shared(("replica rows", len(block), n, dtype, str(device)),
                        lambda: torch.zeros((len(block), n), dtype=dtype, device=device))
    row, _ = models.flatten_(model, out=rows[block.index(world.rank)])
    return rows, row


def compact_optimizer_state(state: Dict[str, Any]) -> Dict[str, Any]:
    """A ``torch.optim`` state dict whose tensors are copies of their own (not views of a process's stacked
    moments): what a checkpoint saves, with the bytes of a replica's own optimizer."""
    return {**state, "state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()}
                               for k, s in state["state"].items()}}
