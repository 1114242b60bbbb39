"""The asynchronous protocol under a real mpiexec: conservation, no hang, frozen partners, signature gossip."""
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from communities.results import read_jsonl
from communities.tools import jobs
from tests.helpers.mpi import initial_mean_and_final, run_engine, tiny_batch

pytestmark = pytest.mark.timeout(900)

ASYNC = ["protocol=async", "comm.timeout=20"]
LR0 = ["strategy=gossip", "train.lr=0", "train.momentum=0", "model.init=per_rank", "merge.lam=1", "train.budget=60"]
# no cross-community merges within the budget: every view should show the planted groups, whatever the timing
VIEWS = ["train.budget=40", "partners.p_cross.start=0", "partners.p_cross.begin=100"]
SLOW = ["faults.speed={0: 4.0}", "model.hidden=[256,256]", "train.batch_size=64", "train.wall_budget=6",
        "train.budget=100000", "strategy=gossip", "data.partition=iid"]

# a unit budget with one rank 4x slower: the fast ranks either serve once done, or train on (train.after_budget)
BUDGETED = ["faults.speed={0: 4.0}", "model.hidden=[256,256]", "train.batch_size=64", "train.budget=30",
            "strategy=gossip", "data.partition=iid", *ASYNC]

POSTED = "comm.exchange=posted"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's 4-rank runs that need no signal, in one batch."""
    return tiny_batch(tmp_path_factory, "async", 4, {"lr0": [*ASYNC, *LR0], "views": [*ASYNC, *VIEWS],
                                                    "slow_vc": SLOW, "slow_async": [*SLOW, *ASYNC],
                                                    "serve": BUDGETED,
                                                    "train_on": [*BUDGETED, "train.after_budget=train"],
                                                    "lr0_posted": [*ASYNC, *LR0, POSTED],
                                                    "train_on_posted": [*BUDGETED, "train.after_budget=train",
                                                                        POSTED]})


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_lr0_async_gossip_conserves_the_mean_and_reaches_it(runs):
    """Every exchange is symmetric: with lr = 0 the mean is conserved, and gossip drives every rank to it."""
    mean0, final_mean, spread0 = initial_mean_and_final(runs.config, 4, runs["lr0"])
    s = summary(runs["lr0"])
    assert s["protocol"] == "async" and s["merges"] > 0
    assert torch.allclose(final_mean, mean0, atol=1e-5)
    assert s["consensus_distance"] < 1e-2 * spread0


def test_lr0_posted_exchanges_conserve_the_mean_and_reach_it(runs):
    """Posted exchanges merge by displacement, each side when the other's half has arrived: with lr = 0 the mean
    is still conserved, and gossip still drives every rank to it."""
    mean0, final_mean, spread0 = initial_mean_and_final(runs.config, 4, runs["lr0_posted"])
    s = summary(runs["lr0_posted"])
    assert s["protocol"] == "async" and s["merges"] > 20
    assert torch.allclose(final_mean, mean0, atol=1e-5)
    assert s["consensus_distance"] < 1e-2 * spread0
    rows = [m for m in read_jsonl(runs["lr0_posted"] / "merges.jsonl") if m["event"] == "merge"]
    assert rows and all(m["a"] == 0.5 for m in rows)
    # both sides merge every exchange once, and log it (merges completed in the drain included)
    sides = Counter((m["i"], m["j"]) for m in rows)
    assert all(sides[(i, j)] == sides[(j, i)] for i, j in sides)


def test_sixteen_ranks_with_jitter_and_crossed_requests_finish_and_conserve_the_mean(tmp_path, tiny_config):
    """16 ranks, random sleeps after every batch, every timer firing every unit: many crossed and busy requests."""
    n = 16
    run_engine(n, tiny_config, tmp_path, *ASYNC, "strategy=gossip", "train.lr=0", "train.momentum=0",
               "model.init=per_rank", "merge.lam=1", "train.budget=15", "faults.jitter=0.003",
               "data.partition=iid", timeout=480)
    mean0, final_mean, _ = initial_mean_and_final(tiny_config, n, tmp_path / "tiny")
    assert torch.allclose(final_mean, mean0, atol=1e-5)
    events = [m["event"] for m in read_jsonl(tmp_path / "tiny" / "merges.jsonl")]
    assert events.count("merge") > 2 * n and "busy" in events  # requests met ranks waiting on their own


def test_community_views_are_recorded_and_tables_fill_by_gossip(runs):
    """Signatures spread by gossip: every rank's table holds every rank's row soon after the first signing."""
    n = 4
    run = runs["views"]
    s = summary(run)
    views = read_jsonl(run / "views.jsonl")
    first = {r: min(v["t"] for v in views if v["rank"] == r) for r in range(n)}
    assert set(first) == set(range(n))
    # signed at t=5; complete within a few more rounds of its own, however the exchanges fall (timing: 15 in most
    # runs, 20 in one of three fresh-clone CI runs on this 2-core machine)
    assert max(first.values()) <= 25
    assert s["view_agreement"]["views"] == len(views) and s["view_agreement"]["final_mean_ari_vs_rank0"] >= 0.9
    assert s["first_round_ari"] == 1.0  # rank 0's first view recovers the planted groups (nothing merged them)
    assert (run / "rounds" / "round_0000" / "Z.npy").exists()
    assert all(len(v["labels"]) == n for v in views)


def test_a_frozen_rank_is_skipped_within_the_timeout_and_named(tmp_path, tiny_config):
    """Rank 2 stops dead for 3.5 timeouts between two units (faults.stall: no polling, no answers): its partners
    give up after comm.timeout, say so, and go on; nobody waits for it beyond the timeouts.

    (A rank frozen *inside* an exchange, after its GO, leaves its partner in a blocking Sendrecv: that is the
    watchdog's, which aborts the job naming it, as under the virtual clock; docs/concepts/protocols.md.)
    """
    timeout = 2.0
    res = run_engine(4, tiny_config, tmp_path, "protocol=async", "strategy=gossip", f"comm.timeout={timeout}",
                     "train.budget=100000", "train.wall_budget=10", "merge.lam=1", "model.hidden=[64,64]",
                     "faults.stall_rank=2", "faults.stall_at=10", f"faults.stall_seconds={3.5 * timeout}",
                     timeout=300)
    assert f"rank 2 did not answer within comm.timeout={timeout:g}s; skipped" in res.stdout
    skipped = [m for m in read_jsonl(tmp_path / "tiny" / "merges.jsonl") if m["event"] == "timeout"]
    assert skipped and all(m["j"] == 2 for m in skipped)
    s = summary(tmp_path / "tiny")
    # the others trained on while rank 2 was frozen (after unit 10's training, before its row: rows 9 to 10)
    walls = {(m["rank"], m["t"]): m["wall"] for m in read_jsonl(tmp_path / "tiny" / "metrics.jsonl")}
    frozen_from, frozen_to = walls[(2, 9)], walls[(2, 10)]
    assert frozen_to - frozen_from >= 3.5 * timeout
    for r in (0, 1, 3):
        assert sum(frozen_from < w < frozen_to for (rank, _), w in walls.items() if rank == r) > 0, r
    assert max(s["time_split_per_rank"]["wall"]) < 10 + 3.5 * timeout + 30


def test_async_stragglers_do_not_hold_back_the_fast_ranks(runs):
    """One rank 4x slower: under async the others train on (more units, less idle), unlike the virtual clock."""
    vc, asy = summary(runs["slow_vc"]), summary(runs["slow_async"])
    fast = [1, 2, 3]
    units, vc_units = asy["units_per_rank"], vc["units_per_rank"]
    idle, wall = asy["time_split_per_rank"]["idle"], asy["time_split_per_rank"]["wall"]
    vc_idle, vc_wall = vc["time_split_per_rank"]["idle"], vc["time_split_per_rank"]["wall"]
    # In the same 6 s the fast ranks train further than the slow one and than under the virtual clock, where
    # every rank keeps the slow rank's pace, and wait less. Not 4x and not without waiting: an exchange waits for
    # the partner's next batch boundary, which costs milliseconds against this tiny model's 3 ms units, and 4
    # ranks share 2 cores (docs/results/stragglers.md measures it on real workloads). Measured:
    # in CI, fast ranks >= 2x the slow rank's units, idle 0.40 against the virtual clock's 0.73; here under a
    # load average of 45, fast/slow 1.7, fast/virtual-clock 1.3, idle 0.33 against 0.64; here quiet, fast/slow
    # 2.6, fast/virtual-clock 1.23, idle 0.59 against 0.65.
    assert min(units[r] for r in fast) >= 1.4 * units[0]
    assert min(units[r] for r in fast) >= 1.1 * max(vc_units)
    assert np.mean([idle[r] / wall[r] for r in fast]) < np.mean([vc_idle[r] / vc_wall[r] for r in fast])


def test_done_ranks_train_on_until_the_slow_rank_finishes_its_budget(runs):
    """train.after_budget train: a fast rank done with its 30 units trains on (and merges) instead of waiting,
    until the slow rank is done; with serve it waits, its units exactly the budget."""
    serve, on = summary(runs["serve"]), summary(runs["train_on"])
    fast = [1, 2, 3]
    assert serve["units_per_rank"] == [30] * 4
    units = on["units_per_rank"]
    assert units[0] >= 30 and min(units[r] for r in fast) > max(30, units[0])
    rows = read_jsonl(runs["train_on"] / "metrics.jsonl")
    assert {m["rank"] for m in rows if m["t"] > 30} >= set(fast)  # the rows past the budget are logged
    merges = read_jsonl(runs["train_on"] / "merges.jsonl")
    assert any(m["event"] == "merge" and m["t"] > 30 for m in merges)  # ... and so are their merges

    def idle_share(s):
        split = s["time_split_per_rank"]
        return np.mean([split["idle"][r] / split["wall"][r] for r in fast])

    # Measured here (4 ranks on 2 cores, beside a CI run): serve 0.70 idle, train on 0.37; with other jobs on the
    # cores, serve 0.55 and train on 0.42 once. Training on instead of waiting must leave the fast ranks less idle
    assert idle_share(on) < idle_share(serve)
    assert np.isfinite(on["consensus_test_acc"])


def test_posted_exchanges_keep_the_fast_ranks_training(runs):
    """One rank 4x slower, done ranks training on: with posted exchanges a fast rank never waits for the slow
    rank's batch boundary, so it idles less than with blocking exchanges and trains more units."""
    blocking, posted = summary(runs["train_on"]), summary(runs["train_on_posted"])
    fast = [1, 2, 3]

    def idle_share(s):
        split = s["time_split_per_rank"]
        return np.mean([split["idle"][r] / split["wall"][r] for r in fast])

    # Measured here (4 ranks on 2 cores, beside a CI run): blocking 0.37, posted 0.01.
    assert idle_share(posted) < idle_share(blocking)
    assert posted["merges"] > 0 and np.isfinite(posted["consensus_test_acc"])
    assert min(posted["units_per_rank"][r] for r in fast) > 30


@pytest.mark.parametrize("how", ["signal", "stopfile"])
def test_an_async_stop_checkpoints_after_draining_and_resume_finishes(tmp_path, tiny_config, how):
    """A stop asked on one rank (SIGUSR1) or by RUN_DIR/STOP reaches every rank as a message: all drain, one
    checkpoint, exit 75; --resume continues to the budget (correct, not bitwise: who meets whom is timing)."""
    import os
    import signal

    from tests.helpers.mpi import finish, start, wait_for

    run = tmp_path / "tiny"
    budget = ["train.budget=400", "strategy=gossip", "merge.lam=2"]
    proc = start(4, tiny_config, tmp_path, *ASYNC, *budget)
    wait_for(run / "rounds" / "round_0001", proc)
    if how == "signal":
        ranks = jobs.job_ranks(proc.pid)  # found by their environment
        assert ranks, "no rank processes found"
        os.kill(ranks[max(ranks)], signal.SIGUSR1)  # one rank only: every rank must stop
    else:
        (run / "STOP").touch()
    code, out, err = finish(proc)
    assert code == 75, err[-3000:]
    assert "checkpoint written" in out and not (run / "summary.json").exists()
    units_at_stop = [json.loads(line)["t"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(units_at_stop) < 400
    res = run_engine(4, tiny_config, tmp_path, *ASYNC, *budget, extra=["--resume"])
    assert "resuming" in res.stdout
    s = summary(run)
    assert s["protocol"] == "async" and s["units_per_rank"] == [400] * 4
    assert np.isfinite(s["consensus_test_acc"]) and s["consensus_test_acc"] > 0.7
