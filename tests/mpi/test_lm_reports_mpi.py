"""A language model's run of the real engine (2 ranks, a tiny GPT on 200 kB of the standard library) reports bits
per byte in metrics.jsonl, consensus.jsonl, summary.json and on the console, and ``communities inspect`` draws its
losses."""
from __future__ import annotations

import json
import math
import os

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from communities.report.inspection import main_inspect  # noqa: E402
from tests.helpers.mpi import run_engine  # noqa: E402

pytestmark = pytest.mark.timeout(300)

LM = """
name: lm
seed: 1
world_size: 2
data:
  dataset: pystdlib
  partition: iid
  test_fraction: 0.1
  lm: {context: 32, max_bytes: 200000, test_windows: 32}
model:
  name: gpt
  gpt: {layers: 1, heads: 1, embed: 16}
train: {optimizer: adamw, lr: 0.01, batch_size: 8, unit: steps, steps_per_unit: 3, budget: 4, eval_every: 2}
signature: {every: 2}
"""


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_language_models_run_reports_bits_per_byte_and_inspect_draws_its_loss(tmp_path, capsys):
    config = tmp_path / "lm.yaml"
    config.write_text(LM)
    res = run_engine(2, config, tmp_path, timeout=240)
    assert "nats/token" in res.stdout and "bits/byte" in res.stdout and "next-token accuracy" in res.stdout
    run = tmp_path / "lm"
    evaluated = [r for r in _rows(run / "metrics.jsonl") if r["test_loss"] is not None]
    assert evaluated and all(r["test_bpb"] == pytest.approx(r["test_loss"] / math.log(2)) for r in evaluated)
    consensus = _rows(run / "consensus.jsonl")
    assert consensus and all(r["test_bpb"] == pytest.approx(r["test_loss"] / math.log(2)) for r in consensus)
    s = json.loads((run / "summary.json").read_text())
    assert s["task"] == "language_model" and s["bytes_per_token"] == 1.0 and s["context"] == 32
    assert s["consensus_test_bpb"] == pytest.approx(s["consensus_test_loss"] * s["bits_per_byte_factor"])
    assert len(s["rank_test_loss"]) == 2 and s["mean_rank_bpb"] == pytest.approx(s["mean_rank_loss"] / math.log(2))
    out = tmp_path / "report"
    assert main_inspect([str(run), "--out", str(out), "--no-svg"]) == 0
    assert "final loss: consensus" in capsys.readouterr().out
    assert (out / "loss.png").stat().st_size > 0 and 'src="loss.png"' in (out / "index.html").read_text()
