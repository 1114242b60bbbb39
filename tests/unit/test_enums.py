"""The enums that replaced strings and tri-states: resume, the stop, timer categories."""
from __future__ import annotations

import json
import time

import pytest

from communities.engine.state.run_dir import Resume
from communities.engine.timer import Timer
from communities.errors import StopReason
from communities.results import TIME_CATEGORIES, TimeCategory


def test_resume_from_the_command_line_and_slurm():
    assert Resume.of(True, 0) is Resume.RESUME and Resume.of(True, 3) is Resume.RESUME
    assert Resume.of(False, 1) is Resume.AUTO
    assert Resume.of(False, 0) is Resume.FRESH
    with pytest.raises(ValueError, match="True is not a valid Resume"):
        Resume(True)  # the old tri-state is refused, not read as a truth value


def test_time_categories_keep_their_plain_names():
    assert TIME_CATEGORIES == ("train", "exchange", "signature", "idle", "eval", "other", "turn")
    assert all(type(c) is str for c in TIME_CATEGORIES)
    assert json.dumps({TimeCategory.IDLE: 1.0, "v": TimeCategory.EVAL}) == '{"idle": 1.0, "v": "eval"}'
    timer = Timer()
    with timer(TimeCategory.TRAIN):
        with timer("idle"):  # the plain name is the same category
            pass
    assert list(timer.split()) == list(TIME_CATEGORIES) and all(type(k) is str for k in timer.total)


def test_a_replicas_turn_is_a_category_of_its_own_and_not_idle():
    """While the other replicas of its process run, a replica waits for its turn: those seconds (the world's
    ``turn_seconds``) are ``turn``, left out of the section open meanwhile and of a collective's duration."""
    turns = [0.0]
    timer = Timer(turns=lambda: turns[0])
    timer.start()
    with timer(TimeCategory.OTHER):
        with timer.collective("Allreduce"):
            time.sleep(0.25)
            turns[0] += 0.2  # of the 0.25 s waited in the call, the other replicas ran 0.2 s
        with timer(TimeCategory.TRAIN):
            time.sleep(0.05)
    split = timer.split()
    assert split["turn"] == pytest.approx(0.2, abs=1e-9)
    assert 0.04 <= split["other"] < 0.2 and split["train"] >= 0.05 and split["idle"] == 0.0
    assert timer.calls["Allreduce"][0] < 0.2  # what settle compares across ranks: the call less the turn
    assert sum(split.values()) == pytest.approx(timer.elapsed(), abs=2e-3)
    state = timer.state_dict()
    again = Timer()
    again.load_state_dict(state)
    assert again.split()["turn"] == pytest.approx(0.2, abs=1e-9)  # a resumed run keeps its turns


def test_an_unknown_timer_category_is_refused():
    with pytest.raises(ValueError, match="'waiting' is not a valid TimeCategory"):
        with Timer()("waiting"):
            pass


def test_stop_reasons_compare_with_their_values():
    assert StopReason.SIGNAL == "signal" and StopReason.BUDGET == "budget"
    assert StopReason("budget") is StopReason.BUDGET
