"""The language-model workload in whole runs (2 ranks): a tiny GPT on the standard library's bytes trains under
community and gossip (consensus loss below the uniform ln 256, whole domains per planted group); a checkpointed
run resumed ends with the uninterrupted run's bits and logs; and a corpus that differs between the ranks (their
HOME directories, under one MPMD launch) is refused before training, naming data.dataset."""
from __future__ import annotations

import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch

from tests.helpers.mpi import Job, mpi_command, run_batch, run_command

pytestmark = pytest.mark.timeout(600)
N = 2
LM = """
name: lm
seed: 7
data:
  dataset: pystdlib
  partition: by_domain
  groups: 2
  test_fraction: 0.1
  lm: {context: 32, max_bytes: 200000, test_windows: 32}
model:
  name: gpt
  gpt: {layers: 1, heads: 1, embed: 16}
train: {optimizer: adamw, lr: 0.01, batch_size: 16, unit: steps, steps_per_unit: 3, budget: 6, eval_every: 3,
        schedule: cosine, warmup: 0.2}
signature: {dim: 64, every: 3}
"""
CHECKPOINTED = ["checkpoint.every=3", "checkpoint.at_end=false"]


def _rows(run, name):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in ("wall", "bytes_sent")} for r in rows]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    config = root / "lm.yaml"
    config.write_text(LM)
    jobs = {"community": Job(config, root / "community", ["strategy=community", *CHECKPOINTED]),
            "gossip": Job(config, root / "gossip", ["strategy=gossip"])}
    res = run_batch(N, jobs, timeout=400, check=False)
    for name, r in res.items():
        assert r.returncode == 0, (name, r.stderr[-3000:])
    run, resumed = root / "community" / "lm", root / "resumed" / "lm"
    shutil.copytree(run, resumed)  # as if killed after the checkpoint at unit 3
    for product in ("summary.json", "consensus.pt"):
        (resumed / product).unlink()
    meta = resumed / "meta.json"
    meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))
    again = run_batch(N, {"resumed": Job(config, root / "resumed", ["strategy=community", *CHECKPOINTED],
                                         extra=["--resume"])}, timeout=300, check=False)
    assert again["resumed"].returncode == 0, again["resumed"].stderr[-3000:]
    assert "resuming" in again["resumed"].stdout
    return {"config": config, "community": run, "gossip": root / "gossip" / "lm", "resumed": resumed}


@pytest.mark.parametrize("strategy", ["community", "gossip"])
def test_a_tiny_language_model_trains(runs, strategy):
    run = runs[strategy]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["units"] == 6 and summary["strategy"] == strategy
    loss = summary["consensus_test_loss"]
    assert math.isfinite(loss) and loss < math.log(256), loss  # below the uniform guess over bytes
    consensus = _rows(run, "consensus.jsonl")
    assert [r["t"] for r in consensus] == [3, 6] and consensus[-1]["test_loss"] < consensus[0]["test_loss"]
    weights = torch.load(run / "consensus.pt", weights_only=True)
    assert "tokens.weight" in weights and weights["tokens.weight"].shape == (256, 16)
    assert all(torch.isfinite(w).all() for w in weights.values())
    # whole domains per planted group, the groups the contiguous blocks of ranks
    part = json.loads((run / "partition.json").read_text())
    assert part["partition"] == "by_domain" and part["groups"] == [0, 1]
    held = np.array(part["shard_domains"]) > 0
    assert not np.any(held[0] & held[1]) and held.any(axis=0).all()
    assert all(part["domain_groups"][d] == r for r in range(N) for d in np.flatnonzero(held[r]))


def test_a_resumed_language_model_ends_with_the_same_bits(runs):
    a = torch.load(runs["community"] / "consensus.pt", weights_only=True)
    b = torch.load(runs["resumed"] / "consensus.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for log in ("metrics.jsonl", "merges.jsonl", "consensus.jsonl"):
        assert _strip(_rows(runs["community"], log)) == _strip(_rows(runs["resumed"], log)), log
    sa, sb = (json.loads((runs[r] / "summary.json").read_text()) for r in ("community", "resumed"))
    for key in ("consensus_test_loss", "consensus_test_acc", "rank_test_acc", "final_dispersion"):
        assert sa[key] == sb[key], key


def _corpus(home, changed: bool):
    for d in ("alpha", "beta"):
        for i in range(4):
            path = home / "corpus" / d / f"part{i}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            text = "".join(f"{d} line {k} of part {i}: the quick brown fox jumps over the lazy dog\n"
                           for k in range(40))
            if changed and (d, i) == ("beta", 2):
                text = text.replace("lazy", "LAZY", 1)  # one file differs, by one word, its size unchanged
            path.write_text(text)


def test_a_corpus_that_differs_across_ranks_is_refused(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _corpus(a, False)
    _corpus(b, True)
    config = tmp_path / "text.yaml"
    config.write_text(LM.replace("dataset: pystdlib", "dataset: text\n  root: ~/corpus")
                      .replace("test_fraction: 0.1", "test_fraction: 0.3")
                      .replace("max_bytes: 200000, ", ""))
    out = tmp_path / "out"

    def rank(home):
        return ["env", f"HOME={home}", sys.executable, "-m", "mpi4py", "-m", "communities", "run", str(config),
                f"output.root={out}", "--no-progress"]

    first = mpi_command(1, rank(a)[1:], program="env")
    cmd = first + [":", "-n", "1", *rank(b)]
    res = run_command(cmd, 180, "an MPMD launch with two corpora", check=False)
    assert res.returncode != 0, res.stdout[-2000:]
    said = res.stdout + res.stderr
    assert "data.dataset='text'" in said and "the ranks' data differ" in said and "ranks [1]" in said, said[-3000:]
    assert not list(out.rglob("metrics.jsonl")) and not list(out.rglob("summary.json"))
