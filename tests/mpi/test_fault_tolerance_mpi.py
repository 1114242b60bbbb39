"""Surviving lost ranks (``comm.fault_tolerance: shrink``) under Open MPI 5 with ULFM (.venv-ompi).

Every lost rank here is a process that receives SIGKILL (``faults.kill``: the rank sends it to itself at a
chosen point, so the test knows where it dies): no handler runs, nothing is flushed, MPI is not finalised.
The survivors must notice (Open MPI's runtime reports the dead process), shrink, roll back to the last
signature round and go on to a consensus, exit 0, and leave a run directory that says who was lost and when.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from communities.tools import jobs
from tests.helpers.mpi import LAUNCHER_HUNG, ROOT, consensus_weights, finish, initial_weights, mpi_env, run_engine
from tests.helpers.openmpi import ompi_command, run_engine_ompi

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
SHRINK = "comm.fault_tolerance=shrink"
WRITER_CASES = ("train", "exchange", "checkpoint")
ASYNC = ["protocol=async", "comm.timeout=20"]
LR0 = ["strategy=gossip", "train.lr=0", "train.momentum=0", "model.init=per_rank", "merge.lam=1", "train.budget=40"]
# exit 0, or prterun outlived its ranks and was killed (tests/helpers/mpi.py, communicate): the directory says the rest
ENDED = (0, LAUNCHER_HUNG)
KILLED = re.compile(r"rank (\d+) sends itself SIGKILL at t=(\d+) \((\w+); wall ([\d.]+)\)")


def _run(tmp_path: Path, name: str, *overrides, n: int = 8) -> subprocess.CompletedProcess:
    """One job under ULFM; it must end with a summary (prterun's own exit status is 0 even when a rank died)."""
    res = run_engine_ompi(n, QUICKSTART, tmp_path, f"name={name}", SHRINK, *overrides, ulfm=True, timeout=420,
                          check=False)
    done = (tmp_path / name / "summary.json").exists()
    assert res.returncode in ENDED and done, \
        f"{name} exited {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    return res


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def _merges(run: Path) -> list:
    return [json.loads(line) for line in (run / "merges.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The quickstart on 8 ranks under ULFM: clean, and with ranks SIGKILLed at different points."""
    root = tmp_path_factory.mktemp("ft")
    # the reference: the same 8 replicas on 2 processes (placement changes no bit under the virtual clock, replicas
    # trained one after another: its consensus.pt is the 8-process run's, at a quarter of the processes to start)
    out = {"clean": _run(root, "clean", "world_size=8", "train.vectorize=off", n=2)}
    out["train"] = _run(root, "train", "faults.kill={3: 12}", "faults.kill_in=train")
    out["exchange"] = _run(root, "exchange", "faults.kill={3: 12}", "faults.kill_in=exchange")
    out["round"] = _run(root, "round", "faults.kill={5: 15}", "faults.kill_in=round")
    out["two"] = _run(root, "two", "faults.kill={2: 8, 6: 33}", "faults.kill_in=train", "comm.lost_shard=adopt")
    for where in WRITER_CASES:  # the writer itself: rank 0 (checkpoints every 5 units: the third case dies in one),
        # its shard adopted by rank 1 (dropped, its half of group 0's data is gone: 0.960 against 0.976 clean)
        out[f"writer_{where}"] = _run(root, f"writer_{where}", "faults.kill={0: 12}", f"faults.kill_in={where}",
                                      "checkpoint.every=5", "comm.lost_shard=adopt")
    # a population, 8 replicas on 4 processes: replica 1's death is its process's, replica 0 (the writer) with it
    out["population"] = _run(root, "population", "faults.kill={1: 12}", "comm.lost_shard=adopt", n=4)
    out["async_clean"] = _run(root, "async_clean", *ASYNC)
    out["async_writer"] = _run(root, "async_writer", *ASYNC, "faults.kill={0: 12}", "faults.kill_in=exchange")
    # rank 3 dies in its very first exchange (0: a rank serves while it trains its first unit, logged at t=0)
    out["async_lr0"] = _run(root, "async_lr0", *ASYNC, *LR0, "faults.kill={3: 0}", "faults.kill_in=exchange")
    return root, out


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case, lost", [("train", [3]), ("exchange", [3]), ("round", [5])])
def test_one_rank_of_eight_killed_the_seven_reach_a_consensus(runs, case, lost):
    root, procs = runs
    run, clean = root / case, _summary(root / "clean")
    s = _summary(run)
    assert procs[case].returncode in ENDED
    assert KILLED.search(procs[case].stderr), "the rank did not kill itself"
    assert [e["rank"] for e in s["membership"]["lost"]] == lost
    assert s["membership"]["survivors"] == [r for r in range(8) if r not in lost]
    assert len(s["rank_test_acc"]) == 7 and s["world_size"] == 8
    # within 1 point of a clean 8-rank run of the quickstart
    assert s["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.01, (s["consensus_test_acc"], clean)
    assert s["consensus_reached_t"] is not None
    # the loss is on record, and no exchange involves the lost rank after the survivors went on
    merges = _merges(run)
    [gone] = [m for m in merges if m["event"] == "lost"]
    assert gone["i"] == lost[0]
    assert not [m for m in merges if m["event"] == "merge" and lost[0] in (m["i"], m["j"]) and m["t"] > gone["t"]]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(m["t"] for m in metrics if m["rank"] == lost[0]) == gone["t"]  # rows after the rollback: survivors'
    ts = [(m["t"], m["rank"]) for m in metrics]
    assert len(ts) == len(set(ts)), "a unit was logged twice after the rollback"
    info = json.loads((run / "rounds" / f"round_{s['rounds'] - 1:04d}" / "round.json").read_text())
    assert info["t"] > gone["t"]
    _intact(run)  # (the lost rank's units end where the survivors went on from; every other rank's run on)


@pytest.mark.timeout(1800)
def test_where_the_rank_dies_does_not_change_the_result(runs):
    """Killed after its training, inside an exchange, or at the next round: the survivors roll back to the same
    round (t=10) with the same membership, so they compute bitwise the same consensus."""
    root, _ = runs
    went_on_from = {case: _summary(root / case)["membership"]["recoveries"][0]["t"] for case in ("train", "exchange")}
    assert set(went_on_from.values()) == {10}
    a, b = ((root / case / "consensus.pt").read_bytes() for case in ("train", "exchange"))
    assert a == b


def _intact(run: Path) -> None:
    """A finished run directory as a clean run leaves it (``report.audit``: complete, every product and checkpoint
    matching its manifest, no temporaries, every unit of every rank logged once), and ``communities inspect``
    reads it (exit 0)."""
    from communities.cli import main
    from communities.report.audit import audit

    assert audit(run) == []
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):  # the command, in this process
        code = main(["inspect", str(run), "--out", str(run.parent / f"{run.name}_report"), "--last"])
    assert code == 0, err.getvalue()[-2000:]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("where", WRITER_CASES)
def test_the_writer_killed_the_lowest_survivor_takes_the_run_directory_over(runs, where):
    """Rank 0 holds the lock and writes every file. SIGKILLed after its training, inside an exchange, or inside a
    checkpoint (the rank files written, the commit not): rank 1 takes the lock over and writes from then on,
    the job exits 0, and the run directory is complete, intact and names both writers."""
    root, procs = runs
    run = root / f"writer_{where}"
    assert KILLED.search(procs[f"writer_{where}"].stderr).group(3) == where
    s = _summary(run)
    assert [e["rank"] for e in s["membership"]["lost"]] == [0]
    assert s["membership"]["survivors"] == list(range(1, 8)) and len(s["rank_test_acc"]) == 7
    assert s["membership"]["recoveries"][0]["writer"] == 1
    writers = json.loads((run / "meta.json").read_text())["writers"]
    assert [w["rank"] for w in writers] == [0, 1] and writers[0]["pid"] != writers[1]["pid"]
    assert s["membership"]["writers"] == writers
    clean = _summary(root / "clean")
    assert s["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.01, (s["consensus_test_acc"], clean)
    merges = _merges(run)
    assert s["merges"] == sum(1 for m in merges if m["event"] == "merge" and m["i"] == m["initiator"])
    [gone] = [m for m in merges if m["event"] == "lost"]
    assert gone["i"] == 0 and gone["t"] == 10
    _intact(run)


@pytest.mark.timeout(1800)
def test_where_the_writer_dies_does_not_change_the_result(runs):
    """Each of the three deaths rolls the survivors back to t=10 with rank 1 writing: the same bits."""
    root, _ = runs
    assert {_summary(root / f"writer_{w}")["membership"]["recoveries"][0]["t"] for w in WRITER_CASES} == {10}
    a, *rest = ((root / f"writer_{w}" / "consensus.pt").read_bytes() for w in WRITER_CASES)
    assert all(a == b for b in rest)


@pytest.mark.timeout(1800)
def test_a_population_loses_a_process_and_with_it_its_block_of_replicas(runs):
    """8 replicas on 4 processes. Replica 1 SIGKILLs its process, so replicas 0 and 1 are lost together, by the
    same recovery as a lost rank; replica 0 was the writer, so replica 2's process takes the run directory over;
    the two shards are adopted by replicas 2 and 5, and the 6 survivors reach a consensus within a point of a clean
    run."""
    root, procs = runs
    run = root / "population"
    assert KILLED.search(procs["population"].stderr).group(1) == "1"
    s = _summary(run)
    # (a block's shards go to survivors spread over the world: replica 2 and replica 5, on two processes)
    assert [(e["rank"], e["t"], e["adopted_by"]) for e in s["membership"]["lost"]] == [(0, 10, 2), (1, 10, 5)]
    assert s["membership"]["survivors"] == list(range(2, 8)) and len(s["membership"]["recoveries"]) == 1
    writers = json.loads((run / "meta.json").read_text())["writers"]
    assert [w["rank"] for w in writers] == [0, 2] and writers[0]["pid"] != writers[1]["pid"]
    assert s["placement"]["processes"] == 4 and len(s["placement"]["train_share_per_process"]) == 3
    clean = _summary(root / "clean")
    assert s["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.01, (s["consensus_test_acc"], clean)
    _intact(run)


@pytest.mark.timeout(1800)
def test_async_a_rank_killed_inside_its_first_exchange_the_survivors_mean_is_conserved(runs):
    """protocol async, lr 0: rank 3 dies inside its first exchange (after the header swap), before it merged with
    anyone. Its partner's half-received buffer is never merged, every other survivor's exchange cut by the revoke
    is settled, and the survivors' merges go on: the consensus is the mean of the 7 survivors' initial weights."""
    root, procs = runs
    run = root / "async_lr0"
    assert KILLED.search(procs["async_lr0"].stderr).group(3) == "exchange"
    s = _summary(run)
    assert [e["rank"] for e in s["membership"]["lost"]] == [3] and s["protocol"] == "async"
    inits = initial_weights(QUICKSTART, 8)
    survivors = torch.stack([w for r, w in enumerate(inits) if r != 3]).mean(0)
    final = consensus_weights(QUICKSTART, run)
    assert torch.allclose(final, survivors, atol=1e-5), float((final - survivors).abs().max())
    assert not torch.allclose(final, torch.stack(inits).mean(0), atol=1e-3)  # (the 8 ranks' mean is not it)
    merges = _merges(run)
    assert not [m for m in merges if m["event"] == "merge" and 3 in (m["i"], m["j"])]
    assert s["consensus_distance"] < 1e-3  # and gossip still drove the survivors to it
    _intact(run)


@pytest.mark.timeout(1800)
def test_async_the_writer_killed_inside_an_exchange(runs):
    """protocol async: rank 0 dies inside an exchange; the survivors settle and go on each from its own unit,
    rank 1 takes the run directory over, and the directory is complete and intact."""
    root, procs = runs
    run = root / "async_writer"
    s = _summary(run)
    assert [e["rank"] for e in s["membership"]["lost"]] == [0] and s["membership"]["survivors"] == list(range(1, 8))
    assert [w["rank"] for w in json.loads((run / "meta.json").read_text())["writers"]] == [0, 1]
    merges = _merges(run)  # the heir counts what its predecessor wrote too
    assert s["merges"] == sum(1 for m in merges if m["event"] == "merge" and m["i"] == m["initiator"])
    assert s["consensus_reached_t"] is not None
    # Async runs are not deterministic, and rank 0's shard is dropped (half of group 0's data). On one quiet
    # machine six clean runs gave 0.958-0.971 and six runs with this loss 0.940-0.971; one CI run gave 0.929
    # against a clean 0.969. Within 5 points: the survivors' consensus learned. The close comparison with a run
    # that lost nothing is the chaos soak's (communities bench chaos, 1 point), which reports it.
    clean = _summary(root / "async_clean")["consensus_test_acc"]
    assert s["consensus_test_acc"] >= clean - 0.05, (s["consensus_test_acc"], clean)
    _intact(run)


@pytest.mark.timeout(1800)
def test_two_ranks_killed_at_different_units_and_a_shard_adopted(runs):
    root, procs = runs
    s = _summary(root / "two")
    assert procs["two"].returncode in ENDED
    lost = {e["rank"]: e for e in s["membership"]["lost"]}
    assert sorted(lost) == [2, 6]
    assert lost[2]["t"] < lost[6]["t"]
    assert lost[2]["adopted_by"] == 3 and lost[6]["adopted_by"] == 7  # the next rank alive after each
    assert s["membership"]["survivors"] == [0, 1, 3, 4, 5, 7]
    assert len(s["membership"]["recoveries"]) == 2
    clean = _summary(root / "clean")
    assert s["consensus_test_acc"] >= clean["consensus_test_acc"] - 0.02
    # the heir trains on both shards: its units see more samples than a rank that adopted nothing
    metrics = [json.loads(x) for x in (root / "two" / "metrics.jsonl").read_text().splitlines()]
    last = {m["rank"]: m["samples"] for m in metrics if m["t"] == s["units"]}
    assert last[3] > 1.5 * last[1]


@pytest.mark.timeout(1800)
def test_recovery_time_and_throughput(runs):
    """The benchmark line: seconds from the SIGKILL to the survivors' next completed unit,
    and the survivors' units per second before and after (printed; the assertion is only that it recovered)."""
    root, procs = runs
    for case in ("train", "exchange", "round"):
        killed = float(KILLED.search(procs[case].stderr).group(4))
        rec = _summary(root / case)["membership"]["recoveries"][0]
        to_unit = rec["first_unit_wall"] - killed
        metrics = [json.loads(x) for x in (root / case / "metrics.jsonl").read_text().splitlines()]
        t0 = rec["t"]
        before, after = [], []
        for r in _summary(root / case)["membership"]["survivors"]:
            rows = sorted((m["t"], m["wall"]) for m in metrics if m["rank"] == r)
            wall = dict(rows)
            end = rows[-1][0]
            before.append(t0 / wall[t0])
            after.append((end - t0 - 1) / (wall[end] - wall[t0 + 1]))
        shrink = rec["recovered_wall"] - rec["detected_wall"]
        print(f"\nshrink {case}: kill -> next completed unit {to_unit:.2f}s (detected after "
              f"{rec['detected_wall'] - killed:.2f}s, shrink+rollback {shrink:.3f}s);"
              f" survivors {np.mean(before):.1f} units/s before, {np.mean(after):.1f} after")
        assert to_unit > 0


@pytest.mark.timeout(900)
def test_a_stop_after_the_writers_loss_checkpoints_and_the_survivors_resume(tmp_path):
    """Lose rank 0, the writer; then a STOP file, which the new writer (rank 1) sees: the 7 survivors checkpoint
    (their membership recorded) and exit 75. A resume must be launched with 7 ranks (8 are refused, naming why);
    its lead is logical rank 1, which takes the lock, continues, and ends with the loss and every writer on
    record."""
    run = tmp_path / "stop"
    # a budget of 40 units: the stop lands at t=15 (measured), and the resume trains 25 units, not 185 (96 -> 60 s)
    args = ["-m", "communities", "run", str(QUICKSTART), f"output.root={tmp_path}", "name=stop", SHRINK,
            "faults.kill={0: 12}", "faults.slow_max=0.15", "consensus.stop=false", "train.budget=40", "--no-progress"]
    proc = jobs.start(ompi_command(8, args, ulfm=True), cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        merges = run / "merges.jsonl"
        if merges.exists() and '"lost"' in merges.read_text():
            (run / "STOP").touch()
            break
        time.sleep(0.1)
    code, out, err = finish(proc, timeout=300, launcher_may_hang=True)
    assert code in (75, LAUNCHER_HUNG), (out[-2000:], err[-3000:])  # (75: the status below, "interrupted")
    [ckpt] = [d for d in (run / "checkpoints").glob("u*") if (d / "COMPLETE").exists()]
    info = json.loads((ckpt / "COMPLETE").read_text())
    assert info["alive"] == list(range(1, 8)) and [e["rank"] for e in info["lost"]] == [0]
    assert sorted(info["files"]) == [f"rank{r:05d}.pt" for r in info["alive"]]
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "interrupted" and [w["rank"] for w in meta["writers"]] == [0, 1]
    (run / "STOP").unlink(missing_ok=True)  # (the engine removes it once it has stopped)
    refused = run_engine_ompi(8, QUICKSTART, tmp_path, "name=stop", SHRINK, ulfm=True, check=False,
                              extra=["--resume"], timeout=300)
    assert refused.returncode in (2, LAUNCHER_HUNG) and "launch 7 ranks" in refused.stdout + refused.stderr
    done = run_engine_ompi(7, QUICKSTART, tmp_path, "name=stop", SHRINK, "faults.slow_max=0.15",
                           "consensus.stop=false", "train.budget=40", ulfm=True, extra=["--resume"], timeout=300)
    assert done.returncode in ENDED
    s = _summary(run)
    assert s["units"] == 40 > info["t"] and [e["rank"] for e in s["membership"]["lost"]] == [0]  # the budget
    assert s["membership"]["survivors"] == list(range(1, 8))
    assert len(s["rank_test_acc"]) == 7
    writers = json.loads((run / "meta.json").read_text())["writers"]
    assert [(w["rank"], w["why"].split()[0]) for w in writers] == [(0, "started"), (1, "writer"), (1, "resumed")]
    _intact(run)


@pytest.mark.timeout(300)
def test_shrink_is_refused_where_mpi_has_no_ulfm(tmp_path, tiny_config):
    """The mpich wheel has no working ULFM: exit 2 before anything trains, naming the key and the launch line."""
    res = run_engine(2, tiny_config, tmp_path, SHRINK, check=False)
    assert res.returncode == 2
    text = res.stdout + res.stderr
    assert "comm.fault_tolerance=shrink" in text and "ULFM" in text
    assert not (tmp_path / "tiny" / "metrics.jsonl").exists()
