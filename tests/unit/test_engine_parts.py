"""The engine's parts in-process, on a one-rank MPI world: each owns its state and round-trips it exactly."""
from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from communities import config
from communities.core.clustering import Communities
from communities.core.protocol import RunningDigest
from communities.engine.faults import InjectedFaults, NoFaults, make_faults
from communities.engine.loop import Engine
from communities.engine.mixing import strategies
from communities.engine.mixing.exchange import Header, decide
from communities.engine.mixing.mixer import Mixer
from communities.engine.outcome.consensus import Consensus
from communities.engine.replica.replica import Replica
from communities.engine.rounds.signature_rounds import RoundResult, SignatureRounds
from communities.engine.state.checkpoint import Checkpointer
from communities.engine.timer import Timer
from communities.results import Event, MergeRow, MetricRow, Summary, read_run

TINY = {
    "name": "tiny", "seed": 3, "strategy": "isolated",
    "data": {"dataset": "synthetic", "synthetic": {"n_samples": 300, "n_features": 8, "n_classes": 3}},
    "model": {"name": "mlp", "hidden": [8]},
    "train": {"lr": 0.05, "batch_size": 16, "unit": "steps", "steps_per_unit": 3, "budget": 12, "eval_every": 4},
    "signature": {"dim": 16, "every": 3},
    "comm": {"timeout": 0},
}


def make_cfg(**overrides) -> config.Config:
    raw = config.plain(TINY)
    for key, value in overrides.items():
        node = raw
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return config.from_dict(raw)


@pytest.fixture(scope="module")
def world():
    from communities.runtime.comm import World

    w = World(timeout=0)
    assert w.size == 1, "these tests run in-process, on a world of one rank"
    return w


def through_disk(state: dict) -> dict:
    """What a checkpoint does to a state: torch.save now, torch.load(weights_only=True) later."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def build(world, cfg=None, faults=None):
    cfg = cfg or make_cfg()
    timer = Timer()
    faults = faults or NoFaults()
    replica = Replica.build(cfg, world, torch.device("cpu"), timer, faults)
    return cfg, timer, replica


# ---------------------------------------------------------------------- pure pieces


def test_header_round_trips_through_its_float64_buffer():
    h = Header(samples=1234.0, loss=0.25, size=1001, state=2002, diverged=False)
    a = h.to_array()
    assert a.dtype == np.float64 and a.shape == (5,)
    assert Header.from_array(a) == h
    pbt = Header(samples=1.0, loss=0.5, size=7, state=0, diverged=False, score=0.75, ready=True, hyper=(0.1, 2.5))
    b = pbt.to_array()
    assert b.shape == (9,) and Header.from_array(b) == pbt  # pbt: score, ready and the values travel too


@pytest.mark.parametrize("mine_bad,other_bad,policy,expected", [
    (False, False, "reset", (0.5, Event.MERGE)),
    (True, False, "reset", (1.0, Event.RESET)),
    (True, False, "quarantine", (0.0, Event.QUARANTINED)),
    (False, True, "reset", (0.0, Event.SKIP_DIVERGED)),
    (True, True, "reset", (0.0, Event.SKIP_DIVERGED)),
])
def test_decide_never_merges_a_diverged_model_into_a_healthy_one(mine_bad, other_bad, policy, expected):
    cfg = make_cfg()
    mine = Header(10.0, 0.5, 7, False, mine_bad)
    other = Header(20.0, 0.7, 7, False, other_bad)
    assert decide(mine, other, cfg.merge, policy, t=1) == expected


def test_records_round_trip_through_float64_rows():
    m = MetricRow(3, 0.5, 0.9, float("nan"), float("nan"), 96, 1000, 1.5)
    assert MetricRow.from_row(m.to_row()) == m or np.allclose(MetricRow.from_row(m.to_row()).to_row(), m.to_row(),
                                                            equal_nan=True)
    e = MergeRow.pairwise(4, 1, 2, 1, 0.5, update=0.1, distance=0.2, sent=4096, event=Event.MERGE)
    assert MergeRow.from_row(e.to_row()) == e
    assert e.counts_as_update
    assert not MergeRow.pairwise(4, 1, 2, 1, 0.0, update=0.0, distance=0.2, sent=40,
                                 event=Event.SKIP_DIVERGED).counts_as_update
    assert MergeRow.global_average(4, 1, 0.3, 40, Event.RESET).counts_as_update  # global rows


def test_every_configurable_strategy_has_a_behaviour():
    assert set(strategies.STRATEGIES) == set(config.STRATEGIES)
    assert set(config.SYNCS_GRADIENTS) <= set(config.STRATEGIES)


def test_make_faults_is_a_no_op_unless_asked():
    cfg = make_cfg()
    assert type(make_faults(cfg.faults, 0, 0)) is NoFaults
    f = make_faults(make_cfg(**{"faults.nan_rank": 0, "faults.nan_at": 2}).faults, 0, 0)
    assert isinstance(f, InjectedFaults)
    w = torch.ones(4)
    f.after_unit(1, w)
    assert torch.isfinite(w).all()
    f.after_unit(2, w)
    assert torch.isnan(w).all()


def test_running_digest_depends_on_every_update():
    a, b = RunningDigest(), RunningDigest()
    a.update(np.arange(3))
    b.update(np.arange(3))
    assert a.value == b.value
    b.update(np.zeros(0, dtype=np.int64))  # even an empty exchange list changes it
    assert a.value != b.value
    c = RunningDigest()
    c.load_state_dict(a.state_dict())
    assert c.value == a.value


# ---------------------------------------------------------------------- parts on one rank


def test_replica_state_round_trip_continues_bit_for_bit(world):
    cfg, timer, replica = build(world)
    row = replica.train_unit(1)
    assert row.t == 1 and row.samples == 3 * 16 and np.isfinite(row.loss)
    saved = through_disk(replica.state_dict())  # state_dict() holds live references, as torch's do
    replica.train_unit(2)
    after = replica.flat.clone()
    replica.load_state_dict(saved)
    assert replica.samples == 3 * 16
    replica.train_unit(2)
    assert torch.equal(replica.flat, after)  # optimizer moments, dropout RNG and weights all restored


def test_replica_refuses_a_state_of_another_model(world):
    _, _, replica = build(world)
    state = replica.state_dict()
    state["flat"] = torch.zeros(3)
    with pytest.raises(ValueError, match="weights"):
        replica.load_state_dict(state)


def test_replica_masked_mean_of_one_rank_is_its_weights_and_a_diverged_rank_does_not_count(world):
    _, _, replica = build(world)
    assert torch.equal(replica.masked_mean(), replica.flat)
    replica.diverged = True
    assert not replica.keep
    assert torch.equal(replica.masked_mean(), torch.zeros_like(replica.flat))  # nobody counts: zeros / world


def test_replica_holding_gives_its_weights_and_optimizer_back_also_after_an_error(world):
    _, _, replica = build(world)
    replica.train_unit(1)  # momentum buffers in the optimizer's state
    own, moments = replica.flat.clone(), [v.clone() for s in replica.opt.state.values() for v in s.values()]
    other = torch.zeros_like(replica.flat)
    with pytest.raises(RuntimeError, match="inside"):
        with replica.holding(other, fresh_optimizer=True):
            assert torch.equal(replica.flat, other) and not replica.opt.state
            replica.train_unit(2)
            raise RuntimeError("inside")
    assert torch.equal(replica.flat, own)
    assert all(torch.equal(a, b) for a, b in zip(moments, [v for s in replica.opt.state.values() for v in s.values()]))
    assert replica.evaluate(other) != replica.evaluate() and torch.equal(replica.flat, own)


def test_replica_data_adopt_gives_a_new_value_with_the_lost_shards_appended(world):
    _, _, replica = build(world)
    before = replica.data
    n = before.shard.indices.size
    replica.adopt([0])  # (a world of one rank: its own shard again stands in for a lost rank's)
    assert replica.data is not before and before.shard.indices.size == n and before.x.shape[0] == n
    assert replica.data.shard.indices.size == 2 * n and replica.data.x.shape[0] == 2 * n
    assert replica.data.shards is before.shards
    with pytest.raises(dataclasses.FrozenInstanceError):
        replica.data.x = before.x  # type: ignore[misc]


def test_local_sgd_average_on_one_rank_leaves_the_weights_and_logs_a_global_row(world):
    cfg = make_cfg(strategy="local_sgd", **{"merge.period": 2})
    cfg, timer, replica = build(world, cfg)
    mixer = Mixer(cfg, world, timer, replica=replica, agreement=RunningDigest())
    replica.train_unit(1)
    assert mixer.mix(1) == []
    before = replica.flat.clone()
    replica.train_unit(2)
    w2 = replica.flat.clone()
    rows = mixer.mix(2)
    assert len(rows) == 1 and rows[0].event == Event.AVERAGE and rows[0].j == -1
    assert torch.equal(replica.flat, w2) and not torch.equal(before, w2)
    assert rows[0].update_norm == 0.0


def test_allreduce_strategy_binds_one_flat_gradient_buffer(world):
    cfg = make_cfg(strategy="allreduce", **{"train.unit": "epoch"})
    cfg, timer, replica = build(world, cfg)
    mixer = Mixer(cfg, world, timer, replica=replica, agreement=RunningDigest())
    assert callable(mixer.grad_sync) and mixer.unit_steps == -(-replica.data.shard.indices.size // 16)
    row = replica.train_unit(1, mixer.grad_sync, mixer.unit_steps)
    assert np.isfinite(row.loss) and timer.total["exchange"] > 0


def test_signature_round_on_one_rank(world):
    cfg, timer, replica = build(world)
    agreement = RunningDigest()
    rounds = SignatureRounds(cfg, world, timer, replica=replica, agreement=agreement)
    assert not rounds.due(2) and rounds.due(3)
    rnd = rounds.run(3)
    assert isinstance(rnd, RoundResult) and rnd.index == 0 and rnd.t == 3
    assert rnd.signatures.shape == (1, 16) and rnd.communities.labels.tolist() == [0]
    assert np.isnan(rnd.dispersion) and not rnd.outliers.any() and agreement.value
    state = through_disk(rounds.state_dict())
    other = SignatureRounds(cfg, world, timer, replica=replica, agreement=RunningDigest())
    other.load_state_dict(state)
    assert other.index == 1 and other.counts == [1]


def test_overlapped_signature_round_takes_effect_one_round_later(world):
    cfg = make_cfg(**{"signature.overlap": True})
    cfg, timer, replica = build(world, cfg)
    rounds = SignatureRounds(cfg, world, timer, replica=replica, agreement=RunningDigest())
    assert rounds.run(3) is None and rounds.index == 0
    rnd = rounds.run(6)
    assert rnd is not None and rnd.index == 0 and rnd.t == 6
    rounds.drain()
    assert rounds.state_dict()["pending"] is not None  # the gather started at t=6, finished, kept for a resume


def test_consensus_counts_merges_and_waits_for_patience(world):
    cfg = make_cfg(**{"consensus.patience": 2, "consensus.tol": 0.1})
    cfg, timer, replica = build(world, cfg)
    consensus = Consensus(cfg, world, timer, replica=replica)
    consensus.record([MergeRow.pairwise(1, 0, 1, 0, 0.5, update=2.0, distance=4.0, sent=10, event=Event.MERGE),
                      MergeRow.pairwise(1, 0, 1, 1, 0.0, update=9.0, distance=4.0, sent=10, event=Event.SKIP_DIVERGED)])
    com = Communities(Z=np.zeros((0, 4)), labels=np.zeros(1, dtype=np.int64), cut_height=0.0,
                      distances=np.zeros(0))

    def rnd(t, disp):
        return RoundResult(0, t, np.zeros((1, 4)), com, np.zeros(1, dtype=bool), disp, None, None)

    d1 = consensus.observe(rnd(3, 0.01), annealed=True)
    assert d1.update == 2.0 and not d1.reached  # the skipped exchange did not count
    d2 = consensus.observe(rnd(6, 0.01), annealed=True)
    assert d2.reached and d2.stop and consensus.reached_t == 6 and d2.update is None
    assert not consensus.observe(rnd(9, 0.5), annealed=True).reached  # calm rounds start over
    assert not consensus.observe(rnd(12, 0.01), annealed=False).reached  # never before annealing is done


def test_checkpointer_restores_every_part(world, tmp_path):
    cfg, timer, replica = build(world)
    mixer = Mixer(cfg, world, timer, replica=replica, agreement=RunningDigest())
    parts = {"replica": replica, "mixer": mixer, "timer": timer, "traffic": world}
    ck = Checkpointer(cfg, world, tmp_path / "checkpoints", parts=parts, before_save=lambda: None, info=lambda: {})
    replica.train_unit(1)
    ck.save(1)
    assert (tmp_path / "checkpoints" / "u00000001").is_dir()
    w1 = replica.flat.clone()
    replica.train_unit(2)
    assert ck.load(tmp_path / "checkpoints" / "u00000001") == 1
    assert torch.equal(replica.flat, w1)


def test_a_whole_run_in_process_writes_the_results_layout(world, tmp_path):
    """Engine.run on one rank: the loop, its parts and the run directory, without mpiexec."""
    cfg = make_cfg(**{"output.root": str(tmp_path), "checkpoint.every": 6})
    engine = Engine(cfg, world, tmp_path / "tiny", progress=False)
    summary = engine.run()
    assert isinstance(summary, Summary) and summary.units == 12 and summary.rounds == 4
    run = read_run(tmp_path / "tiny")
    assert run.complete and run.record == summary
    assert len(run.metrics()) == 12 and len(run.round_paths) == 4
    assert set(summary.time_split) == set(Timer.CATEGORIES)


def test_deterministic_algorithms_are_on_without_loading_the_compiler():
    """The engine sets torch's deterministic flag (warn only) without importing torch._inductor at start-up."""
    import subprocess
    import sys

    code = ("import sys, torch; from communities.engine.loop import deterministic_algorithms; "
            "deterministic_algorithms(); print(torch.are_deterministic_algorithms_enabled(), "
            "torch.is_deterministic_algorithms_warn_only_enabled(), 'torch._inductor' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "True", "False"]


def test_an_async_round_with_a_partial_table_clusters_as_soon_as_it_fills():
    """protocol async: a round whose gossip table lacks rows is tried again at every later unit, with the rows it
    signed (no new row of its own), instead of waiting S more units."""
    from types import SimpleNamespace

    from communities.core.gossip_table import GossipTable
    from communities.engine.rounds.async_rounds import GossipRounds

    rounds = GossipRounds.__new__(GossipRounds)  # its gather alone: no world, replica or clustering needed
    own = iter(np.arange(1.0, 100.0))
    rounds.cfg = SimpleNamespace(signature=SimpleNamespace(every=5))
    rounds.timer = Timer()
    rounds.world = SimpleNamespace(alive=np.ones(3, dtype=bool))
    rounds.signature = SimpleNamespace(row=lambda replica: np.full(2, next(own)))
    rounds.replica, rounds.table, rounds.view_waiting = None, GossipTable(3, 2, 0), False
    assert rounds._gather(5) is None and rounds.view_waiting  # signed at 5; rows 1 and 2 not yet here
    assert rounds.late_view_due(6) and not rounds.late_view_due(10)  # (10 is a round of its own)
    for rank, value in ((1, 7.0), (2, 9.0)):  # an exchange brings rank 1's row, then rank 2's
        theirs = GossipTable(3, 2, rank)
        theirs.set_own(np.full(2, value), 5)
        if rank == 2:
            assert rounds._gather(6) is None and rounds.late_view_due(7)  # row 2 still missing
        rounds.table.merge(theirs.pack(np.array([rank])))
    rows = rounds._gather(7)
    assert rows is not None and rows[:, 0].tolist() == [1.0, 7.0, 9.0]  # its own row is the one signed at 5
    assert not rounds.view_waiting and not rounds.late_view_due(8)
