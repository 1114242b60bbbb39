"""What data one rank holds: a frozen value, built once by a collective (``load_replica_data``), then only
replaced (``adopt``), never changed.

Reading, the ranks' fingerprint check, a sharded reader's shard combination and the placement of tensors
on the device are set-up steps; what they leave (this rank's training shard, the shared test split, its local
test split, and what every rank holds) does not change during a run, except that a survivor may adopt the
shards of lost ranks, which gives a new ``ReplicaData`` (``adopt``).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import numpy as np
import torch

from ...errors import ConfigError, Disagreement
from ...runtime.collective import on_every_rank
from ...runtime.view import WorldView
from ...workload import data

if TYPE_CHECKING:
    from ...config import Config

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class ReplicaData:
    """This rank's data on the device, and what it knows of every rank's shard."""

    dataset: data.Dataset  # (a sharded reader's: this rank's training shard, the shared test split)
    rank: int
    shard: data.Shard  # this rank's training indices (lost ranks' appended by ``adopt``) and its group
    shards: List[data.Shard]  # every rank's at the start (a sharded reader: sizes and groups, its own in full)
    x: torch.Tensor  # this rank's training shard
    y: torch.Tensor
    x_test: torch.Tensor  # the shared test split
    y_test: torch.Tensor
    x_local: torch.Tensor  # this rank's local test data (data.local_test_fraction; may be empty)
    y_local: torch.Tensor
    label_counts: Optional[List[List[int]]]  # a sharded reader's: every rank's label counts (else from shards)
    local_test_sizes: List[int]  # every rank's
    test_split: str  # which test split the consensus is scored on ("shared", or a note that the ranks' differ)

    @property
    def sharded(self) -> bool:
        """Whether a sharded reader gave each rank only its own training shard."""
        return self.dataset.sharded

    @property
    def groups(self) -> Optional[List[int]]:
        """The group of every rank: planted (data.partition: label_groups) or declared by a user dataset; else None."""
        return None if self.shard.group is None else [int(s.group) for s in self.shards]  # type: ignore[arg-type]

    def adopt(self, ranks: List[int]) -> "ReplicaData":
        """comm.lost_shard adopt: this value with the shards of lost ``ranks`` appended to this rank's own."""
        if self.sharded:  # a sharded reader's ranks know only their own shard
            log.warning(f"communities: rank {self.rank} cannot adopt the shards of lost ranks {ranks}: a sharded "
                        "reader's shards are not known here; they are dropped")
            return self
        extra = [np.asarray(self.shards[r].indices, dtype=np.int64) for r in ranks]
        own = np.asarray(self.shard.indices, dtype=np.int64)
        shard = data.Shard(np.concatenate([own] + extra), self.shard.group)
        idx = torch.as_tensor(shard.indices)
        x = data.rows(self.dataset.x_train, idx).to(self.x.device)
        y = data.rows(self.dataset.y_train, idx).to(self.y.device)
        log.warning(f"communities: rank {self.rank} adopts the shards of lost rank{'s' if len(ranks) > 1 else ''} "
                    f"{', '.join(map(str, ranks))}: {len(own)} -> {len(shard.indices)} training examples")
        return dataclasses.replace(self, shard=shard, x=x, y=y)


def load_replica_data(cfg: "Config", world: WorldView, device: torch.device) -> ReplicaData:
    """A collective: read the data, check the ranks read the same, partition it and place this rank's part."""
    ds, fp, own_group = on_every_rank(world, lambda: _read(cfg, world))
    test_split = _check_same_data(cfg, world, ds, fp)
    combined = _combine_shards(cfg, world, ds, own_group) if ds.sharded else None
    return on_every_rank(world, lambda: _place(cfg, world, device, ds, test_split, combined=combined))


def _read(cfg: "Config", world: WorldView) -> Tuple[data.Dataset, Tuple[str, str], Optional[int]]:
    """This rank's copy of the dataset (a sharded reader's: its own training shard), its fingerprint, and a
    sharded reader's declared group for this rank."""
    # mnist1d's generator reseeds numpy's global state, so load before seeding anything.
    # (the replicas of one process share one copy: a dataset function's own sharding is by rank, so not there)
    key = ("data.load", world.rank if ":" in cfg.data.dataset else None)
    ds = world.shared(key, lambda: data.load(cfg.data, cfg.seed, world.rank, world.size))
    own_group = None
    if ds.sharded:
        own_group = data.own_group(ds, world.rank, world.size)
        needs_pool = [k for k, on in (("examples.track", cfg.examples.track),
                                      (f"signature.kind={cfg.signature.kind!r}",
                                       cfg.signature.kind in ("logits", "cka"))) if on]
        if needs_pool:
            raise ConfigError(f"{' and '.join(needs_pool)} need the whole training set on every rank, but "
                              f"data.dataset={cfg.data.dataset!r} is a sharded reader (it takes rank or "
                              "world_size) and gives each rank only its own shard")
    return ds, world.shared(("fingerprint", id(ds)), lambda: data.fingerprint(ds)), own_group


def _check_same_data(cfg: "Config", world: WorldView, ds: data.Dataset, fingerprint: Tuple[str, str]) -> str:
    """A collective: the ranks compare their data's fingerprints; which test split the consensus is scored on.

    A dataset function that is not deterministic gives every rank different data. That is refused
    (``data.on_mismatch: refuse``, a Disagreement naming the ranks, before anything is written), or
    with ``warn`` trained on as it is, the consensus scored on rank 0's test split, as the summary says.
    A sharded reader's training shards differ by design; its test split must not.
    """
    train_fp, test_fp = fingerprint
    texts = world.allgather_text(f"{train_fp} {test_fp}", width=80)
    lead = world.lead  # rank 0, or the lowest survivor of a lost rank 0 (a resume of survivors)
    said = [(t if alive else texts[lead]).split() for t, alive in zip(texts, world.alive)]  # (lost: as the lead)
    test_differ = [r for r, (_, te) in enumerate(said) if te != said[lead][1]]
    train_differ = [] if ds.sharded else [r for r, (tr, _) in enumerate(said) if tr != said[lead][0]]
    if ds.sharded and world.size > 1 and len({tr for tr, _ in said}) == 1 and world.leads:
        log.warning(f"communities: warning: data.dataset={cfg.data.dataset!r} gave every rank the same training "
                    "shard; a sharded reader (it takes rank or world_size) should return rank's own part")
    if not (test_differ or train_differ):
        return "shared"
    what = " and ".join(w for w, d in (("training set", train_differ), ("test split", test_differ)) if d)
    ranks = sorted(set(test_differ) | set(train_differ))
    if cfg.data.on_mismatch == "refuse" and ds.text is not None:
        raise Disagreement(
            f"data.dataset={cfg.data.dataset!r}: the ranks' data differ: ranks {ranks} read another {what} than "
            f"rank {lead} (" + ("another Python version's standard library?" if cfg.data.dataset == "pystdlib" else
                          f"other files under data.root={cfg.data.root!r}?") + " Every rank must read the same "
            "corpus; data.on_mismatch=warn trains anyway)")
    if cfg.data.on_mismatch == "refuse":
        fn = cfg.data.dataset.partition(":")[2] or cfg.data.dataset
        raise Disagreement(
            f"data.dataset={cfg.data.dataset!r}: the ranks' data differ: ranks {ranks} hold another {what} than "
            f"rank {lead}. Is {fn}() deterministic? It is called with seed= (use it for every random choice)"
            + (" and must return the same test split on every rank" if ds.sharded else "")
            + "; data.on_mismatch=warn trains anyway")
    if not test_differ:
        if world.leads:
            log.warning(f"communities: warning: the ranks' training sets differ (ranks {train_differ} from rank "
                        f"{lead}'s); data.dataset={cfg.data.dataset!r} is not deterministic? Each rank trains on its "
                        "own partition of its own copy")
        return "shared"
    if world.leads:
        log.warning(f"communities: warning: the ranks' test splits differ (ranks {test_differ} from rank {lead}'s); "
                    f"data.dataset={cfg.data.dataset!r} is not deterministic? The consensus is scored on "
                    f"rank {lead}'s, each rank on its own")
    return (f"rank {lead}'s (the test splits differ across ranks: {len(test_differ)} of {len(said)} from "
            f"rank {lead}'s)")


def _combine_shards(cfg: "Config", world: WorldView, ds: data.Dataset, own_group: Optional[int]
                    ) -> Tuple[List[data.Shard], np.ndarray, List[List[int]], List[int]]:
    """A collective, for a sharded reader: the class count, standardisation and shard records of every rank.

    Each rank holds out its own local test split (``data.split_local``, as ``data.hold_out`` would); the
    records are of the training part. Returns (shards, this rank's local test indices, label counts, local
    test sizes); the shards of other ranks are their sizes and groups only."""
    ds.classes = int(world.allreduce_array(np.array([max(ds.y_train.max(), ds.y_test.max())]), op="max")[0]) + 1
    if cfg.data.standardize:
        data.standardize_by_moments_(ds, world.allreduce_array(data.moments(ds.x_train)))
    kept, local = data.split_local(np.arange(len(ds.y_train), dtype=np.int64), cfg.data.local_test_fraction,
                                   cfg.seed, world.rank)
    own = np.concatenate([[len(kept), -1 if own_group is None else own_group, len(local)],
                          np.bincount(ds.y_train[kept], minlength=ds.classes)]).astype(np.int64)
    rows = world.allgather(own)
    shards = [data.Shard(np.arange(int(n), dtype=np.int64), None if own_group is None else int(g))
              for n, g in rows[:, :2]]
    shards[world.rank] = data.Shard(kept, shards[world.rank].group)
    return shards, local, rows[:, 3:].tolist(), rows[:, 2].tolist()


def _place(cfg: "Config", world: WorldView, device: torch.device, ds: data.Dataset, test_split: str,
           *, combined: Optional[Tuple[List[data.Shard], np.ndarray, List[List[int]], List[int]]]) -> ReplicaData:
    """This rank's shard (the partition's, or a sharded reader's own) as tensors on the device, and its local
    test data (data.local_test_fraction) held out of it."""
    label_counts: Optional[List[List[int]]] = None
    if combined is None:
        # the partition, the shift of the planted groups and the local tests: the same on every rank
        prepared = world.shared(("data.arrange", id(ds)), lambda: data.arrange(ds, cfg.data, cfg.seed, world.size))
        ds, shards, local = prepared.dataset, prepared.shards, prepared.local_tests[world.rank]
        local_test_sizes = [int(t.size) for t in prepared.local_tests]
    else:
        shards, local, label_counts, local_test_sizes = combined
    shard = shards[world.rank]
    idx, local_idx = torch.as_tensor(shard.indices), torch.as_tensor(local)
    held = ReplicaData(
        ds, world.rank, shard, shards,
        data.rows(ds.x_train, idx).to(device), data.rows(ds.y_train, idx).to(device),
        data.rows(ds.x_test, slice(None)).to(device), data.rows(ds.y_test, slice(None)).to(device),
        data.rows(ds.x_train, local_idx).to(device), data.rows(ds.y_train, local_idx).to(device),
        label_counts, local_test_sizes, test_split)
    log.debug(f"communities: rank {world.rank}: {len(shard.indices)} training examples"
              + ("" if ds.sequence else
                 f" (labels {np.bincount(ds.y_train[shard.indices], minlength=ds.n_classes).tolist()})") + ", "
              f"{len(ds.y_test)} test examples of shape {ds.input_shape}"
              + (f", {len(local)} local test examples" if len(local) else ""))
    if cfg.signature.kind in ("logits", "cka") and cfg.signature.probe_size > len(ds.y_train):
        raise ConfigError(f"signature.probe_size={cfg.signature.probe_size} exceeds the "
                          f"{len(ds.y_train)} training examples")
    return held
