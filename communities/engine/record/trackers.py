"""The trackers a config switches on, opened: the backends (TensorBoard, W&B, MLflow) are imported here, each only
when switched on, so that ``tracking`` (what every backend builds on) imports none of them."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import List

from ...config import Config
from .tracking import Tracker, Trackers, enabled

log = logging.getLogger(__name__)


def open_trackers(cfg: Config, run_dir: Path, start_t: int, key: str) -> Trackers:
    """The trackers the config switches on, each opened (a resumed run continues its own: ``key`` names it).

    A tracker that cannot open is left out with a warning (the run trains without it)."""
    opened: List[Tracker] = []
    for name in enabled(cfg):
        try:
            if name == "tensorboard":
                from .tensorboard_log import TensorBoardLog

                opened.append(TensorBoardLog(cfg, run_dir, start_t))
            elif name == "wandb":
                from .wandb_log import WandbLog

                opened.append(WandbLog(cfg, run_dir, start_t=start_t, key=key))
            else:
                from .mlflow_log import MlflowLog

                opened.append(MlflowLog(cfg, run_dir, start_t=start_t, key=key))
        except Exception as exc:
            log.warning(f"communities: warning: logging.{name}: cannot open ({type(exc).__name__}: {exc}); the run "
                        "goes on without it")
    return Trackers(opened)
