"""TensorBoard (``logging.tensorboard: true``): the trackers' scalars and images in ``RUN_DIR/tensorboard``.

What is logged, and when, is tracking.py's (its docstring lists the tags); the event file is
written by TensorBoard's own background thread. A resumed run drops what the interrupted one
wrote past its checkpoint (``purge_step``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np

from ...config import Config
from .tracking import Tracker, check_available  # noqa: F401  (check_available: this module's former API)

TB_DIR = "tensorboard"  # under the run directory


class TensorBoardLog(Tracker):
    """Rank 0's event file in ``RUN_DIR/tensorboard``; fed by the run log."""

    name = "tensorboard"

    def __init__(self, cfg: Config, run_dir: Path, start_t: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(cfg, run_dir)
        self.path = Path(run_dir) / TB_DIR
        # a resumed run drops what the interrupted one wrote past its checkpoint
        self.writer = SummaryWriter(log_dir=str(self.path), purge_step=start_t + 1 if start_t > 0 else None)

    def write_scalars(self, values: Dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def write_image(self, tag: str, image: np.ndarray, step: int) -> None:
        self.writer.add_image(tag, image, global_step=step, dataformats="HWC")

    def close(self, status: str = "complete") -> None:
        self.writer.close()

    def identity(self) -> dict:
        return {"dir": str(self.path)}
