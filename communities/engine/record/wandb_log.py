"""Weights & Biases (``logging.wandb: true``): the trackers' scalars, images and summary, and the config.

W&B's own environment decides where the run goes: ``WANDB_MODE=offline`` on compute nodes
without internet (then ``wandb sync RUN_DIR/wandb/offline-run-*`` from a login node),
``WANDB_API_KEY``, ``WANDB_ENTITY``; ``WANDB_DIR`` moves its files out of the run directory
(``RUN_DIR/wandb`` by default). The project is ``logging.project``, the run's name the
config's ``name``, its config the whole resolved config (nested, as in ``config.yaml``).

Every scalar is logged against the unit ``t`` (W&B's step metric ``unit``), since rows reach
rank 0 in batches and not in the order of t. A resumed run continues the same W&B run (its id
comes from the run directory and its start time); rows logged again after a rewind appear
twice. W&B's console capture is off (the run's own log is the SLURM log).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from ...config import Config
from .tracking import Tracker

log = logging.getLogger(__name__)

STEP = "unit"  # the step metric every scalar and image is plotted against
EXIT_CODES = {"complete": 0, "interrupted": 75, "failed": 1}


class WandbLog(Tracker):
    """Rank 0's W&B run."""

    name = "wandb"

    def __init__(self, cfg: Config, run_dir: Path, *, start_t: int, key: str):
        import wandb

        super().__init__(cfg, run_dir)
        self.wandb = wandb
        directory = os.environ.get("WANDB_DIR") or str(self.run_dir)
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.logging.project, name=cfg.name, id=key, resume="allow", dir=directory,
                              config=cfg.model_dump(mode="json"), job_type="train",
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)
        where = self.run.dir if getattr(self.run, "offline", False) else (self.run.url or self.run.dir)
        log.info(f"communities: W&B run {self.run.id} ({'resumed at t=' + str(start_t) if start_t else 'new'}): "
                 f"{where}")
        self.closed = False

    def write_scalars(self, values: Dict[str, float], step: int) -> None:
        self.run.log({**values, STEP: step})

    def write_image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.run.log({tag: self.wandb.Image(image, caption=f"{tag} at t={step}"), STEP: step})

    def write_summary(self, summary: dict) -> None:
        self.run.summary.update({k: v for k, v in summary.items() if v is not None})

    def close(self, status: str = "complete") -> None:
        if self.closed:
            return
        self.closed = True
        if status == "interrupted":
            self.run.mark_preempting()  # W&B shows it as preempted, to be resumed
        self.run.finish(exit_code=EXIT_CODES.get(status, 1))

    def identity(self) -> Optional[dict]:
        return {"id": self.run.id, "project": self.cfg.logging.project, "dir": str(getattr(self.run, "dir", ""))}
