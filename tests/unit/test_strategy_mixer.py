"""Who/when vs how: strategies reach the mixer only through ``strategy.Mixing``; merge rows come from named
constructors; the asynchronous mixer draws no unavailable partner."""
from __future__ import annotations

import ast
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from communities import config
from communities.engine.mixing import strategies
from communities.engine.mixing.async_mixer import AsyncMixer
from communities.engine.state.survival import lost_rows
from communities.results import Event, MergeRow

from .test_engine_parts import make_cfg

MIXING = Path(strategies.__file__).parent
ENGINE = MIXING.parent
STRATEGY_FILES = ("strategy.py", "strategies.py", "gossip.py", "averaging.py", "ifca.py")


def imported_modules(path: Path) -> set:
    """Every module a file imports, under TYPE_CHECKING too (relative ones as written: ``.mixer``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_strategies_do_not_import_the_mixer():
    for name in STRATEGY_FILES:
        mixers = {".mixer", ".async_mixer", ".async_posted", "communities.engine.mixing.mixer"}
        assert not mixers & imported_modules(MIXING / name), name


def test_syncs_gradients_has_one_home():
    assert not hasattr(strategies, "SYNCS_GRADIENTS") and config.SYNCS_GRADIENTS == ("allreduce",)


def test_merge_rows_are_built_by_name_at_every_site():
    assert len(list(ENGINE.rglob("*.py"))) > 20  # every engine module, in its sub-packages too
    for path in ENGINE.rglob("*.py"):
        assert "MergeRow(" not in path.read_text() or path.name == "mixer.py", path  # mixer.exchange: its own
    for path in ENGINE.rglob("*.py"):
        assert "._events" not in path.read_text() or path.name == "mixer.py", path


def test_named_merge_rows():
    assert MergeRow.pairwise(4, 1, 2, 1, 0.5, update=0.1, distance=0.2, sent=4096, event=Event.MERGE) == \
        MergeRow(4, 1, 2, 1, 0.5, 0.1, 0.2, 4096, int(Event.MERGE))
    g = MergeRow.global_average(3, 2, 0.7, 80)
    assert (g.j, g.initiator, g.a, g.event, g.bytes) == (-1, -1, 1.0, int(Event.AVERAGE), 80)
    assert math.isnan(g.distance) and g.counts_as_update
    d = MergeRow.declined(5, 0, 3, Event.BUSY)
    assert (d.i, d.j, d.initiator, d.a, d.update_norm, d.bytes, d.event) == (0, 3, 0, 0.0, 0.0, 0, int(Event.BUSY))
    assert MergeRow.from_row(d.to_row()).to_json("constant") == d.to_json("constant")


def test_lost_rows_write_what_they_wrote_by_hand():
    """merges.jsonl's lost rows: byte for byte the JSON the hand-written dict gave (readers depend on it)."""
    records = [{"rank": 3, "t": 10, "adopted_by": 4}, {"rank": 5, "t": 10, "adopted_by": None}]
    before = [{"t": e["t"], "i": e["rank"], "j": -1, "initiator": -1, "a": 0.0, "update_norm": 0.0,
               "distance": None, "bytes": 0, "rule": "shrink", "event": Event.LOST.label,
               **({"adopted_by": e["adopted_by"]} if e.get("adopted_by") is not None else {})} for e in records]
    assert [json.dumps(r) for r in lost_rows(records)] == [json.dumps(r) for r in before]


class FakeMixer:
    """The operations a strategy may call, recorded; enough state for the global strategies."""

    def __init__(self, keep: bool = True):
        self.rank, self.calls, self.rows = 0, [], []
        self.world = SimpleNamespace(rank=0, bcast_=lambda buf, root: None)
        flat = torch.zeros(3)
        self.replica = SimpleNamespace(flat=flat, keep=keep, opt=SimpleNamespace(state={}))
        self.timer = lambda category: _Null()

    def exchange(self, t, partner, initiator):
        self.calls.append(("exchange", t, partner, initiator))

    def average(self, t):
        self.calls.append(("average", t))

    def ifca_average(self, models_, pick):
        self.calls.append(("ifca_average", pick))
        models_[1].fill_(2.0)  # as if the ranks that took model 1 moved it
        return 96

    def enable_outer(self, anchor=False):
        self.calls.append(("enable_outer", anchor))

    def sync_gradients(self):
        self.calls.append(("sync_gradients",))

    def record(self, row):
        self.rows.append(row)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_global_strategies_say_when_and_the_mixer_does_how():
    m = FakeMixer()
    strategies.make(make_cfg(strategy="allreduce"), 1).prepare(m)
    diloco = strategies.make(make_cfg(strategy="diloco", **{"merge.period": 2}), 1)
    diloco.prepare(m)
    for t in range(4):
        diloco.mix(t, m)
    assert m.calls == [("sync_gradients",), ("enable_outer", True), ("average", 0), ("average", 2)]


def test_ifca_records_its_average_through_the_mixer():
    ifca = strategies.make(make_cfg(strategy="ifca", **{"ifca.k": 2, "merge.period": 1}), 1)
    ifca.models = torch.zeros((2, 3))
    ifca.losses = lambda replica: [float(j == 0) for j in range(2)]  # model 1 fits this shard best
    m = FakeMixer()
    ifca.mix(5, m)
    assert m.calls == [("ifca_average", 0)] and ifca.pick == 1
    [row] = m.rows
    expected = MergeRow.global_average(5, 0, float(torch.dist(torch.full((3,), 2.0), torch.zeros(3))), 96)
    assert row.to_json("constant") == expected.to_json("constant")


def test_only_the_community_strategy_freezes():
    gossip = strategies.make(make_cfg(strategy="gossip"), 4)
    assert gossip.frozen_labels() is None
    with pytest.raises(ValueError, match="no communities to freeze"):
        gossip.freeze(np.zeros(4))
    community = strategies.make(make_cfg(strategy="community"), 4)
    community.freeze(np.array([0, 0, 1, 1]))
    assert community.frozen_labels().tolist() == [0, 0, 1, 1]


def test_the_async_draw_skips_unavailable_ranks():
    """A lost rank (not alive) is never asked, as the virtual clock's exchange lists leave it out."""
    n = 4
    mixer = AsyncMixer.__new__(AsyncMixer)  # only what _draw reads
    mixer.cfg, mixer.n, mixer.rank = make_cfg(strategy="gossip"), n, 0
    mixer.strategy = strategies.make(mixer.cfg, n)
    mixer.excluded = np.zeros(n, dtype=bool)
    mixer.world = SimpleNamespace(whole=False, alive=np.array([True, False, False, True]))
    for t in range(20):
        target, _ = mixer._draw(t, np.zeros(n, dtype=bool))
        assert target == 3
    mixer.world.alive = np.array([True, False, False, False])
    assert mixer._draw(0, np.zeros(n, dtype=bool)) == (None, 0)


def test_the_async_draw_before_communities_skips_unavailable_ranks():
    n = 4
    mixer = AsyncMixer.__new__(AsyncMixer)
    mixer.cfg, mixer.n, mixer.rank = make_cfg(strategy="community"), n, 1
    mixer.strategy = strategies.make(mixer.cfg, n)  # no round yet: no law, signatures only
    mixer.excluded = np.array([False, False, True, False])
    mixer.world = SimpleNamespace(whole=False, alive=np.array([False, True, True, True]))
    for t in range(20):
        assert mixer._draw(t, np.zeros(n, dtype=bool))[0] == 3


@pytest.mark.parametrize("policy", ["none", "more_when_far"])
def test_a_checkpoint_keeps_the_round_distances_only_for_pass_similarity(policy):
    """The condensed distances are N(N-1)/2 floats in every replica's file; only examples.pass_similarity reads
    them after the round, so without it the state holds none, and labels, tree and cut height round-trip."""
    from communities.core.clustering import find_communities

    n = 12
    sig = np.repeat(np.eye(3), 4, axis=0) + 0.01 * np.random.default_rng(0).normal(size=(n, 3))
    com = find_communities(sig)
    strat = strategies.make(make_cfg(strategy="community", **{"examples.pass_similarity": policy}), n)
    strat.communities = com
    state = strat.state_dict()
    kept = state["communities"]["distances"].numel()
    assert kept == (n * (n - 1) // 2 if policy != "none" else 0)
    again = strategies.make(make_cfg(strategy="community", **{"examples.pass_similarity": policy}), n)
    again.load_state_dict(state)
    assert np.array_equal(again.communities.labels, com.labels) and np.array_equal(again.communities.Z, com.Z)
    assert again.communities.cut_height == com.cut_height
