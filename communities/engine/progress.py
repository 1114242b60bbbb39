"""Rank 0's progress line: a tqdm bar on a terminal, else a line every 5% of the budget."""
from __future__ import annotations

import logging
import math
from typing import Optional

log = logging.getLogger(__name__)


class Progress:
    """Progress of the loop as rank 0 shows it; silent on other ranks or with ``--no-progress``."""

    def __init__(self, name: str, budget: int, enabled: bool, *, bytes_per_token: Optional[float] = None):
        """``bytes_per_token`` (a language model's byte corpus: 1): the training loss also in bits per byte."""
        self.name, self.budget, self.enabled = name, budget, enabled
        self.bytes_per_token = bytes_per_token
        self.bar = None
        if enabled:
            import sys

            if sys.stderr.isatty():
                from tqdm import tqdm

                self.bar = tqdm(total=budget, desc=name, unit="unit", dynamic_ncols=True)

    def update(self, t: int, communities: Optional[int], dispersion: float, acc: float, loss: float,
               epsilon: Optional[float] = None) -> None:
        """``epsilon`` (privacy.enabled): rank 0's own epsilon so far."""
        if not self.enabled:
            return
        c = communities if communities is not None else "-"
        disp = dispersion if math.isfinite(dispersion) else float("nan")
        info = f"communities={c} dispersion={disp:.3g} acc={acc:.3f} loss={loss:.3f}"
        if self.bytes_per_token and math.isfinite(loss):
            info += f" ({loss / math.log(2) / self.bytes_per_token:.3f} bits/byte)"
        if epsilon is not None:
            info += f" eps={epsilon:.3g}"
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(info, refresh=False)
        elif t % max(1, self.budget // 20) == 0 or t == 1:
            log.info(f"[{self.name}] t={t}/{self.budget} {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
