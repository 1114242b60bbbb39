"""What each rank is handed at the end of a run, and how it scores on the data it serves.

The model a rank delivers is:

- ``consensus``: the Allreduce mean of every rank (consensus.mode global, or auto that kept annealing);
- ``communities``: its frozen community's model (consensus.mode communities, or auto that froze): the mean over
  the community's members that count (not diverged), by ``World.group_mean_`` (a Comm.Split by community label
  and an Allreduce inside), summed in float64, so that any order of summation, an MPI library's or
  ``communities export``'s, gives the same float32 model (a float64 sum of a few float32 values of one weight
  is exact);
- ``ifca``: the shared IFCA model with the lowest loss on its shard (strategy ifca);
- ``finetuned``: the consensus fine-tuned ``consensus.finetune_units`` units on its own shard;
- ``own``: its own model (strategy isolated).

Each is scored on the rank's local test data (data.local_test_fraction) beside the shared test split.
Rank 0 writes the per-community (or per-IFCA-cluster) models as ``models/community_<c>.pt`` with
``models/communities.json`` (members, scores), and summary.json's ``local_test`` and ``community_models``.
"""
from __future__ import annotations

import io
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ...results import finite_or_none
from ...runtime.view import WorldView
from ...workload import train
from ..mixing.ifca import IFCA
from ..replica.replica import Replica
from ..timer import Timer
from .community_mode import CommunityMode

MODELS_DIR = "models"
# one row per rank: its group (community or IFCA pick, -1: none), the group model on its local test data and on
# the shared test split, its own model and the consensus on its local test data, the fine-tuned consensus there
ROW = ("group", "group_local_acc", "group_local_loss", "group_test_acc", "group_test_loss", "own_acc", "own_loss",
       "consensus_acc", "consensus_loss", "finetuned_acc", "finetuned_loss", "local_size")


def _nan_list(values) -> List[Optional[float]]:
    return [finite_or_none(float(v)) for v in values]


def _mean(values) -> Optional[float]:
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else None


class Delivery:
    """The end of a run on one rank: form the delivered models, score them, gather the figures to rank 0."""

    def __init__(self, cfg, world: WorldView, timer: Timer, *, replica: Replica, mode: CommunityMode, strategy,
                 group_size: int = 1):
        # ``world``: the replica's own (each replica delivers and scores on its own local data); the communities are
        # over groups of ``group_size`` (train.group_size), each replica in its group's
        self.cfg, self.world, self.timer, self.replica, self.mode, self.strategy = \
            cfg, world, timer, replica, mode, strategy
        self.group_size = group_size

    @property
    def kind(self) -> str:
        if self.mode.frozen is not None:
            return "communities"
        if isinstance(self.strategy, IFCA):
            return "ifca"
        if self.cfg.consensus.finetune_units > 0:
            return "finetuned"
        if self.cfg.strategy == "isolated":
            return "own"
        return "consensus"

    def deliver(self, consensus: torch.Tensor, t: int, round_index: Optional[int]
                ) -> Tuple[Optional[dict], Optional[dict], Dict[str, bytes]]:
        """A collective: (summary ``local_test``, summary ``community_models``, files for rank 0 to write).

        ``round_index``: the signature round taken at this very unit, if any (its snapshots are these weights).
        """
        r = self.replica
        local = r.has_local_test
        nan = float("nan")
        row = dict.fromkeys(ROW, nan)
        row["local_size"] = float(len(r.data.y_local))  # examples (a language model's: windows, not tokens)
        with self.timer("eval"):
            if local:
                row["own_acc"], row["own_loss"] = r.evaluate_local()
                row["consensus_acc"], row["consensus_loss"] = r.evaluate_local(consensus)
        group, group_model, models_out = self._group_models()
        if group_model is not None:
            row["group"] = float(group)
            with self.timer("eval"):
                if local:
                    row["group_local_acc"], row["group_local_loss"] = r.evaluate_local(group_model)
                row["group_test_acc"], row["group_test_loss"] = r.evaluate(group_model)
        if self.cfg.consensus.finetune_units > 0:
            row["finetuned_acc"], row["finetuned_loss"] = self._finetune(consensus, t)
        rows = self.world.gather_rows(np.array([[row[k] for k in ROW]], dtype=np.float64))
        if rows is None:
            return None, None, {}
        g = dict(zip(ROW, np.concatenate(rows).T))
        files: Dict[str, bytes] = {}
        community = self._community_record(g, models_out, t, round_index, files) if models_out is not None else None
        return (self._local_record(g) if local else None), community, files

    # ------------------------------------------------------------------ the models

    def _group_models(self) -> Tuple[int, Optional[torch.Tensor], Optional[Dict[int, torch.Tensor]]]:
        """(this rank's group, its model, on rank 0 every group's model by id) for frozen communities or IFCA."""
        r, world = self.replica, self.world
        if self.mode.frozen is not None:
            frozen = np.repeat(self.mode.frozen, self.group_size)  # each replica's community (its group's)
            label = int(frozen[world.rank])
            model = r.flat.to(torch.float64)
            world.group_mean_(model, label, counts=r.keep)  # a diverged member does not count
            model = model.to(r.flat.dtype)
            # each community's lowest rank sends its model to rank 0 (float64 rows: float32 round-trips exactly)
            leader = int(np.flatnonzero(frozen == label)[0]) == world.rank
            block = model.detach().cpu().double().reshape(1, -1) if leader else np.zeros((0, model.numel()))
            got = world.gather_rows(np.asarray(block))
            models_out: Optional[Dict[int, torch.Tensor]] = None
            if got is not None:
                models_out = {}
                for rank, b in enumerate(got):
                    if b.size:
                        models_out[int(frozen[rank])] = torch.from_numpy(b[0]).to(r.flat.dtype)
            return label, model, models_out
        if isinstance(self.strategy, IFCA):
            pick = self.strategy.choose(r)  # the shared model with the lowest loss on this rank's shard
            models_out = {j: self.strategy.models[j].detach().cpu().clone() for j in range(self.strategy.k)} \
                if world.leads else None
            return pick, self.strategy.models[pick].clone(), models_out
        return -1, None, None

    def _finetune(self, consensus: torch.Tensor, t: int) -> Tuple[float, float]:
        """The consensus trained ``finetune_units`` more units on this rank's shard (fresh optimizer state), scored
        on its local test data; this rank's own weights and optimizer are left as they were."""
        r, cfg = self.replica, self.cfg
        with r.holding(consensus, fresh_optimizer=True):
            with self.timer("train"):
                for u in range(1, cfg.consensus.finetune_units + 1):
                    train.train_unit(r.model, r.opt, r.data.x, r.data.y, cfg.train, seed=cfg.seed, rank=r.rank, t=t + u)
            with self.timer("eval"):
                return r.evaluate_local() if r.has_local_test else (float("nan"), float("nan"))

    # ------------------------------------------------------------------ rank 0: the records

    def _local_record(self, g: Dict[str, np.ndarray]) -> dict:
        kind = self.kind
        delivered = {"consensus": "consensus", "own": "own", "finetuned": "finetuned",
                     "communities": "group_local", "ifca": "group_local"}[kind]
        acc_key = "group_local_acc" if delivered == "group_local" else f"{delivered}_acc"
        loss_key = "group_local_loss" if delivered == "group_local" else f"{delivered}_loss"
        out = {"fraction": self.cfg.data.local_test_fraction, "sizes": [int(s) for s in g["local_size"]],
               "delivered": kind, "acc": _nan_list(g[acc_key]), "mean_acc": _mean(g[acc_key]),
               "loss": _nan_list(g[loss_key]), "mean_loss": _mean(g[loss_key]),
               "own_acc": _nan_list(g["own_acc"]), "mean_own_acc": _mean(g["own_acc"]),
               "consensus_acc": _nan_list(g["consensus_acc"]), "mean_consensus_acc": _mean(g["consensus_acc"])}
        if self.cfg.consensus.finetune_units > 0:
            out.update(finetuned_acc=_nan_list(g["finetuned_acc"]), mean_finetuned_acc=_mean(g["finetuned_acc"]))
        return out

    def _community_record(self, g: Dict[str, np.ndarray], models_out: Dict[int, torch.Tensor], t: int,
                          round_index: Optional[int], files: Dict[str, bytes]) -> dict:
        labels = g["group"].astype(np.int64)
        entries = []
        for c in sorted(models_out):
            members = np.flatnonzero(labels == c)
            name = f"{MODELS_DIR}/community_{c}.pt"
            buf = io.BytesIO()
            torch.save(self.replica.state_dict_of(models_out[c]), buf)
            files[name] = buf.getvalue()
            entries.append({
                "community": int(c), "members": members.tolist(), "file": name,
                "local_test_acc": _mean(g["group_local_acc"][members]) if members.size else None,
                "local_test_acc_members": _nan_list(g["group_local_acc"][members]),
                "test_acc": finite_or_none(float(g["group_test_acc"][members[0]])) if members.size else None,
                "test_loss": finite_or_none(float(g["group_test_loss"][members[0]])) if members.size else None})
        record = {"kind": self.kind, "t": t, "round": round_index, "labels": labels.tolist(),
                  "frozen_round": self.mode.frozen_round, "frozen_t": self.mode.frozen_t, "models": entries}
        if self.kind == "ifca":
            record["k"] = self.strategy.k
        return record
