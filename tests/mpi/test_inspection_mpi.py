"""``communities inspect`` on a run of the real engine under mpiexec (the synthetic runs are in
tests/unit/test_inspection.py)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from communities.report.inspection import main_inspect  # noqa: E402
from tests.helpers.mpi import run_engine  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def test_inspect_a_run_of_the_real_engine(tmp_path, tiny_config, capsys):
    """Not synthetic: 4 ranks of ``communities run`` for 15 units (3 signature rounds), with example
    tracking on so summary.json has its nested ``examples`` table; every figure must exist and be linked.
    (The 4 ranks are 4 replicas on 2 MPI processes: placement changes no bit, and 2 start-ups cost less.)"""
    run_engine(2, tiny_config, tmp_path, "world_size=4", "train.budget=15", "examples.track=true")
    run = tmp_path / "tiny"
    rounds = sorted(p.name for p in (run / "rounds").iterdir() if p.name.startswith("round_"))
    assert len(rounds) >= 2, rounds
    out = tmp_path / "report"
    assert main_inspect([str(run), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err, captured.err  # the engine's own files are consistent
    assert f"rounds: {len(rounds)} " in captured.out and "status complete" in captured.out
    stems = ["curves", "timeline", "merge_matrix"] + [f"dendrogram_{r}" for r in rounds]
    page = (out / "index.html").read_text()
    refs = set(re.findall(r'(?:src|href)="([^"]+)"', page))
    for stem in stems:
        for ext in ("png", "svg"):  # 4 ranks: every figure is small enough for an SVG copy
            name = f"{stem}.{ext}"
            assert _nonempty(out / name), name
            assert name in refs, name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _nonempty(out / "rounds.csv") and "rounds.csv" in refs
    for s in refs:
        assert (out / s).is_file(), s
    summary = json.loads((run / "summary.json").read_text())
    assert "examples" in summary and "data_bytes_mean" in page and "globally_hard" in page
