"""The per-rank loop: train a unit, mix, and every S units a signature round and the consensus check.

The engine is a set of parts that own their state (``state_dict`` /
``load_state_dict``), built from their config sections:

- ``replica``: the shard, the model as one flat buffer, the optimizer (replica.py);
- ``mixer``: who mixes with whom and how, by the strategy's step (mixer.py, strategies.py);
- ``rounds``: signatures, their gather, the communities (rounds.py);
- ``consensus``: patience, merge activity, the consensus model (consensus.py);
- ``log``: the rows that reach rank 0 and the run directory (runlog.py);
- ``checkpoints``: ``{name: part.state_dict()}`` (checkpoint.py).

``Engine.run`` asks the parts what to do; a round's result is passed on
explicitly. Decisions that must agree (exchange lists, communities, the stop)
are computed by every rank from identical inputs.
"""
from __future__ import annotations

import logging
import os
import platform
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..config import Config
from ..core.protocol import RunningDigest
from ..errors import ConfigError, DiskError, Preempted, StopReason, collective
from ..manifest import read_info
from ..results import Summary, TimeCategory, finite_or_none
from ..runtime import stopflag
from ..runtime.collective import collective_check, on_every_rank
from ..runtime.comm import RankLost
from ..runtime.groups import build_groups
from ..runtime.view import WorldView
from ..workload import private
from . import protocols
from .faults import make_faults
from .outcome.community_mode import CommunityMode
from .outcome.consensus import Decision
from .outcome.delivery import Delivery
from .progress import Progress
from .record import trackers, tracking
from .record.round_snapshots import RoundSnapshots
from .record.runlog import RunLog, count_merges, language_model, print_summary
from .replica.replica import Replica
from .state import survival
from .state.async_survival import AsyncSurvival
from .state.checkpoint import Checkpointer, Stateful
from .state.run_dir import Resume, RunDirectory, describe_partition, now
from .timer import Timer

log = logging.getLogger(__name__)



def _set_up(cfg: Config, world: WorldView) -> torch.device:
    """Every rank's checks and settings before the parts are built (each a step all ranks pass or none does):
    the world and the trackers' and DP's packages, ULFM, the watchdog, threads, determinism, the device."""
    def check() -> None:
        cfg.check_world(world.size)
        tracking.check_available(cfg)
        if cfg.privacy.enabled:
            private.require_opacus()

    collective_check(world, check)
    if cfg.comm.fault_tolerance == "shrink":
        on_every_rank(world, world.enable_shrink)  # no ULFM here: exit 2 naming the launch line
    world.set_timeout(cfg.comm.timeout)
    torch.set_num_threads(cfg.threads or _env_threads())
    deterministic_algorithms()
    local_rank = world.local_rank if cfg.device != "cpu" else 0  # a collective: before on_every_rank
    device = on_every_rank(world, lambda: select_device(cfg.device, local_rank))
    unused = unused_gpus(cfg.device)
    if unused and world.leads:
        log.warning(unused)
    return device

class Engine:
    """One rank's engine. Build with ``Engine(cfg, world, run_dir, ...)`` (a collective), then ``run()``."""

    def __init__(self, cfg: Config, world: WorldView, run_dir: Path, *, overwrite: bool = False,
                 argv: Optional[List[str]] = None, progress: bool = True, resume: Resume = Resume.FRESH):
        self.cfg, self.world = cfg, world
        resume = Resume(resume)  # a Resume or its value; anything else (a bool) is a ValueError naming it
        if resume is not Resume.FRESH:
            survival.resume_membership(world, Path(run_dir))  # a job of survivors: their logical ranks

        device = _set_up(cfg, world)
        self.timer = Timer(turns=world.turn_seconds, waits=world.waited_seconds)
        self.faults = make_faults(cfg.faults, cfg.seed, world.rank, block=world.process_block)
        self.agreement = RunningDigest()
        # train.group_size > 1: the algorithm's parts see the groups (a group's lead speaks for it across groups);
        # the replica's own (data, training, rows, checkpoints) keep the replica's world
        self.groups = build_groups(world, cfg.train.group_size)
        view = world if self.groups is None else self.groups
        self.replica = Replica.build(cfg, world, device, self.timer, self.faults, groups=self.groups)
        self.rounds, self.mixer, self.consensus, collective_log = protocols.build(
            cfg, view, self.timer, self.replica, self.agreement)
        self.mode = CommunityMode(cfg, view, self.timer, replica=self.replica,
                                  strategy=self.mixer.strategy)
        self.mixer.probe = self.mode.probe
        self.snapshots = RoundSnapshots(world, Path(run_dir)) if cfg.output.round_snapshots else None
        self.run_dir = RunDirectory(cfg, world, run_dir)
        resumed = self.run_dir.open(overwrite, resume, lambda: describe_partition(self.replica), argv or sys.argv,
                                    device, n_params=self.replica.flat.numel())
        self.log = RunLog(cfg, world, self.timer, writer=self.run_dir.writer, collective=collective_log,
                          lm=language_model(self.replica.data.dataset),
                          logs_merges=self.groups is None or self.groups.leads_group)
        text = self.replica.data.dataset.text
        self.progress = Progress(cfg.name, cfg.train.budget, progress and world.leads,
                                 bytes_per_token=None if text is None else text.bytes_per_token)
        parts: Dict[str, Stateful] = {
            "replica": self.replica, "mixer": self.mixer, "rounds": self.rounds, "consensus": self.consensus,
            "log": self.log, "timer": self.timer, "traffic": world, "agreement": self.agreement, "faults": self.faults}
        if cfg.consensus.mode != "global":
            parts["mode"] = self.mode
        self.survival = survival.NoSurvival()
        self.argv = list(argv or sys.argv)
        self._heir = False  # this rank took the run directory over from a lost writer
        self.logged_t: int = 0  # the last unit whose row this rank logged (async: where a survivor goes on from)
        if cfg.comm.fault_tolerance == "shrink":  # what a lost rank rolls back: all but the clocks and counters
            rolled = {k: v for k, v in parts.items() if k not in ("timer", "traffic")}
            hooks: Dict[str, Any] = dict(replica=self.replica, lost_shard=cfg.comm.lost_shard,
                                         rewind=self._rewind, log_lost=self._log_lost, take_over=self._take_over,
                                         on_shrink=self._regroup)
            if cfg.protocol == "async":  # nothing rolled back: the survivors settle and go on (async_survival.py)
                self.survival = AsyncSurvival(world, rolled, mixer=self.mixer, logged_t=lambda: self.logged_t,
                                              run_dir=self.run_dir, drop_rows=self.log.drop_after, view=view, **hooks)
                self.log.seen = {}  # a final gather cut by a loss is gathered again: its rows are written once
            else:
                self.survival = survival.Survival(world, rolled, **hooks)
        self.checkpoints = Checkpointer(cfg, world, Path(run_dir) / "checkpoints", parts=parts,
                                        before_save=lambda: self.log.flush(final=True), info=self._checkpoint_info,
                                        failure=lambda: self.run_dir.failure, faults=self.faults)
        try:
            self.t = self.checkpoints.load(resumed, self.run_dir.resume_data) if resumed is not None else 0
        except BaseException:
            self.run_dir.release()
            raise
        self.run_dir.resume_data = None
        self.loaded_t = self.t if resumed is not None else -1
        self.logged_t = self.t
        if resumed is not None:
            self.survival.restore(read_info(resumed))
        if world.leads and tracking.enabled(cfg):
            self._open_trackers(self.t)

    # ------------------------------------------------------------------ the loop

    def run(self) -> Optional[Summary]:
        """Train until consensus or the budget; rank 0 returns the summary."""
        self.timer.start()
        self.progress.begin(self.t)
        previous_handlers = stopflag.install()
        try:
            # what the parts do not claim: the loop itself, checkpoints, log writes
            with self.timer(TimeCategory.OTHER):
                summary = self._train()
        except Preempted:
            # Keep the flag-only handlers: after `scontrol requeue` SLURM sends SIGTERM to every rank while
            # they are exiting, and they must still exit 75 rather than die of the signal.
            self._close_trackers("interrupted")
            raise
        except DiskError as exc:  # raised on every rank at the same collective step
            stopflag.restore(previous_handlers)
            self._close_trackers("failed")
            raise self.run_dir.failed(exc, self.t) from None
        except BaseException:
            self._close_trackers("failed")
            raise
        else:
            stopflag.restore(previous_handlers)
            return summary
        finally:
            self.progress.close()

    def _open_trackers(self, t: int) -> None:
        """The lead: TensorBoard, W&B, MLflow as configured; where they log goes into meta.json's ``tracking``."""
        meta = self.run_dir.meta
        self.log.board = trackers.open_trackers(self.cfg, self.run_dir.path, t, key=str(meta.get("run_id", "")))
        meta["tracking"] = self.log.board.identities()

    def _close_trackers(self, status: str) -> None:
        if self.log.board is not None:
            self.log.board.close(status)

    def _train(self) -> Optional[Summary]:
        """The units, then the end; a lost rank (fault_tolerance shrink) sends the survivors back to a round."""
        self.survival.remember(self.t)
        while True:
            try:
                ended = False
                for t in range(self.t + 1, self.cfg.train.budget + 1):
                    self.t = t
                    if self._unit(t):
                        ended = True
                        break
                    self.survival.unit_done(t)
                while not ended and self.mixer.train_on():  # async, train.after_budget train: past the budget
                    self.t += 1
                    ended = self._unit(self.t)
                self.mixer.drain()  # async: serve until every rank is done; then the ranks are together again
                self.consensus.record(self.log.merges(self.mixer.late_events()))  # (async: merges in the drain)
                # (a resume of a run that reached its end but could not write it: the checkpoint loaded is the end)
                if self.cfg.checkpoint.at_end and self.t != self.loaded_t:
                    self.checkpoints.save(self.t, final=True)
                return self._finish()
            except RankLost as lost:
                with self.timer(TimeCategory.IDLE):
                    self.t = self.survival.recover(lost)

    def _unit(self, t: int) -> bool:
        """Unit t of this rank; True when the run ends here (consensus reached, or the wall budget spent)."""
        self.world.watchdog.context = f"t={t}"
        if self.cfg.faults.disk_full_at is not None and t >= self.cfg.faults.disk_full_at:
            self._fill_disk()
        hyper = self.replica.hyper
        self.log.unit(self.replica.train_unit(t, self.mixer.grad_sync, self.mixer.unit_steps,
                                              self.mixer.between_batches),
                      None if hyper is None else hyper.values.copy())
        self.logged_t = t
        self.consensus.record(self.log.merges(self.mixer.mix(t)))
        decision = self._round(t) if self.rounds.due(t) else None
        if self.rounds.late_view_due(t) and self.mixer.law(t) is None:  # async: a partner law that waits for its
            self._round(t)  # first view gets it once the gossip table fills; the verdict waits for a round proper
        self.log.consensus(self.consensus.evaluate_due(t))
        self.progress.update(t, self.rounds.latest_count, self.rounds.last_dispersion,
                             self.replica.test_acc, self.replica.recent_loss,
                             epsilon=self.replica.epsilon if self.replica.dp is not None else None)
        stop = decision is not None and decision.stop  # identical on every rank (virtual clock): a signal is moot
        if self.cfg.protocol == "async" and self.rounds.due(t):  # a population's replicas stop together: once
            member = self.groups is not None and not self.groups.leads_group  # (a group's view is its lead's)
            stop = self.world.together(("settled", t), None if member else stop, _all_settled)
        if stop:
            return True
        # A write that failed on rank 0 (a full disk) stops every rank like a signal, then raises there.
        signal = stopflag.requested() or self.run_dir.stop_file_present() or self.run_dir.failure is not None
        reason = self.mixer.stop_reason(t, self.rounds.due(t), signal)
        if reason == StopReason.BUDGET:
            return True
        if reason == StopReason.SIGNAL:
            self.mixer.drain()
            self.consensus.record(self.log.merges(self.mixer.late_events()))
            self._share_failure()
            self.checkpoints.save(t)
            self._preempt(t)
        if self.checkpoints.due(t):
            self.checkpoints.save(t)
        if self.rounds.due(t):
            self.survival.remember(t)  # fault_tolerance shrink: where the survivors of a lost rank go on from
        return False

    def _round(self, t: int) -> Optional[Decision]:
        """A signature round: new communities for the mixer, a verdict from the consensus, a round in the log."""
        rnd = self.rounds.run(t)
        decision, mode = None, None
        if rnd is not None:
            self.mixer.observe(rnd)
            mode = self.mode.observe(rnd)  # consensus.mode: may freeze the communities (the law becomes final)
            decision = self.consensus.observe(rnd, self.mixer.annealed(t), self.mode.dispersion(rnd))
            if self.snapshots is not None:
                self.snapshots.save(rnd.index, t, self.replica.flat, self.replica.n_params)
        self.log.round(rnd, self.mixer.law(t), decision, self.agreement.value, self.replica.tracker, mode=mode)
        return decision

    # ------------------------------------------------------------------ stop and finish

    def _share_failure(self) -> None:
        """A collective: rank 0's recorded write failure, if any, raised as the same DiskError on every rank."""
        failure = self.run_dir.failure
        message = self.world.bcast_text(str(failure) if failure is not None else "")
        if message:
            raise collective(DiskError(message))

    def _fill_disk(self) -> None:
        """Fault injection (``faults.disk_full_at``): from now on every write into the run directory fails."""
        self.checkpoints.full = True
        if self.snapshots is not None:
            self.snapshots.full = True
        if self.run_dir.writer is not None:
            self.run_dir.writer.full = True

    def _preempt(self, t: int) -> None:
        self.run_dir.interrupted(t)
        # No rank exits before rank 0 has committed: srun --kill-on-bad-exit would otherwise kill rank 0
        # mid-commit when the first rank exits 75.
        self.world.barrier("Barrier before exiting on a stop (rank 0 commits the checkpoint)")
        raise Preempted(f"stopped at t={t}")

    def _checkpoint_info(self) -> dict:
        com = self.mixer.strategy.communities
        return {"round": self.rounds.index, "time": now(),
                "communities": com.labels.tolist() if com is not None else None, **self.survival.info()}

    def _take_over(self, t: int, lost: List[int]) -> None:
        """The new lead, when the writer was lost: the run directory, and the log's writing side, are its own."""
        self.run_dir.take_over(t, lost, self.argv)
        self.log.writer = self.run_dir.writer
        self.log.load_seen(self.run_dir.path)  # (async: what the lost writer wrote is not written again)
        self._heir = True  # its own merge count started at zero: it counts the file's instead
        if self.cfg.protocol == "async":  # (nothing is rewound after it: count now)
            self.log.merges_logged = count_merges(self.run_dir.path / "merges.jsonl")
        if tracking.enabled(self.cfg) and self.log.board is None:
            self._open_trackers(t)

    def _rewind(self, t: int, lost: bool = False) -> None:
        """The lead, after a loss: the logs back to t. An heir of a lost writer counts the merges written so far
        from the file (the copy it may restore was taken while its count was not kept); the first writer's restored
        count is right already."""
        self.run_dir.rewind(t, lost=lost)
        if self._heir:
            self.log.merges_logged = count_merges(self.run_dir.path / "merges.jsonl")

    def _regroup(self, stage: str) -> None:
        """Around a shrink, with data-parallel groups: before it, the group's own communicator is revoked too (a
        member blocked in the group's average with this one returns and recovers); after it, a lost member leaves
        its group, which goes on (its average over the members alive, a new lead if its lead was lost); a group
        with no member alive is lost."""
        if self.groups is None:
            return
        if stage == "before":
            self.groups.revoke()
            return
        self.groups.refresh()
        assert self.replica.group is not None
        self.replica.group.refresh()
        self.log.logs_merges = self.groups.leads_group

    def _log_lost(self, records: List[dict]) -> None:
        """The lead: the ranks lost, as ``merges.jsonl`` rows (event ``lost``), written at once."""
        if self.run_dir.writer is not None:
            self.run_dir.writer.append_jsonl("merges.jsonl", survival.lost_rows(records))

    def _finish(self) -> Optional[Summary]:
        """The consensus model, evaluated and saved, and the summary (rank 0 returns it)."""
        cfg, replica = self.cfg, self.replica
        self.rounds.drain()
        self.log.flush(final=True)
        self.log.consensus_rows(self.consensus.curve())
        with self.world.monitoring():
            mean = self.consensus.model()
        with self.timer(TimeCategory.EVAL):  # the same bits on every rank: scored once per process (a population)
            acc, loss = self.world.shared(("consensus evaluation", "end"), lambda: replica.evaluate(mean))
        distance = float(torch.dist(replica.flat, mean) / max(float(mean.norm()), 1e-12))
        # the round written at this very unit, if any (its snapshots are the weights delivered now)
        at_round = self.rounds.index - 1 if self.rounds.due(self.t) and self.rounds.index > 0 else None
        with self.world.monitoring():  # forming and scoring the delivered models: not training traffic
            delivery = Delivery(cfg, self.world, self.timer, replica=replica, mode=self.mode,
                                strategy=self.mixer.strategy, group_size=cfg.train.group_size)
            local_test, community_models, files = delivery.deliver(mean, self.t, at_round)
        run = {"name": cfg.name, "strategy": cfg.strategy, "world_size": self.world.size,
               "n_params": int(replica.flat.numel()), "units": self.t, "rounds": self.rounds.index,
               "consensus_test_acc": acc, "consensus_test_loss": loss,
               "communities_per_round": self.rounds.counts, "first_round_ari": self.rounds.first_ari,
               "final_dispersion": finite_or_none(self.rounds.last_dispersion),
               "consensus_reached_t": self.consensus.reached_t, "consensus_test_split": replica.data.test_split,
               "local_test": local_test, "consensus_mode": self.mode.summary(), "community_models": community_models,
               "membership": self.survival.summary()}
        if run["membership"] is not None and self.world.leads:
            run["membership"]["writers"] = self.run_dir.meta.get("writers", [])
        self.log.models(files, community_models)
        model = replica.state_dict_of(mean) if self.world.leads else None
        with self.world.monitoring():  # measuring, not training traffic
            self.timer.settle(self.world)
        dp = None
        if replica.dp is not None:
            dp = {"epsilon": replica.epsilon, "noise_multiplier": replica.dp.noise_multiplier,
                  "sample_rate": replica.dp.sample_rate, "dp_steps": replica.dp_steps,
                  "planned_epsilon": replica.dp.planned_epsilon}
        com = self.mixer.strategy.communities
        labels = None if com is None else np.repeat(com.labels, cfg.train.group_size)  # (a group's, per replica)
        summary = self.log.finish(run, replica.test_acc, distance, model, replica.tracker, views=self.rounds.views,
                                  dp=dp, hyper=None if replica.hyper is None else replica.hyper.values, labels=labels,
                                  test_loss=replica.test_loss)
        self.run_dir.complete(self.log.products)
        self._share_failure()  # the end's writes are rank 0's: every rank must learn whether they failed
        return summary


def _all_settled(views: List[Optional[bool]]) -> List[bool]:
    """Whether every view of a process has settled (a group member's, None, is its lead's)."""
    told = [v for v in views if v is not None]
    return [bool(told) and all(told)] * len(views)


def select_device(device: str, local_rank: int) -> torch.device:
    """``cpu``, ``cuda`` (an error where torch sees no GPU) or ``auto``: GPU ``local_rank % count`` if any."""
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if device == "cuda":
            raise ConfigError(f"device='cuda' but torch {torch.__version__} sees no CUDA device on host "
                              f"{platform.node()}")
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def unused_gpus(device: str, env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """A warning when SLURM gave the job GPUs (``SLURM_GPUS_ON_NODE``) that ``device: cpu`` leaves idle: a
    hand-written batch script's (``communities slurm`` refuses the combination)."""
    gpus = (os.environ if env is None else env).get("SLURM_GPUS_ON_NODE", "").strip()
    if device != "cpu" or not gpus.isdigit() or int(gpus) == 0:
        return None
    return (f"communities: warning: SLURM gave this job {gpus} GPU(s) per node, but device='cpu': the ranks train "
            "on the CPUs (set device=cuda to use the GPUs)")


def deterministic_algorithms() -> None:
    """``torch.use_deterministic_algorithms(True, warn_only=True)``, without importing ``torch._inductor``.

    The public call imports the compiler stack only to copy the flag into inductor's config, which costs
    1.2 CPU-seconds per rank at start-up (2.3 s against 1.1 s for ``import torch`` and the flag, measured on
    this 2-core machine): a third of a rank's start-up, paid by every rank of every job. The engine never
    compiles, so where the compiler is not loaded already, the flag is set in torch's core alone.
    """
    set_flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_flag is None or "torch._inductor" in sys.modules:
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        set_flag(True, warn_only=True)


def _env_threads() -> int:
    """Threads per rank when the config leaves ``threads`` unset: OMP_NUM_THREADS (SLURM's --cpus-per-task)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def run(cfg: Config, world: WorldView, *, overwrite: bool = False, argv: Optional[List[str]] = None,
        progress: bool = True, resume: Resume = Resume.FRESH) -> Optional[Summary]:
    """Run one training job on this rank; rank 0 returns the summary."""
    run_dir = Path(cfg.output.root) / cfg.name
    engine = Engine(cfg, world, run_dir, overwrite=overwrite, argv=argv, progress=progress, resume=resume)
    if world.leads and engine.run_dir.resumed_from is not None:
        log.info(f"communities: resuming {run_dir} from {engine.run_dir.resumed_from.name} (t={engine.t})")
    summary = engine.run()
    if summary is not None:
        print_summary(summary, run_dir)
    return summary
