"""What does not go together: one table of cross-section refusals, and the check of a placement.

Each row says that a setting (``subject``) is refused with another one (``key``), and why.
The config's validation (config.py) raises the first row that holds for a config; the
placement check (``check_placement``: ``communities run``, ``validate --processes`` and
``slurm``) adds the rows about several replicas in one process. Every message has one
form, ``SUBJECT is refused with KEY (WHY)``, so it names the two keys a user can change.

Subjects, keys and reasons are format strings over the config (``c``) and, for the
placement rows, over the placement (``p``: ``replicas``, ``processes``, ``per_process``).
The module reads a config by its attributes and imports nothing of the package but the
error it raises, so that config.py can use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple, Union

from .errors import ConfigError

PAIRWISE = ("community", "gossip", "ring")  # strategies that merge in pairs (the ones protocol async runs)
LM_DATASETS = ("pystdlib", "text", "tokens")  # the language-model corpora (data.lm)

Text = Union[str, Callable[[Any], str]]  # a format string over ``c`` (and ``p``), or a function of the config


@dataclass(frozen=True)
class Refusal:
    """``subject`` is refused with ``key`` where ``when`` holds, because ``why``."""

    subject: Text
    key: Text
    when: Callable[[Any], bool]
    why: str
    placement: bool = False  # a row of the placement check: several replicas in one process

    def message(self, c: Any, p: Any = None) -> str:
        return f"{_text(self.subject, c, p)} is refused with {_text(self.key, c, p)} ({_text(self.why, c, p)})"


def _text(text: Text, c: Any, p: Any) -> str:
    return text(c) if callable(text) else text.format(c=c, p=p)


def _about(subject: Text, applies: Callable[[Any], bool],
           rows: Iterable[Tuple[Text, Callable[[Any], bool], str]], placement: bool = False) -> List[Refusal]:
    """The rows of one subject: each holds where the subject applies and its own condition does."""
    return [Refusal(subject, key, (lambda c, a=applies, w=when: a(c) and w(c)), why, placement)
            for key, when, why in rows]


def _lm(c: Any) -> bool:
    return c.data.dataset in LM_DATASETS


def _planted(c: Any) -> bool:
    return c.data.partition == "label_groups" or c.data.shift != "none" or ":" in c.data.dataset


def _late_start(c: Any) -> List[int]:
    return [r for r in c.pbt.start if c.world_size is not None and r >= c.world_size]


def _replica_faults(c: Any) -> List[str]:
    """The per-replica fault keys set in ``c``."""
    f = c.faults
    named = (("faults.nan_rank", f.nan_rank is not None), ("faults.hostile_rank", f.hostile_rank is not None),
             ("faults.stall_rank", f.stall_rank is not None), ("faults.speed", bool(f.speed)),
             ("faults.kill", bool(f.kill) and c.comm.fault_tolerance != "shrink"), ("faults.jitter", f.jitter > 0),
             ("faults.slow_max", f.slow_max > 0))
    return [k for k, on in named if on]


def _posted(what: str) -> str:
    return f"a posted exchange carries the weights, a header and signature rows only, not {what}"


REFUSALS: Tuple[Refusal, ...] = (
    *_about("protocol='async'", lambda c: c.protocol == "async", [
        ("strategy={c.strategy!r}", lambda c: c.strategy not in PAIRWISE,
         "async runs the pairwise strategies " + ", ".join(PAIRWISE) + ": global averages need every rank at the "
         "same unit"),
        ("checkpoint.every={c.checkpoint.every}", lambda c: bool(c.checkpoint.every),
         "under async, ranks are at different units; checkpoints are taken at a stop and at the end"),
        ("consensus.mode={c.consensus.mode!r}", lambda c: c.consensus.mode != "global",
         "freezing the communities is a decision every rank takes at the same signature round: it needs "
         "protocol='virtual_clock'"),
        ("output.round_snapshots=true", lambda c: c.output.round_snapshots,
         "it needs signature rounds that every rank takes at the same unit: protocol='virtual_clock'"),
    ]),
    *_about("comm.exchange='posted'", lambda c: c.protocol == "async" and c.comm.exchange == "posted", [
        ("merge.optimizer_state='average'", lambda c: c.merge.optimizer_state == "average",
         _posted("the optimizer moments")),
        ("merge.partner_policy='least_recent'", lambda c: c.merge.partner_policy == "least_recent",
         _posted("the seen-at table")),
        ("merge.outer.enabled=true", lambda c: c.merge.outer.enabled, _posted("an outer step on the merge")),
        ("examples.pass_hard=true", lambda c: c.examples.pass_hard, _posted("hard examples")),
    ]),
    *_about("comm.exchange={c.comm.exchange!r}", lambda c: c.comm.exchange != "sendrecv", [
        ("protocol={c.protocol!r}", lambda c: c.protocol != "async",
         "the virtual clock's exchange lists are walked in order, each a blocking Sendrecv: it needs "
         "protocol='async'"),
    ]),
    *_about("train.after_budget={c.train.after_budget!r}", lambda c: c.train.after_budget != "serve", [
        ("protocol={c.protocol!r}", lambda c: c.protocol != "async",
         "under the virtual clock every rank finishes its budget at the same unit: it needs protocol='async'"),
    ]),
    *_about("privacy.enabled=true", lambda c: c.privacy.enabled, [
        ("examples.pass_hard=true", lambda c: c.examples.pass_hard, "it sends raw training examples to partners"),
        ("examples.track=true", lambda c: c.examples.track,
         "it scores every example of the shard without noise and retires or logs them by confidence"),
        ("signature.kind={c.signature.kind!r}", lambda c: c.signature.kind in ("logits", "cka"),
         "its probe batch is training examples drawn from every rank's shard, sent as the model's outputs on them "
         "without noise"),
        ("strategy='ifca'", lambda c: c.strategy == "ifca",
         "each rank picks its model by the loss on its shard, without noise"),
        ("merge.rule='loss'", lambda c: c.merge.rule == "loss",
         "partners would be told each other's training loss, without noise"),
        ("comm.lost_shard='adopt'", lambda c: c.comm.fault_tolerance == "shrink" and c.comm.lost_shard == "adopt",
         "survivors would train on a lost rank's shard outside that shard's accounting"),
        ("model.batchnorm=true", lambda c: c.model.batchnorm,
         "batch statistics mix the examples of a batch: no gradient is one example's"),
        ("model.dropout={c.model.dropout}", lambda c: c.model.dropout > 0,
         "the clipping pass and the gradient pass would draw different masks"),
    ]),
    *_about("partners.schedule='hypercube'", lambda c: c.partners.schedule == "hypercube", [
        ("strategy={c.strategy!r}", lambda c: c.strategy not in ("community", "gossip"),
         "the hypercube is a schedule for strategy community or gossip"),
        ("protocol={c.protocol!r}", lambda c: c.protocol != "virtual_clock",
         "every rank takes its stage at the same unit: it needs protocol='virtual_clock'"),
        ("merge.partner_policy={c.merge.partner_policy!r}", lambda c: c.merge.partner_policy != "law",
         "the hypercube fixes every partner: the policy would have nothing to choose"),
    ]),
    *_about("merge.average_every={c.merge.average_every}", lambda c: c.merge.average_every > 0, [
        ("strategy={c.strategy!r}", lambda c: c.strategy not in PAIRWISE,
         "it adds global averages to the pairwise strategies (" + ", ".join(PAIRWISE) + "); strategy={c.strategy!r} "
         "has merge.period"),
        ("protocol={c.protocol!r}", lambda c: c.protocol != "virtual_clock",
         "an Allreduce every rank enters at the same unit: it needs protocol='virtual_clock'"),
        ("consensus.mode={c.consensus.mode!r}", lambda c: c.consensus.mode != "global",
         "it averages the whole world: it would undo the community models"),
    ]),
    *_about("pbt.enabled=true", lambda c: c.pbt.enabled, [
        ("strategy={c.strategy!r}", lambda c: c.strategy not in PAIRWISE,
         "adoption rides on pairwise merges (strategies " + ", ".join(PAIRWISE) + ")"),
        ("data.local_test_fraction=0", lambda c: c.data.local_test_fraction <= 0,
         "each replica is scored on its own held-out data; set data.local_test_fraction (e.g. 0.1)"),
        ("privacy.enabled=true", lambda c: c.privacy.enabled,
         "the score, a loss on the shard's held-out part, travels without noise"),
        ("pbt.params.train.momentum and train.optimizer={c.train.optimizer!r}",
         lambda c: "train.momentum" in c.pbt.params and c.train.optimizer != "sgd", "momentum is SGD's"),
        ("pbt.params.train.beta1/beta2 and train.optimizer={c.train.optimizer!r}",
         lambda c: any(k in c.pbt.params for k in ("train.beta1", "train.beta2")) and c.train.optimizer != "adamw",
         "the betas are AdamW's"),
        ("pbt.params.merge.alpha and merge.rule={c.merge.rule!r}",
         lambda c: "merge.alpha" in c.pbt.params and c.merge.rule not in ("constant", "clock", "loss"),
         "the rule does not use merge.alpha"),
        ("pbt.params.train.momentum from 0 and train.nesterov=true",
         lambda c: "train.momentum" in c.pbt.params and c.train.nesterov and c.pbt.params["train.momentum"].low <= 0,
         "Nesterov needs a momentum > 0"),
        ("protocol='async'", lambda c: c.pbt.selection == "truncation" and c.protocol == "async",
         "pbt.selection='truncation' ranks the whole population at a signature round, and async has no such "
         "collective: use pbt.selection=tournament"),
        (lambda c: f"pbt.start naming replica {_late_start(c)[0]}", lambda c: bool(_late_start(c)),
         "world_size={c.world_size} replicas are numbered 0..world_size-1"),
    ]),
    *_about("model.name='gpt'", lambda c: c.model.name == "gpt", [
        ("data.dataset={c.data.dataset!r}", lambda c: not _lm(c),
         "it reads token windows: it needs data.dataset " + ", ".join(LM_DATASETS)),
    ]),
    *_about("data.dataset={c.data.dataset!r} (a language model's corpus)", _lm, [
        ("model.name={c.model.name!r}", lambda c: c.model.name in ("mlp", "cnn1d"),
         "a classifier of features; use gpt or a module:function model"),
        ("privacy.enabled=true", lambda c: c.privacy.enabled, "per-example clipping of a sequence model is not built"),
        ("examples.track=true", lambda c: c.examples.track, "its per-example confidence is a classifier's"),
        ("signature.kind={c.signature.kind!r}", lambda c: c.signature.kind in ("logits", "cka"),
         "its probe is a classifier's; use a weight signature"),
        ("train.vectorize=on", lambda c: c.train.vectorize == "on",
         "the stacked trainer is a classifier's; auto trains one replica after another"),
    ]),
    *_about("comm.fault_tolerance='shrink'", lambda c: c.comm.fault_tolerance == "shrink", [
        ("protocol='async' and comm.exchange='posted'", lambda c: c.protocol == "async" and c.comm.exchange == "posted",
         "halves in flight on the revoked communicator could not be paired up again; comm.exchange=sendrecv "
         "survives a loss"),
        ("strategy={c.strategy!r}", lambda c: c.strategy in ("ifca", "oracle"),
         "its k shared models would need every rank's pick again"),
        ("consensus.mode={c.consensus.mode!r}", lambda c: c.consensus.mode != "global",
         "community models are formed over the whole world"),
        ("signature.overlap=true", lambda c: c.signature.overlap, "a gather in flight cannot be rolled back"),
        ("comm.lost_shard='adopt' and examples.track=true",
         lambda c: c.comm.lost_shard == "adopt" and c.examples.track, "the example table is per shard"),
    ]),
    *_about("strategy='oracle'", lambda c: c.strategy == "oracle", [
        ("ifca.init={c.ifca.init!r}", lambda c: c.ifca.init != "random",
         "its assignment is the planted groups: there is nothing to start (ifca.init='random')"),
        ("data.partition={c.data.partition!r} and data.shift='none'", lambda c: not _planted(c),
         "it trains the planted groups, and data.dataset={c.data.dataset!r} has none: plant them "
         "(data.partition=label_groups or data.shift)"),
    ]),
    *_about("consensus.mode={c.consensus.mode!r}", lambda c: c.consensus.mode != "global", [
        ("strategy={c.strategy!r}", lambda c: c.strategy != "community",
         "it delivers the communities of strategy 'community'; strategy={c.strategy!r} has none "
         "(consensus.mode='global')"),
        ("data.local_test_fraction=0", lambda c: c.consensus.mode == "auto" and c.data.local_test_fraction <= 0,
         "mode auto decides from the members' local validation data: set data.local_test_fraction > 0"),
    ]),
    *_about("train.group_size={c.train.group_size}", lambda c: c.train.group_size > 1, [
        ("world_size={c.world_size}", lambda c: c.world_size is not None and c.world_size % c.train.group_size != 0,
         "a group size must divide world_size"),
        ("strategy='allreduce'", lambda c: c.strategy == "allreduce",
         "every replica already averages gradients at every step"),
        ("strategy={c.strategy!r}", lambda c: c.strategy in ("ifca", "oracle"),
         "each replica picks or is given its model by its own shard or group"),
        ("examples.track / examples.pass_hard", lambda c: c.examples.track or c.examples.pass_hard,
         "the example table is one replica's shard"),
        (lambda c: _replica_faults(c)[0], lambda c: bool(_replica_faults(c)),
         "it acts on one replica, which its group would have to follow"),
    ]),
    # several replicas in one MPI process (a population): what acts on a process, or needs one replica in each
    *_about("world_size={p.replicas} replicas on {p.processes} MPI processes ({p.per_process} per process)",
            lambda c: True, [
                ("device={c.device!r}", lambda c: c.device != "cpu", "replicas in one process run on the CPU for now"),
                ("faults.kill without comm.fault_tolerance=shrink",
                 lambda c: bool(c.faults.kill) and c.comm.fault_tolerance != "shrink", "it kills a process"),
                # protocol async: a pair across processes is a posted exchange (engine/mixing/async_population.py)
                *[("protocol='async' and " + key, lambda c, on=on: c.protocol == "async" and on(c),
                   _posted(what)) for key, on, what in (
                    ("merge.optimizer_state='average'", lambda c: c.merge.optimizer_state == "average",
                     "the optimizer moments"),
                    ("merge.partner_policy='least_recent'", lambda c: c.merge.partner_policy == "least_recent",
                     "the seen-at table"),
                    ("merge.outer.enabled=true", lambda c: c.merge.outer.enabled, "an outer step on the merge"),
                    ("examples.pass_hard=true", lambda c: c.examples.pass_hard, "hard examples"))],
            ], placement=True),
)


def first_refusal(c: Any, rows: Sequence[Refusal] = REFUSALS, p: Any = None) -> Optional[str]:
    """The message of the first row of ``rows`` that holds for config ``c`` (placement rows only with ``p``)."""
    for row in rows:
        if row.placement == (p is not None) and row.when(c):
            return row.message(c, p)
    return None


@dataclass(frozen=True)
class Layout:
    """``replicas`` on ``processes`` MPI processes (what the placement rows are formatted with)."""

    replicas: int
    processes: int

    @property
    def per_process(self) -> int:
        return self.replicas // self.processes


def check_placement(cfg: Any, processes: int, *, source: Optional[str] = None) -> int:
    """The number of replicas ``cfg`` runs on ``processes`` MPI processes: its ``world_size`` (on any number of
    processes that divides it), or one per process without one. ConfigError naming the keys where that placement
    cannot run, before anything starts; ``source`` says where the process count came from (the launcher, the
    ``--processes`` option, a SLURM job's tasks), so that no message claims MPI started what it did not."""
    if processes < 1:
        raise ConfigError(f"{source or f'{processes} MPI processes'}: the number of MPI processes must be at least 1")
    problem = placement_refusal(cfg, processes, source=source)
    if problem:
        raise ConfigError(problem)
    replicas = processes if cfg.world_size is None else cfg.world_size
    cfg.check_world(replicas)
    return replicas


def placement_refusal(cfg: Any, processes: int, *, source: Optional[str] = None) -> Optional[str]:
    """Why ``cfg`` cannot run on ``processes`` MPI processes, naming the keys (None: it can)."""
    where = source or f"{processes} MPI processes"
    n = cfg.world_size
    replicas = processes if n is None else n
    size = cfg.train.group_size
    if cfg.protocol == "async" and size > 1 and (replicas == processes or (replicas // processes) % size):
        return (f"train.group_size={size} with protocol=async: a group trains at its own pace as one process's "
                f"replicas do, so it must lie inside one process (group_size dividing the replicas per process; "
                f"here {where} for world_size={n})")
    if replicas == processes:
        return None
    if processes > replicas or replicas % processes:
        return (f"world_size={replicas} replicas cannot be placed on {where}: start {replicas} processes (one replica "
                f"each) or a number that divides {replicas} ({_divisors(replicas)}; each process then hosts "
                f"world_size / P replicas), or set world_size={processes} (or world_size=null: one replica per "
                "process)")
    group = group_placement_problem(size, replicas, processes)
    if group:
        return group
    if size > 1 and cfg.comm.fault_tolerance == "shrink" and size > replicas // processes:
        return (f"train.group_size={size} spanning processes ({replicas // processes} replicas each) with "
                "comm.fault_tolerance=shrink: a group that loses a process would need its stacked average rebuilt "
                "on fewer rows; use groups inside a process (group_size dividing the replicas per process), or one "
                "replica per process")
    problem = first_refusal(cfg, p=Layout(replicas, processes))
    return f"{problem}: start {replicas} processes, one replica each" if problem else None


def _divisors(n: int, shown: int = 8) -> str:
    """The process counts that place ``n`` replicas, as ``1, 2, 4 or 8`` (the first and last few of many)."""
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    ds = [str(d) for d in sorted(set(small + [n // d for d in small]))]
    if len(ds) > shown:
        ds = ds[: shown // 2] + ["..."] + ds[-(shown // 2):]
    return ", ".join(ds[:-1]) + f" or {ds[-1]}" if len(ds) > 1 else ds[0]


def group_placement_problem(size: int, replicas: int, processes: int) -> Optional[str]:
    """Why data-parallel groups of ``size`` cannot sit on ``processes`` contiguous blocks (None: they can): a group
    lies inside one process or spans whole processes, so that its gradient average is a tree in one process's
    memory or one Allreduce among processes that host nothing else."""
    if size == 1 or replicas % size:
        return None
    block = replicas // processes
    if block % size == 0 or size % block == 0:
        return None
    return (f"train.group_size={size} with world_size={replicas} on {processes} processes ({block} replicas each): "
            f"a group must lie inside one process (group_size dividing {block}) or span whole processes ({block} "
            "dividing group_size)")
