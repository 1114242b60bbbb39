"""Exact mixing in whole runs (4 replicas on 2 processes, one mpiexec): with lr 0, the one-peer hypercube makes the
4 replicas the exact initial mean within 2 units and every unit merges every replica once; merge.average_every
adds a global average at every H-th unit, after which every replica holds the mean. That runs without these options
are unchanged is the golden runs' check (tests/mpi/test_golden.py: the same consensus.pt bits as recorded)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.mpi import initial_mean_and_final, tiny_batch

pytestmark = pytest.mark.timeout(600)
N = 4
FROZEN = [f"world_size={N}", "train.lr=0", "model.init=per_rank", "train.budget=10"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tiny_batch(tmp_path_factory, "mixing", 2, {
        "hypercube": [*FROZEN, "strategy=gossip", "partners.schedule=hypercube"],
        "pga": [*FROZEN, "strategy=community", "merge.average_every=5"],
    })


def _merges(run):
    return [json.loads(line) for line in (run / "merges.jsonl").read_text().splitlines()]


def test_the_hypercube_gives_every_replica_the_exact_mean(runs):
    run = runs["hypercube"]
    mean0, final, _ = initial_mean_and_final(runs.config, N, run)
    assert torch.allclose(final, mean0, atol=1e-6)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["consensus_distance"] < 1e-6  # every replica holds the mean, not only the average of them
    merges = [m for m in _merges(run) if m["event"] == "merge"]
    for t in range(1, 11):  # every unit, every replica merges exactly once, with its hypercube partner
        sides = sorted((m["i"], m["j"]) for m in merges if m["t"] == t)
        bit = 1 << (t % 2)  # stage t: bit t mod log2(4)
        assert sides == sorted((i, i ^ bit) for i in range(N)), t
        assert all(m["a"] == 0.5 for m in merges if m["t"] == t)


def test_average_every_adds_exact_global_averages(runs):
    run = runs["pga"]
    averages = [m for m in _merges(run) if m["event"] == "average"]
    assert sorted({m["t"] for m in averages}) == [5, 10] and len(averages) == 2 * N
    summary = json.loads((run / "summary.json").read_text())
    assert summary["consensus_distance"] < 1e-6  # the last unit ended with an average
    mean0, final, _ = initial_mean_and_final(runs.config, N, run)
    assert torch.allclose(final, mean0, atol=1e-6)

