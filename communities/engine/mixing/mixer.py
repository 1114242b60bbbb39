"""The mixer: how ranks combine, under the virtual-clock protocol.

Each unit the strategy (``strategies.py``) says who mixes when, and takes its
step through the mixer's operations (``strategy.Mixing``): pairwise exchanges
in the order of the unit's exchange list, a global average, IFCA's masked
average of its k models, or (``allreduce``) a gradient Allreduce inside
training. The mixer owns how bytes are combined: the header and weight swap
(``PairExchange``), the merge rule and what travels with it (optimizer moments,
the record of which shards a model has seen, hard examples), the outer steps,
the collectives of the global averages, and the merge events it returns for
the run log and the consensus.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Protocol

import numpy as np
import torch

from ...config import Config
from ...core import partners, pbt, protocol
from ...core.partners import Law
from ...core.protocol import RunningDigest
from ...errors import StopReason
from ...results import Event, MergeRow
from ...runtime.view import WorldView
from ...workload import models, train
from ..replica.examples import distance_factor
from ..replica.replica import Replica
from ..rounds.signature_rounds import RoundResult
from ..timer import Timer
from . import strategies
from .exchange import Header, PairExchange, Payload, Received, decide, optimizer_moments


class MergeScorer(Protocol):
    """What scores merges as they happen (consensus.mode auto: ``community_mode.MergeProbe``)."""

    def active(self) -> bool: ...

    def merged(self, partner: int, before: torch.Tensor, a: float) -> None: ...


class Mixer:
    """The virtual-clock mixer of one rank (the default ``protocol``)."""

    def __init__(self, cfg: Config, world: WorldView, timer: Timer, *, replica: Replica, agreement: RunningDigest):
        self.cfg, self.world, self.timer, self.replica, self.agreement = cfg, world, timer, replica, agreement
        self.rank, self.n = world.rank, world.size
        self.strategy = strategies.make(cfg, self.n)
        self.pair = PairExchange(world, replica.flat.numel(), replica.flat.dtype)
        # merge.partner_policy=least_recent: the last unit the model now here trained on each rank's shard
        self.seen_at = np.full(self.n, -1, dtype=np.int64)
        self.excluded = np.zeros(self.n, dtype=bool)  # robust outliers of the latest round: no exchanges
        # consensus.mode auto: scores each merge on the local validation data (community_mode.py)
        self.probe: Optional[MergeScorer] = None
        self._events: List[MergeRow] = []
        self.grad_sync: Optional[Callable[[], None]] = None  # called between backward and the optimizer step
        self.unit_steps: Optional[int] = None  # fixed steps per unit (every rank must take as many)
        self.strategy.prepare(self)

    # ------------------------------------------------------------------ what the loop asks

    def mix(self, t: int) -> List[MergeRow]:
        """Unit t's mixing step (every rank trained unit t); returns this rank's merge events."""
        self.seen_at[self.rank] = t
        self._step(t)
        return self.late_events()

    def late_events(self) -> List[MergeRow]:
        """The merge events recorded since the last ``mix`` (async: exchanges served or completed in a drain)."""
        events, self._events = self._events, []
        return events

    def _step(self, t: int) -> None:
        """Under the virtual clock the strategy takes the step; its operations record the events."""
        self.strategy.mix(t, self)

    def events_since(self, mark: int) -> List[MergeRow]:
        """The merge events recorded since the ``mark``-th of this unit's (a group's lead tells its members)."""
        return self._events[mark:]

    def record(self, row: MergeRow) -> None:
        """A merge event of this unit's step (the strategies' own: ifca), returned by ``mix``."""
        self._events.append(row)

    @property
    def between_batches(self) -> Optional[Callable[[], None]]:
        """What runs after every batch: nothing here, the virtual clock mixes only between units."""
        return None

    def observe(self, rnd: RoundResult) -> None:
        """A new signature round: its communities set the partner law, its outliers are left out; under
        pbt.selection truncation the population's hyperparameters are selected."""
        self.excluded = rnd.outliers
        self.replica.set_outlier(bool(rnd.outliers[self.rank]))
        self.strategy.observe(rnd.communities, self, rnd.t)
        if self.replica.hyper is not None and self.cfg.pbt.selection == "truncation":
            self._select(rnd.t)

    def _select(self, t: int) -> None:
        """pbt.selection truncation: every replica's held-out loss and values gathered (one Allgather); the ready
        replicas ranked in the bottom fraction adopt the values of one drawn from the top, then explore."""
        r, hyper = self.replica, self.replica.hyper
        assert hyper is not None
        with self.timer("eval"):
            _, score = r.evaluate_local()
            score = r.group_mean(score)  # a group's: its members' mean
        with self.timer("idle"):
            table = self.world.allgather(np.concatenate([[score, float(hyper.ready(t))], hyper.values]))
        alive = self.world.alive
        scores = np.where(alive, table[:, 0], np.nan)
        source = pbt.truncation(scores, (table[:, 1] > 0) & alive, self.cfg.pbt.fraction,
                                protocol.rng(self.cfg.seed, protocol.Purpose.PBT_SELECT, t))
        j = int(source[self.rank])
        if j >= 0:
            hyper.adopt(t, table[j, 2:], r.opt)
            self.record(MergeRow.adopted(t, self.rank, j, -1, score, partner_score=float(table[j, 0])))

    @property
    def unavailable(self) -> np.ndarray:
        """Ranks no exchange may involve: the latest round's robust outliers, and ranks lost (fault_tolerance)."""
        return self.excluded if self.world.whole else self.excluded | ~self.world.alive

    def law(self, t: int) -> Optional[Law]:
        return self.strategy.law(t)

    def stop_reason(self, t: int, at_round: bool, signal: bool) -> Optional[StopReason]:
        """At signature rounds, one tiny Allreduce: ``signal`` if any rank was asked to stop (a signal or the
        STOP file), ``budget`` once any rank passed ``train.wall_budget``; the same answer on every rank.

        Polled at rounds only: no collective between rounds (the exchanges still pace every rank to the
        slowest, docs/concepts/how-it-works.md).
        """
        if not at_round:
            return None
        budget = self.cfg.train.wall_budget
        over = budget is not None and self.timer.elapsed() >= budget
        with self.timer("idle"):
            flags = self.world.allreduce_array(np.array([float(signal), float(over)]), "max")
        return StopReason.SIGNAL if flags[0] > 0 else (StopReason.BUDGET if flags[1] > 0 else None)

    def drain(self) -> None:
        """Nothing is in flight between units under the virtual clock."""

    def train_on(self) -> bool:
        """Whether this rank, its budget done, trains another unit (async's train.after_budget): never here."""
        return False

    def annealed(self, t: int) -> bool:
        return self.strategy.annealed(t)

    # ------------------------------------------------------------------ how: pairwise

    def exchange(self, t: int, partner: int, initiator: int, rule_t: Optional[int] = None) -> None:
        """Swap weights with ``partner`` and apply the merge rule on both sides.

        Two round trips: the header, then one payload (``exchange.Payload``: the
        weights, and the optimizer moments and seen-at table where they travel).
        ``rule_t`` is the unit a scheduled rule (ema) is evaluated at; both sides
        must use the same one (the asynchronous mixer passes the pair's minimum).
        """
        cfg, r = self.cfg, self.replica
        mc = cfg.merge
        moments = optimizer_moments(r.model, r.opt) if mc.optimizer_state == "average" and r.opt.state else []
        mine = self._header(t, moments)
        sent0 = self.world.bytes_sent
        with self.timer("idle"):  # the partner may still be training: this is where we wait for it
            other = self.pair.swap_headers(mine, partner)
        r.faults.in_exchange(t)
        with self.timer("exchange"):
            alpha = None
            if r.hyper is not None and "merge.alpha" in r.hyper.names:  # pbt: each side owns an alpha
                k = r.hyper.names.index("merge.alpha")
                alpha = pbt.pair_alpha(mine.hyper[k], other.hyper[k])
            a, event = decide(mine, other, mc, cfg.robust.diverged, t if rule_t is None else rule_t, alpha=alpha)
            probe = self.probe if self.probe is not None and event == Event.MERGE and self.probe.active() else None
            probed = r.flat.clone() if probe is not None else None
            outer = r.outer if event == Event.MERGE else None
            before = r.flat.clone() if outer is not None else None
            # both sides know from the two headers what travels: moments only into a merge both can average
            payload = Payload(r.flat, outgoing=r.outgoing() if r.faults.hostile else None,
                              state=moments if event == Event.MERGE and mine.state and other.state else (),
                              seen_at=self.seen_at if mc.partner_policy == "least_recent" else None)
            got = self.pair.swap(payload, partner, a)
            distance = got.distance
            if outer is not None and before is not None:
                outer.step_(before, r.flat)
                update = float(torch.dist(r.flat, before))
            else:
                update = a * distance if a else 0.0
            if event == Event.MERGE:
                self._merge_optimizer_state(a, got)
            if got.seen_at is not None:
                self._swap_seen_at(got.seen_at, a)
            # Hard examples stay a step of their own (a count, then two packets; metered as data, not as
            # bytes_sent). Their size could be told by the header (each side's count; the packets hold the
            # larger), but only by widening it, and the header's 40 bytes count as training traffic in every run;
            # the hand-over (validate, remove, append) is the tracker's (example_tracker.py).
            if event == Event.MERGE and r.tracker is not None and cfg.examples.pass_hard:
                with self.world.metered("data"):
                    r.tracker.exchange(self.world, partner, self._pass_factor(partner))
            if event == Event.RESET:
                r.opt.state.clear()  # moments of a diverged model are as bad as its weights
                r.diverged = False
            if probe is not None and probed is not None:
                with self.timer("eval"):
                    probe.merged(partner, probed, a)
        self.record(MergeRow.pairwise(t, self.rank, partner, initiator, a, update=update, distance=distance,
                                      sent=self.world.bytes_sent - sent0, event=event))
        if r.hyper is not None and cfg.pbt.selection == "tournament" and \
                pbt.adopts(mine.score, other.score, mine.ready, cfg.pbt.margin):
            r.hyper.adopt(t, np.asarray(other.hyper), r.opt)  # exploit the better side's, then explore
            self.record(MergeRow.adopted(t, self.rank, partner, initiator, mine.score, partner_score=other.score))

    def _header(self, t: int, moments: List[torch.Tensor]) -> Header:
        """This side's header; under pbt with its score (the loss on its own held-out data, before the merge)."""
        r = self.replica
        base = (r.told_samples, r.told_loss, r.flat.numel(), sum(v.numel() for v in moments), r.diverged)
        if r.hyper is None:
            return Header(*base)
        score = float("nan")
        if self.cfg.pbt.selection == "tournament":  # (truncation scores at signature rounds: ``_select``)
            with self.timer("eval"):
                _, score = r.evaluate_local()
                score = r.group_mean(score)  # a group's score: its members' mean (the same header on every member)
        return Header(*base, score=score, ready=r.hyper.ready(t), hyper=tuple(float(v) for v in r.hyper.values))

    def _merge_optimizer_state(self, a: float, got: Received) -> None:
        """reset: clear the moments; average: merge them with the partner's, which came in the payload."""
        r, mode = self.replica, self.cfg.merge.optimizer_state
        if mode == "reset":
            r.opt.state.clear()
        elif mode == "average":
            got.merge_state_(a)  # each moment in place, with its slice of the partner's

    def _swap_seen_at(self, seen: np.ndarray, a: float) -> None:
        """The record of which shards the model has seen travels with the model (in the payload)."""
        if a >= 1.0:
            self.seen_at = seen  # the partner's model is now this rank's
        elif a > 0.0:
            self.seen_at = np.maximum(self.seen_at, seen)

    def _pass_factor(self, partner: int) -> float:
        """examples.pass_similarity: the pair's signature distance against the latest round's median."""
        com, policy = self.strategy.communities, self.cfg.examples.pass_similarity
        if policy == "none" or com is None or com.distances.size == 0:
            return 1.0
        d = partners.condensed_row(com.distances, self.n, self.rank)[partner]
        return distance_factor(policy, float(d), float(np.median(com.distances)))

    # ------------------------------------------------------------------ how: global

    def enable_outer(self, anchor: bool = False) -> None:
        """An outer optimizer (merge.outer) on merges, or with an anchor on global averages (diloco)."""
        self.replica.enable_outer(self.cfg.merge.outer, anchor=anchor)

    def sync_gradients(self) -> None:
        """allreduce: the flat gradient Allreduce-averaged at every step, and every rank taking as many steps."""
        replica, world, timer = self.replica, self.world, self.timer
        flat_grad = models.bind_flat_grad_(replica.model)

        def average_gradients() -> None:
            with timer("exchange"), timer.collective("gradient_allreduce"):  # waits settle into idle
                world.allreduce_mean_(flat_grad)

        self.grad_sync = average_gradients
        if self.cfg.train.unit == "epoch":  # each step is a collective: every rank must take as many
            self.unit_steps = train.lockstep_steps([s.indices.size for s in replica.data.shards],
                                                   self.cfg.train.batch_size)

    def average(self, t: int) -> None:
        """local_sgd: every rank takes the Allreduce mean; diloco: an outer step on the mean's pseudo-gradient."""
        r = self.replica
        sent0 = self.world.bytes_sent
        with self.timer("exchange"):
            before = r.flat.clone()
            mean = r.masked_mean()
            if r.anchor is not None:
                assert r.outer is not None  # an anchor comes with its outer optimizer (diloco)
                r.outer.step_(r.anchor, mean)  # mean <- anchor - lr * nesterov(anchor - mean)
                r.anchor.copy_(mean)
            event = Event.AVERAGE
            if r.diverged and self.cfg.robust.diverged == "quarantine":
                event = Event.QUARANTINED
            else:
                if r.diverged:
                    r.opt.state.clear()
                    r.diverged, event = False, Event.RESET
                r.flat.copy_(mean)
            update = float(torch.dist(r.flat, before))
        self.record(MergeRow.global_average(t, self.rank, update, self.world.bytes_sent - sent0, event))

    def ifca_average(self, models_: torch.Tensor, pick: int) -> int:
        """ifca: each of the k shared models (the rows of ``models_``, alike on every rank) becomes the mean of
        the ranks that trained it (this rank: ``pick``, unless it does not ``keep``); returns the bytes sent.

        One *masked* Allreduce: a (k, P) buffer holding this rank's weights in the slot of its pick and zeros
        elsewhere, summed over the world with the k pick counts. It equals what a Comm.Split by pick and an
        Allreduce inside would give (adding zeros is exact), and every rank leaves it holding all k models: a
        model nobody took keeps its weights. Why not the split: the ranks would then need the other groups'
        models too (k broadcasts, k times one model's bytes, as this costs), and a communicator built per step;
        one collective does both.
        """
        r, world = self.replica, self.world
        sent0 = world.bytes_sent
        with self.timer("exchange"):
            total = torch.zeros_like(models_)
            counts = np.zeros(models_.shape[0])
            if r.keep:
                total[pick].copy_(r.flat)
                counts[pick] = 1.0
            with self.timer.collective("ifca_average"):
                world.allreduce_sum_(total.view(-1))
                counts = world.allreduce_array(counts)
            for j in range(models_.shape[0]):
                if counts[j] > 0:
                    models_[j].copy_(total[j].div_(counts[j]))
        return world.bytes_sent - sent0

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        return {"strategy": self.strategy.state_dict(), "seen_at": torch.from_numpy(self.seen_at.copy()),
                "excluded": torch.from_numpy(self.excluded.copy())}

    def load_state_dict(self, state: dict) -> None:
        self.strategy.load_state_dict(state["strategy"])
        self.seen_at = state["seen_at"].numpy().copy()
        self.excluded = state["excluded"].numpy().copy()
