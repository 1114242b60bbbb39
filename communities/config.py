"""Typed, validated run configuration.

One YAML file plus ``key.path=value`` overrides becomes one frozen ``Config``.
Rank 0 validates it and broadcasts the resolved JSON; every rank validates the
same bytes again, so all ranks hold an identical config. Every error names the
key, the value and what is allowed, and unknown keys suggest the nearest valid one.
"""
from __future__ import annotations

import datetime as _dt
import difflib
import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import overrides as overrides_mod
from .errors import ConfigError
from .refusals import LM_DATASETS, first_refusal

__all__ = ["Config", "ConfigError", "load", "from_dict", "from_json", "apply_overrides", "read_yaml"]


def _numeric(annotation: Any) -> bool:
    """Whether a field holds numbers (int, float, Optional of them, List of them)."""
    if annotation in (int, float):
        return True
    return any(_numeric(a) for a in get_args(annotation))


class _Section(BaseModel):
    # allow_inf_nan=False: ``lr: .inf`` or ``.nan`` is an error naming the key, not a run that silently diverges.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info) -> Any:
        # pydantic's lax mode takes ``seed: true`` as 1: a typo'd key or a YAML ``yes`` would run silently.
        field = cls.model_fields.get(info.field_name) if info.field_name else None
        if field is not None and _numeric(field.annotation):
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, bool) for v in values):
                raise ValueError("must be a number, not a boolean")
        return value


class Schedule(_Section):
    """A scalar annealed from ``start`` to ``end`` over ``[begin, begin + horizon]`` units."""

    start: float = Field(description="the value up to unit begin")
    end: float = Field(description="the value from unit begin + horizon on")
    shape: Literal["linear", "cosine", "exp", "constant"] = Field(
        "linear", description="linear | cosine (slow, fast, slow) | exp (geometric: start and end > 0) | constant "
        "(start throughout)")
    begin: int = Field(0, ge=0, description="unit at which annealing starts")
    horizon: int = Field(100, ge=1, description="units the annealing takes")

    @model_validator(mode="after")
    def _exp_needs_positive(self):
        if self.shape == "exp" and (self.start <= 0 or self.end <= 0):
            raise ValueError(f"shape 'exp' needs start > 0 and end > 0, got start={self.start}, end={self.end}")
        return self


class SyntheticData(_Section):
    """data.dataset synthetic: a Gaussian mixture, one cluster per class."""

    n_samples: int = Field(4000, ge=20, description="examples generated, training and test together")
    n_features: int = Field(32, ge=1, description="dimensions of an example")
    n_classes: int = Field(8, ge=2, description="classes, one Gaussian cluster each")
    class_sep: float = Field(2.0, gt=0, description="how far apart the class centres are (larger: easier)")
    noise: float = Field(1.0, ge=0, description="standard deviation of each cluster around its centre")


class LmData(_Section):
    """The language-model corpora's settings (data.dataset: pystdlib, text, tokens)."""

    context: int = Field(64, ge=2, le=65_536, description="tokens per example window (the model's context)")
    max_bytes: Optional[int] = Field(
        None, ge=1024, description="pystdlib and text: at most this many training bytes, each domain cut to its share "
        "(none: the whole corpus)")
    test_windows: Optional[int] = Field(
        256, ge=1, description="at most this many held-out windows, evenly spaced (what every evaluation scores; "
        "none: all of them)")
    vocab: Optional[int] = Field(None, ge=2, le=65_536, description="tokens: the vocabulary size (none: the largest "
                                 "id in the files, plus one)")
    bytes_per_token: Optional[float] = Field(
        None, gt=0, description="tokens: the corpus's mean bytes per token, for bits per byte (none: not reported)")


class DataConfig(_Section):
    dataset: str = Field("digits", description="digits | mnist1d | synthetic | pystdlib | text | tokens | "
                         "module:function (docs/guides/own-model-and-data.md)")
    root: Optional[str] = Field(None, description="a directory of data on disk, passed to a module:function "
                                "dataset as root= (e.g. torchvision's root); relative to the current directory")
    samples: Optional[int] = Field(
        None, ge=100, le=640_000, description="mnist1d: the samples its generator makes (num_samples: train + test, "
        "split 80/20; none: its default 5,000, 4,000 of them training examples). Cached under data.root when that "
        "is set, so that one process generates them once (a CPU minute per 200,000) and every rank and later run reads "
        "them back")
    samples_per_replica: Optional[int] = Field(
        None, ge=1, description="mnist1d, weak scaling: the training examples each replica holds, so that data.samples "
        "grows with the world (samples_per_replica x world_size x 1.25 generated, the generator's 80/20 split) and a "
        "larger world does not starve its replicas; instead of data.samples")
    on_mismatch: Literal["refuse", "warn"] = Field(
        "refuse", description="when the ranks' data differ at start-up (a dataset function that is not "
        "deterministic): refuse to train, naming the ranks; warn: train anyway, the consensus scored on rank 0's "
        "test split")
    partition: Literal["iid", "dirichlet", "label_groups", "by_domain"] = Field(
        "iid", description="iid | dirichlet | label_groups | by_domain (a text corpus: whole domains per group of "
        "data.groups ranks)")
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (partition: dirichlet)")
    groups: int = Field(4, ge=1, description="planted groups of ranks (partition: label_groups)")
    purity: float = Field(1.0, ge=0, le=1, description="share of a rank's data drawn from its group's labels")
    test_fraction: float = Field(0.25, gt=0, lt=1, description="held-out share for datasets without a test split")
    standardize: bool = Field(True, description="scale every feature to mean 0 and variance 1 by the moments of "
                              "the whole training set (the ranks' sums allreduced, so every rank scales alike)")
    synthetic: SyntheticData = SyntheticData()
    lm: LmData = LmData()
    local_test_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of each rank's own shard held out (seeded per rank) as its local "
        "validation/test data, on which per-rank and per-community models are scored (0: none)")
    shift: Literal["none", "label_permutation", "input_permutation", "rotation"] = Field(
        "none", description="concept shift of the planted groups (data.groups contiguous blocks of ranks): a fixed "
        "seeded transform per group, group 0 the identity; the shared test split is pooled over the groups")

    @model_validator(mode="after")
    def _dataset_known(self):
        if self.dataset not in ("digits", "mnist1d", "synthetic") + LM_DATASETS and ":" not in self.dataset:
            raise ValueError(
                f"data.dataset={self.dataset!r} is not one of digits, mnist1d, synthetic, pystdlib, text, tokens, "
                "or a 'package.module:function' returning (x_train, y_train, x_test, y_test) "
                "(docs/guides/own-model-and-data.md)"
            )
        if self.samples is not None and self.dataset != "mnist1d":
            hint = " (synthetic: data.synthetic.n_samples)" if self.dataset == "synthetic" else ""
            raise ValueError(f"data.samples={self.samples} sets the mnist1d generator's sample count: it needs "
                             f"data.dataset=mnist1d, not {self.dataset!r}{hint}")
        if self.samples_per_replica is not None:
            if self.dataset != "mnist1d":
                raise ValueError(f"data.samples_per_replica={self.samples_per_replica} sizes the mnist1d generator: "
                                 f"it needs data.dataset=mnist1d, not {self.dataset!r}")
            if self.samples is not None:
                raise ValueError(f"data.samples_per_replica={self.samples_per_replica} and data.samples="
                                 f"{self.samples} both size the data: set one")
        lm = self.dataset in LM_DATASETS
        if lm and self.partition not in ("iid", "by_domain"):
            raise ValueError(f"data.partition={self.partition!r} does not apply to a text corpus "
                             f"(data.dataset={self.dataset!r}): iid or by_domain")
        if not lm and self.partition == "by_domain":
            raise ValueError(f"data.partition='by_domain' splits a text corpus by its domains: it needs data.dataset "
                             f"pystdlib, text or tokens, not {self.dataset!r}")
        if lm and self.shift != "none":
            raise ValueError(f"data.shift={self.shift!r} transforms images and labels; a text corpus "
                             f"(data.dataset={self.dataset!r}) has planted groups through data.partition=by_domain")
        if self.dataset in ("text", "tokens") and self.root is None:
            raise ValueError(f"data.dataset={self.dataset!r} reads its files from data.root, which is not set")
        if self.dataset == "tokens" and self.partition == "by_domain":
            raise ValueError("data.partition='by_domain' needs domains (files under directories): "
                             "data.dataset='tokens' is one stream of token ids; use iid")
        if self.dataset != "tokens" and (self.lm.vocab is not None or self.lm.bytes_per_token is not None):
            raise ValueError("data.lm.vocab and data.lm.bytes_per_token describe a token corpus (data.dataset=tokens); "
                             f"data.dataset={self.dataset!r} is bytes")
        if self.shift != "none":
            if self.groups < 2:
                raise ValueError(f"data.shift={self.shift!r} transforms planted groups of ranks: it needs "
                                 f"data.groups >= 2 (got data.groups={self.groups})")
            if ":" in self.dataset:
                raise ValueError(f"data.shift={self.shift!r} applies to the built-in datasets (digits, mnist1d, "
                                 f"synthetic), not data.dataset={self.dataset!r}: shift a user dataset in its own "
                                 "function and declare its groups")
        return self


class GptModel(_Section):
    """model.name gpt: a decoder-only transformer (its context is data.lm.context, its vocabulary the corpus's)."""

    layers: int = Field(4, ge=1, description="transformer blocks")
    heads: int = Field(4, ge=1, description="attention heads per block")
    embed: int = Field(128, ge=1, description="the residual stream's width; a multiple of heads")

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.embed % self.heads:
            raise ValueError(f"model.gpt.embed={self.embed} must be a multiple of model.gpt.heads={self.heads}")
        return self


class ModelConfig(_Section):
    name: str = Field("mlp", description="mlp | cnn1d | gpt | module:function")
    hidden: List[int] = Field(default_factory=lambda: [64], description="mlp: the hidden layers' widths")
    channels: int = Field(25, ge=1, description="cnn1d channels")
    batchnorm: bool = Field(False, description="mlp, cnn1d: a BatchNorm layer after each hidden layer (its "
                            "running statistics are merged with the weights)")
    dropout: float = Field(0.0, ge=0, lt=1, description="mlp: dropout probability after each hidden layer")
    init: Literal["shared", "per_rank"] = Field(
        "shared", description="shared: rank 0's weights broadcast; per_rank: each rank its own (tests)"
    )
    gpt: GptModel = GptModel()

    @model_validator(mode="after")
    def _model_known(self):
        if self.name not in ("mlp", "cnn1d", "gpt") and ":" not in self.name:
            raise ValueError(f"model.name={self.name!r} is not one of mlp, cnn1d, gpt, or a 'module:function'")
        if any(h < 1 for h in self.hidden):
            raise ValueError(f"model.hidden={self.hidden} must hold positive layer widths")
        return self


class TrainConfig(_Section):
    optimizer: Literal["sgd", "adamw"] = Field("sgd", description="the local optimizer of every replica: sgd "
                                                "(with momentum) or adamw")
    lr: float = Field(0.05, ge=0, description="the learning rate (the peak, under a schedule or warmup)")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd: momentum")
    nesterov: bool = Field(False, description="sgd: Nesterov momentum")
    weight_decay: float = Field(0.0, ge=0, description="weight decay (adamw: decoupled)")
    betas: List[float] = Field(default_factory=lambda: [0.9, 0.999], description="adamw: its two betas, "
                               "each in [0, 1)")
    batch_size: int = Field(32, ge=1, description="examples per step on each replica")
    unit: Literal["epoch", "steps"] = Field("epoch", description="one unit of virtual time")
    steps_per_unit: int = Field(10, ge=1, description="steps per unit when unit: steps")
    budget: int = Field(100, ge=1, description="maximum units of virtual time (each rank's own units under async)")
    wall_budget: Optional[float] = Field(
        None, gt=0, description="seconds of wall clock: under protocol async each rank stops training after this "
        "long; under the virtual clock every rank stops at the first signature round past it (null: none)")
    after_budget: Literal["serve", "train"] = Field(
        "serve", description="protocol async: what a rank does once its own budget units are done, until every "
        "rank's are: serve (answer partners' requests only) or train (go on training units on its own shard, "
        "merging as before, so that the slowest rank does not train its last units alone; the run then ends when "
        "the slowest rank finishes its budget)")
    eval_every: int = Field(10, ge=1, description="units between test evaluations")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="the learning rate over the budget: constant, or cosine decay to min_lr x lr at the "
        "last unit (after the warmup)")
    warmup: float = Field(0.0, ge=0, lt=1, description="share of the budget over which the learning rate rises "
                          "linearly from 0 (any schedule)")
    min_lr: float = Field(0.1, ge=0, le=1, description="schedule cosine: the final learning rate, as a share of lr")
    eval_samples: Optional[int] = Field(
        None, ge=1, description="each replica's own test evaluations use the first this many examples of the test "
        "split (null: all of it); the consensus model is always scored on the whole split. For populations, "
        "whose N replicas would each score the whole split")
    group_size: int = Field(
        1, ge=1, description="data-parallel groups: this many consecutive replicas average their gradients at every "
        "step and hold one model trained on their shards; signatures, communities, partners, merges and consensus "
        "act on groups (1: every replica is its own model). It must divide world_size; in a population a group lies "
        "inside one process or spans whole processes")
    vectorize: Literal["off", "on", "auto"] = Field(
        "off", description="a population's replicas in one process trained as one stacked model (torch.func.vmap): "
        "equal to the sequential path within float tolerance, not bitwise; auto: where 2+ replicas share a process "
        "and the model qualifies (no buffers, no dropout, no examples.track, no per-batch faults)")

    @field_validator("vectorize", mode="before")
    @classmethod
    def _yaml_switch(cls, v):
        """YAML reads a bare on/off as true/false."""
        return ("on" if v else "off") if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _betas(self):
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas={self.betas} must be two numbers in [0, 1)")
        return self


class OuterConfig(_Section):
    """DiLoCo-style outer step on the pseudo-gradient ``w_before - w_merged``."""

    enabled: bool = Field(False, description="take an outer step on each merge's pseudo-gradient (NoLoCo, "
                          "SlowMo); strategy diloco always takes one on its global averages")
    lr: float = Field(0.7, gt=0, description="the outer step's learning rate")
    momentum: float = Field(0.9, ge=0, lt=1, description="the outer step's momentum")
    nesterov: bool = Field(True, description="Nesterov momentum for the outer step")


class MergeConfig(_Section):
    lam: float = Field(2.0, ge=1, description="mean units between a rank's merges; K ~ 1 + Poisson(lam - 1)")
    period: int = Field(4, ge=1, description="units between global averages (strategy local_sgd, diloco)")
    average_every: int = Field(0, ge=0, description="pairwise strategies: an exact global average (Allreduce "
                               "mean) every this many units besides the merges (Gossip-PGA, Chen et al. 2021; "
                               "0: none)")
    rule: Literal["constant", "clock", "loss", "ema", "swap"] = Field(
        "constant", description="the merge w_i <- (1 - a) w_i + a w_j on both sides: constant (a = alpha), clock "
        "(weighted by samples seen), loss (weighted by inverse recent loss), ema (a from the schedule merge.ema), "
        "swap (a = 1: the two models trade places)")
    alpha: float = Field(0.5, ge=0, le=1, description="interpolation weight a for constant/clock/loss")
    ema: Schedule = Schedule(start=0.1, end=0.5, shape="linear", horizon=100)
    optimizer_state: Literal["keep", "reset", "average"] = Field(
        "keep", description="the optimizer's moments at a merge: keep them, reset them, or average them with the "
        "partner's (they then travel in the exchange)")
    outer: OuterConfig = OuterConfig()
    partner_policy: Literal["law", "least_recent"] = Field(
        "law", description="law: partners from the partner law alone; least_recent: weight the law by how long "
        "ago the model last trained on each partner's shard (made for rule: swap)")

    @model_validator(mode="after")
    def _coefficients_in_range(self):
        for v in (self.ema.start, self.ema.end):
            if not 0 <= v <= 1:
                raise ValueError(f"merge.ema start/end must lie in [0, 1], got {v}")
        if self.rule in ("clock", "loss") and self.alpha > 0.5:
            # a_i = 2 alpha c_j / (c_i + c_j) reaches 2 alpha: above 0.5 the merge would extrapolate past the partner
            raise ValueError(f"merge.alpha={self.alpha} with rule {self.rule!r} must be <= 0.5 (0.5: the "
                             "weighted average); a larger alpha would extrapolate past the partner's weights")
        return self


class SignatureConfig(_Section):
    kind: Literal["countsketch", "gaussian", "logits", "cka"] = Field(
        "countsketch", description="weights: countsketch | gaussian (random projections of w - w0); "
        "function: logits (outputs on the probe batch) | cka (linear CKA of a layer on the probe batch)")
    dim: int = Field(256, ge=2, description="signature dimension d (cka: the feature sketch width k)")
    every: int = Field(5, ge=1, description="units S between signature rounds")
    overlap: bool = Field(False, description="Iallgather started at t takes effect at t + every")
    probe_size: int = Field(128, ge=2, description="logits/cka: examples in the shared probe batch")
    layer: Optional[str] = Field(None, description="cka: the named module whose output is compared "
                                 "(null: the input of the last Linear layer)")
    debias: bool = Field(True, description="cka: remove the sketch's bias when the layer is wider than dim")
    gossip_rows: int = Field(64, ge=1, description="protocol async: at most this many signature rows passed on "
                             "per exchange (own row first, then the newest)")


class ClusteringConfig(_Section):
    linkage: Literal["average", "complete", "ward", "single"] = Field(
        "ward", description="the agglomerative tree (scipy linkage); ward with metric cosine (or a signature.kind "
        "that gives distances, such as cka) is Ward's tree of the unit rows, on sqrt(2 d)")
    metric: Literal["cosine", "euclidean"] = Field(
        "cosine", description="cosine: the signatures' directions (unit rows; a replica that drifted farther is no "
        "community of its own); euclidean: the signatures as they are")
    cut: Literal["maxclust", "distance", "auto"] = Field(
        "auto", description="maxclust: k(t) communities; distance: the tree cut at threshold; auto: as many "
        "communities as the community test finds at level alpha (one when it finds none)")
    refine: bool = Field(True, description="refine every cut by Lloyd's k-means steps from the tree's cut (a row "
                         "joins its nearest community mean until none moves)")
    alpha: Optional[float] = Field(
        0.05, gt=0, lt=1, description="auto cut: the community test's level, the rate at which a cloud of "
        "signatures without communities is split (an upper bound: the null is the least favourable unimodal "
        "cloud); null: no test, the best-silhouette k (the cut before the test)")
    draws: int = Field(39, ge=3, description="auto cut: null draws of the community test; its smallest p-value is "
                       "1/(draws+1), so (draws+1) * alpha must be at least 1")
    test_rows: Optional[int] = Field(
        512, ge=8, description="auto cut: past this many signatures the test looks at a seeded subsample of this "
        "many (each null draw costs one Ward tree, O(rows^2)); null: all of them")
    null: Literal["uniform", "gaussian"] = Field(
        "uniform", description="auto cut: the test's cloud without communities, with the signatures' principal "
        "variances: uniform scores (the least favourable unimodal shape: at most alpha for any flatter-topped "
        "cloud) or Gaussian scores (more power, but rejects clouds flatter-topped than Gaussian)")
    k: Schedule = Schedule(start=4, end=1, shape="linear", horizon=100)
    threshold: float = Field(0.5, gt=0, description="distance threshold (cut: distance)")
    max_communities: int = Field(16, ge=1, description="largest k tried by cut: auto")
    min_silhouette: Optional[float] = Field(
        None, ge=-1, le=1, description="auto cut: a floor of your own on the communities' mean silhouette, below "
        "which they become one community (null: none; the cut before the test used 0.25 with alpha null)")
    min_separation: float = Field(
        0.1, ge=0, description="auto cut: communities must join at least this far apart (cosine distance, or "
        "euclidean relative to the RMS signature norm; with the test, the mean distance between their members)")

    @model_validator(mode="after")
    def _k_and_level(self):
        if self.k.start < 1 or self.k.end < 1:
            raise ValueError(f"clustering.k must stay >= 1, got start={self.k.start}, end={self.k.end}")
        if self.cut == "auto" and self.alpha is not None and (self.draws + 1) * self.alpha < 1 - 1e-9:
            need = math.ceil(1 / self.alpha - 1e-9) - 1
            raise ValueError(f"clustering.draws={self.draws} is too few for clustering.alpha={self.alpha}: the "
                             f"test's smallest p-value is 1/(draws+1); use draws >= {need}")
        return self


class PartnerConfig(_Section):
    law: Literal["flat", "hierarchical"] = Field(
        "flat", description="flat: P(j | i) proportional to p_intra inside i's community, p_cross(t) outside; "
        "hierarchical: proportional to exp(-h_ij / T(t)), h_ij the cophenetic height at which i and j join")
    schedule: Literal["law", "hypercube"] = Field(
        "law", description="law: merges fire by each rank's merge clock, partners drawn from the law; hypercube: "
        "every unit every rank merges with its one-peer hypercube partner (position p XOR 2^(t mod log2 m)) inside "
        "its community, or, with probability p_cross(t) for the whole unit, inside the whole world (gossip: "
        "always the world): the exact mean of 2^k ranks in k units (Ying et al. 2021)")
    p_intra: float = Field(1.0, gt=0, description="flat law: the weight of a partner inside the community")
    p_cross: Schedule = Schedule(start=0.02, end=1.0, shape="cosine", horizon=100)
    temperature: Schedule = Schedule(start=0.05, end=20.0, shape="exp", horizon=100)

    @model_validator(mode="after")
    def _p_cross(self):
        if self.p_cross.start < 0 or self.p_cross.end < 0:
            raise ValueError("partners.p_cross must stay >= 0")
        if self.p_cross.end > self.p_intra:
            raise ValueError(f"partners.p_cross.end={self.p_cross.end} exceeds partners.p_intra={self.p_intra}")
        if self.temperature.start <= 0 or self.temperature.end <= 0:
            raise ValueError("partners.temperature must stay > 0")
        return self


class ConsensusConfig(_Section):
    tol: float = Field(0.05, gt=0, description="relative signature dispersion counted as consensus")
    patience: int = Field(3, ge=1, description="consecutive rounds under tol, after annealing, to stop")
    update_tol: Optional[float] = Field(
        None, gt=0, description="also require the round's mean merge update norm, over the mean weight norm, "
        "under this (null: dispersion alone decides)")
    stop: bool = Field(True, description="stop at consensus; false runs the whole budget")
    mode: Literal["global", "communities", "auto"] = Field(
        "global", description="global: anneal to one consensus model; communities: freeze the communities of "
        "round freeze_round (cross-community merges off) and deliver one model per community; auto: keep "
        "annealing while merges across those communities do not hurt the members' local validation loss, freeze "
        "them when they do (strategy community)")
    freeze_round: int = Field(0, ge=0, description="modes communities/auto: the signature round whose communities "
                              "are frozen (communities) or weighed and frozen if merging them hurts (auto); 0: the "
                              "first, found before any cross-community merge")
    k: Optional[int] = Field(None, ge=1, description="modes communities/auto: cut that round's tree into k "
                             "communities (scipy fcluster maxclust) instead of the round's own cut (null: its cut)")
    auto_harm: float = Field(
        0.02, gt=0, description="mode auto: merges across the communities hurt when they raise the members' local "
        "validation loss by more than this share of its value before the merge (beyond what merges inside a "
        "community cost, when they raise it too). Measured: conflicting groups 0.07 to 3.0 at 8-16 replicas and "
        "0.04 at 1,024 (round 1); label skew -0.28 to -0.84; language domains sharing a syntax 0.0004")
    auto_min_merges: int = Field(8, ge=1, description="mode auto: cross-community merge sides scored (each "
                                 "exchange has two) needed before deciding")
    finetune_units: int = Field(0, ge=0, description="after the run, each rank fine-tunes the consensus model "
                                "this many units on its own shard and is scored on its local test data (0: off)")


class OutputConfig(_Section):
    root: str = Field("results", description="the directory that holds run directories (results/<name>/)")
    consensus_every: int = Field(0, ge=0, description="units between consensus-model evaluations (0: eval_every)")
    snapshot_seconds: float = Field(
        1.0, ge=0, description="protocol async: seconds of wall clock between copies of the weights, averaged at "
        "the end into the consensus-over-wall-time curve (0: none)")
    snapshots_max: int = Field(64, ge=2, description="protocol async: copies kept; past that every other one is "
                               "dropped and the interval doubles")
    round_snapshots: bool = Field(False, description="each rank writes its flat weights at every signature round "
                                  "(snapshots/round_NNNN/rankRRRRR.pt), for communities export: N models per round")


class LoggingConfig(_Section):
    """Where ML users look for metrics: TensorBoard, W&B, MLflow (rank 0 writes what it gathers anyway, off the training
    path)."""

    tensorboard: bool = Field(False, description="write TensorBoard scalars (consensus and rank accuracy, loss, "
                              "dispersion, communities, p_cross, bytes, wall split) to RUN_DIR/tensorboard; needs "
                              "pip install 'communities[tensorboard]'")
    per_rank: bool = Field(False, description="the trackers: also every rank's own loss, accuracy and bytes")
    dendrograms: bool = Field(True, description="the trackers: each round's dendrogram and the community timeline as "
                              "images (drawn at the end; needs matplotlib)")
    wandb: bool = Field(False, description="log the config, the same scalars, the dendrograms, the community timeline "
                        "and the summary to Weights & Biases (rank 0; WANDB_MODE=offline on nodes without internet); "
                        "needs pip install 'communities[wandb]'")
    mlflow: bool = Field(False, description="log the same to MLflow (rank 0; the tracking server or store of "
                         "MLFLOW_TRACKING_URI, else MLflow's default); needs pip install 'communities[mlflow]'")
    project: str = Field("communities", description="wandb: the project; mlflow: the experiment name")


class SlurmConfig(_Section):
    """What ``communities slurm`` writes into the batch script besides the run itself."""

    setup: List[str] = Field(default_factory=list, description="shell lines the job runs first (module loads, "
                             "activating an environment), before communities slurm's --setup lines")


class CommConfig(_Section):
    cuda_aware: bool = Field(False, description="pass device buffers to MPI directly")
    check_hashes: bool = Field(True, description="allgather a hash of exchange lists and communities each round")
    timeout: float = Field(600.0, ge=0, description="seconds a rank may block in one MPI wait before the watchdog "
                                                    "aborts the job naming who it waited for (0: no watchdog)")
    exchange: Literal["sendrecv", "posted"] = Field(
        "sendrecv", description="protocol async: sendrecv: the pair meets in blocking Sendrecvs (the requester "
        "waits for its partner's next batch boundary); posted: each side posts a copy of its weights and trains on, "
        "and merges the partner's when it has arrived, by a displacement that conserves the pair's sum")
    fault_tolerance: Literal["abort", "shrink"] = Field(
        "abort", description="abort: a lost rank ends the job (resume from the last checkpoint); shrink: the "
        "survivors shrink the communicator and go on (needs an MPI with ULFM: Open MPI 5 with --with-ft ulfm)")
    lost_shard: Literal["drop", "adopt"] = Field(
        "drop", description="shrink: what happens to a lost rank's shard: drop it, or adopt it (the next rank "
        "alive after it, in rank order, adds it to its own)")


class RobustConfig(_Section):
    """What to do with diverged and hostile ranks."""

    diverged: Literal["reset", "quarantine"] = Field(
        "reset", description="reset: a diverged rank takes its next partner's weights; quarantine: it is left out")
    loss_factor: float = Field(10.0, gt=1, description="a unit loss above this x the first unit's counts as diverged")
    enabled: bool = Field(False, description="drop outlier ranks (by signature) from exchanges, averages, consensus")
    outlier_factor: float = Field(5.0, gt=1, description="outlier: signature farther than this x the median "
                                                          "distance from the median signature")


class FaultsConfig(_Section):
    """Fault injection for testing the defences (chaos testing); off by default."""

    nan_rank: Optional[int] = Field(None, ge=0, description="this rank's weights become NaN at unit nan_at")
    nan_at: int = Field(1, ge=1, description="the unit at which faults.nan_rank's weights become NaN")
    hostile_rank: Optional[int] = Field(None, ge=0, description="this rank sends scaled or random weights")
    hostile_kind: Literal["scale", "random"] = Field(
        "scale", description="what faults.hostile_rank sends: its weights times hostile_scale, or random weights "
        "of the same norm")
    hostile_scale: float = Field(-10.0, description="scale attack factor; negative flips the sign (a ReLU net "
                                                   "predicts almost the same with positively scaled weights)")
    slow_max: float = Field(0.0, ge=0, description="each unit, each rank sleeps a random [0, slow_max] seconds")
    stall_rank: Optional[int] = Field(None, ge=0, description="this rank stops responding at unit stall_at")
    stall_at: int = Field(1, ge=1, description="the unit at which faults.stall_rank stops responding")
    stall_seconds: float = Field(3600.0, gt=0, description="how long faults.stall_rank sleeps")
    speed: Dict[int, float] = Field(
        default_factory=dict, description="rank -> slowdown factor >= 1: the rank sleeps (factor - 1) x each "
        "batch's own time after it, e.g. {0: 3.0} makes rank 0 three times slower")
    jitter: float = Field(0.0, ge=0, description="every rank sleeps a random [0, jitter] seconds after each batch")

    disk_full_at: Optional[int] = Field(None, ge=1, description="from this unit on, every write into the run "
                                        "directory fails as on a full disk (ENOSPC), on every rank")
    kill: Dict[int, int] = Field(
        default_factory=dict, description="rank -> unit: the rank's process sends itself SIGKILL at that unit "
        "(a lost rank, for comm.fault_tolerance tests), where kill_in says; 0: from the start (under async a rank "
        "serves exchanges during its first unit, logged at t=0)")
    kill_in: Literal["train", "exchange", "round", "checkpoint"] = Field(
        "train", description="train: after the unit's training; exchange: inside its first exchange from that unit "
        "on, after the header swap (the partner waits in the weights' Sendrecv); round: at its first signature "
        "round from that unit on, just before the Allgather (the others are in it); checkpoint: inside its first "
        "checkpoint from that unit on, once every rank's file is written and before the commit (the others wait "
        "for the writer's verdict)")

    @model_validator(mode="after")
    def _nonzero_scale(self):
        if self.hostile_scale == 0:
            raise ValueError("faults.hostile_scale must be non-zero")
        if any(r < 0 or t < 0 for r, t in self.kill.items()):
            raise ValueError(f"faults.kill={self.kill}: ranks and units are >= 0")
        bad = {r: f for r, f in self.speed.items() if r < 0 or not f >= 1.0}
        if bad:
            raise ValueError(f"faults.speed={bad}: ranks are >= 0 and slowdown factors >= 1")
        return self


class CheckpointConfig(_Section):
    every: int = Field(0, ge=0, description="units between checkpoints (0: only at the end and on a stop signal)")
    at_end: bool = Field(True, description="write a checkpoint at the end of the run")
    keep: int = Field(1, ge=0, description="complete checkpoints kept besides the newest")
    requeue: bool = Field(False, description="on a stop signal under SLURM, rank 0 runs scontrol requeue itself "
                                             "(launch/slurm.sbatch requeues after the ranks exit instead)")


# Keys a resumed run may change: they do not alter what is computed up to the checkpoint.
# ``name`` follows the run directory: a copied or renamed run directory resumes under its new name.
RESUME_MAY_CHANGE = ("train.budget", "train.wall_budget", "output", "checkpoint", "comm.check_hashes", "comm.timeout",
                     "consensus.stop", "consensus.patience", "consensus.tol", "train.eval_every", "name",
                     "faults.disk_full_at", "logging", "data.on_mismatch", "comm.fault_tolerance", "faults.kill",
                     "slurm")


def differences(saved: dict, current: dict, prefix: str = "") -> List[str]:
    """Dotted keys whose values differ between two config dicts (``RESUME_MAY_CHANGE`` ignored)."""
    out = []
    # JSON keys are strings: a checkpoint's saved config has "0" where the live one has 0 (faults.speed, pbt.start)
    saved, current = {str(k): v for k, v in saved.items()}, {str(k): v for k, v in current.items()}
    for key in sorted(set(saved) | set(current)):
        path = f"{prefix}{key}"
        if any(path == k or path.startswith(k + ".") for k in RESUME_MAY_CHANGE):
            continue
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(differences(a, b, path + "."))
        elif a != b:
            out.append(f"{path}: checkpoint has {a!r}, config has {b!r}")
    if not prefix:
        out.extend(_budget_moves_schedule(saved, current))
    return out


def mnist1d_samples(per_replica: int, world: int) -> int:
    """The mnist1d generator's sample count that gives every replica ``per_replica`` training examples (80/20)."""
    return -(-int(per_replica) * int(world) * 5 // 4)


def _budget_moves_schedule(saved: dict, current: dict) -> List[str]:
    """A new train.budget under an lr schedule stretches the schedule: the lr would jump at the resume."""
    old, new = saved.get("train") or {}, current.get("train") or {}
    moving = new.get("schedule", "constant") != "constant" or (new.get("warmup") or 0) > 0
    if moving and old.get("budget") is not None and old.get("budget") != new.get("budget"):
        return [f"train.budget: checkpoint has {old.get('budget')!r}, config has {new.get('budget')!r} (the lr "
                "schedule, train.schedule and train.warmup, runs over the budget: a new one would move the lr)"]
    return []




class ExamplesConfig(_Section):
    """Per-example confidence, retirement and hard-example passing (all off by default)."""

    track: bool = Field(False, description="track each example's confidence (needed by retire and pass_hard)")
    eval_every: int = Field(5, ge=1, description="units E between confidence evaluations of the shard")
    ema: float = Field(0.5, gt=0, le=1, description="weight of the newest probability in the confidence EMA")
    retire: bool = Field(False, description="move examples every evaluation finds easy to a reserve, then retire")
    tau_retire: float = Field(0.95, gt=0, lt=1, description="confidence above which an example counts as easy")
    patience: int = Field(3, ge=1, description="M: consecutive easy evaluations before the reserve")
    reserve_rounds: int = Field(3, ge=1, description="R: evaluations in the reserve before retirement")
    rho: float = Field(0.1, ge=0, le=1, description="probability a reserve example is trained on and checked")
    pass_hard: bool = Field(False, description="partners exchange their lowest-confidence examples at each merge")
    pass_fraction: float = Field(0.05, ge=0, le=1, description="share of the evaluated active examples passed")
    pass_count: Optional[int] = Field(None, ge=0, description="at most this many examples per merge (null: no cap)")
    pass_max_bytes: int = Field(1 << 20, ge=0, description="cap on one side's example packet, in bytes")
    handover: bool = Field(True, description="the sender drops what it passes (the total is conserved); "
                           "false: it keeps a copy")
    pass_similarity: Literal["none", "more_when_far", "more_when_near"] = Field(
        "none", description="scale the count by the pair's signature distance over the round's median")
    pass_which: Literal["hardest", "unseen"] = Field(
        "unseen", description="hardest first, or hardest among those the partner never trained on first")
    tau_hard: float = Field(0.5, gt=0, lt=1, description="below this confidence, a fully visited example is "
                            "logged as globally hard")
    visited: Literal["auto", "bitset", "recent"] = Field(
        "auto", description="how each example's set of visiting ranks is kept: bitset (exact, a bit per rank), "
        "recent (a count and the 16 most recent visitors); auto: bitset up to 1,024 ranks, recent beyond")

    @model_validator(mode="after")
    def _needs_tracking(self):
        for key in ("retire", "pass_hard"):
            if getattr(self, key) and not self.track:
                raise ValueError(f"examples.{key}=true needs examples.track=true")
        return self


class IfcaConfig(_Section):
    """The IFCA baseline (Ghosh et al. 2020): k shared models, each rank trains the one that fits its data best."""

    k: int = Field(4, ge=1, description="shared models; every merge.period units each rank picks the one with the "
                   "lowest loss on its shard, trains it, and the ranks that picked the same one average it")
    init: Literal["random", "warmup", "restarts"] = Field(
        "random", description="how the k models start: random (seeded models, the first pick by loss); warmup "
        "(warmup_units of local training, then k-means on the signatures of the local models assigns the initial "
        "clusters, each cluster's model the mean of its members); restarts (`restarts` short starts of "
        "warmup_units units each, the one with the lowest training loss kept)")
    warmup_units: int = Field(2, ge=1, description="units of the start: local training before the k-means "
                              "(init warmup), or the length of each short start (init restarts); part of train.budget")
    restarts: int = Field(5, ge=1, description="short random starts under init restarts (restarts x warmup_units "
                          "units of train.budget); the one with the lowest mean training loss goes on")


class PrivacyConfig(_Section):
    """DP-SGD on every replica (Abadi et al. 2016): per-example clipping, Gaussian noise, Opacus's accountant."""

    enabled: bool = Field(False, description="each replica trains with DP-SGD; needs the privacy extra "
                          "(pip install -e '.[privacy]')")
    max_grad_norm: float = Field(1.0, gt=0, description="C: every example's gradient is scaled to norm <= C")
    noise_multiplier: Optional[float] = Field(
        None, ge=0, description="sigma: noise N(0, (sigma C)^2) per coordinate on each step's sum of clipped "
        "gradients; set this or epsilon")
    epsilon: Optional[float] = Field(
        None, gt=0, description="target epsilon for the planned train.budget: the noise multiplier is derived "
        "(Opacus's get_noise_multiplier) from each replica's sampling rate and planned steps; set this or "
        "noise_multiplier")
    delta: float = Field(1e-5, gt=0, lt=1, description="the delta of every epsilon reported")
    sampling: Literal["poisson", "shuffle"] = Field(
        "poisson", description="poisson: each step takes each example of the shard with probability q = "
        "batch_size / shard size, what the accountant assumes; shuffle: the plain run's shuffled batches, "
        "accounted as if Poisson at the same q (common practice, not what the analysis proves)")
    noise: Literal["secret", "seeded"] = Field(
        "secret", description="secret: each replica's noise generator is seeded from the OS's entropy and never "
        "written or sent (runs are not bitwise reproducible); seeded: keyed by (seed, unit, replica), bitwise "
        "reproducible and resumable, but anyone who knows the config's seed can subtract the noise: for "
        "experiments, not for protecting data")
    accountant: Literal["rdp"] = Field("rdp", description="Opacus's Renyi-DP accountant")
    report_train_loss: bool = Field(
        False, description="write each replica's training loss and accuracy on its shard to metrics.jsonl; they "
        "are not noised, and rank 0 gathers them (off: null there, and no partner is told a loss)")
    per_example: Literal["auto", "ghost", "hooks", "vmap"] = Field(
        "auto", description="how the clipped sum of per-example gradients is computed: ghost (ghost clipping and "
        "book-keeping: Linear and Conv1d layers' norms and clipped sum from their inputs and output gradients, "
        "without per-example gradients or a second backward; Opacus's per-example gradients for other layers; one "
        "backward), hooks (Opacus's per-example gradients for every layer, one backward; refuses a convolution "
        "that pads other than with zeros), vmap (torch.func, any model it can trace, two passes); auto: ghost when "
        "it takes every layer with parameters, else vmap (communities bench privacy); the gradient applied is the "
        "same within rounding, and the plain step's bit for bit when no bound binds")

    @model_validator(mode="after")
    def _one_noise(self):
        given = [k for k in ("noise_multiplier", "epsilon") if getattr(self, k) is not None]
        if self.enabled and len(given) != 1:
            raise ValueError("privacy.enabled=true needs exactly one of privacy.noise_multiplier and privacy.epsilon"
                             + (" (both are set)" if len(given) == 2 else " (neither is set)"))
        if not self.enabled and given:
            raise ValueError(f"privacy.{given[0]} has no effect with privacy.enabled=false")
        return self


PBT_PARAMS = {  # a learnable hyperparameter -> the values its config field allows: (low, high or None, high allowed)
    "train.lr": (0.0, None, False), "train.momentum": (0.0, 1.0, False), "train.weight_decay": (0.0, None, False),
    "train.beta1": (0.0, 1.0, False), "train.beta2": (0.0, 1.0, False), "merge.alpha": (0.0, 1.0, True),
    "merge.lam": (1.0, None, False),
}


class PbtRange(_Section):
    """Where one learnable hyperparameter lives: each replica's first value is drawn from [low, high]."""

    low: float = Field(description="the lowest first value (and the lowest kept when exploring)")
    high: float = Field(description="the highest first value (and the highest kept when exploring)")
    scale: Literal["log", "linear"] = Field("log", description="log: drawn log-uniformly (low > 0); linear: uniformly")

    @model_validator(mode="after")
    def _ordered(self):
        if self.high < self.low:
            raise ValueError(f"high={self.high} is below low={self.low}")
        if self.scale == "log" and self.low <= 0:
            raise ValueError(f"scale='log' needs low > 0 (got low={self.low}); use scale='linear' for a range from 0")
        return self


class PbtConfig(_Section):
    """Population-based training: each replica owns its hyperparameters; by the loss on its own held-out data the
    worse adopt the better ones' values and perturb them (at signature rounds from the whole population, or at a
    merge from the partner)."""

    enabled: bool = Field(False, description="learn the hyperparameters of pbt.params (needs a "
                          "pairwise strategy and data.local_test_fraction > 0, whose loss is the score)")
    selection: Literal["truncation", "tournament"] = Field(
        "truncation", description="truncation: at every signature round each ready replica whose held-out loss ranks "
        "in the bottom pbt.fraction adopts the values of one drawn from the top pbt.fraction (one gather of every "
        "replica's score and values; virtual clock); tournament: at a merge the worse of the pair adopts the "
        "better one's (greedy at many replicas: the learning rate decays early)")
    fraction: float = Field(0.25, gt=0, le=0.5, description="pbt.selection truncation: the share of the population "
                            "in the top and in the bottom (0.5 came within 1 point of the best fixed lr at 64 IID "
                            "replicas where 0.25 did not, and lost 2.2 points on digits' label-permuted groups: "
                            "docs/results/pbt.md)")
    params: Dict[str, PbtRange] = Field(
        default_factory=dict, description="the learnable hyperparameters, each {low, high, scale}: "
        + ", ".join(PBT_PARAMS) + " (train.beta1/beta2: the entries of train.betas)")
    start: Dict[int, Dict[str, float]] = Field(
        default_factory=dict, description="replicas that start from given values instead of a draw, e.g. {0: "
        "{train.lr: 0.1}} (a value from an earlier sweep); any value the config field allows, in range or not")
    ready: int = Field(4, ge=1, description="units a replica trains with its hyperparameters before it may adopt "
                       "new ones (PBT's ready); under truncation selection runs at signature rounds only, so a "
                       "ready at or under signature.every changes nothing")
    factors: List[float] = Field(default_factory=lambda: [0.8, 1.25], min_length=1, description="explore: each "
                                 "adopted value is multiplied by one of these, drawn uniformly, then kept in range")
    resample: float = Field(0.0, ge=0, le=1, description="explore: the probability that a value is drawn afresh "
                            "from its range instead")
    margin: float = Field(0.0, ge=0, lt=1, description="adopt only where the partner's score is lower by more than "
                          "this share of one's own (0: any lower score)")

    @field_validator("factors")
    @classmethod
    def _positive(cls, factors: List[float]) -> List[float]:
        if any(f <= 0 for f in factors):
            raise ValueError(f"every factor must be > 0 (got {factors})")
        return factors

    @model_validator(mode="after")
    def _known(self):
        for key, rng in self.params.items():
            if key not in PBT_PARAMS:
                near = difflib.get_close_matches(key, list(PBT_PARAMS), n=1)
                raise ValueError(f"pbt.params has no hyperparameter {key!r}"
                                 + (f" (did you mean {near[0]!r}?)" if near else "")
                                 + f"; learnable: {', '.join(PBT_PARAMS)}")
            lo, hi, closed = PBT_PARAMS[key]
            over = hi is not None and (rng.high > hi if closed else rng.high >= hi)
            if rng.low < lo or over:
                bound = f">= {lo}" if hi is None else f"[{lo}, {hi}{']' if closed else ')'}"
                raise ValueError(f"pbt.params.{key}: [{rng.low}, {rng.high}] leaves {key}'s allowed values {bound}")
        for replica, values in self.start.items():
            if replica < 0:
                raise ValueError(f"pbt.start: replica {replica} is negative")
            for key, value in values.items():
                if key not in self.params:
                    raise ValueError(f"pbt.start.{replica}.{key}: {key!r} is not one of pbt.params "
                                     f"({', '.join(self.params) or 'none'})")
                lo, hi, closed = PBT_PARAMS[key]
                if value < lo or (hi is not None and (value > hi if closed else value >= hi)):
                    raise ValueError(f"pbt.start.{replica}.{key}={value} is not a value {key} allows")
        if self.enabled and not self.params:
            raise ValueError("pbt.enabled=true needs at least one entry in pbt.params")
        if not self.enabled and self.params:
            raise ValueError(f"pbt.params ({', '.join(self.params)}) has no effect with pbt.enabled=false")
        return self


Strategy = Literal["community", "gossip", "ring", "isolated", "local_sgd", "diloco", "allreduce", "ifca", "oracle"]
STRATEGIES = get_args(Strategy)
SYNCS_GRADIENTS = ("allreduce",)  # strategies that communicate inside a unit's training (every step)

NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]+")
SEED_BOUND = 2**32  # numpy's legacy RandomState and scikit-learn's random_state take seeds in [0, 2**32)


class Config(_Section):
    name: str = Field("run", description="the run directory's name under output.root: one plain file name")
    seed: int = Field(0, ge=0, lt=SEED_BOUND, description="0 <= seed < 2**32")
    strategy: Strategy = Field(
        "community", description="how replicas combine their work: community (partners by community), gossip "
        "(uniform partners), ring, isolated (no mixing), local_sgd (a mean every merge.period units), diloco (that "
        "mean as an outer Nesterov step), allreduce (gradients every step), ifca (k shared models), oracle (IFCA "
        "fixed to the planted groups)")
    protocol: Literal["virtual_clock", "async"] = Field(
        "virtual_clock", description="virtual_clock: every rank walks the same exchange lists (deterministic, "
        "bitwise resumable); async: each rank at its own pace, merges served between batches")
    world_size: Optional[int] = Field(None, ge=1, description="the number of replicas N: MPI may start N processes "
                                      "or any number P that divides N (each hosting N/P replicas); null: one replica "
                                      "per process, any number")
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="cpu; cuda (an error where torch sees no GPU); auto: GPU local_rank % n_gpus where "
        "there is one, else the CPU")
    threads: Optional[int] = Field(None, ge=1, description="torch threads per rank; null: OMP_NUM_THREADS, else 1")
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()
    merge: MergeConfig = MergeConfig()
    signature: SignatureConfig = SignatureConfig()
    clustering: ClusteringConfig = ClusteringConfig()
    partners: PartnerConfig = PartnerConfig()
    consensus: ConsensusConfig = ConsensusConfig()
    output: OutputConfig = OutputConfig()
    comm: CommConfig = CommConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    robust: RobustConfig = RobustConfig()
    faults: FaultsConfig = FaultsConfig()
    examples: ExamplesConfig = ExamplesConfig()
    logging: LoggingConfig = LoggingConfig()
    ifca: IfcaConfig = IfcaConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    pbt: PbtConfig = PbtConfig()
    slurm: SlurmConfig = SlurmConfig()

    @field_validator("name", mode="after")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # ``output.root/name`` is what --overwrite clears: '..' or 'a/b' would point it at another directory.
        if not NAME_CHARS.fullmatch(name) or name in (".", "..") or len(name) > 255:
            raise ValueError(f"name={name!r} must be one plain file name (at most 255 of A-Z a-z 0-9 _ . -, no '/', "
                             "not '.' or '..'): it names the run directory under output.root")
        return name

    @field_validator("seed", mode="before")
    @classmethod
    def _seed_range(cls, seed: Any) -> Any:
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < SEED_BOUND:
            raise ValueError(f"seed={seed} is out of range: 0 <= seed < 2**32 (= {SEED_BOUND})")
        return seed

    @model_validator(mode="after")
    def _cross_section(self):
        """Settings of different sections that do not go together: the first row of ``refusals.REFUSALS`` that holds."""
        problem = first_refusal(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _ifca_start(self):
        ic = self.ifca
        if self.strategy != "ifca" or ic.init == "random":
            return self
        units = ic.warmup_units * (ic.restarts if ic.init == "restarts" else 1)
        if units >= self.train.budget:
            what = f"ifca.restarts={ic.restarts} x ifca.warmup_units={ic.warmup_units}" if ic.init == "restarts" \
                else f"ifca.warmup_units={ic.warmup_units}"
            raise ValueError(f"{what} = {units} units of ifca.init={ic.init!r} leave no unit of train.budget="
                             f"{self.train.budget} for IFCA itself")
        return self

    def check_world(self, world: int) -> None:
        """Checks that need the world size; raise ConfigError naming the key."""
        if self.world_size is not None and self.world_size != world:
            raise ConfigError(f"world_size={self.world_size} replicas, but this world has {world} (placing replicas on "
                              "processes: refusals.check_placement)")
        if (self.data.partition == "label_groups" or self.data.shift != "none") and self.data.groups > world:
            raise ConfigError(
                f"data.groups={self.data.groups} planted groups need at least as many ranks; world size is {world}"
            )
        if self.consensus.mode != "global" and self.consensus.k is not None and self.consensus.k > world:
            raise ConfigError(f"consensus.k={self.consensus.k} communities need at least as many ranks; world size "
                              f"is {world}")
        if self.strategy == "community" and self.clustering.cut == "maxclust" and self.clustering.k.start > world:
            raise ConfigError(f"clustering.k.start={self.clustering.k.start} exceeds the world size {world}")
        for key in ("nan_rank", "hostile_rank", "stall_rank"):
            rank = getattr(self.faults, key)
            if rank is not None and rank >= world:
                raise ConfigError(f"faults.{key}={rank} is not a rank of a world of {world} (0..{world - 1})")
        for key in ("speed", "kill"):
            for rank in getattr(self.faults, key):
                if rank >= world:
                    raise ConfigError(f"faults.{key} names rank {rank}, not a rank of a world of {world} "
                                      f"(0..{world - 1})")
        if self.strategy == "ifca" and self.ifca.init == "warmup" and self.ifca.k > world:
            raise ConfigError(f"ifca.k={self.ifca.k} clusters of ifca.init='warmup' (k-means over the ranks) need at "
                              f"least as many ranks; world size is {world}")
        if self.strategy in ("community", "gossip", "ring") and world < 2:
            raise ConfigError(f"strategy={self.strategy!r} needs at least 2 ranks; world size is {world}")
        spr = self.data.samples_per_replica
        if spr is not None and not 100 <= mnist1d_samples(spr, world) <= 640_000:
            raise ConfigError(f"data.samples_per_replica={spr} x world size {world} asks the mnist1d generator for "
                              f"{mnist1d_samples(spr, world):,} samples; it makes 100 to 640,000")
        G = self.train.group_size
        if G > 1:
            if world % G:
                raise ConfigError(f"train.group_size={G} must divide the world size {world}")
            groups = world // G
            if self.strategy in ("community", "gossip", "ring") and groups < 2:
                raise ConfigError(f"strategy={self.strategy!r} mixes groups: train.group_size={G} leaves {groups} "
                                  f"group of a world of {world}")
            if self.strategy == "community" and self.clustering.cut == "maxclust" and self.clustering.k.start > groups:
                raise ConfigError(f"clustering.k.start={self.clustering.k.start} exceeds the {groups} groups of "
                                  f"train.group_size={G}")
            if self.consensus.mode != "global" and self.consensus.k is not None and self.consensus.k > groups:
                raise ConfigError(f"consensus.k={self.consensus.k} communities need at least as many groups; "
                                  f"train.group_size={G} makes {groups}")

    def to_json(self) -> str:
        return self.model_dump_json()

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


# --------------------------------------------------------------------------- parsing


def _all_keys(model: type[BaseModel], prefix: str = "") -> List[str]:
    keys = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        keys.append(path)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys.extend(_all_keys(ann, path + "."))
    return keys


def _schedule_hint(key: str, value: Any) -> str:
    """What a schedule looks like, for a key given something else (``clustering.k=3``)."""
    v = value if isinstance(value, (int, float)) and not isinstance(value, bool) else 3
    return (f"takes a schedule, not a single value: a mapping annealed from start to end, such as {{start: 4, end: 1, "
            f"shape: linear, begin: 0, horizon: 100}} (shape linear, cosine, exp or constant; unwritten fields keep "
            f"their defaults). A constant {v} is {key}='{{start: {v}, end: {v}}}' on the command line, or {key}.start="
            f"{v} {key}.end={v} (got {value!r})")


def _format_error(err: dict, raw: dict) -> str:
    loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-after"))
    value = raw
    for part in err["loc"]:
        value = value.get(part) if isinstance(value, dict) else None
    if err["type"] == "extra_forbidden":
        near = difflib.get_close_matches(loc, _all_keys(Config), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        return f"unknown key {loc!r}{hint}"
    msg = err["msg"].removeprefix("Value error, ")
    where = f"{loc}: " if loc else ""
    if err["type"] == "model_type":  # a value where a section goes: say what the section looks like
        if (err.get("ctx") or {}).get("class_name") == "Schedule":
            return f"{where}{_schedule_hint(loc, value)}"
        return f"{where}takes a section of keys (a mapping), not a single value (got {value!r})"
    if value is not None and not isinstance(value, dict) and f"{value}" not in msg:
        return f"{where}{msg} (got {value!r})"
    return f"{where}{msg}"


class StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key written twice in one mapping (PyYAML keeps the last silently).

    ``load_strict`` walks the composed node graph once before constructing it, so the error can name the
    key's dotted path and both lines. Merge keys (``<<: *base``) may still be overridden by explicit keys.
    """

    def check_duplicates(self, root: yaml.Node, source: str) -> None:
        seen_nodes = set()  # each node once: aliases share nodes (no cycles, no exponential walks)
        stack = [(root, "")]
        while stack:
            node, path = stack.pop()
            if id(node) in seen_nodes:
                continue
            seen_nodes.add(id(node))
            if isinstance(node, yaml.MappingNode):
                lines: dict = {}
                for key_node, value_node in node.value:
                    label = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
                    child = f"{path}.{label}" if path else label
                    if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                        key = self.construct_object(key_node)  # equal as dict keys: 1, 1.0, true, yes
                        if key in lines:
                            raise ConfigError(
                                f"{source}: duplicate key {child!r} (line {lines[key]} and line "
                                f"{key_node.start_mark.line + 1}); each key may appear once per section")
                        lines[key] = key_node.start_mark.line + 1
                    stack.append((value_node, child))
            elif isinstance(node, yaml.SequenceNode):
                stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))


def load_strict(text: str, source: str = "config") -> Any:
    """``yaml.safe_load`` with duplicate keys rejected (ConfigError naming the key path and ``source``)."""
    loader = StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        loader.check_duplicates(node, source)
        return loader.construct_document(node)
    finally:
        loader.dispose()


MAX_NODES = 100_000  # a config has a few hundred; this stops alias bombs ("billion laughs") early


def _plain(value: Any, path: str, budget: List[int], active: set) -> Any:
    """A JSON-compatible deep copy of parsed YAML; ConfigError naming the key for what JSON cannot hold.

    YAML values beyond JSON's: timestamps become ISO strings; anything else is an error.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise ConfigError(f"more than {MAX_NODES} values (nested aliases?) - a config is far smaller")
    where = path or "the top level"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value  # inf/nan reach the validator, which names the key
    if isinstance(value, (_dt.date, _dt.datetime)):
        return value.isoformat()
    if isinstance(value, (dict, list)):
        if id(value) in active:
            raise ConfigError(f"{where}: refers to itself (a recursive YAML alias)")
        active.add(id(value))
        try:
            if isinstance(value, list):
                return [_plain(v, f"{path}[{i}]", budget, active) for i, v in enumerate(value)]
            out = {}
            for k, v in value.items():
                if not isinstance(k, (str, int, float, bool)) and k is not None:
                    raise ConfigError(f"{where}: a key of type {type(k).__name__} ({k!r}); keys are names")
                key = json.dumps(k) if not isinstance(k, str) else k  # 1 -> "1", None -> "null", True -> "true"
                out[key] = _plain(v, f"{path}.{key}" if path else key, budget, active)
            return out
        finally:
            active.discard(id(value))
    raise ConfigError(f"{where}: a YAML value of type {type(value).__name__} is not supported ({value!r:.60})")


def plain(value: Any, path: str = "") -> Any:
    return _plain(value, path, [MAX_NODES], set())


def _yaml_failure(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return " ".join(str(exc).split()) or type(exc).__name__


# PyYAML raises more than YAMLError on some input: ValueError for a date like 2020-13-45 or ``!!int x``,
# RecursionError for thousands of nested brackets, OverflowError for huge ``!!float`` literals.
YAML_FAILURES = (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError)


def _parse_scalar(text: str, key: str = "") -> Any:
    try:
        value = load_strict(text, f"override {key}")
    except ConfigError:
        raise
    except YAML_FAILURES:
        return text
    return plain(value, key)


def _override_path(key: str) -> List[str]:
    """The path of an override's key. ``pbt.params``' keys hold dots themselves: ``pbt.params.train.lr.low`` is
    (pbt, params, train.lr, low), and ``pbt.params.train.lr`` (a whole range) is (pbt, params, train.lr)."""
    parts = key.split(".")
    if parts[:2] == ["pbt", "params"] and len(parts) > 3:
        fields = set(PbtRange.model_fields)
        if parts[-1] in fields:
            return parts[:2] + [".".join(parts[2:-1]), parts[-1]]
        return parts[:2] + [".".join(parts[2:])]
    return parts


@functools.lru_cache(maxsize=1)
def _defaults_json() -> str:
    return json.dumps(Config().model_dump())


def defaults() -> dict:
    """The default config as a plain dict (a fresh copy)."""
    return json.loads(_defaults_json())


def apply_overrides(raw: dict, overrides: List[str]) -> dict:
    """Apply ``a.b.c=value`` strings (values parsed as YAML) to a config's plain dict (``overrides.merge_override``).

    An override merges into what is there: a mapping merges into the section it names, and a section the file
    leaves out starts from its default, so ``merge.ema.end=0.4`` and ``merge.ema={end: 0.4}`` both keep the
    schedule's other fields. A free-form table (``faults.speed``, ``pbt.params``, ...) given whole replaces the
    file's. Interpolations are left for ``load`` to resolve.
    """
    out = plain(raw)
    base = defaults()
    free = overrides_mod.tables(Config)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        key, text = item.split("=", 1)
        parts = _override_path(key.strip())
        if not all(parts):
            raise ConfigError(f"override {item!r} has an empty key")
        try:
            overrides_mod.merge_override(out, parts, _parse_scalar(text, key.strip()), base,
                                         replace=".".join(parts) in free)
        except ConfigError as exc:
            raise ConfigError(f"override {item!r}: {exc}") from None
    return out


def from_dict(raw: Any, source: str = "config") -> Config:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of keys, got {type(raw).__name__}")
    try:
        return Config.model_validate(raw)
    except ValidationError as exc:
        lines = [_format_error(e, raw) for e in exc.errors()]
        raise ConfigError(f"{source}: " + "; ".join(dict.fromkeys(lines))) from None


def read_yaml(path: Union[str, Path], what: str = "config") -> Any:
    """The plain data of a YAML file: UTF-8, duplicate keys rejected. Every failure is a ConfigError naming it."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not a UTF-8 text file (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          f"a {what} is a YAML text file") from None
    try:
        raw = load_strict(text, str(path))
    except ConfigError:
        raise
    except YAML_FAILURES as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_failure(exc)}") from None
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    try:
        return plain(raw or {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def load(path: Union[str, Path], overrides: Optional[List[str]] = None) -> Config:
    """Read YAML at ``path``, apply overrides, resolve interpolations, validate, and fill a name template.

    Every failure is a ConfigError naming the file and the key (docs/getting-started/quickstart.md, "Configs")."""
    raw = read_yaml(path)
    merged = apply_overrides(raw, overrides or [])
    try:
        merged = overrides_mod.resolve(merged, defaults())
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    template = merged.get("name")
    if overrides_mod.is_template(template):  # resolved from the validated config: defaults and overrides included
        draft = from_dict({**merged, "name": "run"}, source=str(path))
        try:
            merged["name"] = overrides_mod.render_name(template, draft.model_dump(), _override_path)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    else:
        name = run_name(path, raw, merged, overrides or [])
        if name is not None:
            merged["name"] = name
    return from_dict(merged, source=str(path))


# overrides that make a run of another config's run: without a name of its own it would write over that run
NAMES_THE_WORK = ("data.dataset", "model.name")


def run_name(path: Union[str, Path], raw: dict, merged: dict, overrides: List[str]) -> Optional[str]:
    """The run's name where the user gave none that fits; None keeps what the config says.

    A file without ``name`` is named after the file (``my_run.yaml`` -> ``my_run``). An override of
    ``data.dataset`` or ``model.name`` without a ``name=`` override appends the new value
    (``quickstart.yaml data.dataset=my_data:blobs`` -> ``quickstart-my_data.blobs``), so a run of other
    data never lands in, or overwrites, the directory of the config's own run.
    """
    keys = [o.split("=", 1)[0].strip() for o in overrides if "=" in o]
    if "name" in keys:
        return None
    base = merged.get("name") if "name" in raw else _plain_name(Path(path).stem)
    if not isinstance(base, str):
        return None
    changed = []
    for key in NAMES_THE_WORK:
        if key in keys:
            section, field = key.split(".")
            old, new = (d.get(section, {}).get(field) if isinstance(d.get(section), dict) else None
                        for d in (raw, merged))
            if new != old and isinstance(new, str):
                changed.append(_plain_name(new))
    name = "-".join([base] + changed)
    return name[:255] if name != merged.get("name") else None


def _plain_name(text: str) -> str:
    """``text`` as a run directory name: characters outside ``NAME_CHARS`` become '.', never '.' or '..'."""
    out = re.sub(r"[^A-Za-z0-9_.\-]", ".", text).strip(".") or "run"
    return out


def from_json(text: str) -> Config:
    return from_dict(json.loads(text), source="broadcast config")
