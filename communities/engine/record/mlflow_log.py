"""MLflow (``logging.mlflow: true``): the trackers' scalars, images and summary, and the config as parameters.

MLflow's own environment decides where the run goes: ``MLFLOW_TRACKING_URI`` (a server, a
database, or a ``file:`` store; MLflow 3 asks for ``MLFLOW_ALLOW_FILE_STORE=true`` with the
last). The experiment is ``logging.project``, the run's name the config's ``name``. The
config is logged flat (``train.lr``, ``partners.p_cross.start``, ...), lists and dicts as
JSON; images go to the run's ``images/`` (``log_image`` with a key and the unit as step),
the summary to ``summary.json``. A resumed run continues the same MLflow run (found by its
tag ``communities.run_key``); a parameter it changed keeps its first value there.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from ...config import Config
from .tracking import Tracker

log = logging.getLogger(__name__)

RUN_KEY_TAG = "communities.run_key"
STATUS = {"complete": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}
PARAM_LIMIT = 6000  # characters in one parameter value (MLflow 2 and 3; longer values are cut)
BATCH_PARAMS, BATCH_METRICS = 100, 1000  # MLflow's log_batch limits


def flat_params(tree: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, str]]:
    """``(dotted key, text)`` for every leaf of a config dump; lists and empty dicts as JSON."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from flat_params(value, path + ".")
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            yield path, text[:PARAM_LIMIT]


def _chunks(items: List[Any], size: int) -> Iterator[List[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


class MlflowLog(Tracker):
    """Rank 0's MLflow run, written through ``MlflowClient`` (no global active run in the user's process)."""

    name = "mlflow"

    def __init__(self, cfg: Config, run_dir: Path, *, start_t: int, key: str):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        super().__init__(cfg, run_dir)
        self.client = MlflowClient()
        self.experiment_id = self._experiment(cfg.logging.project)
        found = self.client.search_runs([self.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{key}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            known = found[0].data.params
        else:
            run = self.client.create_run(self.experiment_id, run_name=cfg.name,
                                         tags={RUN_KEY_TAG: key, "communities.run_dir": str(self.run_dir)})
            self.run_id, known = run.info.run_id, {}
        params = [Param(k, v) for k, v in flat_params(cfg.model_dump(mode="json")) if k not in known]
        for chunk in _chunks(params, BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=chunk)
        log.info(f"communities: MLflow run {self.run_id} ({'resumed at t=' + str(start_t) if found else 'new'}) in "
                 f"experiment {cfg.logging.project!r} at {self.client.tracking_uri}")
        self.closed = False

    def _experiment(self, name: str) -> str:
        existing = self.client.get_experiment_by_name(name)
        if existing is not None:
            return existing.experiment_id
        try:
            return self.client.create_experiment(name)
        except Exception:  # another run of a sweep created it meanwhile
            existing = self.client.get_experiment_by_name(name)
            if existing is None:
                raise
            return existing.experiment_id

    def write_scalars(self, values: Dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(tag, value, now, step) for tag, value in values.items()]
        for chunk in _chunks(metrics, BATCH_METRICS):
            self.client.log_batch(self.run_id, metrics=chunk)

    def write_image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.client.log_image(self.run_id, image, key=tag, step=step)

    def write_summary(self, summary: dict) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")

    def close(self, status: str = "complete") -> None:
        if self.closed:
            return
        self.closed = True
        self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))

    def identity(self) -> Optional[dict]:
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": self.client.tracking_uri}
