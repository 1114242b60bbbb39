"""Surviving a lost rank (``comm.fault_tolerance: shrink``): roll back to the last signature round, go on smaller.

Under the virtual clock the ranks are never more than a few units apart, and
the only points every rank is known to have passed are the collectives. So each
rank keeps an in-memory copy of its parts' ``state_dict()`` at the end of every
signature round (the same bytes a checkpoint would write; the last two). When a
peer fails, ULFM raises on whichever survivor touches it first; that rank
revokes the communicator, so every other survivor's next MPI call fails too, and
the survivors:

1. shrink the communicator and agree on who is left (``World.recover``);
2. agree on the newest round every survivor has a copy of (an Allreduce min; a
   round is either complete on a survivor or its previous one is), and restore
   it: any exchange or round cut by the failure, half-received buffers included,
   is undone on every survivor, and rank 0 drops the log rows written after it;
3. go on from that unit with the lost ranks out of every exchange list, every
   gather and every mean. Ranks keep their logical numbers, so shards, merge
   clocks and partner laws keep their meaning, and every survivor derives the
   same exchange lists and communities from the agreed membership.

The lost rank's shard is dropped, or adopted (``comm.lost_shard: adopt``) by the
next rank alive after it in rank order. The writer is the lead, the lowest rank
alive (rank 0 at the start). When it is lost, the new lead takes the run
directory's lock over (the kernel released the dead holder's), sweeps its
temporaries and rewinds its logs to the agreed round like any loss, and writes
from then on; ``meta.json`` names each writer. Only a lock still held (the
writer reported lost is alive) ends the job, with ``WriterLost``.
"""
from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ...errors import ConfigError, DiskError, ResultsError, RunLocked, collective
from ...manifest import complete_dirs, read_info
from ...results import MergeRow
from ...runtime.comm import RankLost
from ...runtime.view import WorldView
from .checkpoint import Stateful

log = logging.getLogger(__name__)


class WriterLost(RuntimeError):
    """The writer was lost and no survivor could take the run directory over: the survivors stop (then resume)."""


class NoSurvival:
    """``comm.fault_tolerance: abort``: a lost rank ends the job; nothing is kept in memory."""

    def remember(self, t: int) -> None:
        """At the end of a signature round's unit (and before the first unit)."""

    def recover(self, exc: RankLost) -> int:
        raise exc

    def unit_done(self, t: int) -> None:
        """After each unit (the first one after a recovery is timed)."""

    def summary(self) -> Optional[dict]:
        return None

    def info(self) -> dict:
        return {}

    def restore(self, info: dict) -> None:
        """A resumed job: what the checkpoint says was lost (nothing to do without fault tolerance)."""


class Survival(NoSurvival):
    """The survivors' side of a lost rank: in-memory round copies, the recovery, and who was lost when."""

    KEEP = 2  # a survivor whose round was cut by the failure still holds the one before it

    def __init__(self, world: WorldView, parts: Dict[str, Stateful], *, replica, lost_shard: str, rewind, log_lost,
                 take_over, on_shrink: Callable[[str], None] = lambda stage: None):
        self.world, self.parts, self.replica, self.policy = world, parts, replica, lost_shard
        # before each shrink and right after it (data-parallel groups: their communicators revoked, then rebuilt)
        self.on_shrink = on_shrink
        self._rewind, self._log_lost = rewind, log_lost  # the lead: drop rows after t; write the LOST rows
        self._take_over = take_over  # the new lead, when the writer was lost: (t, lost) -> it writes from now on
        self.copies: List[Tuple[int, bytes]] = []
        self.lost: List[dict] = []  # {"rank", "t": unit gone on from, "adopted_by"}
        self.recoveries: List[dict] = []

    # ------------------------------------------------------------------ in the loop

    def remember(self, t: int) -> None:
        """Keep a copy of every rolled-back part's state after unit t (a signature round's unit)."""
        buf = io.BytesIO()
        torch.save({name: part.state_dict() for name, part in self.parts.items()}, buf)
        self.copies = (self.copies + [(t, buf.getvalue())])[-self.KEEP:]

    def recover(self, exc: RankLost) -> int:
        """Shrink, agree, restore the newest common round; returns the unit to go on from (every survivor)."""
        detected = time.time()
        world = self.world
        writer = world.lead
        (log.warning if world.leads else log.debug)(
            f"communities: rank {world.rank}: a peer failed ({exc}); shrinking to the survivors")
        lost: List[int] = []
        while True:
            try:
                self.on_shrink("before")
                lost += world.recover()
                self.on_shrink("after")
                t = int(world.allreduce_scalar(float(self.copies[-1][0]), "min"))
                if not world.alive[writer]:
                    self._new_writer(t, sorted(lost), writer)
                break
            except RankLost as again:  # another rank failed during the recovery itself: shrink once more
                log.warning(f"communities: rank {world.rank}: another failure while recovering ({again})")
        saved = dict(self.copies)
        if t not in saved:
            raise RuntimeError(f"rank {world.rank} holds no copy of t={t} (it has {sorted(saved)})")
        state = torch.load(io.BytesIO(saved[t]), map_location="cpu", weights_only=True)
        for name, part in self.parts.items():
            part.load_state_dict(state[name])
        self.copies = [(u, b) for u, b in self.copies if u <= t]
        self._note(sorted(lost), t, detected, writer, f"from t={t}")
        return t

    def _note(self, lost: List[int], t: int, detected: float, writer: int, went_on: str, **extra) -> None:
        """A recovery's records (who was lost, who adopted what, its timing); the lead puts the run directory
        back in order (``_tidy``), writes the lost rows and says what happened."""
        world = self.world
        for k, rank in enumerate(lost):
            self.lost.append({"rank": int(rank), "t": t, "adopted_by": self._adopt(rank, k, len(lost))})
        recovered = time.time()
        self.recoveries.append({"lost": [int(r) for r in lost], "t": t, "survivors": int(world.n_alive),
                                "writer": int(world.lead), "detected_wall": detected, "recovered_wall": recovered,
                                **extra})
        if world.leads:
            self._tidy(t)
            self._log_lost([e for e in self.lost if e["rank"] in lost])
            log.warning(f"communities: lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))}; "
                        f"{world.n_alive} survivors go on {went_on} ({recovered - detected:.2f}s to recover)"
                        + (f"; rank {world.lead} writes the run directory now" if world.lead != writer else ""))

    def _tidy(self, t: int) -> None:
        """The lead: the logs and checkpoints back to the unit the survivors go on from."""
        self._rewind(t, lost=True)

    def _new_writer(self, t: int, lost: List[int], writer: int) -> None:
        """The writer was lost: the lowest survivor takes the run directory over (a collective of the survivors).

        What it could not do (the lock is still held: the writer reported lost is alive) stops every survivor
        with ``WriterLost``, as a lost writer did before there was a takeover.
        """
        world = self.world
        problem = ""
        if world.leads:
            try:
                self._take_over(t, lost)
            except (RunLocked, DiskError, ResultsError) as err:
                problem = str(err)
        problem = world.bcast_text(problem)
        if problem:
            raise WriterLost(f"rank {writer}, the writer of the run directory, was lost and rank {world.lead} could "
                             f"not take it over ({problem}): the survivors stop (resume from the last checkpoint "
                             "with --resume)")

    def _adopt(self, rank: int, k: int = 0, count: int = 1) -> Optional[int]:
        """comm.lost_shard adopt: the next rank alive after ``rank`` adds its shard (and what it had adopted). In a
        population a lost process takes a block: its ``count`` replicas (``rank`` the k-th) go to survivors spread
        over the whole world, so that no process's stacked unit grows by a whole block of shards."""
        if self.policy != "adopt":
            return None
        alive = np.flatnonzero(self.world.alive)
        stride = max(1, len(alive) // max(count, 1)) if self.world.processes < self.world.size else 0
        heir = int(alive[(np.searchsorted(alive, rank) + k * stride) % len(alive)])
        if heir == self.world.rank:
            held = [rank] + [e["rank"] for e in self.lost if e.get("adopted_by") == rank]
            self.replica.adopt(held)
        for e in self.lost:  # what the lost rank had adopted is the heir's now
            if e.get("adopted_by") == rank:
                e["adopted_by"] = heir
        return heir

    def unit_done(self, t: int) -> None:
        last = self.recoveries[-1] if self.recoveries else None
        if last is not None and "first_unit_wall" not in last:
            last["first_unit_wall"] = time.time()  # kill -> this: what a lost rank costs the survivors

    # ------------------------------------------------------------------ records

    def info(self) -> dict:
        """For a checkpoint's manifest: who is alive (a resume launches that many ranks) and who was lost."""
        return {"alive": np.flatnonzero(self.world.alive).tolist(), "lost": list(self.lost)}

    def restore(self, info: dict) -> None:
        """A resumed job: the records, and the shards this rank had adopted."""
        self.lost = [dict(e) for e in info.get("lost", [])]
        held = [e["rank"] for e in self.lost if e.get("adopted_by") == self.world.rank]
        if held:
            self.replica.adopt(held)

    def summary(self) -> Optional[dict]:
        return {"survivors": np.flatnonzero(self.world.alive).tolist(), "lost": list(self.lost),
                "recoveries": list(self.recoveries), "lost_shard": self.policy}


def survivors(world: WorldView, run_dir: Path) -> Optional[Tuple[List[int], int]]:
    """(the logical ranks alive, the job's size) when the newest checkpoint of ``run_dir`` was written by the
    survivors of a lost rank, else None (a collective: rank 0 reads, every rank gets its answer)."""
    text = ""
    if world.leads:
        found = complete_dirs(Path(run_dir) / "checkpoints")
        if found:
            try:
                info = read_info(found[0])
            except Exception:  # a damaged manifest: the resume itself names it
                info = {}
            alive, size = info.get("alive"), info.get("world_size")
            if isinstance(alive, list) and isinstance(size, int) and len(alive) < size:
                text = json.dumps({"alive": [int(r) for r in alive], "size": size})
    text = world.bcast_text(text)
    if not text:
        return None
    got = json.loads(text)
    return [int(r) for r in got["alive"]], int(got["size"])


def resume_membership(world: WorldView, run_dir: Path) -> None:
    """Before anything else on a resume: if the newest checkpoint was written by the survivors of a larger job,
    and this job has as many ranks as survived, each process takes its logical rank (a collective)."""
    found = survivors(world, run_dir)
    if found is None:
        return
    alive, size = found
    if len(alive) != world.size:
        raise collective(ConfigError(f"cannot resume: the newest checkpoint was "
                          f"written by the {len(alive)} survivors (ranks {alive}) of a "
                          f"{size}-rank job; launch {len(alive)} ranks, not {world.size}"))
    world.set_membership(alive, size)


def lost_rows(records: List[dict]) -> List[dict]:
    """``merges.jsonl`` rows of the ranks lost: event ``lost``, i the rank, t the unit the survivors went on from."""
    return [{**MergeRow.lost(int(e["t"]), int(e["rank"])).to_json(rule="shrink"),
             **({"adopted_by": e["adopted_by"]} if e.get("adopted_by") is not None else {})} for e in records]
