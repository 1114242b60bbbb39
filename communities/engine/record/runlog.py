"""The run log: every rank's metric and merge rows reach rank 0, which writes the run directory.

Rows are typed records (``results.MetricRow``, ``results.MergeRow``) kept on
each rank and gathered to rank 0 as float64 blocks at every signature round, at
checkpoints and at the end (no pickle, no per-unit collective). Rank 0 alone
writes ``metrics.jsonl``, ``merges.jsonl``, ``consensus.jsonl``,
``examples.jsonl``, ``rounds/`` and ``summary.json``, through the run writer, which
records a failed write instead of raising (the engine stops every rank on it). Under
``protocol: async`` there is no collective in the loop: the rows reach rank 0 at a
stop and at the end, rank 0 writes its own view as ``rounds/``, and every rank's
views go to ``views.jsonl``.
"""
from __future__ import annotations

import io
import json
import logging
import math
from itertools import groupby
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ...config import Config
from ...core import pbt
from ...core.clustering import adjusted_rand
from ...core.partners import Law
from ...manifest import entry
from ...results import (
    TIME_CATEGORIES,
    Event,
    LanguageModel,
    MergeRow,
    MetricRow,
    RunWriter,
    Summary,
    TimeCategory,
    finite_or_none,
    read_jsonl,
)
from ...runtime.view import WorldView
from ...workload.data import Dataset
from ..outcome.consensus import Decision
from ..replica.examples import ExampleTracker
from ..rounds.signature_rounds import RoundResult
from ..timer import Timer
from .tracking import Trackers

log = logging.getLogger(__name__)

# What each rank reports at the end, gathered as one float64 row per rank
FINAL_FIELDS = ("test_acc", "distance", "bytes_sent", "wall", "bytes_monitoring", "bytes_data", "units",
                "bytes_in_process", "test_loss", "bytes_in_group", "process_waited", "process_idle") + TIME_CATEGORIES
LOG_FILES = ("metrics.jsonl", "merges.jsonl", "consensus.jsonl", "examples.jsonl", "views.jsonl")
DP_FIELDS = ("epsilon", "noise_multiplier", "sample_rate", "dp_steps", "planned_epsilon")  # privacy.enabled


class RunLog:
    """One rank's log buffer; on rank 0 also the writer of the run directory."""

    def __init__(self, cfg: Config, world: WorldView, timer: Timer, *, writer: Optional[RunWriter],
                 collective: bool = True, lm: Optional[LanguageModel] = None, logs_merges: bool = True):
        self.cfg, self.world, self.timer, self.writer = cfg, world, timer, writer
        # train.group_size > 1: a merge is its group's; its lead logs it, the members hold the same rows
        self.logs_merges = logs_merges
        self.lm = lm  # a language model's run: its rows and summary also speak bits per byte
        self.collective = collective  # rows may be gathered at every round (false: only at a stop and the end)
        self.rank = world.rank
        self.metric_rows: List[MetricRow] = []
        self.merge_rows: List[MergeRow] = []
        self.merges_logged = 0  # rank 0: pairwise merges written (counted once, at the initiator)
        self.products: dict = {}  # rank 0: manifest entries of the files written at the end
        self.board: Optional[Trackers] = None  # rank 0 with logging.tensorboard/wandb/mlflow: the same rows
        self.hyper_names = pbt.Space.of(cfg.pbt.params).names if cfg.pbt.enabled else ()
        self.hyper_rows: List[np.ndarray] = []  # pbt: one row per metric row
        # async under comm.fault_tolerance shrink: the rows written, per file, so that a final gather a loss cut
        # after it reached the lead (the others send their rows again) writes each row once
        self.seen: Optional[Dict[str, set]] = None

    def unit(self, row: MetricRow, hyper: Optional[np.ndarray] = None) -> None:
        """A unit's row; under pbt with the replica's hyperparameters as they were for it."""
        self.metric_rows.append(row)
        if self.hyper_names:
            self.hyper_rows.append(np.asarray(hyper, dtype=np.float64).reshape(len(self.hyper_names)))

    def drop_after(self, t: int) -> None:
        """Forget the buffered rows of units after t (async, after a loss: those units are trained again)."""
        keep = [k for k, row in enumerate(self.metric_rows) if row.t <= t]
        self.metric_rows = [self.metric_rows[k] for k in keep]
        if self.hyper_rows:
            self.hyper_rows = [self.hyper_rows[k] for k in keep]

    def merges(self, rows: List[MergeRow]) -> List[MergeRow]:
        if self.logs_merges:
            self.merge_rows.extend(rows)
        return rows

    def consensus(self, row: Optional[dict]) -> None:
        """A consensus-model evaluation (rank 0 writes it; the others hold the same figures)."""
        if row is not None:
            self.consensus_rows([row])

    def consensus_rows(self, rows: List[dict]) -> None:
        if rows and self.writer is not None:
            if self.lm is not None:
                rows = [self.lm.with_bpb(r) for r in rows]
            self._append("consensus.jsonl", rows)
            if self.board is not None:
                self.board.consensus(rows)

    def round(self, rnd: Optional[RoundResult], law: Optional[Law], decision: Optional[Decision],
              agreement: bytes, tracker: Optional[ExampleTracker], *, mode: Optional[dict] = None) -> None:
        """At a signature round: gather the rows, write the round, log the example tables.

        ``mode``: consensus.mode's entry for round.json (frozen communities, auto's verdict), if any.
        """
        self.flush()
        if rnd is None:
            return
        if self.writer is not None:  # under async: rank 0's own view
            cc = self.cfg.clustering
            com = rnd.communities
            info: Dict[str, Any] = {
                "round": rnd.index, "t": rnd.t, "n_communities": com.count,
                "law": law.kind if law is not None else None, "k": rnd.k,
                "p_cross": law.p_cross if law is not None and law.kind in ("flat", "frozen") else None,
                "temperature": law.temperature if law is not None and law.kind == "hierarchical" else None,
                "cut": cc.cut, "cut_height": com.cut_height, "linkage": cc.linkage, "metric": cc.metric,
                "test": com.test.to_dict() if com.test is not None else None,
                "dispersion": finite_or_none(rnd.dispersion),
                "mean_update_norm": decision.update if decision is not None else None,
                "relative_update": decision.relative_update if decision is not None else None, "ari": rnd.ari,
                "hash": agreement.hex() if self.collective else None,
                "outliers": np.flatnonzero(rnd.outliers).tolist() if self.cfg.robust.enabled else None,
            }
            if mode is not None:
                info["consensus_mode"] = mode
            self.writer.write_round(rnd.index, rnd.signatures.astype(np.float32), com.Z, com.labels, info)
            log.debug(f"communities: round {rnd.index} at t={rnd.t}: {com.count} communities {com.labels.tolist()}, "
                      f"dispersion {rnd.dispersion:.4g}" + (f", p_cross {info['p_cross']:.3g}"
                                                            if info["p_cross"] is not None else ""))
            if self.board is not None:
                self.board.round(info, com.Z, com.labels)
        if tracker is not None and self.collective:
            self._examples(rnd.index, rnd.t, tracker)

    def flush(self, final: bool = False) -> None:
        """Gather the buffered rows of every rank to rank 0, which appends them (a collective).

        Without collectives in the loop (async) only ``final`` flushes, when every rank has drained.
        """
        if not (self.collective or final):
            return
        with self.timer(TimeCategory.IDLE):
            metrics = self.world.gather_rows(self._block(self.metric_rows, MetricRow))
            merges = self.world.gather_rows(self._block(self.merge_rows, MergeRow))
            hyper = (self.world.gather_rows(np.array(self.hyper_rows, dtype=np.float64).reshape(
                -1, len(self.hyper_names))) if self.hyper_names else None)
        self.metric_rows, self.merge_rows, self.hyper_rows = [], [], []
        if self.writer is None or metrics is None or merges is None:  # not rank 0
            return
        local = self.cfg.data.local_test_fraction > 0
        private = self.cfg.privacy.enabled
        rows = [MetricRow.from_row(m).to_json(r, local, private, self.lm)
                for r, block in enumerate(metrics) for m in block]
        if hyper is not None:  # pbt: each row's hyperparameters, rank block by rank block in the same order
            values = [v for block in hyper for v in block]
            for row, v in zip(rows, values):
                row["hyper"] = {n: float(x) for n, x in zip(self.hyper_names, v)}
        rows.sort(key=lambda d: (d["t"], d["rank"]))
        self._append("metrics.jsonl", rows)
        if self.board is not None:
            self.board.metrics(rows)
        events = [MergeRow.from_row(m) for block in merges for m in block]
        mrows = [e.to_json(self.cfg.merge.rule if e.event == Event.MERGE else self.cfg.strategy) for e in events]
        mrows.sort(key=lambda d: (d["t"], d["initiator"], d["i"]))
        mrows = self._append("merges.jsonl", mrows)
        self.merges_logged += sum(1 for m in mrows if m["i"] == m["initiator"] and m["event"] == "merge")

    def _append(self, name: str, rows: List[dict]) -> List[dict]:
        """The lead: append ``rows`` to ``name`` (those not written already, when ``seen`` keeps track)."""
        assert self.writer is not None
        if self.seen is not None:
            seen = self.seen.setdefault(name, set())
            fresh = []
            for r in rows:
                key = json.dumps(r, sort_keys=True, default=str)
                if key not in seen:
                    seen.add(key)
                    fresh.append(r)
            rows = fresh
        self.writer.append_jsonl(name, rows)
        return rows

    def load_seen(self, run_dir: Path) -> None:
        """A new writer (the lost writer's heir) that keeps track: what its files already hold."""
        if self.seen is None:
            return
        for name in LOG_FILES:
            self.seen[name] = {json.dumps(r, sort_keys=True, default=str) for r in read_jsonl(run_dir / name)}

    @staticmethod
    def _block(rows, record) -> np.ndarray:
        return np.array([r.to_row() for r in rows], dtype=np.float64).reshape(-1, record.width())

    def _examples(self, index: int, t: int, tracker: ExampleTracker) -> None:
        """examples.jsonl: one line per rank per signature round (counts, passes, confidence quantiles)."""
        row = np.concatenate([[t, self.world.bytes_data], tracker.stats()]).reshape(1, -1)
        with self.timer(TimeCategory.IDLE):
            rows = self.world.gather_rows(row)
        if self.writer is None or rows is None:  # not rank 0
            return
        fields = ("t", "data_bytes") + ExampleTracker.STATS_FIELDS
        out = []
        for r, block in enumerate(rows):
            if not block.size:  # a lost rank (comm.fault_tolerance: shrink)
                continue
            d: Dict[str, Any] = {"rank": r, "round": index}
            for key, v in zip(fields, block[0]):
                d[key] = finite_or_none(v) if key.startswith("q") else int(v)
            out.append(d)
        self._append("examples.jsonl", out)

    # ------------------------------------------------------------------ the end

    def models(self, files: dict, record: Optional[dict]) -> None:
        """Rank 0: the delivered per-community models (``models/``), each with its manifest entry in meta.json."""
        if self.writer is None or record is None:
            return
        for name, data in files.items():
            if self.writer.write_bytes(name, data):
                self.products[name] = entry(data)
        self.writer.write_json("models/communities.json", record)

    def finish(self, run: dict, test_acc: float, distance: float, consensus_state: Optional[dict],
               tracker: Optional[ExampleTracker], *, views: Optional[List[list]] = None,
               dp: Optional[dict] = None, hyper: Optional[np.ndarray] = None,
               labels: Optional[np.ndarray] = None, test_loss: float = float("nan")) -> Optional[Summary]:
        """Gather every rank's final figures; rank 0 writes ``consensus.pt`` and ``summary.json`` and returns it.

        ``run`` holds the figures every rank shares (name, units, rounds, the
        consensus model's accuracy, ...); ``test_acc`` and ``distance`` (to the
        consensus, relative) are this rank's own; ``views`` (async) its community views;
        ``dp`` (privacy.enabled) its ``DP_FIELDS``; ``hyper`` (pbt) its final hyperparameters, summarised per
        community of ``labels`` (the latest round's); ``test_loss`` its own model's last test loss (a language
        model's summary reports the ranks' losses).
        """
        w = self.world
        mine = {"test_acc": test_acc, "test_loss": test_loss, "distance": distance, "bytes_sent": w.bytes_sent,
                "wall": self.timer.elapsed(), "bytes_monitoring": w.bytes_monitoring, "bytes_data": w.bytes_data,
                "units": run["units"], "bytes_in_process": w.bytes_in_process, "bytes_in_group": w.bytes_in_group,
                "process_waited": self.timer.process_waited(), "process_idle": w.process_idle, **self.timer.split()}
        mine.update({f: (dp or {}).get(f, float("nan")) for f in DP_FIELDS})
        row = np.array([[mine[f] for f in FINAL_FIELDS + DP_FIELDS]], dtype=np.float64)
        ex = tracker.stats().reshape(1, -1) if tracker is not None else np.zeros((1, 0))
        hard = tracker.globally_hard() if tracker is not None else np.zeros((0, 2))
        ex_rows = w.gather_rows(ex)
        hard_rows = w.gather_rows(hard)
        gathered = w.gather_rows(row)
        hyper_rows = w.gather_rows(np.asarray(hyper, dtype=np.float64).reshape(1, -1)) if self.hyper_names else None
        view_rows = None
        if views is not None:  # rows of (round, t, wall, N labels)
            ranks = w.size // self.cfg.train.group_size  # (a view labels the groups)
            view_rows = w.gather_rows(np.asarray(views, dtype=np.float64).reshape(len(views), 3 + ranks))
        if self.writer is None or gathered is None:  # not rank 0
            return None
        g = dict(zip(FINAL_FIELDS + DP_FIELDS, np.concatenate(gathered).T))  # one column per field, one entry per rank
        accs = g["test_acc"]
        buf = io.BytesIO()
        torch.save(consensus_state, buf)
        if self.writer.write_bytes("consensus.pt", buf.getvalue()):
            self.products["consensus.pt"] = entry(buf.getvalue())  # its size and digest go into meta.json
        units = [int(u) for u in g["units"]]
        summary = Summary(
            **{**run, "units": max(units)}, units_per_rank=units, merges=self.merges_logged,
            rank_test_acc=accs.tolist(), best_rank_acc=float(accs.max()),
            worst_rank_acc=float(accs.min()), mean_rank_acc=float(accs.mean()),
            consensus_distance=float(g["distance"].mean()), bytes_sent_per_rank=[int(b) for b in g["bytes_sent"]],
            bytes_sent_mean=float(g["bytes_sent"].mean()), wall_time=float(g["wall"].max()),
            monitoring_bytes_mean=float(g["bytes_monitoring"].mean()), data_bytes_mean=float(g["bytes_data"].mean()),
            time_split={c: float(g[c].mean()) for c in TIME_CATEGORIES},
            time_split_per_rank={c: [float(x) for x in g[c]] for c in ("wall",) + TIME_CATEGORIES},
            examples=self._examples_summary(ex_rows, hard_rows) if tracker is not None else None,
            protocol=self.cfg.protocol,
            view_agreement=self._views(view_rows) if view_rows is not None else None,
            placement=placement_summary(w.processes, w.size, g),
            groups=group_summary(self.cfg.train.group_size, g, np.flatnonzero(w.alive)),
            privacy=self._privacy_summary(g) if dp is not None else None,
            pbt=(pbt.summary(self.hyper_names, np.concatenate(hyper_rows), labels)
                 if hyper_rows is not None else None),
            **(self.lm.summary_fields(run["consensus_test_loss"], g["test_loss"]) if self.lm is not None else {}))
        self.writer.write_json("summary.json", summary.to_dict())
        if self.board is not None:
            self.board.finish(summary)
        return summary

    def _privacy_summary(self, g: Dict[str, np.ndarray]) -> dict:
        """summary.json's ``privacy``: every replica's epsilon (the worst first) and what it was computed from."""
        pc = self.cfg.privacy

        def each(key: str) -> list:
            return [finite_or_none(float(v)) for v in g[key]]

        eps = g["epsilon"]
        return {"epsilon_max": finite_or_none(float(np.nanmax(eps))) if np.isfinite(eps).all() else None,
                "delta": pc.delta, "accountant": pc.accountant, "sampling": pc.sampling, "noise": pc.noise,
                "max_grad_norm": pc.max_grad_norm, "target_epsilon": pc.epsilon,
                "epsilon_per_rank": each("epsilon"), "planned_epsilon_per_rank": each("planned_epsilon"),
                "noise_multiplier_per_rank": each("noise_multiplier"), "sample_rate_per_rank": each("sample_rate"),
                "steps_per_rank": [int(v) for v in g["dp_steps"]],
                "protects": "each replica's training shard, against everyone who sees its weights or anything "
                            "computed from them (partners, signature rounds, the consensus)"}

    def _examples_summary(self, ex_rows, hard_rows) -> dict:
        """Rank 0: totals over ranks of the example tables, and the globally hard ids (globally_hard.json)."""
        assert self.writer is not None  # rank 0
        fields = ExampleTracker.STATS_FIELDS
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

    def _views(self, blocks: List[np.ndarray]) -> dict:
        """Rank 0: views.jsonl, and how far each rank's views agreed with rank 0's at the same wall time."""
        assert self.writer is not None  # rank 0
        rows = [{"rank": r, "round": int(v[0]), "t": int(v[1]), "wall": round(float(v[2]), 4),
                 "labels": [int(x) for x in v[3:]]} for r, block in enumerate(blocks) for v in block]
        self._append("views.jsonl", rows)
        return view_agreement(rows)

    def state_dict(self) -> dict:
        return {"merges_logged": self.merges_logged}

    def load_state_dict(self, state: dict) -> None:
        """The state after a round or checkpoint, when no row is buffered (a rollback drops the rows since)."""
        self.merges_logged = int(state["merges_logged"])
        self.metric_rows, self.merge_rows = [], []


def count_merges(path: Path) -> int:
    """The pairwise merges a ``merges.jsonl`` holds, each counted once (at its initiator), as ``flush`` counts."""
    if not path.exists():
        return 0
    return sum(1 for m in read_jsonl(path) if m.get("event") == "merge" and m.get("i") == m.get("initiator"))


def language_model(ds: Dataset) -> Optional[LanguageModel]:
    """A language model's run (its data a text corpus, workload/text.py: token windows), else None (a
    classifier's)."""
    if ds.text is None:
        return None
    return LanguageModel(ds.text.bytes_per_token, int(ds.x_test.shape[-1]))


def view_agreement(rows: List[dict]) -> dict:
    """ARI of every view against rank 0's latest view at that wall time: how much the ranks' communities agreed."""
    own = sorted((v for v in rows if v["rank"] == 0), key=lambda v: v["wall"])
    walls = np.array([v["wall"] for v in own])
    scores: List[float] = []
    last: Dict[int, float] = {}
    for v in rows:
        if v["rank"] == 0 or not own:
            continue
        k = max(int(np.searchsorted(walls, v["wall"], side="right")) - 1, 0)
        ari = adjusted_rand(np.asarray(v["labels"]), own[k]["labels"])
        assert ari is not None  # (None only without groups)
        scores.append(ari)
        last[v["rank"]] = ari
    return {"views": len(rows), "mean_ari_vs_rank0": float(np.mean(scores)) if scores else None,
            "min_ari_vs_rank0": float(np.min(scores)) if scores else None,
            "final_mean_ari_vs_rank0": float(np.mean(list(last.values()))) if last else None}


def print_summary(s: Summary, run_dir: Path) -> None:
    """The short end-of-run report rank 0 prints (logged at INFO: --quiet leaves it out)."""
    counts = ", ".join(f"{k}x{len(list(g))}" for k, g in groupby(s.communities_per_round))
    split = seconds_split(s.time_split)
    ari = s.first_round_ari
    on = "" if s.consensus_test_split == "shared" else f"   (on {s.consensus_test_split})"
    disp = s.final_dispersion
    lm = s.language_model
    lines = [f"\n== {s.name}: {s.strategy} on {s.world_size} ranks, {s.units} units, {s.rounds} rounds =="]
    lines += lm_lines(s, lm, on) if lm is not None else [
        f"consensus test accuracy  {s.consensus_test_acc:.4f}{on}",
        f"rank test accuracy       best {s.best_rank_acc:.4f}  worst {s.worst_rank_acc:.4f}  "
        f"mean {s.mean_rank_acc:.4f}"]
    lines += [
        f"communities per round    {counts or '-'}" + (f"   (first-round ARI {ari:.3f})" if ari is not None else ""),
        (f"final dispersion         {disp:.4g}" if disp is not None else "final dispersion         -")
        + (f"   consensus reached at t={s.consensus_reached_t}" if s.consensus_reached_t else "   (no consensus stop)"),
        f"bytes sent per rank      {s.bytes_sent_mean / 1e6:.2f} MB (mean), {s.merges} merges; "
        f"+{s.monitoring_bytes_mean / 1e6:.2f} MB evaluating the consensus model",
    ]
    if s.data_bytes_mean:
        lines.append(f"examples passed          {s.data_bytes_mean / 1e6:.2f} MB per rank (data, apart from the above)")
    if s.examples:
        e = s.examples
        lines.append(f"examples                 {e['total']} held: {e['active']} active, {e['reserve']} reserve, "
                     f"{e['retired']} retired ({100 * e['retired_fraction']:.1f}%); {e['forgetting_events']} "
                     f"forgetting events; {e['globally_hard']} globally hard")
    if s.consensus_mode:
        m = s.consensus_mode
        what = (f"froze {m['communities']} communities at round {m['frozen_round']} (t={m['frozen_t']})"
                if m["decision"] == "communities" else "kept annealing to one consensus")
        lines.append(f"consensus.mode {m['mode']:<9} {what}")
    if s.community_models:
        models = s.community_models["models"]
        lines.append(f"community models         {len(models)} in {run_dir / 'models'}: " + ", ".join(
            f"{e['community']}: {_acc(e['local_test_acc'])}" for e in models) + " (local test accuracy)")
    if s.local_test and lm is not None:
        lt = s.local_test
        lines.append(f"local test loss          {lt['delivered']} {_loss(lt.get('mean_loss'), lm)} (mean over ranks); "
                     f"next-token accuracy {_acc(lt.get('mean_acc'))}")
    elif s.local_test:
        lt = s.local_test
        lines.append(f"local test accuracy      {lt['delivered']} {_acc(lt['mean_acc'])} (mean over ranks); own "
                     f"models {_acc(lt['mean_own_acc'])}, consensus {_acc(lt['mean_consensus_acc'])}")
    if s.privacy:
        dp = s.privacy
        eps = dp["epsilon_max"]
        lines.append(f"privacy                  epsilon {eps:.3g} (worst replica) at delta {dp['delta']:g}, "
                     f"{dp['sampling']} sampling, clipping {dp['max_grad_norm']:g}" if eps is not None else
                     "privacy                  epsilon inf (no noise): nothing is protected")
    if s.pbt:
        groups = s.pbt.get("per_community") or {}
        lines.append("learnt (pbt, medians)    " + "; ".join(
            f"{name} {median:.3g}" + (" (" + ", ".join(f"c{c} {g[name]['median']:.3g}" for c, g in groups.items())
                                      + ")" if len(groups) > 1 else "")
            for name, median in s.pbt["median"].items()))
    if s.placement and "wall_per_process" in s.placement:  # a population: the process's split first
        lines += population_wall_lines(s.placement, s.wall_time, split)
    else:
        lines.append(f"wall time                {s.wall_time:.1f}s: {split}")
    lines.append(f"results                  {run_dir}")
    for line in lines:
        log.info(line)


def seconds_split(split: Dict[str, float]) -> str:
    """``train 2.9s (80%) / idle ...``: seconds per category with its share, a zero turn left out."""
    total = sum(split.values()) or 1.0
    return " / ".join(f"{k} {v:.1f}s ({100 * v / total:.0f}%)" for k, v in split.items()
                      if k != TimeCategory.TURN or v > 0)


def population_wall_lines(placement: dict, wall_time: float, replica_split: str) -> List[str]:
    """A population's wall time: each process's (its replicas training and evaluating, the process waiting on
    the others, the rest), mean over processes, then a replica's own, whose turns are the time the other
    replicas of its process ran."""
    n, per = placement["processes"], placement["replicas_per_process"]
    parts = {"train": "train_per_process", "eval": "eval_per_process",
             "waiting for other processes": "waiting_per_process", "other": "other_per_process"}
    mean = {label: float(np.mean(placement[key])) for label, key in parts.items()}
    shares = placement["train_share_per_process"]
    spread = f"; train share by process {min(shares):.0%}..{max(shares):.0%}" if n > 1 else ""
    return [f"wall time                {wall_time:.1f}s, per process ({n} processes, {per} replicas each): "
            + seconds_split(mean) + spread,
            f"per replica (mean)       {replica_split} (turn: the other replicas of its process running)"]


def _acc(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def _loss(x: Optional[float], lm: LanguageModel) -> str:
    """A loss as ``2.876 nats/token, 4.149 bits/byte`` (bits only where the bytes per token are known)."""
    if x is None or not math.isfinite(x):
        return "-"
    bpb = lm.bpb(x)
    return f"{x:.3f} nats/token" + (f", {bpb:.3f} bits/byte" if bpb is not None else "")


def lm_lines(s: Summary, lm: LanguageModel, on: str = "") -> List[str]:
    """A language model's end-of-run figures: losses first (lower is better), accuracy as next-token accuracy."""
    losses = [x for x in (s.rank_test_loss or []) if x is not None]
    ranks = (f"best {min(losses):.3f}  worst {max(losses):.3f}  mean {_loss(s.mean_rank_loss, lm)}" if losses
             else "-")
    return [f"consensus test loss      {_loss(s.consensus_test_loss, lm)}; next-token accuracy "
            f"{s.consensus_test_acc:.4f}{on}",
            f"rank test loss           {ranks}; next-token accuracy mean {s.mean_rank_acc:.4f}"]


def group_summary(size: int, g: Dict[str, np.ndarray], ranks: Optional[np.ndarray] = None) -> Optional[dict]:
    """Data-parallel groups (train.group_size > 1): bytes inside groups (every step's gradient average, the leads'
    copies to their members) against bytes between groups (what the method sends: merges, signatures, averages)."""
    if size <= 1:
        return None
    inside = g["bytes_in_group"]
    between = g["bytes_sent"] - inside
    # (the replicas alive, in rank order: a lost member's group sums its survivors')
    of = np.asarray(ranks if ranks is not None else np.arange(len(between))) // size
    per_group = np.bincount(of, weights=between)[np.unique(of)]
    return {"size": size, "groups": len(per_group), "bytes_in_group_mean": float(inside.mean()),
            "bytes_between_groups_mean": float(between.mean()),
            "bytes_between_groups_per_group_mean": float(per_group.mean())}


def placement_summary(processes: int, replicas: int, g: Dict[str, np.ndarray]) -> Optional[dict]:
    """A population's figures (None with one replica per process): bytes that crossed MPI against bytes swapped
    in memory, and each process's wall time split: its replicas training and evaluating (one after another, or
    stacked), the process waiting on other processes (its collectives and exchanges between them), and the rest
    (signature rounds, merges in memory, logs). A replica's own split has its turns (time_split's ``turn``)."""
    if processes >= replicas:
        return None
    per = replicas // processes

    def by_process(key: str) -> np.ndarray:  # (a lost process took its whole block: the survivors')
        return g[key].reshape(-1, per)

    wall = by_process("wall").max(axis=1)
    train, evals = by_process("train").sum(axis=1), by_process("eval").sum(axis=1)
    waiting = by_process("process_waited").max(axis=1)  # (the same on each replica of a process)
    other = np.maximum(wall - train - evals - waiting, 0.0)

    def listed(a: np.ndarray) -> List[float]:
        return [float(x) for x in a]

    # the hub's own idle time (it waited on other processes, polling included under protocol async)
    idle = by_process("process_idle").max(axis=1)
    return {"processes": processes, "replicas_per_process": per,
            "bytes_network_mean": float((g["bytes_sent"] - g["bytes_in_process"]).mean()),
            "bytes_in_process_mean": float(g["bytes_in_process"].mean()),
            "train_share_per_process": [float(a / b) if b > 0 else 0.0 for a, b in zip(train, wall)],
            "wall_per_process": listed(wall), "train_per_process": listed(train), "eval_per_process": listed(evals),
            "waiting_per_process": listed(waiting), "other_per_process": listed(other),
            "idle_share_per_process": [float(a / b) if b > 0 else 0.0 for a, b in zip(idle, wall)]}
