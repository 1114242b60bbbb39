"""Lost ranks without MPI failures: the logical-rank bookkeeping of ``World`` on a one-process world, the config
rules of ``comm.fault_tolerance``, the refusal where MPI has no ULFM, and the survival part's round copies."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from communities import config
from communities.config import ConfigError
from communities.engine.survival import NoSurvival, Survival, lost_rows
from communities.runtime.comm import World, ulfm_problem


@pytest.fixture
def survivor():
    """This process as logical rank 0, the one survivor of an 8-rank job (a resume of survivors does this)."""
    w = World(timeout=0)
    assert w.comm.Get_size() == 1
    w.set_membership([0], 8)
    return w


def test_a_survivor_keeps_its_logical_rank_and_the_job_its_size(survivor):
    w = survivor
    assert (w.rank, w.size, w.n_alive, w.whole) == (0, 8, 1, False)
    assert w.alive.tolist() == [True] + [False] * 7
    with pytest.raises(ValueError, match="rank 3 was lost"):
        w.sendrecv_array(np.zeros(1), 3)


def test_gathers_place_the_survivors_rows_at_their_logical_ranks(survivor):
    w = survivor
    got = w.allgather(np.array([7.0, 8.0]))
    assert got.shape == (8, 2)
    assert got[0].tolist() == [7.0, 8.0] and not got[1:].any()
    text = w.allgather_text("here")
    assert text[0] == "here" and text.count("") == 7
    rows = w.gather_rows(np.ones((3, 2)))
    assert [b.shape[0] for b in rows] == [3, 0, 0, 0, 0, 0, 0, 0]


def test_means_are_over_the_ranks_alive(survivor):
    t = torch.tensor([4.0, 6.0])
    survivor.allreduce_mean_(t)
    assert t.tolist() == [4.0, 6.0]  # one survivor: its own values, not an eighth of them


def test_a_membership_must_match_the_processes():
    w = World(timeout=0)
    with pytest.raises(ValueError, match="2 survivors need as many ranks"):
        w.set_membership([1, 4], 8)


def test_mpich_has_no_ulfm_and_says_how_to_get_it():
    problem = ulfm_problem(env={})
    assert problem is not None and "ULFM" in problem
    with pytest.raises(ConfigError, match="comm.fault_tolerance=shrink"):
        World(timeout=0).enable_shrink()


def test_open_mpi_without_ft_flags_is_refused(monkeypatch):
    monkeypatch.setattr(World, "library_version", staticmethod(lambda: "Open MPI v5.0.11"))
    assert "--with-ft ulfm" in ulfm_problem(env={})
    assert ulfm_problem(env={"OMPI_MCA_mpi_ft_enable": "1"}) is None


@pytest.mark.parametrize("override, needle", [
    ("protocol=async", "protocol='async'"),
    ("strategy=ifca", "strategy='ifca'"),
    ("signature.overlap=true", "signature.overlap"),
])
def test_shrink_refuses_what_it_cannot_roll_back(override, needle):
    with pytest.raises(ConfigError, match="comm.fault_tolerance") as err:
        config.load("configs/quickstart.yaml", ["comm.fault_tolerance=shrink", override])
    assert needle in str(err.value)


def test_kill_faults_are_checked():
    with pytest.raises(ConfigError, match="faults.kill"):
        config.load("configs/quickstart.yaml", ["faults.kill={3: 0}"])
    cfg = config.load("configs/quickstart.yaml", ["faults.kill={9: 4}"])
    with pytest.raises(ConfigError, match="faults.kill names rank 9"):
        cfg.check_world(8)


class _Part:
    def __init__(self):
        self.value = torch.zeros(3)

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value.copy_(state["value"])


def test_survival_keeps_the_last_two_round_copies(survivor):
    part = _Part()
    s = Survival(survivor, {"part": part}, replica=None, lost_shard="drop", rewind=None, log_lost=None)
    for t in (0, 5, 10):
        part.value.fill_(t)
        s.remember(t)
    assert [t for t, _ in s.copies] == [5, 10]
    assert s.info() == {"alive": [0], "lost": []}
    assert NoSurvival().summary() is None


def test_lost_rows_are_merge_events():
    [row] = lost_rows([{"rank": 3, "t": 10, "adopted_by": 4}])
    assert row["event"] == "lost" and (row["i"], row["j"], row["t"], row["adopted_by"]) == (3, -1, 10, 4)
