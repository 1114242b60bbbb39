"""Rank 0's progress lines (no terminal, as in a SLURM log): elapsed time, units per second and an ETA, and a line
at least once a minute, so that a slow run's log does not look stalled."""
from __future__ import annotations

import logging

from communities.engine.progress import EVERY_S, Progress, clock, pace


def test_clock_and_pace():
    assert [clock(s) for s in (0, 7.4, 65, 3600 * 3 + 129, 86400 * 2 + 3729)] == \
        ["0:00", "0:07", "1:05", "3:02:09", "2d 1:02:09"]
    assert clock(float("nan")) == "?"
    assert pace(10, 40, 0, 5.0) == "t=10/40 (25%) 0:05 elapsed, 2 units/s, eta 0:15"
    assert pace(3, 40, 0, 300.0) == "t=3/40 (8%) 5:00 elapsed, 100 s/unit, eta 1:01:40"  # slow units read per unit
    assert pace(25, 40, 20, 10.0) == "t=25/40 (62%) 0:10 elapsed, 0.5 units/s, eta 0:30"  # a resume: its own units
    assert pace(20, 40, 20, 0.0) == "t=20/40 (50%) 0:00 elapsed"  # nothing done yet: no speed
    assert pace(45, 40, 0, 9.0).endswith("eta 0:00")  # past the budget (async's after_budget)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("[run]")]


def test_lines_every_5_percent_and_at_least_once_a_minute(caplog):
    clk = Clock()
    p = Progress("run", 100, True, now=clk)
    p.begin(0)
    with caplog.at_level(logging.INFO, logger="communities"):
        for t in range(1, 12):
            clk.now += 2.0 if t <= 5 else 40.0  # the units slow down from t=6
            p.update(t, 2, 0.5, 0.8, 0.3)
    got = lines(caplog)
    # t=1 (the first), t=5 (5%), t=7 (60 s since t=5), t=9 (again), t=10 (5%); not t=11 (40 s since t=10)
    assert [g.split()[1] for g in got] == ["t=1/100", "t=5/100", "t=7/100", "t=9/100", "t=10/100"]
    assert got[0] == "[run] t=1/100 (1%) 0:02 elapsed, 0.5 units/s, eta 3:18 communities=2 dispersion=0.5 " \
                     "acc=0.800 loss=0.300"
    assert got[1].startswith("[run] t=5/100 (5%) 0:10 elapsed, 0.5 units/s, eta 3:10 ")
    assert "t=10/100 (10%) 3:30 elapsed, 21 s/unit, eta 31:30" in got[-1]
    assert EVERY_S == 60.0


def test_a_resumed_run_counts_from_its_checkpoint_and_other_ranks_are_silent(caplog):
    clk = Clock()
    p = Progress("run", 40, True, now=clk)
    quiet = Progress("run", 40, False, now=clk)
    p.begin(20)
    quiet.begin(20)
    with caplog.at_level(logging.INFO, logger="communities"):
        clk.now += 4.0
        p.update(21, None, float("nan"), 0.5, 1.0)
        quiet.update(21, None, float("nan"), 0.5, 1.0)
    assert lines(caplog) == ["[run] t=21/40 (52%) 0:04 elapsed, 0.25 units/s, eta 1:16 communities=- "
                             "dispersion=nan acc=0.500 loss=1.000"]
