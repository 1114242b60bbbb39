"""IFCA started fairly, and the oracle arm (issue 23), without MPI: the k-means assignment on planted signatures,
restarts keeping the lowest training loss, the oracle's fixed groups, and the config keys' clear errors."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from communities import config
from communities.core import cluster_start
from communities.engine.mixing import strategies
from communities.errors import ConfigError

from .test_engine_parts import make_cfg
from .test_strategy_mixer import FakeMixer

QUICK = "configs/quickstart.yaml"


def planted_rows(groups, d=16, spread=0.05, seed=0):
    """Signature rows of ranks in planted groups: one random centre per group, a little noise per rank."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(max(groups) + 1, d))
    return centres[groups] + spread * rng.normal(size=(len(groups), d))


# --------------------------------------------------------------------------- the pure parts


def test_kmeans_recovers_planted_groups_numbered_by_first_member():
    groups = np.array([2, 2, 0, 0, 3, 3, 1, 1])
    labels = cluster_start.kmeans_assignment(planted_rows(groups), 4, seed=0)
    assert labels.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # the planted partition, numbered in order of first rank


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_kmeans_is_the_same_for_every_seed_of_the_data_and_of_kmeans(seed):
    groups = np.repeat(np.arange(3), 4)
    rows = planted_rows(groups, seed=seed)
    a = cluster_start.kmeans_assignment(rows, 3, seed=seed)
    assert cluster_start.kmeans_assignment(rows.copy(), 3, seed=seed).tolist() == a.tolist()
    assert a.tolist() == groups.tolist()


def test_kmeans_refuses_what_it_cannot_cluster():
    with pytest.raises(ValueError, match="N >= k"):
        cluster_start.kmeans_assignment(np.zeros((3, 4)), 4, seed=0)
    with pytest.raises(ValueError, match="non-finite"):
        cluster_start.kmeans_assignment(np.full((4, 2), np.nan), 2, seed=0)
    assert cluster_start.kmeans_assignment(np.ones((3, 2)), 1, seed=0).tolist() == [0, 0, 0]


def test_canonical_labels_number_clusters_by_first_member():
    assert cluster_start.canonical_labels(np.array([5, 5, 2, 9, 2])).tolist() == [0, 0, 1, 2, 1]


def test_lowest_loss_takes_the_first_lowest_and_never_a_non_finite_one():
    assert cluster_start.lowest_loss([0.5, 0.2, 0.2]) == 1
    assert cluster_start.lowest_loss([np.nan, 0.9, np.inf]) == 1
    assert cluster_start.lowest_loss([np.nan, np.nan]) == 0


# --------------------------------------------------------------------------- the strategy, through a fake mixer


class StartMixer(FakeMixer):
    """A one-rank mixer whose collectives say what the test wants the other ranks to have said."""

    def __init__(self, rank=0, n=4, rows=None, scores=()):
        super().__init__()
        self.rank = rank
        self.scores = list(scores)  # the mean training loss of each start, as the Allreduce would give it
        self.world = SimpleNamespace(rank=rank, size=n, bytes_sent=0, bcast_=lambda buf, root=None: None,
                                     leads=rank == 0, allgather=lambda row: rows, allreduce_scalar=self._score)
        self.agreement = SimpleNamespace(update=lambda *arrays: self.calls.append(("agree", arrays[0].tolist())))

    def _score(self, value):
        return self.scores.pop(0) * self.world.size

    def ifca_average(self, models_, pick):
        self.calls.append(("ifca_average", pick))
        return 0


def test_restarts_go_on_with_the_lowest_training_loss_start():
    cfg = make_cfg(strategy="ifca", **{"ifca.k": 2, "ifca.init": "restarts", "ifca.restarts": 3,
                                       "ifca.warmup_units": 2, "merge.period": 1})
    ifca = strategies.make(cfg, 4)
    m = StartMixer(scores=[0.9, 0.3, 0.6])  # start 1 has the lowest training loss
    ifca.seeded_models = lambda mixer, start: torch.full((2, 3), float(start))  # start s: models all s
    ifca.losses = lambda replica: [0.5, 0.1] if ifca.models[0, 0] == 1 else [0.1, 0.5]  # start 1: this rank picks 1
    ifca.prepare(m)
    for t in range(1, 7):
        ifca.mix(t, m)
    assert ifca.start_losses == [0.9, 0.3, 0.6]
    assert torch.equal(ifca.models, torch.full((2, 3), 1.0)) and ifca.pick == 1  # start 1's models and pick
    assert torch.equal(m.replica.flat, ifca.models[1]) and ifca.best is None
    ifca.mix(7, m)  # then IFCA as usual
    assert m.calls[-1] == ("ifca_average", 1)


def test_restarts_resume_in_the_middle_of_the_starts():
    cfg = make_cfg(strategy="ifca", **{"ifca.k": 2, "ifca.init": "restarts", "ifca.restarts": 2,
                                       "ifca.warmup_units": 2, "merge.period": 1})
    ifca = strategies.make(cfg, 4)
    ifca.seeded_models = lambda mixer, start: torch.full((2, 3), float(start))
    ifca.losses = lambda replica: [0.1, 0.5]
    ifca.prepare(StartMixer())
    ifca.mix(1, StartMixer())
    ifca.mix(2, StartMixer(scores=[0.4]))  # start 0 ends
    again = strategies.make(cfg, 4)
    again.models = torch.zeros((2, 3))
    again.load_state_dict(ifca.state_dict())
    assert again.start_losses == [0.4] and again.best.start == 0 and torch.equal(again.best.models, ifca.best.models)


def test_warmup_trains_alone_then_kmeans_assigns_the_initial_clusters():
    cfg = make_cfg(strategy="ifca", **{"ifca.k": 2, "ifca.init": "warmup", "ifca.warmup_units": 3,
                                       "merge.period": 1, "signature.dim": 8})
    ifca = strategies.make(cfg, 4)
    ifca.seeded_models = lambda mixer, start: torch.zeros((2, 3))
    rows = planted_rows(np.array([0, 0, 1, 1]), d=8).astype(np.float32)
    m = StartMixer(rank=2, rows=rows)
    m.replica.flat.fill_(7.0)
    ifca.prepare(m)
    assert torch.equal(m.replica.flat, torch.full((3,), 7.0))  # no pick yet: the rank keeps its own weights
    for t in range(1, 3):
        ifca.mix(t, m)
    assert m.calls == []  # local training: no mixing
    ifca.mix(3, m)
    assert m.calls == [("agree", [0, 0, 1, 1]), ("ifca_average", 1)] and ifca.pick == 1
    assert torch.equal(m.replica.flat, ifca.models[1])


def test_random_init_picks_at_once_as_before():
    ifca = strategies.make(make_cfg(strategy="ifca", **{"ifca.k": 2}), 4)
    ifca.seeded_models = lambda mixer, start: torch.stack([torch.zeros(3), torch.ones(3)])
    ifca.losses = lambda replica: [0.7, 0.2]
    m = StartMixer()
    ifca.prepare(m)
    assert ifca.pick == 1 and torch.equal(m.replica.flat, torch.ones(3))
    assert "restarts" not in ifca.state_dict()  # the default checkpoint is unchanged


def oracle_mixer(groups, rank):
    m = StartMixer(rank=rank, n=4 if groups is None else len(groups))
    m.replica.data = SimpleNamespace(groups=groups)
    m.replica.flat.copy_(torch.tensor([1.0, 2.0, 3.0]))
    return m


def test_the_oracle_trains_exactly_the_planted_groups():
    oracle = strategies.make(make_cfg(strategy="oracle", **{"data.shift": "label_permutation", "merge.period": 1}), 6)
    m = oracle_mixer([4, 4, 7, 7, 9, 9], rank=3)
    oracle.prepare(m)
    assert oracle.k == 3 and oracle.pick == 1  # group 7 is the second of the groups 4, 7, 9
    assert all(torch.equal(oracle.models[j], torch.tensor([1.0, 2.0, 3.0])) for j in range(3))  # the shared start
    oracle.losses = lambda replica: pytest.fail("the oracle never scores models")
    for t in range(1, 4):
        oracle.mix(t, m)
    assert m.calls == [("ifca_average", 1)] * 3 and oracle.choose(m.replica) == 1


def test_the_oracle_is_refused_without_planted_groups():
    oracle = strategies.make(make_cfg(strategy="oracle", **{"data.shift": "label_permutation"}), 4)
    with pytest.raises(ConfigError, match="strategy='oracle' trains the planted groups"):
        oracle.prepare(oracle_mixer(None, rank=0))


# --------------------------------------------------------------------------- the config keys


@pytest.mark.parametrize("overrides,message", [
    (["strategy=ifca", "ifca.init=kmeans"], "ifca.init"),
    (["strategy=ifca", "ifca.warmup_units=0"], "ifca.warmup_units"),
    (["strategy=ifca", "ifca.restarts=0"], "ifca.restarts"),
    (["strategy=ifca", "ifca.init=warmup", "ifca.warmup_units=100", "train.budget=100"],
     "ifca.warmup_units=100 = 100 units of ifca.init='warmup' leave no unit of train.budget=100"),
    (["strategy=ifca", "ifca.init=restarts", "ifca.restarts=5", "ifca.warmup_units=4", "train.budget=20"],
     "ifca.restarts=5 x ifca.warmup_units=4"),
    (["strategy=oracle", "data.partition=iid", "data.shift=none"],
     "strategy='oracle' is refused with data.partition='iid'"),
    (["strategy=oracle", "data.partition=label_groups", "ifca.init=warmup"],
     "strategy='oracle' is refused with ifca.init='warmup'"),
    (["strategy=oracle", "data.shift=label_permutation", "comm.fault_tolerance=shrink"], "strategy='oracle'"),
])
def test_the_ifca_keys_are_checked_with_errors_naming_them(overrides, message):
    with pytest.raises(ConfigError) as err:
        config.load(QUICK, overrides)
    assert message in str(err.value)


def test_the_ifca_keys_that_are_fine():
    config.load(QUICK, ["strategy=ifca", "ifca.init=restarts", "ifca.restarts=5", "ifca.warmup_units=4"])
    config.load(QUICK, ["strategy=oracle", "data.partition=iid", "data.shift=label_permutation"])
    config.load(QUICK, ["strategy=oracle", "data.dataset=my_data:blobs"])  # a dataset may declare its groups
    config.load(QUICK, ["ifca.init=warmup", "ifca.warmup_units=500"])  # not read unless strategy=ifca


def test_warmup_needs_as_many_ranks_as_clusters():
    cfg = config.load(QUICK, ["strategy=ifca", "ifca.init=warmup", "ifca.k=8", "world_size=null"])
    with pytest.raises(ConfigError, match="ifca.k=8 clusters of ifca.init='warmup'"):
        cfg.check_world(4)
    cfg.check_world(8)
    config.load(QUICK, ["strategy=ifca", "ifca.k=8", "world_size=null"]).check_world(4)  # random: any k


def test_the_concept_shift_spec_has_the_fair_arms_and_every_run_validates(tmp_path):
    from communities.tools.compare.runs import plan_runs, validate
    from communities.tools.compare.spec import load_specs

    specs = load_specs("configs/compare/concept_shift.yaml")
    assert len(specs) == 4  # digits and MNIST-1D, 8 and 16 ranks
    for spec in specs:
        arms = {a.label: a for a in spec.arms}
        assert {"auto", "communities", "ifca_k4", "ifca_k4_warmup", "ifca_k4_restarts", "ifca_k2", "ifca_k8",
                "oracle", "global"} <= set(arms)
        assert "ifca.init=warmup" in arms["ifca_k4_warmup"].overrides and arms["oracle"].strategy == "oracle"
        assert validate(spec, plan_runs(spec, tmp_path, [], seeds=[0])) == []
