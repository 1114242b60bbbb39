"""The settling of exchanges cut by a lost rank under ``protocol: async`` (``ExchangeRecord``), without MPI:
whatever the revoke cut, and whatever each side did after, the survivors' sum comes back to what it was."""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from communities.engine.state.async_survival import NO_EXCHANGE, ExchangeRecord
from communities.runtime.comm import RankLost


def _merge(rec: ExchangeRecord, other: torch.Tensor, partner: int, initiator: int, rid: int, cut: bool = False):
    """One side of a symmetric a = 1/2 exchange; ``cut``: the revoke reached this side before the partner's half."""
    with pytest.raises(RankLost) if cut else nullcontext():
        with rec.around(partner, initiator, rid):
            half = rec.flat.clone()
            rec.flat.add_(other - half, alpha=0.5)  # (a chunked merge cut half-way would look like this too)
            if cut:
                raise RankLost("revoked")


def test_a_cut_exchange_is_restored_on_its_side():
    rec = ExchangeRecord(torch.tensor([1.0, 2.0]))
    _merge(rec, torch.tensor([3.0, 4.0]), partner=1, initiator=0, rid=7, cut=True)
    assert rec.flat.tolist() == [1.0, 2.0] and rec.last == (1, 0, 7, 0) and not rec.merged


def test_a_merge_completed_on_one_side_only_is_undone_even_after_another_exchange():
    """A merges with B (B's side is cut), then A merges with C: settling undoes A's first merge alone, and the
    three survivors' sum is what it was before either exchange."""
    a, b, c = torch.tensor([0.0, 4.0]), torch.tensor([2.0, 0.0]), torch.tensor([8.0, 8.0])
    total = a + b + c
    A, B, C = (ExchangeRecord(x.clone()) for x in (a, b, c))
    _merge(A, b, partner=1, initiator=0, rid=1)
    _merge(B, a, partner=0, initiator=0, rid=1, cut=True)
    a1 = A.flat.clone()
    _merge(A, C.flat.clone(), partner=2, initiator=2, rid=5)
    _merge(C, a1, partner=0, initiator=2, rid=5)
    rows = np.array([A.row(), B.row(), C.row()])
    alive = np.ones(3, dtype=bool)
    assert A.settle(rows, 0, alive) == [1]
    assert B.settle(rows, 1, alive) == [] and C.settle(rows, 2, alive) == []
    assert torch.allclose(A.flat + B.flat + C.flat, total)


def test_a_merge_with_a_rank_now_lost_stands():
    rec = ExchangeRecord(torch.zeros(2))
    _merge(rec, torch.ones(2), partner=1, initiator=1, rid=3)
    rows = np.array([rec.row(), np.asarray(NO_EXCHANGE, dtype=np.float64)])
    assert rec.settle(rows, 0, np.array([True, False])) == [] and rec.flat.tolist() == [0.5, 0.5]


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 6), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5), st.booleans(),
                                             st.booleans()), min_size=1, max_size=12), st.integers(0, 10_000))
def test_any_pattern_of_cuts_conserves_the_sum(n, exchanges, seed):
    """Random exchanges between n survivors; at the revoke, each one's last exchange may be cut on either side
    or both (only the last exchange of a rank can be cut on it). The settling restores the sum."""
    gen = torch.Generator().manual_seed(seed)
    recs = [ExchangeRecord(torch.randn(3, generator=gen, dtype=torch.float64)) for _ in range(n)]
    total = sum(r.flat for r in recs).clone()
    rid = 0
    pairs = [(i % n, j % n, ci, cj) for i, j, ci, cj in exchanges if i % n != j % n]
    for k, (i, j, cut_i, cut_j) in enumerate(pairs):
        rid += 1
        last_i = not any(i in p[:2] for p in pairs[k + 1:])  # only a rank's last exchange can meet the revoke
        last_j = not any(j in p[:2] for p in pairs[k + 1:])
        wi, wj = recs[i].flat.clone(), recs[j].flat.clone()
        _merge(recs[i], wj, j, i, rid, cut=cut_i and last_i)
        _merge(recs[j], wi, i, i, rid, cut=cut_j and last_j)
    rows = np.array([r.row() for r in recs])
    for r, rec in enumerate(recs):
        rec.settle(rows, r, np.ones(n, dtype=bool))
    assert torch.allclose(sum(r.flat for r in recs), total, atol=1e-12)


def test_rows_gathered_again_after_a_loss_are_written_once(tmp_path):
    """Under async a final gather cut by a loss after it reached the lead is gathered again: the lead writes
    each row once, and a new writer knows what its files already hold."""
    from communities import config
    from communities.engine.record.runlog import RunLog
    from communities.engine.timer import Timer
    from communities.results import RunWriter, read_jsonl
    from communities.runtime.comm import World

    cfg = config.from_dict({"name": "run"})
    writer = RunWriter(tmp_path / "run", overwrite=True)
    log = RunLog(cfg, World(timeout=0), Timer(), writer=writer, collective=False)
    log.seen = {}
    rows = [{"t": 1, "rank": 0, "loss": 0.5}, {"t": 1, "rank": 1, "loss": 0.25}]
    log._append("metrics.jsonl", rows)
    log._append("metrics.jsonl", rows + [{"t": 2, "rank": 0, "loss": 0.125}])
    assert [(r["t"], r["rank"]) for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [(1, 0), (1, 1), (2, 0)]
    heir = RunLog(cfg, World(timeout=0), Timer(), writer=writer, collective=False)
    heir.seen = {}
    heir.load_seen(tmp_path / "run")
    heir._append("metrics.jsonl", rows)
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 3
    writer.close()
