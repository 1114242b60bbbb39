"""``communities lm-reference``: the centralized language-model reference trains, reports and refuses.

One tiny run (pystdlib cut to 100 kB, a 1-layer gpt of embed 16) is shared by the checks of its record.
"""
import json
import math

import numpy as np
import pytest
import yaml

from communities import cli
from communities.errors import EXIT_USER
from communities.tools import lm_reference

pytestmark = pytest.mark.timeout(300)

TINY = {
    "name": "lm_tiny",
    "world_size": 2,
    "strategy": "community",
    "data": {"dataset": "pystdlib", "partition": "iid", "test_fraction": 0.1,
             "lm": {"context": 32, "max_bytes": 100_000, "test_windows": 64}},
    "model": {"name": "gpt", "gpt": {"layers": 1, "heads": 1, "embed": 16}},
    "train": {"optimizer": "adamw", "lr": 0.01, "batch_size": 8, "unit": "steps", "steps_per_unit": 5,
              "budget": 4, "eval_every": 2, "schedule": "cosine", "warmup": 0.1},
}


def write_config(path, **changes):
    cfg = json.loads(json.dumps(TINY))
    cfg["output"] = {"root": str(path.parent / "results")}
    for key, value in changes.items():
        cfg[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("lmref")
    config = write_config(d / "tiny.yaml")
    code = cli.main(["lm-reference", str(config), "--eval-every", "10"])
    out = d / "results" / "lm_tiny_reference.json"
    return code, out, config


def test_finishes_and_writes_its_record(tiny_run, capsys):
    code, out, _ = tiny_run
    assert code == 0
    rec = json.loads(out.read_text())
    for key in ("tokens", "steps", "batch_size", "replica_batch_size", "world_size", "tokens_per_second",
                "train_seconds", "final", "initial", "curve", "basis", "train_windows", "test_windows",
                "bytes_per_token", "config", "overrides", "parameters"):
        assert key in rec, key
    for key in ("test_loss", "test_bpb", "test_acc"):
        assert math.isfinite(rec["final"][key])
    assert rec["tokens_per_second"] > 0
    assert not list(out.parent.glob(".*.tmp"))  # the temporary was renamed, none left behind


def test_token_count_is_the_worlds(tiny_run):
    rec = json.loads(tiny_run[1].read_text())
    t = TINY["train"]
    tokens = TINY["world_size"] * t["budget"] * t["steps_per_unit"] * t["batch_size"] * TINY["data"]["lm"]["context"]
    assert rec["tokens"] == tokens == rec["curve"][-1]["tokens"]
    assert rec["batch_size"] == TINY["world_size"] * t["batch_size"]  # what allreduce averages per step
    assert rec["steps"] == t["budget"] * t["steps_per_unit"] == rec["curve"][-1]["step"]
    assert [r["step"] for r in rec["curve"]] == [0, 10, 20]


def test_loss_falls_below_uniform(tiny_run):
    rec = json.loads(tiny_run[1].read_text())
    final = rec["final"]
    assert final["test_loss"] < math.log(256) - 0.5  # uniform over bytes: ln 256 = 5.55 nats
    assert final["test_loss"] < rec["initial"]["test_loss"]
    assert final["test_bpb"] == pytest.approx(final["test_loss"] / math.log(2))  # bytes: one byte a token


def test_existing_out_is_refused_without_overwrite(tiny_run, capsys):
    _, out, config = tiny_run
    before = out.read_bytes()
    assert cli.main(["lm-reference", str(config)]) == EXIT_USER
    err = capsys.readouterr().err
    assert str(out) in err and "--overwrite" in err
    assert out.read_bytes() == before


def test_non_text_dataset_is_refused(tmp_path, capsys):
    config = write_config(tmp_path / "digits.yaml", data={"dataset": "digits"}, model={"name": "mlp"})
    assert cli.main(["lm-reference", str(config)]) == EXIT_USER
    err = capsys.readouterr().err
    assert "data.dataset='digits'" in err and "not a text corpus" in err
    assert not (tmp_path / "results").exists()


def test_bad_key_names_it(tmp_path, capsys):
    config = write_config(tmp_path / "tiny.yaml")
    assert cli.main(["lm-reference", str(config), "train.batch_size=0"]) == EXIT_USER
    assert "batch_size" in capsys.readouterr().err


class _Cfg:
    """The parts of a config the plan reads."""

    def __init__(self, unit="steps", strategy="community"):
        self.strategy = strategy
        self.train = type("T", (), dict(unit=unit, batch_size=8, steps_per_unit=5, budget=4))()
        self.data = type("D", (), dict(lm=type("L", (), dict(context=32))()))()


def test_another_batch_keeps_the_tokens():
    default = lm_reference.make_plan(_Cfg(), [100, 120], None)
    other = lm_reference.make_plan(_Cfg(), [100, 120], 12)
    assert other.tokens == default.tokens == 2 * 4 * 5 * 8 * 32
    assert other.steps == math.ceil(default.windows / 12)
    assert sum(other.batch_at(j) for j in range(1, other.steps + 1)) == other.windows
    pool = np.arange(50, 90)
    drawn = np.concatenate(list(lm_reference.batches(pool, other, seed=3)))
    assert len(drawn) == other.windows and set(drawn) <= set(pool)
    assert np.array_equal(drawn[:40][np.argsort(drawn[:40])], pool)  # one permutation of the pool after another


def test_epoch_unit_counts_every_shards_passes():
    plan = lm_reference.make_plan(_Cfg(unit="epoch"), [100, 120], None)
    assert plan.windows == 4 * 220
    lock = lm_reference.make_plan(_Cfg(unit="epoch", strategy="allreduce"), [100, 120], None)
    assert lock.windows == 2 * 4 * 15 * 8  # every replica takes the longest shard's ceil(120 / 8) steps
