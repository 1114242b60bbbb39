"""privacy.enabled in whole runs (4 replicas on 2 processes): noiseless, never-binding DP-SGD is the plain run bit
for bit; a private run reports each replica's epsilon after every unit, within its target, in metrics.jsonl and
summary.json; seeded noise reproduces; all-reduce's per-step sync runs on the noised gradients; and what DP-SGD
cannot train is refused by name before any training."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.mpi import Job, run_batch

pytest.importorskip("opacus")
pytestmark = pytest.mark.timeout(600)
POP = ["world_size=4", "train.budget=20"]
PRIVATE = ["privacy.enabled=true", "privacy.epsilon=4", "privacy.noise=seeded"]


def _rows(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_private_runs_account_reproduce_and_reduce_to_the_plain_run(tiny_config, tmp_path):
    jobs = {
        "plain": Job(tiny_config, tmp_path, ["name=plain", *POP]),
        "noiseless": Job(tiny_config, tmp_path, ["name=noiseless", *POP, "privacy.enabled=true",
                                                  "privacy.noise_multiplier=0", "privacy.max_grad_norm=1e9",
                                                  "privacy.sampling=shuffle"]),
        "dp": Job(tiny_config, tmp_path, ["name=dp", *POP, *PRIVATE]),
        "dp_again": Job(tiny_config, tmp_path, ["name=dp_again", *POP, *PRIVATE]),
        "dp_allreduce": Job(tiny_config, tmp_path, ["name=dp_allreduce", *POP, *PRIVATE, "strategy=allreduce"]),
        "refused": Job(tiny_config, tmp_path, ["name=refused", *POP, *PRIVATE, "train.vectorize=on"]),
    }
    res = run_batch(2, jobs, timeout=500, check=False)
    for name in ("plain", "noiseless", "dp", "dp_again", "dp_allreduce"):
        assert res[name].returncode == 0, (name, res[name].stderr[-2000:])

    def weights(name):
        return torch.load(tmp_path / name / "consensus.pt", weights_only=True)

    a, b = weights("plain"), weights("noiseless")
    assert all(torch.equal(a[k], b[k]) for k in a)  # no noise, no clipping: the plain run bit for bit
    c, d = weights("dp"), weights("dp_again")
    assert all(torch.equal(c[k], d[k]) for k in c)  # privacy.noise=seeded reproduces
    assert any(not torch.equal(a[k], c[k]) for k in a)  # and the noise is there

    summary = json.loads((tmp_path / "dp" / "summary.json").read_text())
    dp = summary["privacy"]
    assert dp["target_epsilon"] == 4 and dp["delta"] == 1e-5 and dp["sampling"] == "poisson"
    assert len(dp["epsilon_per_rank"]) == 4
    assert 3.9 <= dp["epsilon_max"] <= 4.0  # the planned budget spent, not overspent
    assert dp["steps_per_rank"] == [20 * 4] * 4  # unit: steps, 4 steps a unit
    rows = _rows(tmp_path / "dp")
    by_rank = {r: [row["epsilon"] for row in rows if row["rank"] == r] for r in range(4)}
    for r, eps in by_rank.items():
        assert len(eps) == 20 and eps == sorted(eps) and eps[0] > 0  # after every unit, never falling
        assert eps[-1] == dp["epsilon_per_rank"][r]  # each replica its own (shard sizes, so q, differ)
    assert dp["epsilon_max"] == max(dp["epsilon_per_rank"])
    assert all(row["loss"] is None and row["train_acc"] is None for row in rows)  # not noised: not gathered
    assert all(row["samples"] == row["t"] * 4 * 32 for row in rows)  # expected, not drawn, Poisson counts
    assert "epsilon" not in _rows(tmp_path / "plain")[0] and _rows(tmp_path / "plain")[0]["loss"] is not None
    assert "privacy" not in json.loads((tmp_path / "plain" / "summary.json").read_text())
    assert "(worst replica) at delta 1e-05, poisson sampling" in res["dp"].stdout + res["dp"].stderr  # the summary
    ar = json.loads((tmp_path / "dp_allreduce" / "summary.json").read_text())
    assert ar["privacy"]["epsilon_max"] <= 4.0 and ar["consensus_test_acc"] > 0.3  # 4 classes: chance is 0.25

    pytest.importorskip("matplotlib")
    from communities.report.inspection import main_inspect

    assert main_inspect([str(tmp_path / "dp"), "--no-svg", "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "privacy.png").stat().st_size > 0  # each replica's epsilon over t
    assert "privacy.png" in (tmp_path / "report" / "index.html").read_text()

    assert res["refused"].returncode == 2
    out = res["refused"].stdout + res["refused"].stderr
    assert "train.vectorize=on cannot apply with privacy.enabled" in out
    assert not (tmp_path / "refused" / "metrics.jsonl").exists() or not _rows(tmp_path / "refused")
