"""Lost ranks without MPI failures: the logical-rank bookkeeping (``Membership``, pure, and ``World`` on a
one-process world), the config rules of ``comm.fault_tolerance``, the refusal where MPI has no ULFM, and the
survival part's round copies."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from communities import config
from communities.config import ConfigError
from communities.engine.state.survival import NoSurvival, Survival, lost_rows
from communities.runtime import launcher
from communities.runtime.comm import World
from communities.runtime.membership import Membership
from communities.runtime.ulfm import ulfm_problem


@pytest.fixture
def survivor():
    """This process as logical rank 0, the one survivor of an 8-rank job (a resume of survivors does this)."""
    w = World(timeout=0)
    assert w.comm.Get_size() == 1
    w.set_membership([0], 8)
    return w


def test_a_whole_membership_maps_nothing():
    m = Membership(4)
    assert (m.n_alive, m.whole, m.alive.tolist()) == (4, True, [True] * 4)
    assert [m.comm_rank(r) for r in range(4)] == [0, 1, 2, 3]
    rows = np.arange(8.0).reshape(4, 2)
    assert m.spread(rows) is rows  # the default path: no copy
    blocks = [np.ones((r, 3)) for r in range(4)]
    assert m.spread_blocks(blocks, 3) is blocks


def test_a_shrink_keeps_the_survivors_logical_ranks():
    m = Membership(6)
    assert m.keep([0, 2, 3, 5]) == [1, 4]  # communicator ranks 1 and 4 (logical 1 and 4) are gone
    assert m.members.tolist() == [0, 2, 3, 5] and not m.whole and m.n_alive == 4
    assert m.alive.tolist() == [True, False, True, True, False, True]
    assert [m.comm_rank(r) for r in (0, 2, 3, 5)] == [0, 1, 2, 3]
    assert [m.logical(k) for k in range(4)] == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="rank 4 was lost"):
        m.comm_rank(4)
    with pytest.raises(ValueError, match="rank 9 was lost"):
        m.comm_rank(9)
    assert m.keep([1, 2, 3]) == [0]  # a second loss: communicator ranks of the shrunk communicator
    assert m.members.tolist() == [2, 3, 5]


def test_rows_of_the_survivors_are_spread_to_their_logical_ranks():
    m = Membership(5, [1, 3])
    got = m.spread(np.array([[1.0, 1.5], [3.0, 3.5]]))
    assert got.shape == (5, 2) and got[1].tolist() == [1.0, 1.5] and got[3].tolist() == [3.0, 3.5]
    assert not got[[0, 2, 4]].any()
    blocks = m.spread_blocks([np.ones((2, 3)), np.ones((1, 3))], 3)
    assert [b.shape for b in blocks] == [(0, 3), (2, 3), (0, 3), (1, 3), (0, 3)]


def test_survivors_of_a_larger_job_are_sorted_and_must_match_the_processes():
    m = Membership.of_survivors([5, 2, 7], 8, processes=3)
    assert m.members.tolist() == [2, 5, 7] and m.size == 8 and m.logical(1) == 5
    with pytest.raises(ValueError, match="2 survivors need as many ranks; this job has 3"):
        Membership.of_survivors([1, 4], 8, processes=3)


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
    monkeypatch.setattr(launcher, "library_version", lambda: "Open MPI v5.0.11")
    assert "--with-ft ulfm" in ulfm_problem(env={})
    assert ulfm_problem(env={"OMPI_MCA_mpi_ft_enable": "1"}) is None


@pytest.mark.parametrize("overrides, needle", [
    (["protocol=async", "comm.exchange=posted"], "comm.exchange='posted'"),
    (["strategy=ifca"], "strategy='ifca'"),
    (["signature.overlap=true"], "signature.overlap"),
])
def test_shrink_refuses_what_it_cannot_roll_back(overrides, needle):
    with pytest.raises(ConfigError, match="comm.fault_tolerance") as err:
        config.load("configs/quickstart.yaml", ["comm.fault_tolerance=shrink", *overrides])
    assert needle in str(err.value)


def test_shrink_runs_under_async_with_blocking_exchanges():
    cfg = config.load("configs/quickstart.yaml", ["comm.fault_tolerance=shrink", "protocol=async"])
    assert cfg.comm.exchange == "sendrecv"


def test_kill_faults_are_checked():
    with pytest.raises(ConfigError, match="faults.kill"):
        config.load("configs/quickstart.yaml", ["faults.kill={3: -1}"])
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
    s = Survival(survivor, {"part": part}, replica=None, lost_shard="drop", rewind=None, log_lost=None,
                 take_over=None)
    for t in (0, 5, 10):
        part.value.fill_(t)
        s.remember(t)
    assert [t for t, _ in s.copies] == [5, 10]
    assert s.info() == {"alive": [0], "lost": []}
    assert NoSurvival().summary() is None


def test_lost_rows_are_merge_events():
    [row] = lost_rows([{"rank": 3, "t": 10, "adopted_by": 4}])
    assert row["event"] == "lost" and (row["i"], row["j"], row["t"], row["adopted_by"]) == (3, -1, 10, 4)


def test_the_lead_is_the_lowest_rank_alive():
    """Rank 0 leads (writes, roots every gather) while it lives; after its loss the lowest survivor does."""
    m = Membership(6)
    assert m.lead == 0
    m.keep([1, 2, 4, 5])  # logical 0 and 3 lost
    assert m.lead == 1
    m.keep([1, 2, 3])  # then logical 1
    assert m.lead == 2
    assert Membership.of_survivors([7, 3, 5], 8, processes=3).lead == 3


def test_survivors_without_rank_0_root_every_collective_at_their_lead():
    """A resumed job of the survivors of a lost rank 0: this process is logical rank 3, which must write and
    root the gathers and broadcasts (rank 0 is nowhere)."""
    from communities.runtime.collective import collective_check

    w = World(timeout=0)
    w.set_membership([3], 8)
    assert (w.rank, w.lead, w.leads) == (3, 3, True)
    rows = w.gather_rows(np.ones((2, 2)))
    assert rows is not None and [b.shape[0] for b in rows] == [0, 0, 0, 2, 0, 0, 0, 0]
    assert w.bcast_text("from the lead") == "from the lead"
    assert collective_check(w, lambda: "ran") == "ran"
    w.agree(b"digest", "a digest")  # compared with the lead's own row, not with an absent rank 0's


def test_a_new_writer_takes_the_run_directory_over_and_meta_names_it(tmp_path):
    """The lowest survivor's side of the writer's loss: a lock still held (the 'lost' writer is alive) is
    refused naming its holder; a released one is taken, temporaries are swept and meta.json names both writers."""
    import json

    from communities.engine.state.run_dir import RunDirectory
    from communities.errors import RunLocked
    from communities.runlock import RunLock

    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"status": "running", "writers": [{"rank": 0, "why": "started"}]}))
    (run / ".metrics.jsonl.abc.tmp").write_text("torn")
    old = RunLock(run)
    old.acquire(["old writer"])
    w = World(timeout=0)
    w.set_membership([1], 4)
    rd = RunDirectory(config.from_dict({"name": "run"}), w, run)
    with pytest.raises(RunLocked, match="in use by another run"):
        rd.take_over(10, [0], ["new writer"])
    assert rd.writer is None and (run / ".metrics.jsonl.abc.tmp").exists()
    old.release()  # as the kernel does when the writer's process dies
    rd.take_over(10, [0], ["new writer"])
    assert rd.writer is not None and rd.lock is not None and rd.lock.held
    assert not (run / ".metrics.jsonl.abc.tmp").exists()
    writers = json.loads((run / "meta.json").read_text())["writers"]
    assert [x["rank"] for x in writers] == [0, 1] and "t=10" in writers[1]["why"]
    rd.take_over(10, [0], ["again"])  # idempotent: a second failure during the recovery repeats the call
    assert len(json.loads((run / "meta.json").read_text())["writers"]) == 2
    rd.release()


def test_rows_appended_after_a_rewind_reach_the_rewritten_log(tmp_path):
    """The writer keeps each log open for its appends. A rewind that drops rows rewrites the file (a new inode):
    the appends after it must reach the new file, not the unlinked one (the chaos soak found rows lost so)."""
    from communities.engine.state.run_dir import RunDirectory
    from communities.results import RunWriter, read_jsonl

    run = tmp_path / "run"
    rd = RunDirectory(config.from_dict({"name": "run"}), World(timeout=0), run)
    rd.writer = RunWriter(run, overwrite=True)
    rd.writer.append_jsonl("metrics.jsonl", [{"t": t, "rank": 0} for t in (1, 2, 3)])
    rd.rewind(2, lost=True)  # the survivors go back to t=2: row 3 is dropped, the file rewritten
    rd.writer.append_jsonl("metrics.jsonl", [{"t": 3, "rank": 0}, {"t": 4, "rank": 0}])
    assert [r["t"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    rd.writer.close()
