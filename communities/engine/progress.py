"""Rank 0's progress: a tqdm bar on a terminal, else a log line every 5% of the budget and at least once a minute.

A line says how far the run is, how long it has run, how fast and how long the budget still
takes, so that a SLURM log does not look stalled between lines::

    [quickstart] t=20/40 (50%) 0:08 elapsed, 2.41 units/s, eta 0:08 communities=3 dispersion=0.21 ...

Speed and ETA count the units of this attempt only (a resumed run starts its clock at its checkpoint);
the ETA is to the end of ``train.budget`` (a run may stop earlier, at consensus).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

EVERY_S = 60.0  # the longest gap between two log lines (at a unit's end) when no 5% step falls in it


def clock(seconds: float) -> str:
    """``0:07``, ``12:05``, ``3:02:09``, ``2d 03:02:09``: a duration as a log line shows it."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    text = f"{hours}:{minutes:02d}:{s:02d}" if hours or days else f"{minutes}:{s:02d}"
    return f"{days}d {text}" if days else text


def pace(t: int, budget: int, start_t: int, elapsed: float) -> str:
    """``t=20/40 (50%) 0:08 elapsed, 2.41 units/s, eta 0:08`` (no speed before a unit is done)."""
    done = t - start_t
    share = f" ({100 * t / budget:.0f}%)" if budget > 0 else ""
    text = f"t={t}/{budget}{share} {clock(elapsed)} elapsed"
    if done <= 0 or elapsed <= 0:
        return text
    rate = done / elapsed
    speed = f"{rate:.3g} units/s" if rate >= 0.1 else f"{1 / rate:.3g} s/unit"
    return f"{text}, {speed}, eta {clock(max(0, budget - t) / rate)}"


class Progress:
    """Progress of the loop as rank 0 shows it; silent on other ranks or with ``--no-progress``."""

    def __init__(self, name: str, budget: int, enabled: bool, *, bytes_per_token: Optional[float] = None,
                 now: Callable[[], float] = time.monotonic):
        """``bytes_per_token`` (a language model's byte corpus: 1): the training loss also in bits per byte."""
        self.name, self.budget, self.enabled = name, budget, enabled
        self.bytes_per_token = bytes_per_token
        self.now = now
        self.bar = None
        self.start_t = 0
        self.started = now()
        self.last_line = self.started

    def begin(self, t: int) -> None:
        """The loop starts after unit ``t`` (0, or a checkpoint's): the clock and, on a terminal, the bar."""
        self.start_t = t
        self.started = self.last_line = self.now()
        if self.enabled:
            import sys

            if sys.stderr.isatty():
                from tqdm import tqdm

                self.bar = tqdm(total=self.budget, initial=t, desc=self.name, unit="unit", dynamic_ncols=True)

    def update(self, t: int, communities: Optional[int], dispersion: float, acc: float, loss: float,
               *, epsilon: Optional[float] = None) -> None:
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
            return
        now = self.now()
        if t % max(1, self.budget // 20) == 0 or t == self.start_t + 1 or now - self.last_line >= EVERY_S:
            self.last_line = now
            log.info(f"[{self.name}] {pace(t, self.budget, self.start_t, now - self.started)} {info}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
