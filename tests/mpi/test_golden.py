"""Bitwise neutrality: fixed runs must give the consensus weights recorded in tests/helpers/golden.json.

The table was recorded before the parts redesign (issue 11) and is re-recorded
only by a deliberate change of what the engine computes
(``python tests/helpers/golden_runs.py --record tests/helpers/golden.json``).
CI checks the quickstart and the short runs of every optional path; ``make golden``
checks all of them (every strategy on the quickstart, mnist1d seed 0), each as its own job.
Here every CI entry runs as a population: its replicas (``world_size``) on 2 MPI processes, all
entries in one batch (one mpiexec, tests/helpers/batch.py: the same command-line entry, one
start-up). Placement must not change a bit (DESIGN.md, "Populations"), so the table recorded
with one process per replica holds; the quickstart also runs on 8 processes (one per replica)
and on 1, and all three give the table's consensus.pt.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from communities import config
from tests.helpers import golden_runs
from tests.helpers.mpi import ROOT, Job, run_batch

TABLE = Path(golden_runs.__file__).with_name("golden.json")
CI_RUNS = ["quickstart", "short_examples", "short_cka", "short_swap", "short_overlap_hier", "short_robust_hostile",
           "short_clock_outer", "short_ema_steps"]

pytestmark = pytest.mark.timeout(1800)
# what a run adds that does not change its weights: the quickstart also writes its TensorBoard events
WATCHED = {"quickstart": ["logging.tensorboard=true"]}


PROCESSES = 2  # the MPI processes of the CI batch; every CI entry's world size is a multiple
PLACEMENTS = (8, 1)  # the quickstart's other placements (its 8 replicas on 8 processes, on 1)


def job(name: str, root: Path) -> Job:
    """Golden entry ``name`` as a batch job under ``root``, its world size pinned (a population where the batch
    has fewer processes)."""
    n, config, _ = golden_runs.RUNS[name]
    return Job(ROOT / config, root, [*golden_runs.job_overrides(name), f"world_size={n}", *WATCHED.get(name, [])],
               ["--overwrite"])


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """Every CI golden run, all on PROCESSES processes in one batch: {name: (its run directory, its output)}."""
    root = tmp_path_factory.mktemp("golden")
    results = run_batch(PROCESSES, {name: job(name, root) for name in CI_RUNS}, timeout=1500,
                        env=golden_runs.KERNEL_ENV)
    return {name: (root / name, res) for name, res in results.items()}


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """The quickstart on each of PLACEMENTS processes, each its own small batch: {processes: run directory}."""
    done = {}
    for p in PLACEMENTS:
        root = tmp_path_factory.mktemp(f"golden_p{p}")
        run_batch(p, {"quickstart": job("quickstart", root)}, timeout=900, env=golden_runs.KERNEL_ENV)
        done[p] = root / "quickstart"
    return done


def table_or_skip() -> dict:
    """The golden table; skip where the pinned kernels compute other bits than the machine that recorded it."""
    table = json.loads(TABLE.read_text())
    here = golden_runs.kernel_fingerprint()
    if table["kernels"] != here:
        pytest.skip(f"the pinned kernels compute other bits here (calibration {here}; the table's {table['kernels']}, "
                    f"recorded on {table['fingerprint']})")
    return table


@pytest.mark.parametrize("name", CI_RUNS)
def test_golden_run_is_bitwise_unchanged(golden, name):
    table = table_or_skip()
    run_dir = golden[name][0]
    placement = json.loads((run_dir / "summary.json").read_text())["placement"]
    assert placement["processes"] == PROCESSES  # it did run as a population
    assert placement["replicas_per_process"] == golden_runs.RUNS[name][0] // PROCESSES
    got = golden_runs.record_of(run_dir)
    want = table["runs"][name]
    assert got == want, {k: (want[k], got.get(k)) for k in want if want[k] != got.get(k)}


def test_placement_does_not_change_the_quickstart(golden, placed):
    """The quickstart's 8 replicas on 8, 2 and 1 MPI processes: the same consensus.pt, byte for byte, and the
    golden table's."""
    runs = {PROCESSES: golden["quickstart"][0], **placed}
    sha = {p: golden_runs.record_of(run)["consensus_pt_sha256"] for p, run in sorted(runs.items())}
    assert len(set(sha.values())) == 1, sha
    for p, run in runs.items():
        placement = json.loads((run / "summary.json").read_text()).get("placement")
        assert (placement or {}).get("processes", 8) == p, (p, placement)  # one replica per process: no placement
    assert sha[1] == table_or_skip()["runs"]["quickstart"]["consensus_pt_sha256"]


def test_quickstart_meets_its_promises(golden):
    """The quickstart's claims (README, docs/getting-started/quickstart.md): consensus >= 0.95, first-round
    ARI >= 0.9, one community, dispersion < tol; with logging.tensorboard its event file holds the scalars
    docs/guides/tracking.md lists (read back with TensorBoard's reader)."""
    run_dir, res = golden["quickstart"]
    s = json.loads((run_dir / "summary.json").read_text())
    check_tensorboard(run_dir, s)
    # the printed summary ends with the wall split, a partition of the loop's time (docs/getting-started/quickstart.md);
    # a population (the batch runs on 2 processes) prints each process's split, then a replica's mean, with turn
    split = r"train [\d.]+s \(\d+%\) / exchange .* / other [\d.]+s \(\d+%\)"
    assert re.search(r"(wall time +[\d.]+s:|per replica \(mean\)) +" + split, res.stdout), res.stdout[-1500:]
    assert s["consensus_test_acc"] >= 0.95
    assert s["first_round_ari"] >= 0.9
    assert s["communities_per_round"][-1] == 1
    assert s["final_dispersion"] < config.load(ROOT / "configs/quickstart.yaml").consensus.tol


def check_tensorboard(run: Path, summary: dict) -> None:
    """The quickstart's event file, as TensorBoard reads it: every listed scalar, at the units it belongs to."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    scalars = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    rounds = [json.loads(p.read_text()) for p in sorted((run / "rounds").glob("round_*/round.json"))]
    assert [int(v) for v in scalars["communities/count"].values()] == summary["communities_per_round"]
    assert sorted(scalars["communities/p_cross"]) == [r["t"] for r in rounds]
    assert scalars["communities/dispersion"][summary["units"]] == pytest.approx(summary["final_dispersion"])
    consensus = [json.loads(line) for line in (run / "consensus.jsonl").read_text().splitlines()]
    assert scalars["accuracy/consensus_test"] == pytest.approx({c["t"]: c["test_acc"] for c in consensus})
    assert "loss/consensus_test" in scalars and "loss/rank_train_mean" in scalars
    t_end, evaluated = summary["units"], max(scalars["accuracy/rank_test_max"])  # the ranks' last evaluation
    assert scalars["accuracy/rank_test_max"][evaluated] == pytest.approx(summary["best_rank_acc"])
    assert scalars["final/consensus_test_acc"][t_end] == pytest.approx(summary["consensus_test_acc"])
    assert scalars["bytes/sent_per_rank_mean_mb"][t_end] > 0
    for category, seconds in summary["time_split"].items():  # the wall split
        assert scalars[f"time/{category}_s"][t_end] == pytest.approx(seconds)
    assert len(acc.Images("dendrogram")) == summary["rounds"]  # one dendrogram per round
