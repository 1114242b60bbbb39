"""A process's replicas as rows of one (R, F) tensor (engine/replica/block.py): the stacked step trains the rows in
place, with no copy in or back, and gives the bits the copying path gives, through merges (in place on the rows),
optimizer resets and averages between units; a checkpoint of a replica holds its own optimizer state only."""
from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch

from communities.engine.replica import block
from communities.workload import models, train
from communities.workload import vectorized as vz

SIZES = [37, 50, 64, 11, 5]  # unequal shards: some replicas sit out the later steps (the active mask)
OPTIMIZERS = {
    "sgd_momentum": dict(optimizer="sgd", momentum=0.9),
    "sgd_plain": dict(optimizer="sgd", momentum=0.0, lr=0.1),
    "adamw": dict(optimizer="adamw", lr=1e-2, weight_decay=1e-2),
}


def _cfg(**kw):
    base = dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=False, weight_decay=0.0, betas=[0.9, 0.999],
                batch_size=16, unit="epoch", steps_per_unit=4)
    return SimpleNamespace(**{**base, **kw})


def _data():
    g = torch.Generator().manual_seed(0)
    return ([torch.randn(n, 10, generator=g) for n in SIZES], [torch.randint(0, 3, (n,), generator=g) for n in SIZES])


class _World:
    """What ``block.onto_row`` asks of a replica's world: its rank, its process's block, the process's memo."""

    def __init__(self, rank, memo):
        self.rank, self.process_block, self.memo = rank, list(range(len(SIZES))), memo

    def shared(self, key, compute):
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]


def _population(cfg, rows: bool):
    """Replicas as the engine holds them: models flattened into own buffers, or re-homed into one block."""
    ms, flats, memo = [], [], {}
    for r in range(len(SIZES)):
        torch.manual_seed(100 + r)
        m = models.MLP(10, 3, (8,))
        flat, _ = models.flatten_(m)
        if rows:
            placed = block.onto_row(_World(r, memo), m, flat)
            assert placed is not None
            stacked, flat = placed
        ms.append(m)
        flats.append(flat)
    opts = [train.make_optimizer(cfg, m.parameters()) for m in ms]
    base = stacked if rows else torch.zeros(len(ms), flats[0].numel())
    return ms, opts, flats, vz.StackedTrainer(ms[0], base, cfg, name="mlp")


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_rows_train_in_place_with_the_copying_paths_bits(opt):
    cfg = _cfg(**OPTIMIZERS[opt])
    xs, ys = _data()
    runs = {}
    for rows in (False, True):
        ms, opts, flats, trainer = _population(cfg, rows)
        ptrs = [f.data_ptr() for f in flats]
        members = [vz.Member(m, o, f, x, y, r) for r, (m, o, f, x, y) in enumerate(zip(ms, opts, flats, xs, ys))]
        assert vz.are_rows(trainer.flats, flats) == rows
        for t in range(4):
            vz.train_members(trainer, members, 3, t)
            # between units, what the engine does in place: a merge of two replicas, an average of their moments
            # (merge.optimizer_state: average), a reset of one replica's optimizer (reset)
            a = flats[0].clone()
            flats[0].lerp_(flats[1], 0.5)
            flats[1].lerp_(a, 0.5)
            if opts[0].state and opts[1].state:
                for p, q in zip(ms[0].parameters(), ms[1].parameters()):
                    for key, v in opts[0].state[p].items():
                        if torch.is_tensor(v) and v.numel() == p.numel():
                            w = v.clone()
                            v.lerp_(opts[1].state[q][key], 0.5)
                            opts[1].state[q][key].lerp_(w, 0.5)
            if t == 1:
                opts[2].state.clear()
        assert [f.data_ptr() for f in flats] == ptrs  # written into, never rebound
        if rows:  # the parameters are views of the rows, the moments views of the stacked moments
            assert all(p.data_ptr() == flats[0].data_ptr() for p in list(ms[0].parameters())[:1])
            moments = [v for o in opts for s in o.state.values() for v in s.values() if torch.is_tensor(v)
                       and v.numel() > 1]
            held = trainer.optimizer.momentum, trainer.optimizer.second
            assert all(any(h is not None and v._base is h for h in held) for v in moments)
        runs[rows] = (torch.stack(flats).clone(), [o.state_dict() for o in opts])
    assert torch.equal(runs[False][0], runs[True][0])
    for a, b in zip(runs[False][1], runs[True][1]):
        assert a["state"].keys() == b["state"].keys()
        for k in a["state"]:
            for key, v in a["state"][k].items():
                assert torch.equal(v, b["state"][k][key]), (k, key)


def test_a_checkpoint_holds_a_replicas_own_moments_only():
    cfg = _cfg()
    xs, ys = _data()
    ms, opts, flats, trainer = _population(cfg, rows=True)
    members = [vz.Member(m, o, f, x, y, r) for r, (m, o, f, x, y) in enumerate(zip(ms, opts, flats, xs, ys))]
    vz.train_members(trainer, members, 3, 0)

    def size(state):
        buf = io.BytesIO()
        torch.save(state, buf)
        return len(buf.getvalue())

    compact = block.compact_optimizer_state(opts[1].state_dict())
    assert size(compact) < size(opts[1].state_dict())  # a view would carry every replica's moments
    for k, s in compact["state"].items():
        assert s["momentum_buffer"]._base is None
        assert torch.equal(s["momentum_buffer"], opts[1].state_dict()["state"][k]["momentum_buffer"])
    fresh = train.make_optimizer(cfg, ms[1].parameters())
    fresh.load_state_dict(compact)  # a resume: its own tensors, copied into the rows at the next unit
    opts[1].load_state_dict(compact)
    vz.train_members(trainer, members, 3, 1)
