"""The per-rank loop: train a unit, exchange, sign and cluster, check consensus.

Every rank runs ``run``. Decisions that must agree (exchange lists, communities,
the stop) are computed by every rank from identical inputs; a running digest of
them is allgathered every round to prove it. Rank 0 alone writes the run
directory; the other ranks' metrics and merge records reach it as numeric
buffers gathered at signature rounds.
"""
from __future__ import annotations

import datetime as _dt
import io
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from . import (checkpoint, clustering, data, merge, models, partners, probe, protocol, robust, schedule, signature,
               stopflag, strategies, tracking, train)
from .comm import Stopwatch, World
from .config import Config, ConfigError, differences
from .exchange import ChunkBuffers, swap_and_merge_chunked
from .results import ResultsError, RunWriter, atomic_write_bytes, read_json, read_jsonl, repair_jsonl

METRIC_FIELDS = ("t", "loss", "train_acc", "test_acc", "test_loss", "samples", "bytes_sent", "wall")
MERGE_FIELDS = ("t", "i", "j", "initiator", "a", "update_norm", "distance", "bytes", "event")
# merges.jsonl events: a pairwise merge; a global Allreduce average (j = initiator = -1); kept my weights because
# the partner diverged; took the partner's weights because I diverged; left alone because I am quarantined.
EVENTS = ("merge", "average", "skip_diverged", "reset", "quarantined")
RULE_CODES = {r: k for k, r in enumerate(merge.RULES)}

USER_ERRORS = (ConfigError, data.DataError, models.ModelError, ResultsError, OSError)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped by a signal or STOP file, checkpoint written; resume with --resume
STOP_FILE = "STOP"
LOGS = ("metrics.jsonl", "merges.jsonl", "consensus.jsonl", "examples.jsonl")


class Preempted(Exception):
    """Every rank raises this after the collective stop and checkpoint; the CLI exits 75."""

    collective = True


class RunComplete(Exception):
    """``--resume`` of a run that already finished: nothing to do (exit 0)."""

    collective = True


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def collective_check(world: World, fn, root: int = 0):
    """Run ``fn`` on ``root`` and share its outcome, so a failure there stops every rank.

    A user error (bad config, data, model or run directory) is re-raised on every
    rank as a ConfigError marked ``collective``: the CLI then exits 2 everywhere
    with one message and no traceback. Any other failure aborts the job.
    """
    msg, out = "", None
    if world.rank == root:
        try:
            out = fn()
        except RunComplete as exc:
            msg = f"done\0{exc}"
        except USER_ERRORS as exc:
            msg = f"user\0{exc}"
        except Exception as exc:
            msg = f"bug\0{type(exc).__name__}: {exc}"
            world.bcast_text(msg, root)
            raise
    msg = world.bcast_text(msg, root)
    if msg:
        kind, text = msg.split("\0", 1)
        if kind == "bug":
            err = RuntimeError(f"rank {root} failed during set-up: {text}")
            err.failed_rank = root  # the CLI prints one traceback, the failing rank's
            raise err
        if kind == "done":
            raise RunComplete(text)
        raise collective(ConfigError(text))
    return out


def collective(exc: Exception) -> Exception:
    """Mark an error that every rank raises identically (safe to exit without MPI_Abort)."""
    exc.collective = True
    return exc


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


@dataclass
class RankState:
    """What one rank carries through virtual time."""

    t: int = 0
    samples: int = 0
    recent_loss: float = float("nan")
    test_acc: float = float("nan")
    test_loss: float = float("nan")
    metric_rows: List[list] = field(default_factory=list)
    merge_rows: List[list] = field(default_factory=list)
    update_norms: List[float] = field(default_factory=list)
    rounds: int = 0
    calm_rounds: int = 0
    consensus_t: Optional[int] = None
    communities_per_round: List[int] = field(default_factory=list)
    first_ari: Optional[float] = None
    last_dispersion: float = float("nan")
    first_loss: float = float("nan")
    diverged: bool = False


class Engine:
    """One rank's engine. Build with ``Engine(cfg, world, ...)``, then ``run()``."""

    def __init__(self, cfg: Config, world: World, run_dir: Path, overwrite: bool = False,
                 argv: Optional[List[str]] = None, progress: bool = True, resume=False):
        self.cfg, self.world, self.argv = cfg, world, argv or sys.argv
        self.rank, self.n = world.rank, world.size
        self.show_progress = progress and self.rank == 0
        collective_check(world, lambda: cfg.check_world(self.n))
        world.set_timeout(cfg.comm.timeout)
        torch.set_num_threads(cfg.threads or _env_threads())
        torch.use_deterministic_algorithms(True, warn_only=True)
        local_rank = world.local_rank if cfg.device != "cpu" else 0  # a collective: before on_every_rank
        self.device = on_every_rank(world, lambda: select_device(cfg.device, local_rank))
        self.watch = Stopwatch()
        self.state = RankState()
        self.writer: Optional[RunWriter] = None
        self.run_dir = Path(run_dir)
        self._overwrite = overwrite
        self._resume = resume  # False, True (--resume) or "auto" (a SLURM restart)
        self.strategy = strategies.make(cfg, self.n)
        on_every_rank(world, self._setup_data)
        self._setup_model()
        self.clock = protocol.MergeClock(self.n, cfg.seed, cfg.merge.lam) if self.strategy.pairwise else None
        self._digest = b""
        self._pending = None  # overlapped signature allgather: (request, gathered, sent)
        self._merges_logged = 0
        self._wall_before = 0.0  # wall time of earlier segments of a resumed run
        self.outliers = np.zeros(self.n, dtype=bool)  # robust: ranks left out, identical on every rank
        # BLAS distances only where every rank runs the same kernels; else pdist, the same bits on any CPU
        self.fast_distances = len(set(world.allgather_text(clustering.blas_fingerprint()))) == 1
        f = cfg.faults
        self.hostile = f.hostile_rank == self.rank
        self._hostile_rng = torch.Generator().manual_seed(cfg.seed * 31 + 7)
        self.resumed_from = self._setup_output()
        if self.resumed_from is not None:
            self._restore(self.resumed_from)

    # ------------------------------------------------------------------ setup

    def _setup_data(self) -> None:
        cfg = self.cfg
        # mnist1d's generator reseeds numpy's global state, so load before seeding anything.
        ds = data.load(cfg.data, cfg.seed)
        shards = data.partition(ds.y_train, self.n, cfg.data.partition, cfg.seed, cfg.data.alpha, cfg.data.groups,
                                cfg.data.purity)
        self.dataset, self.shards = ds, shards
        self.shard = shards[self.rank]
        idx = torch.as_tensor(self.shard.indices)
        self.x = torch.as_tensor(ds.x_train)[idx].to(self.device)
        self.y = torch.as_tensor(ds.y_train)[idx].to(self.device)
        self.x_test = torch.as_tensor(ds.x_test).to(self.device)
        self.y_test = torch.as_tensor(ds.y_test).to(self.device)
        self.tracker = None
        if cfg.examples.track:
            self.tracker = tracking.ExampleTracker(cfg.examples, np.asarray(self.shard.indices, dtype=np.int64),
                                                   ds.x_train, ds.y_train, self.n, self.rank, cfg.seed, self.device,
                                                   ds.n_classes)
        # merge.partner_policy=least_recent: the last unit the model now here trained on each rank's shard
        self.seen_at = np.full(self.n, -1, dtype=np.int64)
        self.probe_x = None
        if cfg.signature.kind in probe.KINDS:
            if cfg.signature.probe_size > len(ds.y_train):
                raise ConfigError(f"signature.probe_size={cfg.signature.probe_size} exceeds the "
                                  f"{len(ds.y_train)} training examples")
            from .similarity import probe_indices

            idx = probe_indices(len(ds.y_train), cfg.signature.probe_size, cfg.seed)
            self.probe_x = torch.as_tensor(ds.x_train[idx]).to(self.device)

    def _build_model(self):
        cfg = self.cfg
        torch.manual_seed(models.init_seed(cfg.seed, self.rank, cfg.model.init))
        model = models.build(cfg.model, self.dataset.input_shape, self.dataset.n_classes).to(self.device)
        models.check_output(model, self.x_test[:4], self.dataset.n_classes, cfg.model.name)
        flat, n_params = models.flatten_(model)
        return model, flat, n_params

    def _setup_model(self) -> None:
        cfg = self.cfg
        model, flat, n_params = on_every_rank(self.world, self._build_model)
        shapes = models.shape_signature(model)
        self.world.agree(protocol.digest(np.frombuffer(shapes.encode(), dtype=np.uint8)),
                         f"model parameter shapes and dtypes (this rank: {len(flat)} values)")
        if cfg.model.init == "shared":
            self.world.bcast_(flat, root=0)
        torch.manual_seed(cfg.seed * 104729 + self.rank)  # dropout and other stochastic layers
        self.model, self.flat, self.n_params = model, flat, n_params
        self._chunks = ChunkBuffers(flat.numel(), flat.dtype)
        self.opt = train.make_optimizer(cfg.train, model.parameters())
        sc = cfg.signature
        self.probe_signer = None
        if sc.kind in probe.KINDS:
            self.probe_signer = on_every_rank(self.world, lambda: self._make_probe_signer(model))
        else:
            sk = signature.make_sketch(sc.kind, n_params, sc.dim, cfg.seed, self.device, flat.dtype)
            ref = sk(flat[:n_params]).numpy() if self.rank == 0 else None
            ref = self.world.bcast_array(ref, (sc.dim,), np.float64)
            self.signer = signature.Signer(sk, ref)
        self.outer = self.anchor = None
        if cfg.merge.outer.enabled or self.strategy.outer:
            o = cfg.merge.outer
            self.outer = merge.OuterOptimizer(flat.numel(), o.lr, o.momentum, o.nesterov, self.device, flat.dtype)
        if self.strategy.outer:
            self.anchor = flat.clone()  # the weights all ranks held after the last global step
        self.grad_sync = None
        self.unit_steps = None
        if self.strategy.sync_gradients:
            self.flat_grad = models.bind_flat_grad_(model)
            self.grad_sync = self._average_gradients
            if cfg.train.unit == "epoch":  # every rank must take the same number of steps
                longest = max(s.indices.size for s in self.shards)
                self.unit_steps = -(-longest // cfg.train.batch_size)

    def _make_probe_signer(self, model) -> probe.ProbeSigner:
        sc = self.cfg.signature
        try:
            return probe.ProbeSigner(sc.kind, model, self.probe_x, sc.dim, self.cfg.seed, sc.layer, sc.debias)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def _setup_output(self) -> Optional[Path]:
        """Open the run directory (fresh, or continued from its last checkpoint); returns the checkpoint."""
        cfg = self.cfg

        def open_writer():
            ckpt = self._find_checkpoint() if self._resume else None
            if ckpt is None:
                fresh_over_partial = self._resume == "auto"  # requeued before any checkpoint: same job, start over
                w = RunWriter(self.run_dir, overwrite=self._overwrite or fresh_over_partial)
                w.write_json("partition.json", data.describe(self.shards, self.dataset.y_train, cfg.data.partition,
                                                            len(self.dataset.y_test)))
            else:
                w = RunWriter(self.run_dir, resume=True)
                self._rewind(checkpoint.read_info(ckpt)["t"])
            w.write_text("config.yaml", cfg.to_yaml())
            return w, ckpt

        opened = collective_check(self.world, open_writer)
        self.writer, ckpt = opened if self.rank == 0 else (None, None)
        name = self.world.bcast_text(ckpt.name if ckpt is not None else "")
        hosts = self.world.hostnames()
        if self.rank == 0:
            import mpi4py
            import scipy
            from . import __version__

            previous = read_json(self.run_dir / "meta.json") if name and (self.run_dir / "meta.json").exists() else {}
            self.meta = {
                "package_version": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "numpy": np.__version__, "scipy": scipy.__version__, "mpi4py": mpi4py.__version__,
                "mpi_library": World.library_version(), "world_size": self.n, "hosts": sorted(set(hosts)),
                "device": str(self.device), "strategy": cfg.strategy, "n_params": int(self.flat.numel()),
                "command": list(self.argv), "start_time": previous.get("start_time", _now()), "end_time": None,
                "status": "running", "resumed": previous.get("resumed", []) + ([{"from": name, "at": _now()}] if name else []),
            }
            self.writer.write_json("meta.json", self.meta)
        return self.run_dir / "checkpoints" / name if name else None

    def _find_checkpoint(self) -> Optional[Path]:
        """Rank 0: the last complete checkpoint, after checking it fits this job; None to start fresh."""
        summary = self.run_dir / "summary.json"
        if summary.exists() and (self.run_dir / "meta.json").exists() and \
                read_json(self.run_dir / "meta.json").get("status") == "complete":
            raise RunComplete(f"{self.run_dir} is already complete ({summary}); nothing to resume")
        ckpt = checkpoint.latest(self.run_dir / "checkpoints")
        if ckpt is None:
            if self._resume == "auto":
                return None
            raise ResultsError(f"{self.run_dir / 'checkpoints'}: no complete checkpoint to resume from")
        info = checkpoint.read_info(ckpt)
        if info.get("world_size") != self.n:
            raise ConfigError(f"cannot resume from {ckpt}: it was written by {info.get('world_size')} ranks, "
                              f"this job has {self.n}")
        diffs = differences(info.get("config", {}), self.cfg.model_dump())
        if diffs:
            raise ConfigError(f"cannot resume from {ckpt}: the config differs: " + "; ".join(diffs))
        if info.get("final") and info["t"] >= self.cfg.train.budget:
            raise ConfigError(f"cannot resume from {ckpt}: it is the end of a {info['t']}-unit run; "
                              f"raise train.budget to continue training")
        return ckpt

    def _rewind(self, t: int) -> None:
        """Rank 0: drop log rows and rounds written after unit t (they will be redone identically)."""
        for name in LOGS:
            path = self.run_dir / name
            repair_jsonl(path)
            rows = read_jsonl(path)
            kept = [r for r in rows if r["t"] <= t]
            if len(kept) != len(rows):
                import json

                atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        for d in (self.run_dir / "rounds").glob("round_*"):
            info = d / "round.json"
            if not info.exists() or read_json(info)["t"] > t:
                shutil.rmtree(d)
        for stale in ("summary.json", "consensus.pt", STOP_FILE):
            (self.run_dir / stale).unlink(missing_ok=True)

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict:
        cfg, st = self.cfg, self.state
        self._wall0 = time.perf_counter()
        bar = self._progress_bar()
        previous_handlers = stopflag.install()
        try:
            for t in range(st.t + 1, cfg.train.budget + 1):
                st.t = t
                self.world.watchdog.context = f"t={t}"
                self._train(t)
                if self.clock is not None:
                    initiators = self.clock.fire(t)
                    plan = self.strategy.exchanges(t, initiators, excluded=self.outliers)
                    self._digest = protocol.digest(np.frombuffer(self._digest, dtype=np.uint8),
                                                   np.asarray(plan, dtype=np.int64).reshape(-1, 2))
                    for partner, (i, j) in protocol.my_exchanges(plan, self.rank):
                        self._exchange(t, partner, i)
                if self.strategy.global_period and t % self.strategy.global_period == 0:
                    self._global_average(t)
                stop = False
                if t % cfg.signature.every == 0:
                    stop = self._signature_round(t)
                self._maybe_eval_consensus(t)
                self._progress(bar, t)
                if stop:  # decided identically on every rank: a pending stop signal is moot, the run ends here
                    break
                # Polled at signature rounds only, so that between rounds a slow rank delays its partners alone.
                if t % cfg.signature.every == 0 and self._stop_requested():
                    self._checkpoint(t)
                    self._preempt(t)
                if cfg.checkpoint.every and t % cfg.checkpoint.every == 0 and t < cfg.train.budget:
                    self._checkpoint(t)
            self._final_eval()
            if cfg.checkpoint.at_end:
                self._checkpoint(st.t, final=True)
            summary = self._finish()
        except Preempted:
            # Keep the flag-only handlers: after `scontrol requeue` SLURM sends SIGTERM to every rank while
            # they are exiting, and they must still exit 75 rather than die of the signal.
            raise
        else:
            stopflag.restore(previous_handlers)
            return summary
        finally:
            if bar is not None:
                bar.close()

    # ------------------------------------------------------------------ stop, checkpoint, resume

    def _stop_requested(self) -> bool:
        """One tiny Allreduce: stop if any rank got a signal (``stopflag``) or rank 0 sees ``RUN_DIR/STOP``."""
        local = stopflag.requested() or (self.rank == 0 and (self.run_dir / STOP_FILE).exists())
        with self.watch("idle"):
            return self.world.allreduce_scalar(float(local), "max") > 0

    def _preempt(self, t: int) -> None:
        if self.rank == 0:
            (self.run_dir / STOP_FILE).unlink(missing_ok=True)
            self.meta.update(status="interrupted", end_time=_now())
            self.writer.write_json("meta.json", self.meta)
            self.writer.close()
            job = os.environ.get("SLURM_JOB_ID")
            requeued = False
            if job and self.cfg.checkpoint.requeue and shutil.which("scontrol"):
                res = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
                requeued = res.returncode == 0
                if not requeued:
                    print(f"communities: scontrol requeue {job} failed: {res.stderr.strip()}", file=sys.stderr)
            print(f"communities: stopped at t={t}, checkpoint written"
                  + (f"; job {job} requeued" if requeued else "; continue with --resume"), flush=True)
        # No rank exits before rank 0 has committed: srun --kill-on-bad-exit would otherwise kill rank 0
        # mid-commit when the first rank exits 75.
        with self.world.watchdog.waiting("Barrier before exiting on a stop (rank 0 commits the checkpoint)"):
            self.world.barrier()
        raise Preempted(f"stopped at t={t}")

    def _checkpoint(self, t: int, final: bool = False) -> None:
        """Every rank writes its state; rank 0 commits the checkpoint once all succeeded."""
        self._gather_rows()
        root = self.run_dir / "checkpoints"
        directory = checkpoint.step_dir(root, t)
        ok, err = 1.0, ""
        try:
            directory.mkdir(parents=True, exist_ok=True)
            checkpoint.save_rank(directory, self.rank, self._rank_state())
        except OSError as exc:
            ok, err = 0.0, str(exc)
        with self.watch("idle"):
            all_ok = self.world.allreduce_scalar(ok, "min") > 0
        if err:
            print(f"communities: rank {self.rank} could not write its checkpoint at t={t}: {err}", file=sys.stderr)
        if not all_ok:
            if self.rank == 0:
                print(f"communities: checkpoint at t={t} incomplete; the previous one stays in force", file=sys.stderr)
            return
        if self.rank == 0:
            com = self.strategy.communities
            checkpoint.commit(root, t, {
                "t": t, "final": final, "world_size": self.n, "round": self.state.rounds, "time": _now(),
                "communities": com.labels.tolist() if com is not None else None,
                "config": self.cfg.model_dump(),
            }, keep=self.cfg.checkpoint.keep)

    def _rank_state(self) -> dict:
        st = self.state
        com = self.strategy.communities
        pending = None
        if self._pending is not None:  # finish the overlapped gather now; its result is needed after resume
            with self.world.watchdog.waiting("Iallgather of signatures (some rank has not arrived)"):
                self._pending[0].Wait()
            pending = torch.from_numpy(self._pending[1].copy())
        return {
            "version": 1, "rank": self.rank, "world_size": self.n, "t": st.t,
            "flat": self.flat.detach().cpu().clone(), "optimizer": self.opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "clock": torch.from_numpy(self.clock.state()) if self.clock is not None else None,
            "outer_m": self.outer.m.detach().cpu().clone() if self.outer is not None else None,
            "anchor": self.anchor.detach().cpu().clone() if self.anchor is not None else None,
            "digest": torch.tensor(list(self._digest), dtype=torch.uint8),
            "pending_signatures": pending,
            "communities": None if com is None else {
                "Z": torch.from_numpy(com.Z.copy()), "labels": torch.from_numpy(com.labels.copy()),
                "cut_height": float(com.cut_height), "distances": torch.from_numpy(com.distances.copy())},
            "bytes_sent": int(self.world.bytes_sent), "bytes_monitoring": int(self.world.bytes_monitoring),
            "watch": dict(self.watch.total),
            "wall": self._elapsed(),
            "merges_logged": self._merges_logged,
            "state": {
                "samples": st.samples, "recent_loss": st.recent_loss, "test_acc": st.test_acc,
                "test_loss": st.test_loss, "update_norms": list(st.update_norms), "rounds": st.rounds,
                "calm_rounds": st.calm_rounds, "consensus_t": st.consensus_t,
                "communities_per_round": list(st.communities_per_round), "first_ari": st.first_ari,
                "last_dispersion": st.last_dispersion, "first_loss": st.first_loss, "diverged": st.diverged,
            },
            "outliers": torch.from_numpy(self.outliers.copy()),
            "seen_at": torch.from_numpy(self.seen_at.copy()),
            "bias": None if self.strategy.bias is None else torch.from_numpy(self.strategy.bias.copy()),
            "bytes_data": int(self.world.bytes_data),
            "examples": None if self.tracker is None else self.tracker.state_dict(),
        }

    def _restore(self, directory: Path) -> None:
        """Load this rank's checkpoint file; the loop then continues at t + 1 exactly as it would have."""
        saved = on_every_rank(self.world, lambda: checkpoint.load_rank(directory, self.rank))
        if saved["rank"] != self.rank or saved["world_size"] != self.n or saved["flat"].numel() != self.flat.numel():
            raise ResultsError(f"{checkpoint.rank_file(directory, self.rank)}: written for rank {saved['rank']} of "
                               f"{saved['world_size']} with {saved['flat'].numel()} weights; this is rank {self.rank} "
                               f"of {self.n} with {self.flat.numel()}")
        self.flat.copy_(saved["flat"].to(self.flat.device))
        self.opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(saved["torch_rng"])
        if self.clock is not None:
            self.clock.load(saved["clock"].numpy())
        if self.outer is not None:
            self.outer.m.copy_(saved["outer_m"].to(self.outer.m.device))
        if self.anchor is not None:
            self.anchor.copy_(saved["anchor"].to(self.anchor.device))
        self._digest = bytes(saved["digest"].tolist())
        if saved["pending_signatures"] is not None:
            self._pending = (_Done(), saved["pending_signatures"].numpy().copy(), None)
        com = saved["communities"]
        if com is not None:
            self.strategy.observe(clustering.Communities(
                Z=com["Z"].numpy().copy(), labels=com["labels"].numpy().copy(), cut_height=com["cut_height"],
                distances=com["distances"].numpy().copy()))
        self.world.bytes_sent = saved["bytes_sent"]
        self.world.bytes_monitoring = saved.get("bytes_monitoring", 0)
        self.watch.total.update(saved["watch"])
        self._wall_before = saved["wall"]
        self._merges_logged = saved["merges_logged"]
        for key, value in saved["state"].items():
            setattr(self.state, key, value)
        self.outliers = saved["outliers"].numpy().copy()
        self.seen_at = saved["seen_at"].numpy().copy()
        self.strategy.bias = None if saved["bias"] is None else saved["bias"].numpy().copy()
        self.world.bytes_data = saved["bytes_data"]
        if self.tracker is not None:
            if saved["examples"] is None:
                raise ResultsError(f"{checkpoint.rank_file(directory, self.rank)}: has no example table, but "
                                   "examples.track is on")
            try:
                self.tracker.load_state_dict(saved["examples"])
            except ValueError as exc:
                raise ResultsError(f"{checkpoint.rank_file(directory, self.rank)}: {exc}") from exc
        self.state.t = saved["t"]

    def _train(self, t: int) -> None:
        cfg, st = self.cfg, self.state
        f = cfg.faults
        with self.watch("train"):
            x, y, rows = self.x, self.y, None
            if self.tracker is not None:
                rows = self.tracker.training_rows(t)
                x, y = self.tracker.view(rows)
            res = train.train_unit(self.model, self.opt, x, y, cfg.train, cfg.seed, self.rank, t,
                                   steps=self.unit_steps, grad_sync=self.grad_sync)
            if rows is not None:
                self.tracker.trained(rows)
            self.seen_at[self.rank] = t
            if f.slow_max > 0:
                time.sleep(f.slow_max * protocol.rng(cfg.seed, protocol.SLOW, t, self.rank).random())
        if f.stall_rank == self.rank and t == f.stall_at:
            time.sleep(f.stall_seconds)
        if f.nan_rank == self.rank and t == f.nan_at:
            self.flat.fill_(float("nan"))
        st.samples += res.samples
        st.recent_loss = res.loss
        if t == 1 or not math.isfinite(st.first_loss):
            st.first_loss = res.loss
        if not st.diverged and robust.is_diverged(float(self.flat.sum()), res.loss, st.first_loss,
                                                  cfg.robust.loss_factor):
            st.diverged = True
            print(f"communities: rank {self.rank} diverged at t={t} (loss {res.loss:.4g}); it will not be merged "
                  f"into partners ({cfg.robust.diverged})", file=sys.stderr, flush=True)
        if self.tracker is not None:
            with self.watch("eval"):
                self.tracker.maybe_evaluate(self.model, t)
        test_acc = test_loss = float("nan")
        if t % cfg.train.eval_every == 0 or t == cfg.train.budget:
            with self.watch("eval"):
                test_acc, test_loss = train.evaluate(self.model, self.x_test, self.y_test)
            st.test_acc, st.test_loss = test_acc, test_loss
        st.metric_rows.append([t, res.loss, res.accuracy, test_acc, test_loss, st.samples, self.world.bytes_sent,
                               self._elapsed()])

    def _elapsed(self) -> float:
        """Seconds of this run on this rank, earlier segments of a resumed run included."""
        return self._wall_before + (time.perf_counter() - self._wall0 if hasattr(self, "_wall0") else 0.0)

    def _outgoing(self) -> torch.Tensor:
        """What this rank shows others: its weights, or a simulated Byzantine rank's lie."""
        if not self.hostile:
            return self.flat
        f = self.cfg.faults
        return robust.hostile_payload(self.flat, f.hostile_kind, f.hostile_scale, self._hostile_rng)

    def _exchange(self, t: int, partner: int, initiator: int) -> None:
        """Swap flat weights with ``partner`` and apply the merge rule on both sides.

        Both sides first swap a few float64 numbers (samples, loss, size, whether
        they hold optimizer state, whether they diverged), so each decides the
        same way what to do with the weights that follow.
        """
        cfg, st = self.cfg, self.state
        mc = cfg.merge
        has_state = float(bool(self.opt.state)) if mc.optimizer_state == "average" else 0.0
        meta = np.array([st.samples, st.recent_loss, float(self.flat.numel()), has_state, float(st.diverged)],
                        dtype=np.float64)
        sent0 = self.world.bytes_sent
        with self.watch("idle"):  # the partner may still be training: this is where we wait for it
            other = self.world.sendrecv_array(meta, partner, tag=1)
        if int(other[2]) != self.flat.numel():
            raise RuntimeError(f"rank {self.rank} holds {self.flat.numel()} weights but partner rank {partner} "
                               f"holds {int(other[2])}: the models differ")
        me_bad, other_bad = st.diverged, bool(other[4])
        with self.watch("exchange"):
            if me_bad and not other_bad and cfg.robust.diverged == "reset":
                a, event = 1.0, 3
            elif me_bad:
                a, event = 0.0, 4 if cfg.robust.diverged == "quarantine" else 2
            elif other_bad:
                a, event = 0.0, 2
            else:
                a, event = merge.coefficient(mc.rule, merge.Side(meta[0], meta[1]), merge.Side(other[0], other[1]),
                                             mc.alpha, t, mc.ema), 0
            before = self.flat.clone() if self.outer is not None and event == 0 else None
            if self.hostile:
                recv = torch.empty_like(self.flat)
                self.world.sendrecv(self._outgoing(), recv, partner, tag=2)
                distance = float(torch.dist(self.flat, recv))
                merge.interpolate_(self.flat, recv, a)
            else:
                distance = swap_and_merge_chunked(self.world, self.flat, partner, a, self._chunks)
            if before is not None:
                self.outer.step_(before, self.flat)
                update = float(torch.dist(self.flat, before))
            else:
                update = a * distance if a else 0.0
            if event == 0:
                self._merge_optimizer_state(partner, a, has_state > 0 and other[3] > 0)
            if mc.partner_policy == "least_recent":
                seen = self.world.sendrecv_array(self.seen_at, partner, tag=8)
                if a >= 1.0:
                    self.seen_at = seen  # the partner's model is now this rank's
                elif a > 0.0:
                    self.seen_at = np.maximum(self.seen_at, seen)
            if event == 0 and self.tracker is not None and cfg.examples.pass_hard:
                with self.world.metered("data"):
                    self.tracker.exchange(self.world, partner, self._pass_factor(partner))
            if event == 3:
                self.opt.state.clear()  # moments of a diverged model are as bad as its weights
                st.diverged = False
        if event == 0:
            st.update_norms.append(update)
        st.merge_rows.append([t, self.rank, partner, initiator, a, update, distance, self.world.bytes_sent - sent0,
                              event])

    def _pass_factor(self, partner: int) -> float:
        """examples.pass_similarity: the pair's signature distance against the latest round's median."""
        com, policy = self.strategy.communities, self.cfg.examples.pass_similarity
        if policy == "none" or com is None or com.distances.size == 0:
            return 1.0
        d = partners.condensed_row(com.distances, self.n, self.rank)[partner]
        return tracking.distance_factor(policy, float(d), float(np.median(com.distances)))

    def _keep(self) -> bool:
        """Whether this rank's weights count in averages and the consensus model."""
        return not (self.outliers[self.rank] or self.state.diverged)

    def _masked_mean(self) -> torch.Tensor:
        """Allreduce mean over the ranks that ``_keep``; equals the plain mean (bit for bit) when all do."""
        keep = self._keep()
        mean = self._outgoing().clone() if keep else torch.zeros_like(self.flat)
        self.world.allreduce_sum_(mean)
        count = self.world.allreduce_scalar(float(keep))
        return mean.div_(count if count > 0 else self.n)

    def _global_average(self, t: int) -> None:
        """local_sgd: every rank takes the Allreduce mean; diloco: an outer step on the mean's pseudo-gradient."""
        st = self.state
        sent0 = self.world.bytes_sent
        with self.watch("exchange"):
            before = self.flat.clone()
            mean = self._masked_mean()
            if self.anchor is not None:
                self.outer.step_(self.anchor, mean)  # mean <- anchor - lr * nesterov(anchor - mean)
                self.anchor.copy_(mean)
            event = 1
            if st.diverged and self.cfg.robust.diverged == "quarantine":
                event = 4
            else:
                if st.diverged:
                    self.opt.state.clear()
                    st.diverged, event = False, 3
                self.flat.copy_(mean)
            update = float(torch.dist(self.flat, before))
        st.update_norms.append(update)
        st.merge_rows.append([t, self.rank, -1, -1, 1.0, update, float("nan"), self.world.bytes_sent - sent0, event])

    def _average_gradients(self) -> None:
        """allreduce: one Allreduce of the flat gradient buffer per step."""
        with self.watch("exchange"):
            self.world.allreduce_mean_(self.flat_grad)

    def _merge_optimizer_state(self, partner: int, a: float, both_have_state: bool) -> None:
        mode = self.cfg.merge.optimizer_state
        if mode == "reset":
            self.opt.state.clear()
        elif mode == "average" and both_have_state:
            tensors = [v for p in self.model.parameters() for k, v in sorted(self.opt.state[p].items())
                       if torch.is_tensor(v) and v.is_floating_point() and v.numel() == p.numel()]
            if not tensors:
                return
            flat = torch.cat([v.reshape(-1) for v in tensors])
            theirs = torch.empty_like(flat)
            self.world.sendrecv(flat, theirs, partner, tag=3)
            merge.interpolate_(flat, theirs, a)
            offset = 0
            for v in tensors:
                v.copy_(flat[offset: offset + v.numel()].view_as(v))
                offset += v.numel()

    # ------------------------------------------------------------------ signature rounds

    def _signature_round(self, t: int) -> bool:
        """Allgather signatures, cluster, update the law, log the round; returns the stop decision."""
        cfg, st = self.cfg, self.state
        with self.watch("signature"):
            sig = self._signature()
        with self.watch("idle"):
            if cfg.signature.overlap:
                previous = self._pending
                self._pending = self.world.iallgather(sig)
                if previous is None:
                    self._flush_logs()
                    return False
                with self.world.watchdog.waiting("Iallgather of signatures (some rank has not arrived)"):
                    previous[0].Wait()
                S = previous[1]
            else:
                S = self.world.allgather(sig)
        with self.watch("signature"):
            raw = S
            if cfg.robust.enabled:
                self.outliers = robust.outliers(raw, cfg.robust.outlier_factor)
            S = robust.sanitize(raw)
            cc = cfg.clustering
            k = int(round(schedule.evaluate(cc.k, t))) if cc.cut == "maxclust" else None
            pre = self.probe_signer.distances(S) if self.probe_signer is not None and self.n > 1 else None
            com = clustering.find_communities(S, cc.linkage, cc.metric, cc.cut, k=k, threshold=cc.threshold,
                                              max_k=min(cc.max_communities, self.n - 1),
                                              min_silhouette=cc.min_silhouette,
                                              min_separation=cc.min_separation, distances=pre,
                                              fast=self.fast_distances)
            self.strategy.observe(com)
            counted = np.isfinite(raw).all(axis=1) & ~self.outliers
            disp = float("nan")
            if counted.sum() >= 2:
                if self.probe_signer is None:
                    disp = signature.dispersion(S[counted])
                else:
                    sub = None
                    if pre is not None:
                        from scipy.spatial.distance import squareform

                        sub = squareform(squareform(pre)[np.ix_(counted, counted)], checks=False)
                    disp = self.probe_signer.dispersion(S[counted], sub)
            if cfg.merge.partner_policy == "least_recent" and self.strategy.pairwise:
                self.strategy.bias = partners.staleness_weights(self.world.allgather(self.seen_at), t)
            law = self.strategy.law(t)
            self._digest = protocol.digest(np.frombuffer(self._digest, dtype=np.uint8), com.labels, com.Z, S,
                                           self.outliers, com.distances)
        if cfg.comm.check_hashes:
            with self.watch("idle"):
                self.world.agree(self._digest, f"the exchange lists and communities up to t={t}")
        st.communities_per_round.append(com.count)
        st.last_dispersion = disp
        ari = None
        if self.shard.group is not None:
            from sklearn.metrics import adjusted_rand_score

            ari = float(adjusted_rand_score([s.group for s in self.shards], com.labels))
            if st.first_ari is None:
                st.first_ari = ari
        # consensus: every rank decides identically from the same gathered signatures and update norms
        update, relative_update = self._merge_activity()
        calm = self.strategy.annealed(t) and math.isfinite(disp) and disp < cfg.consensus.tol
        if calm and cfg.consensus.update_tol is not None and relative_update is not None:
            calm = relative_update < cfg.consensus.update_tol
        st.calm_rounds = st.calm_rounds + 1 if calm else 0
        reached = st.calm_rounds >= cfg.consensus.patience
        if reached and st.consensus_t is None:
            st.consensus_t = t
        info = {
            "round": st.rounds, "t": t, "n_communities": com.count,
            "law": law.kind if law is not None else None, "k": k,
            "p_cross": law.p_cross if law is not None and law.kind == "flat" else None,
            "temperature": law.temperature if law is not None and law.kind == "hierarchical" else None,
            "cut": cc.cut, "cut_height": com.cut_height, "linkage": cc.linkage, "metric": cc.metric,
            "dispersion": _num(disp), "mean_update_norm": update, "relative_update": relative_update,
            "ari": ari, "hash": self._digest.hex(),
            "outliers": np.flatnonzero(self.outliers).tolist() if cfg.robust.enabled else None,
        }
        self._flush_logs(info, S, com)
        self._log_examples(t)
        st.rounds += 1
        return reached and cfg.consensus.stop

    def _signature(self) -> np.ndarray:
        """This rank's signature row: of its weights (drift sketch) or of its function on the probe batch."""
        if self.probe_signer is None:
            return self.signer(self._outgoing()[: self.n_params])
        if not self.hostile:
            return self.probe_signer(self.model)
        saved = self.flat.clone()  # a hostile rank shows the function of the weights it sends
        self.flat.copy_(self._outgoing())
        try:
            return self.probe_signer(self.model)
        finally:
            self.flat.copy_(saved)

    def _log_examples(self, t: int) -> None:
        """examples.jsonl: one line per rank per signature round (counts, passes, confidence quantiles)."""
        if self.tracker is None:
            return
        row = np.concatenate([[t, self.world.bytes_data], self.tracker.stats()]).reshape(1, -1)
        with self.watch("idle"):
            rows = self.world.gather_rows(row)
        if self.rank != 0:
            return
        fields = ("t", "data_bytes") + tracking.ExampleTracker.STATS_FIELDS
        out = []
        for r, block in enumerate(rows):
            d = {"rank": r, "round": self.state.rounds}
            for key, v in zip(fields, block[0]):
                d[key] = _num(v) if key.startswith("q") else int(v)
            out.append(d)
        self.writer.append_jsonl("examples.jsonl", out)

    def _merge_activity(self):
        """(mean merge update norm since the last round, that over the mean weight norm), the same on every rank.

        ``None, None`` when no rank merged. The ratio is what ``consensus.update_tol``
        bounds: merges that still move the weights mean the ranks have not settled.
        """
        st = self.state
        row = np.array([sum(st.update_norms), len(st.update_norms), float(self.flat.norm())], dtype=np.float64)
        st.update_norms = []
        with self.watch("idle"), self.world.monitoring():
            g = self.world.allgather(row)
        count = g[:, 1].sum()
        if count == 0:
            return None, None
        mean = float(g[:, 0].sum() / count)
        norms = g[np.isfinite(g[:, 2]), 2]
        scale = float(norms.mean()) if norms.size else 0.0
        return _num(mean), (_num(mean / scale) if scale > 0 else None)

    def _flush_logs(self, info: Optional[dict] = None, S=None, com=None) -> None:
        """Gather the log rows to rank 0 and, at a signature round, write the round."""
        self._gather_rows()
        if self.rank == 0 and info is not None:
            self.writer.write_round(info["round"], S.astype(np.float32), com.Z, com.labels, info)

    def _gather_rows(self) -> None:
        """Metrics and merge rows of every rank reach rank 0 as float64 blocks; it appends them."""
        st = self.state
        with self.watch("idle"):
            metrics = self.world.gather_rows(np.array(st.metric_rows, dtype=np.float64).reshape(-1, len(METRIC_FIELDS)))
            merges = self.world.gather_rows(np.array(st.merge_rows, dtype=np.float64).reshape(-1, len(MERGE_FIELDS)))
        st.metric_rows, st.merge_rows = [], []
        if self.rank != 0:
            return
        rows = []
        for r, block in enumerate(metrics):
            for m in block:
                rows.append({"t": int(m[0]), "rank": r, "loss": _num(m[1]), "train_acc": _num(m[2]),
                             "test_acc": _num(m[3]), "test_loss": _num(m[4]), "samples": int(m[5]),
                             "bytes_sent": int(m[6]), "wall": round(float(m[7]), 4)})
        rows.sort(key=lambda d: (d["t"], d["rank"]))
        self.writer.append_jsonl("metrics.jsonl", rows)
        mrows = [{"t": int(m[0]), "i": int(m[1]), "j": int(m[2]), "initiator": int(m[3]), "a": float(m[4]),
                  "update_norm": _num(m[5]), "distance": _num(m[6]), "bytes": int(m[7]),
                  "rule": self.cfg.merge.rule if m[8] == 0 else self.cfg.strategy, "event": EVENTS[int(m[8])]}
                 for block in merges for m in block]
        mrows.sort(key=lambda d: (d["t"], d["initiator"], d["i"]))
        self.writer.append_jsonl("merges.jsonl", mrows)
        self._merges_logged += sum(1 for m in mrows if m["i"] == m["initiator"] and m["event"] == "merge")

    # ------------------------------------------------------------------ consensus model

    def _consensus_flat(self) -> torch.Tensor:
        return self._masked_mean()

    def _evaluate_flat(self, flat: torch.Tensor):
        saved = self.flat.clone()
        self.flat.copy_(flat)
        try:
            return train.evaluate(self.model, self.x_test, self.y_test)
        finally:
            self.flat.copy_(saved)

    def _maybe_eval_consensus(self, t: int) -> None:
        every = self.cfg.output.consensus_every or self.cfg.train.eval_every
        if t % every:
            return
        with self.watch("eval"), self.world.monitoring():
            acc, loss = self._evaluate_flat(self._consensus_flat())
        if self.rank == 0:
            self.writer.append_jsonl("consensus.jsonl", [{"t": t, "test_acc": acc, "test_loss": loss}])

    # ------------------------------------------------------------------ finish

    def _final_eval(self) -> None:
        """Make sure the last unit's metrics row carries a test evaluation."""
        st = self.state
        if st.metric_rows and math.isnan(st.metric_rows[-1][3]):
            with self.watch("eval"):
                st.test_acc, st.test_loss = train.evaluate(self.model, self.x_test, self.y_test)
            st.metric_rows[-1][3:5] = [st.test_acc, st.test_loss]

    def _finish(self) -> dict:
        cfg, st = self.cfg, self.state
        if self._pending is not None:  # no request may stay active into MPI_Finalize
            with self.world.watchdog.waiting("Iallgather of signatures (some rank has not arrived)"):
                self._pending[0].Wait()
            self._pending = None
        self._gather_rows()
        with self.world.monitoring():
            mean = self._consensus_flat()
        with self.watch("eval"):
            c_acc, c_loss = self._evaluate_flat(mean)
        dist = float(torch.dist(self.flat, mean) / max(float(mean.norm()), 1e-12))
        wall = self._elapsed()
        split = [self.watch.total[c] for c in Stopwatch.CATEGORIES]
        row = np.array([[st.test_acc, dist, self.world.bytes_sent, wall, self.world.bytes_monitoring,
                         self.world.bytes_data, *split]], dtype=np.float64)
        ex = self.tracker.stats().reshape(1, -1) if self.tracker is not None else np.zeros((1, 0))
        hard = self.tracker.globally_hard() if self.tracker is not None else np.zeros((0, 2))
        ex_rows = self.world.gather_rows(ex)
        hard_rows = self.world.gather_rows(hard)
        gathered = self.world.gather_rows(row)
        if self.rank != 0:
            return {}
        g = np.concatenate(gathered)
        accs = g[:, 0]
        saved = self.flat.clone()
        self.flat.copy_(mean)
        buf = io.BytesIO()
        torch.save({k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}, buf)
        self.flat.copy_(saved)
        atomic_write_bytes(self.run_dir / "consensus.pt", buf.getvalue())
        summary = {
            "name": cfg.name, "strategy": cfg.strategy, "world_size": self.n, "n_params": int(self.flat.numel()),
            "units": st.t, "rounds": st.rounds,
            "merges": self._merges_logged,
            "consensus_test_acc": c_acc, "consensus_test_loss": c_loss,
            "rank_test_acc": accs.tolist(), "best_rank_acc": float(accs.max()), "worst_rank_acc": float(accs.min()),
            "mean_rank_acc": float(accs.mean()),
            "communities_per_round": st.communities_per_round, "first_round_ari": st.first_ari,
            "final_dispersion": st.last_dispersion if math.isfinite(st.last_dispersion) else None,
            "consensus_reached_t": st.consensus_t, "consensus_distance": float(g[:, 1].mean()),
            "bytes_sent_per_rank": [int(b) for b in g[:, 2]], "bytes_sent_mean": float(g[:, 2].mean()),
            "wall_time": float(g[:, 3].max()),
            "monitoring_bytes_mean": float(g[:, 4].mean()), "data_bytes_mean": float(g[:, 5].mean()),
            "time_split": {c: float(g[:, 6 + k].mean()) for k, c in enumerate(Stopwatch.CATEGORIES)},
        }
        if self.tracker is not None:
            summary["examples"] = self._examples_summary(ex_rows, hard_rows)
        self.writer.write_json("summary.json", summary)
        self.meta.update(end_time=_now(), status="complete")
        self.writer.write_json("meta.json", self.meta)
        self.writer.close()
        return summary

    def _examples_summary(self, ex_rows, hard_rows) -> dict:
        """Rank 0: totals over ranks of the example tables, and the globally hard ids (globally_hard.json)."""
        fields = tracking.ExampleTracker.STATS_FIELDS
        E = np.concatenate([r for r in ex_rows if r.size]).reshape(-1, len(fields))
        tot = {f: int(E[:, k].sum()) for k, f in enumerate(fields[:7])}
        H = np.concatenate([r for r in hard_rows if r.size] or [np.zeros((0, 2))])
        order = np.argsort(H[:, 0], kind="stable")
        ids, conf = H[order, 0].astype(np.int64), H[order, 1]
        hard = {"tau_hard": self.cfg.examples.tau_hard, "count": int(ids.size), "ids": ids.tolist(),
                "confidence": [float(c) for c in conf]}
        self.writer.write_json("globally_hard.json", hard)
        total = max(tot["total"], 1)
        return {**tot, "retired_fraction": tot["retired"] / total, "reserve_fraction": tot["reserve"] / total,
                "globally_hard": int(ids.size)}

    # ------------------------------------------------------------------ progress

    def _progress_bar(self):
        if not self.show_progress or not sys.stderr.isatty():
            return None
        from tqdm import tqdm

        return tqdm(total=self.cfg.train.budget, desc=self.cfg.name, unit="unit", dynamic_ncols=True)

    def _progress(self, bar, t: int) -> None:
        if not self.show_progress:
            return
        st = self.state
        c = st.communities_per_round[-1] if st.communities_per_round else "-"
        info = f"communities={c} dispersion={st.last_dispersion:.3g} acc={st.test_acc:.3f} loss={st.recent_loss:.3f}"
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(info, refresh=False)
        elif t % max(1, self.cfg.train.budget // 20) == 0 or t == 1:
            print(f"[{self.cfg.name}] t={t}/{self.cfg.train.budget} {info}", flush=True)


class _Done:
    """A request that has already completed (an overlapped gather restored from a checkpoint)."""

    def Wait(self):
        return None


def on_every_rank(world: World, fn):
    """Run local (collective-free) ``fn`` on every rank; a user error anywhere is raised on every rank.

    The error names each failing rank and its message, so rank 0 can print it
    once and every rank can exit 2 instead of some waiting forever.
    """
    out, err = None, None
    try:
        out = fn()
    except USER_ERRORS as exc:
        err = exc
    messages = world.allgather_text("" if err is None else str(err))
    by_message: dict = {}
    for r, m in enumerate(messages):
        if m:
            by_message.setdefault(m, []).append(r)
    if by_message:
        if len(by_message) == 1 and len(next(iter(by_message.values()))) == world.size:
            raise collective(ResultsError(next(iter(by_message))))  # the same failure everywhere
        raise collective(ResultsError("; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {m}"
                                                for m, r in by_message.items())))
    return out


def _env_threads() -> int:
    """Threads per rank when the config leaves ``threads`` unset: OMP_NUM_THREADS (SLURM's --cpus-per-task)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _num(x: float) -> Optional[float]:
    return None if not math.isfinite(x) else float(x)


def print_summary(s: dict, run_dir: Path) -> None:
    """The short end-of-run report rank 0 prints."""
    from itertools import groupby

    counts = ", ".join(f"{k}x{len(list(g))}" for k, g in groupby(s["communities_per_round"]))
    ts = s["time_split"]
    total = sum(ts.values()) or 1.0
    split = " / ".join(f"{k} {v:.1f}s ({100 * v / total:.0f}%)" for k, v in ts.items())
    ari = s["first_round_ari"]
    print(f"\n== {s['name']}: {s['strategy']} on {s['world_size']} ranks, {s['units']} units, {s['rounds']} rounds ==")
    print(f"consensus test accuracy  {s['consensus_test_acc']:.4f}")
    print(f"rank test accuracy       best {s['best_rank_acc']:.4f}  worst {s['worst_rank_acc']:.4f}  "
          f"mean {s['mean_rank_acc']:.4f}")
    print(f"communities per round    {counts or '-'}" + (f"   (first-round ARI {ari:.3f})" if ari is not None else ""))
    disp = s["final_dispersion"]
    print(f"final dispersion         {disp:.4g}" if disp is not None else "final dispersion         -",
          f"  consensus reached at t={s['consensus_reached_t']}" if s["consensus_reached_t"] else "  (no consensus stop)")
    print(f"bytes sent per rank      {s['bytes_sent_mean'] / 1e6:.2f} MB (mean), {s['merges']} merges; "
          f"+{s['monitoring_bytes_mean'] / 1e6:.2f} MB evaluating the consensus model")
    if s.get("data_bytes_mean"):
        print(f"examples passed          {s['data_bytes_mean'] / 1e6:.2f} MB per rank (data, apart from the above)")
    if s.get("examples"):
        e = s["examples"]
        print(f"examples                 {e['total']} held: {e['active']} active, {e['reserve']} reserve, "
              f"{e['retired']} retired ({100 * e['retired_fraction']:.1f}%); {e['forgetting_events']} forgetting "
              f"events; {e['globally_hard']} globally hard")
    print(f"wall time                {s['wall_time']:.1f}s: {split}")
    print(f"results                  {run_dir}")


def run(cfg: Config, world: World, overwrite: bool = False, argv=None, progress: bool = True, resume=False) -> dict:
    """Run one training job on this rank; rank 0 returns the summary."""
    run_dir = Path(cfg.output.root) / cfg.name
    engine = Engine(cfg, world, run_dir, overwrite=overwrite, argv=argv, progress=progress, resume=resume)
    if world.rank == 0 and engine.resumed_from is not None:
        print(f"communities: resuming {run_dir} from {engine.resumed_from.name} (t={engine.state.t})", flush=True)
    summary = engine.run()
    if world.rank == 0:
        print_summary(summary, run_dir)
    return summary
