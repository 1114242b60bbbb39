"""Signature rounds: every S units the ranks allgather signatures and derive the same communities.

A round is a collective: each rank signs its weights (or its function on the
probe batch), the rows are allgathered (or, with ``signature.overlap``, an
``Iallgather`` started this round takes effect the next), and every rank then
runs the same clustering on the same bytes. The result is a ``RoundResult``
that the loop hands to the mixer (new partner law), the consensus (dispersion)
and the run log. A digest of the communities joins the running agreement
digest, which the ranks allgather to prove they agree.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from ...core import clustering, probe, robust, schedule, signature, similarity
from ...core.clustering import Communities
from ...core.protocol import RunningDigest, digest
from ...errors import ConfigError
from ...runtime.collective import on_every_rank
from ...runtime.view import WorldView
from ...workload.vectorized import are_rows
from ..replica.replica import Replica
from ..timer import Timer


@dataclass(frozen=True)
class RoundResult:
    """What one signature round decided, identically on every rank."""

    index: int  # 0, 1, ... (rounds/round_NNNN)
    t: int
    signatures: np.ndarray  # (N, d), non-finite rows zeroed
    communities: Communities
    outliers: np.ndarray  # (N,) bool: ranks left out by robust.enabled (all False otherwise)
    dispersion: float  # nan when fewer than two ranks count
    k: Optional[int]  # the maxclust target (cut: maxclust), else None
    ari: Optional[float]  # against the planted groups, where there are any


class _WeightSignature:
    """A seeded random projection of the drift ``w - w0`` (count-sketch or Gaussian)."""

    def __init__(self, cfg, world: WorldView, replica: Replica):
        sc = cfg.signature
        self.n_params = replica.n_params
        sk = world.shared(("sketch", sc.kind, replica.n_params, sc.dim), lambda: signature.make_sketch(
            sc.kind, replica.n_params, sc.dim, cfg.seed, replica.device, dtype=replica.flat.dtype))
        ref = sk(replica.flat[: replica.n_params]).numpy() if world.leads else None
        self.signer = signature.Signer(sk, world.bcast_array(ref, (sc.dim,), np.float64))

    def row(self, replica: Replica) -> np.ndarray:
        return self.signer(replica.outgoing()[: self.n_params])

    def row_together(self, replica: Replica) -> np.ndarray:
        """``row``, computed for all the replicas of the process at once (``world.together``): one sketch of their
        (R, P) rows (the process's block itself where they are its rows), the same bits as R calls of ``row``;
        waited for as idle, each replica's share counted as signature time."""
        n, r = self.n_params, replica

        def sign_all(items: List[tuple]) -> list:
            start = time.perf_counter()
            flats = [f for f, _ in items]
            rows = r.rows if r.rows is not None and r.rows.shape[1] == n and are_rows(r.rows, flats) else \
                torch.stack(flats)
            raw = self.signer.sketch.many(rows).numpy()
            out = [(raw[i] - signer.reference).astype(np.float32) for i, (_, signer) in enumerate(items)]
            share = (time.perf_counter() - start) / max(len(items), 1)
            return [(row, share) for row in out]

        with r.timer("idle"):
            sig, seconds = r.world.together(("signatures",), (r.outgoing()[:n], self.signer), sign_all)
        r.timer.reassign(seconds, "idle", "signature")
        return sig

    def distances(self, S: np.ndarray) -> Optional[np.ndarray]:
        return None

    def dispersion(self, S: np.ndarray, counted: np.ndarray, pre: Optional[np.ndarray]) -> float:
        return signature.dispersion(S[counted])


class _FunctionSignature:
    """What the model does on the shared probe batch: its logits, or a layer's features for linear CKA."""

    def __init__(self, cfg, world: WorldView, replica: Replica):
        sc = cfg.signature
        ds = replica.data.dataset
        idx = similarity.probe_indices(len(ds.y_train), sc.probe_size, cfg.seed)
        x_probe = torch.as_tensor(ds.x_train[idx]).to(replica.device)

        def make() -> probe.ProbeSigner:
            try:
                return probe.ProbeSigner(sc.kind, replica.model, x_probe, dim=sc.dim, seed=cfg.seed, layer=sc.layer,
                                         debias=sc.debias)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc

        self.signer = on_every_rank(world, make)
        self.n = world.size

    def row(self, replica: Replica) -> np.ndarray:
        if not replica.faults.hostile:
            return self.signer(replica.model)
        with replica.holding(replica.outgoing()):  # a hostile rank shows the function of the weights it sends
            return self.signer(replica.model)

    def distances(self, S: np.ndarray) -> Optional[np.ndarray]:
        return self.signer.distances(S) if self.n > 1 else None

    def dispersion(self, S: np.ndarray, counted: np.ndarray, pre: Optional[np.ndarray]) -> float:
        sub = None
        if pre is not None:
            from scipy.spatial.distance import squareform

            sub = squareform(squareform(pre)[np.ix_(counted, counted)], checks=False)
        return self.signer.dispersion(S[counted], sub)


class SignatureRounds:
    """The signature rounds of one rank: signer, pending gather, clustering, and the rounds' history."""

    agree = True  # every rank derives the same communities: prove it (comm.check_hashes)
    views: Optional[List[list]] = None  # async: this rank's own community views (the same for all here)

    def __init__(self, cfg, world: WorldView, timer: Timer, *, replica: Replica, agreement: RunningDigest):
        self.cfg, self.world, self.timer, self.replica, self.agreement = cfg, world, timer, replica, agreement
        kind = _FunctionSignature if cfg.signature.kind in probe.KINDS else _WeightSignature
        self.signature = kind(cfg, world, replica)
        # replicas trained as rows of one block (train.vectorize, each its own model) sign as one
        self.together = isinstance(self.signature, _WeightSignature) and replica.rows is not None and \
            replica.group is None
        # BLAS distances only where every rank runs the same kernels; else pdist, the same bits on any CPU
        self.fast_distances = len(set(world.allgather_text(clustering.blas_fingerprint()))) == 1
        planted = replica.data.groups  # (with train.group_size > 1: each group's lead's)
        self.groups = None if planted is None else [int(g) for g in world.of_ranks(np.asarray(planted))]
        self.pending: Optional[tuple] = None  # signature.overlap: (request, gathered, sent) of the Iallgather in flight
        self.last_rows: Optional[np.ndarray] = None  # the last gather (a lost rank's row stays its last one)
        self.index = 0  # rounds completed
        self.counts: List[int] = []  # communities per round
        self.last_dispersion = float("nan")
        self.first_ari: Optional[float] = None

    def due(self, t: int) -> bool:
        return t % self.cfg.signature.every == 0

    def late_view_due(self, t: int) -> bool:
        """Whether a round that could not cluster at its own unit is tried again at t (``async_rounds``); never
        under collectives, where every rank gathers every row at the round itself."""
        return False

    def run(self, t: int) -> Optional[RoundResult]:
        """Sign, gather, cluster. None only for the first round of ``signature.overlap`` (nothing gathered yet)."""
        S = self._gather(t)
        if S is None:
            return None
        cfg, gathered = self.cfg, S
        with self.timer("signature"):
            # the same bytes on every rank: computed once for the replicas of a process (a population)
            S, com, outliers, disp, k, ari, decided = self.world.shared(("round", t), lambda: self._decide(t, gathered))
            self.agreement.update(decided)
        if self.agree and cfg.comm.check_hashes:
            with self.timer("idle"):
                self.world.agree(self.agreement.value, f"the exchange lists and communities up to t={t}")
        if self.first_ari is None:
            self.first_ari = ari
        self.counts.append(com.count)
        self.last_dispersion = disp
        self.index += 1
        return RoundResult(self.index - 1, t, S, com, outliers, disp, k, ari)

    def _decide(self, t: int, raw: np.ndarray) -> tuple:
        """What a round decides from the gathered rows ``raw``: (rows sanitised, communities, outliers,
        dispersion, the maxclust target, ARI against the planted groups, a digest of it all)."""
        cfg, n = self.cfg, self.world.size
        cc = cfg.clustering
        outliers = robust.outliers(raw, cfg.robust.outlier_factor) if cfg.robust.enabled else np.zeros(n, dtype=bool)
        S = robust.sanitize(raw)
        k = int(round(schedule.evaluate(cc.k, t))) if cc.cut == "maxclust" else None
        pre = self.signature.distances(S)
        com = clustering.find_communities(S, cc.linkage, cc.metric, cc.cut, k=k, threshold=cc.threshold,
                                          max_k=min(cc.max_communities, n - 1),
                                          min_silhouette=cc.min_silhouette,
                                          min_separation=cc.min_separation, distances=pre,
                                          fast=self.fast_distances, alpha=cc.alpha, draws=cc.draws, null=cc.null,
                                          test_rows=cc.test_rows, refined=cc.refine, seed=cfg.seed, t=t)
        counted = np.isfinite(raw).all(axis=1) & ~outliers & self.world.alive
        disp = self.signature.dispersion(S, counted, pre) if counted.sum() >= 2 else float("nan")
        decided = np.frombuffer(digest(com.labels, com.Z, S, outliers, com.distances), dtype=np.uint8)
        return S, com, outliers, disp, k, clustering.adjusted_rand(com.labels, self.groups), decided

    def _gather(self, t: int) -> Optional[np.ndarray]:
        with self.timer("signature"):
            if self.together:
                assert isinstance(self.signature, _WeightSignature)
                sig = self.signature.row_together(self.replica)
            else:
                sig = self.signature.row(self.replica)
        self.replica.faults.in_round(t)
        with self.timer("idle"):
            if not self.cfg.signature.overlap:
                S = self.world.allgather(sig)
                if not self.world.whole:  # a lost rank keeps its last signature: a point, not a pull to the origin
                    S = S.copy()  # (a population's gather is one read-only array for the process's replicas)
                    lost = ~self.world.alive
                    S[lost] = self.last_rows[lost] if self.last_rows is not None else 0.0
                self.last_rows = S
                return S
            previous, self.pending = self.pending, self.world.iallgather(sig, "Iallgather of signatures")
            if previous is None:
                return None
            previous[0].Wait()  # watched like a blocking collective
            return previous[1]

    def drain(self) -> None:
        """Complete a gather still in flight: no request may stay active into MPI_Finalize or a checkpoint."""
        if self.pending is not None and not isinstance(self.pending[0], _Done):
            self.pending[0].Wait()  # watched like a blocking collective
            self.pending = (_Done(), self.pending[1], None)

    @property
    def latest_count(self) -> Optional[int]:
        """The number of communities of the latest round (None before the first)."""
        return self.counts[-1] if self.counts else None

    def state_dict(self) -> dict:
        self.drain()  # its result is needed after a resume
        return {"pending": None if self.pending is None else torch.from_numpy(self.pending[1].copy()),
                "index": self.index, "counts": list(self.counts), "last_dispersion": self.last_dispersion,
                "first_ari": self.first_ari,
                # (fault_tolerance shrink: a lost rank's row is its last one, the same on every survivor)
                **({"last_rows": None if self.last_rows is None else torch.from_numpy(self.last_rows.copy())}
                   if self.world.shrinks else {})}

    def load_state_dict(self, state: dict) -> None:
        self.pending = None if state["pending"] is None else (_Done(), state["pending"].numpy().copy(), None)
        self.index, self.counts = int(state["index"]), list(state["counts"])
        self.last_dispersion, self.first_ari = state["last_dispersion"], state["first_ari"]
        rows = state.get("last_rows")
        self.last_rows = None if rows is None else rows.numpy().copy()


class _Done:
    """A request that has already completed (a gather drained for a checkpoint, or restored from one)."""

    def Wait(self) -> None:
        return None
