"""Experiment trackers: W&B in its offline mode and MLflow on a file store, fed by a real run and read back.

One run of 4 replicas in this process (a population on a world of one rank) logs to both; the tests read
what each wrote with the tracker's own reader (W&B's transaction log, MLflow's client) and compare it with
the run directory: the config as hyperparameters, the scalars at their units, the dendrogram and timeline
images, the summary. TensorBoard's same feed is checked in tests/mpi/test_golden.py.
"""
from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import numpy as np
import pytest

from communities import config
from communities.engine.record import tracking

pytestmark = pytest.mark.timeout(600)

REPLICAS = 4


def _tiny():
    from tests.conftest import TINY

    return config.plain(config.load_strict(TINY))


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One population run with logging.wandb and logging.mlflow on: (run directory, W&B run, MLflow client)."""
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from communities.engine import loop
    from communities.runtime import population
    from tests.unit.test_disk_errors import world_

    root = tmp_path_factory.mktemp("tracked")
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "wandb-config"),
           "WANDB_CACHE_DIR": str(root / "wandb-cache"), "WANDB_DATA_DIR": str(root / "wandb-data"),
           "MLFLOW_TRACKING_URI": (root / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        raw = _tiny()
        raw.update(world_size=REPLICAS, output={"root": str(root)}, logging={"wandb": True, "mlflow": True,
                                                                            "project": "tracking-test"})
        cfg = config.from_dict(raw)
        population.run_population(world_(), REPLICAS, lambda w: loop.run(cfg, w, argv=["test"], progress=False))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    from mlflow.tracking import MlflowClient

    return root / "tiny", MlflowClient((root / "mlruns").as_uri())


def _rows(run: Path, name: str):
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def _expected(run: Path):
    """What the trackers must show, from the run directory: config, summary, consensus and round scalars."""
    summary = json.loads((run / "summary.json").read_text())
    consensus = {r["t"]: r["test_acc"] for r in _rows(run, "consensus.jsonl")}
    rounds = [json.loads(p.read_text()) for p in sorted((run / "rounds").glob("round_*/round.json"))]
    metrics = _rows(run, "metrics.jsonl")
    last = max(r["t"] for r in metrics)
    loss_mean = float(np.mean([r["loss"] for r in metrics if r["t"] == last]))
    return summary, consensus, rounds, last, loss_mean


def test_wandb_offline_run_holds_config_scalars_images_and_summary(tracked):
    from tests.helpers.wandb_offline import read_run

    run, _ = tracked
    meta = json.loads((run / "meta.json").read_text())
    ident = meta["tracking"]["wandb"]
    [directory] = (run / "wandb").glob("offline-run-*")  # one W&B run: the lead's, none of the other replicas
    assert directory.name.endswith(ident["id"])
    logged = read_run(directory)
    summary, consensus, rounds, last, loss_mean = _expected(run)
    # the config, nested as in config.yaml
    assert logged.config["name"] == "tiny" and logged.config["world_size"] == REPLICAS
    assert logged.config["train"]["lr"] == pytest.approx(0.05) and logged.config["logging"]["wandb"] is True
    # the scalars, at their units
    assert logged.scalars("accuracy/consensus_test") == pytest.approx(consensus)
    assert sorted(logged.scalars("communities/count")) == [r["t"] for r in rounds]
    assert [int(v) for _, v in sorted(logged.scalars("communities/count").items())] == \
        summary["communities_per_round"]
    assert logged.scalars("loss/rank_train_mean")[last] == pytest.approx(loss_mean)
    final = logged.scalars("final/consensus_test_acc")
    assert final == {summary["units"]: pytest.approx(summary["consensus_test_acc"])}
    # the images: a dendrogram per round at its unit, the timeline at the end, as PNG files
    dendrograms = logged.images("dendrogram")
    assert sorted(dendrograms) == [r["t"] for r in rounds]
    [(t_timeline, timeline)] = logged.images("timeline").items()
    assert t_timeline == summary["units"]
    for png in [*dendrograms.values(), timeline]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the summary
    assert logged.summary["consensus_test_acc"] == pytest.approx(summary["consensus_test_acc"])
    assert logged.summary["communities_per_round"] == summary["communities_per_round"]


def test_mlflow_file_store_run_holds_params_metrics_images_and_summary(tracked):
    run, client = tracked
    meta = json.loads((run / "meta.json").read_text())
    ident = meta["tracking"]["mlflow"]
    got = client.get_run(ident["run_id"])
    summary, consensus, rounds, last, loss_mean = _expected(run)
    assert [r.info.run_id for r in client.search_runs([ident["experiment_id"]])] == [ident["run_id"]]  # the lead's
    assert got.info.status == "FINISHED" and got.info.run_name == "tiny"
    assert client.get_experiment(ident["experiment_id"]).name == "tracking-test"
    # the config, flat
    params = got.data.params
    assert params["world_size"] == str(REPLICAS) and float(params["train.lr"]) == pytest.approx(0.05)
    assert params["partners.p_cross.horizon"] == "20" and json.loads(params["model.hidden"]) == [16]
    # the scalars, at their units
    history = {m.step: m.value for m in client.get_metric_history(ident["run_id"], "accuracy/consensus_test")}
    assert history == pytest.approx(consensus)
    counts = client.get_metric_history(ident["run_id"], "communities/count")
    assert [int(m.value) for m in sorted(counts, key=lambda m: m.step)] == summary["communities_per_round"]
    train = {m.step: m.value for m in client.get_metric_history(ident["run_id"], "loss/rank_train_mean")}
    assert train[last] == pytest.approx(loss_mean)
    # the images and the summary, as artifacts
    images = [a.path for a in client.list_artifacts(ident["run_id"], "images")]
    pngs = [p for p in images if p.endswith(".png")]
    assert sum(p.startswith("images/dendrogram+step+") for p in pngs) == len(rounds)
    assert [p for p in pngs if p.startswith(f"images/timeline+step+{summary['units']}+")]
    local = Path(client.download_artifacts(ident["run_id"], "summary.json", str(run.parent)))
    assert json.loads(local.read_text())["consensus_test_acc"] == pytest.approx(summary["consensus_test_acc"])


def test_a_resumed_run_continues_its_mlflow_run(tracked, tmp_path, monkeypatch):
    """The same run key finds the same MLflow run again; a parameter the resume changed keeps its first value."""
    pytest.importorskip("mlflow")
    from communities.engine.record.mlflow_log import MlflowLog

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    raw = _tiny()
    first = MlflowLog(config.from_dict(raw), tmp_path, start_t=0, key="k1")
    first.write_scalars({"loss/x": 1.0}, 5)
    first.close("interrupted")
    raw["train"]["budget"] = 80
    again = MlflowLog(config.from_dict(raw), tmp_path, start_t=5, key="k1")
    again.write_scalars({"loss/x": 0.5}, 10)
    again.close("complete")
    other = MlflowLog(config.from_dict(raw), tmp_path, start_t=0, key="k2")
    other.close()
    assert again.run_id == first.run_id != other.run_id
    got = again.client.get_run(again.run_id)
    assert got.info.status == "FINISHED" and got.data.params["train.budget"] == "40"
    assert [(m.step, m.value) for m in again.client.get_metric_history(again.run_id, "loss/x")] == [(5, 1.0),
                                                                                                  (10, 0.5)]


class _Recorder(tracking.Tracker):
    name = "recorder"

    def __init__(self, cfg, fail_on=None):
        super().__init__(cfg, Path("."))
        self.scalars, self.closed, self.fail_on = {}, [], fail_on

    def write_scalars(self, values, step):
        if self.fail_on is not None and self.fail_on in values:
            raise OSError("the tracking server is gone")
        self.scalars.setdefault(step, {}).update(values)

    def write_image(self, tag, image, step):
        pass

    def close(self, status="complete"):
        self.closed.append(status)


def test_a_failing_tracker_is_dropped_and_the_others_go_on(caplog):
    cfg = config.from_dict(_tiny())
    good, bad = _Recorder(cfg), _Recorder(cfg, fail_on="accuracy/consensus_test")
    trackers = tracking.Trackers([bad, good])
    row = {"t": 3, "rank": 0, "loss": 0.5, "test_acc": float("nan"), "test_loss": float("nan"), "bytes_sent": 2e6,
           "wall": 1.5}
    trackers.metrics([row, {**row, "rank": 1, "loss": 1.5}])
    with caplog.at_level(logging.WARNING, logger="communities"):
        trackers.consensus([{"t": 3, "test_acc": 0.9, "test_loss": 0.2}])
    assert "recorder failed while logging a consensus evaluation" in caplog.text and "goes on" in caplog.text
    assert trackers.trackers == [good] and bad.closed == ["failed"]
    assert good.scalars[3] == {"loss/rank_train_mean": 1.0, "bytes/sent_per_rank_mean_mb": 2.0, "time/elapsed_s": 1.5,
                               "accuracy/consensus_test": 0.9, "loss/consensus_test": 0.2}
    assert not any(math.isnan(v) for v in good.scalars[3].values())  # NaN (no evaluation) is left out
    trackers.close("interrupted")
    assert good.closed == ["interrupted"] and trackers.trackers == []


@pytest.mark.parametrize("key,module", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_tracker_without_its_package_is_a_config_error(monkeypatch, key, module):
    real = tracking.find_spec
    monkeypatch.setattr(tracking, "find_spec", lambda name: None if name == module else real(name))
    raw = _tiny()
    raw["logging"] = {key: True}
    with pytest.raises(config.ConfigError, match=rf"logging.{key}=true needs the {module} package: pip install "
                                                 rf"'communities\[{key}\]'"):
        tracking.check_available(config.from_dict(raw))
