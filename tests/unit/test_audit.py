"""``report.audit``, the chaos soak's verdict on a run directory, and the soak's way of finding ranks to kill."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from communities.report.audit import audit
from communities.tools.jobs import job_ranks
from communities.tools.synthetic import make_run


@pytest.fixture
def run(tmp_path) -> Path:
    return make_run(tmp_path / "run", n_ranks=4, n_rounds=3)


def test_a_complete_run_directory_is_intact(run):
    assert audit(run) == []


def _rewrite(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("damage, expected", [
    (lambda r: (r / ".metrics.jsonl.x1.tmp").write_text(""), "a temporary left behind"),
    (lambda r: (r / "checkpoints" / "u00000010").mkdir(parents=True), "never committed"),
    (lambda r: (r / "rounds" / ".round_0009.abc").mkdir(), "a round never committed"),
    (lambda r: (r / "merges.jsonl").write_text((r / "merges.jsonl").read_text() + '{"t": 1'), "last line is torn"),
    (lambda r: _rewrite(r / "metrics.jsonl", [m for m in map(json.loads, (r / "metrics.jsonl").read_text()
                                                             .splitlines()) if (m["t"], m["rank"]) != (3, 2)]),
     "rank 2's units are not 1.."),
    (lambda r: _rewrite(r / "metrics.jsonl", list(map(json.loads, (r / "metrics.jsonl").read_text().splitlines()))
                        + [json.loads((r / "metrics.jsonl").read_text().splitlines()[0])]), "twice"),
    (lambda r: (r / "meta.json").write_text(json.dumps({**json.loads((r / "meta.json").read_text()),
                                                        "status": "running"})), "not 'complete'"),
    (lambda r: (r / "summary.json").unlink(), "summary.json: missing"),
])
def test_each_kind_of_damage_is_named(run, damage, expected):
    damage(run)
    problems = audit(run)
    assert len(problems) == 1 and expected in problems[0], problems


def test_a_product_that_differs_from_its_digest_is_named(run):
    from communities.manifest import entry

    data = b"weights"
    (run / "consensus.pt").write_bytes(data)
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "files": {"consensus.pt": entry(data)}}))
    assert audit(run) == []
    (run / "consensus.pt").write_bytes(b"weightz")
    [problem] = audit(run)
    assert "consensus.pt" in problem and "damaged" in problem


def test_the_killer_finds_ranks_by_their_environment_only():
    """jobs.job_ranks: descendants of the launcher that are python processes carrying an MPI rank variable."""
    code = "import time; time.sleep(30)"
    env = {**os.environ}
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**env, "OMPI_COMM_WORLD_RANK": "3"}),
             subprocess.Popen([sys.executable, "-c", code], env={**env, "PMI_RANK": "5"}),
             subprocess.Popen([sys.executable, "-c", code], env={k: v for k, v in env.items()
                                                                 if k not in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK",
                                                                              "PMI_RANK")})]
    try:
        deadline = time.monotonic() + 10
        found = {}
        while time.monotonic() < deadline and len(found) < 2:
            found = job_ranks(os.getpid())
            time.sleep(0.05)
        assert found == {3: procs[0].pid, 5: procs[1].pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()
