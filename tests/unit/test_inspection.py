"""Tests for ``communities inspect`` (communities/report/: load.py, figures.py, html.py, inspection.py).

Why these: the inspection tool is what users run on a login node after a run, so
it must read exactly the results layout (synthetic runs written by
tests/helpers/synthetic_run.py through RunWriter), never pull in torch/mpi4py, agree with
scipy and scikit-learn on the numbers it reports, survive big trees and partial
runs, and turn damaged files into one-line messages with exit status 2.
A run of the real engine under mpiexec is inspected in tests/mpi/test_inspection_mpi.py.
"""
from __future__ import annotations

import csv
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from communities.report import figures, load  # noqa: E402
from communities.report.figures import plot_dendrogram  # noqa: E402
from communities.report.inspection import main_inspect  # noqa: E402
from communities.report.load import (  # noqa: E402
    compress_counts,
    load_view,
    merge_counts,
    select_rounds,
    stable_labels,
)
from tests.helpers.synthetic_run import make_run  # noqa: E402

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    """8 ranks, 4 planted groups, 6 rounds: 4 communities, then 2, then 1."""
    return make_run(tmp_path_factory.mktemp("runs") / "small", n_ranks=8, n_rounds=6, groups=4, seed=1)


def _copy(run: Path, tmp_path: Path, name: str = "run") -> Path:
    dst = tmp_path / name
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("report"))
    return dst


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


# --------------------------------------------------------------------------- the report


def test_single_run_writes_every_figure_and_the_report(small_run, tmp_path, capsys):
    out = tmp_path / "report"
    assert main_inspect([str(small_run), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    expected = ["index.html", "curves.png", "timeline.png", "merge_matrix.png", "rounds.csv"]
    expected += [f"dendrogram_round_{r:04d}.png" for r in range(6)]
    for name in expected:
        assert _nonempty(out / name), name
        if name.endswith(".png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
            assert _nonempty(out / name.replace(".png", ".svg")), name  # 8 ranks: SVGs are small
    summary = json.loads((small_run / "summary.json").read_text())
    assert f"communities per round: {compress_counts(summary['communities_per_round'])}" in stdout
    assert "status complete" in stdout
    assert f"consensus {summary['consensus_test_acc']:.3f}".rstrip("0") in stdout
    if summary["consensus_reached_t"] is not None:
        assert f"consensus reached at t={summary['consensus_reached_t']}" in stdout

    page = (out / "index.html").read_text()
    srcs = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert srcs and all(not s.startswith(("/", "http:", "https:", "file:")) for s in srcs)
    for s in srcs:
        assert (out / s).is_file(), s
    assert "<script" not in page
    assert "mean_rank_acc" in page  # the summary.json table
    assert "cophenetic" in page and "n_communities" in page  # the per-round table
    with open(out / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["round"]) for r in rows] == list(range(6))
    assert {"t", "n_communities", "dispersion", "cophenetic", "ari"} <= set(rows[0])


def test_default_report_location_and_no_svg(small_run, tmp_path, capsys):
    run = _copy(small_run, tmp_path)
    assert main_inspect([str(run), "--no-svg"]) == 0
    assert _nonempty(run / "report" / "index.html")
    assert not list((run / "report").glob("*.svg"))
    assert str(run / "report" / "index.html") in capsys.readouterr().out


def test_module_runs_without_torch_or_mpi4py(small_run, tmp_path):
    """The login-node promise: ``python -m communities.report.inspection`` never imports torch or mpi4py."""
    out = tmp_path / "rep"
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['communities.report.inspection', {str(small_run)!r}, '--out', {str(out)!r}, '--last']\n"
        "try:\n"
        "    runpy.run_module('communities.report.inspection', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "bad = [m for m in ('torch', 'mpi4py') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('CLEAN')\n"
    )
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr
    assert "CLEAN" in res.stdout
    assert _nonempty(out / "index.html")
    res = subprocess.run([sys.executable, "-c", "import sys, communities.report.inspection; "
                          "print([m for m in ('torch', 'mpi4py') if m in sys.modules])"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert res.stdout.strip() == "[]", res.stderr


# --------------------------------------------------------------------------- timeline label matching


def test_stable_labels_follow_splits_and_merges():
    rounds = [
        [0, 0, 0, 0, 1, 1, 1, 1, 2, 2],  # A={0..3} B={4..7} C={8,9}
        [5, 5, 5, 7, 3, 3, 3, 3, 9, 9],  # A splits: {0,1,2} keeps A, {3} is new (3); raw ids renamed
        [1, 1, 1, 0, 2, 2, 2, 2, 2, 2],  # B and C merge: B is the larger part and keeps its id
        [4, 4, 4, 4, 4, 4, 4, 4, 4, 4],  # everything merges into the largest overlap (B)
        [8, 8, 8, 8, 8, 6, 6, 6, 6, 6],  # an even split: the part with the lowest rank keeps the id
    ]
    expected = np.array([
        [0, 0, 0, 0, 1, 1, 1, 1, 2, 2],
        [0, 0, 0, 3, 1, 1, 1, 1, 2, 2],
        [0, 0, 0, 3, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 4, 4, 4, 4, 4],
    ])
    got = stable_labels([np.array(r) for r in rounds])
    assert got.shape == (5, 10)
    np.testing.assert_array_equal(got, expected)


def test_stable_labels_ties_and_invariance():
    # Two equal communities merge: the older (smaller) id survives, whichever ranks hold it.
    np.testing.assert_array_equal(stable_labels([[1, 1, 0, 0], [0, 0, 0, 0]]), [[0, 0, 1, 1], [0, 0, 0, 0]])
    # A community that vanished does not come back with its old id: ids are never reused.
    got = stable_labels([[0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(got[2], [0, 0, 2, 2])
    # Renaming the raw labels of any round changes nothing.
    rng = np.random.default_rng(0)
    seq = [rng.integers(0, k, 30) for k in (5, 4, 4, 3, 2, 1, 3)]
    base = stable_labels(seq)
    renamed = [(rng.permutation(10)[a] + 100) for a in seq]
    np.testing.assert_array_equal(stable_labels(renamed), base)
    # The ids kept from one round to the next are a matching of maximum total overlap.
    _assert_max_overlap(base)
    with pytest.raises(ValueError):
        stable_labels([[0, 1], [0, 1, 2]])
    assert stable_labels([]).shape == (0, 0)


def _overlap(prev: np.ndarray, cur: np.ndarray, p: int, c: int) -> int:
    return int(np.sum((prev == p) & (cur == c)))


def _assert_max_overlap(stable: np.ndarray) -> None:
    """Every round's kept ids (a current community carrying an id of the previous round) overlap, in
    total, as much as the best one-to-one matching of old ids to new communities, found by brute force."""
    for r in range(1, len(stable)):
        prev, cur = stable[r - 1], stable[r]
        old, new = list(np.unique(prev)), list(np.unique(cur))
        kept = sum(_overlap(prev, cur, c, c) for c in new if c in old)
        best = 0
        for k in range(min(len(old), len(new)) + 1):
            for olds in itertools.permutations(old, k):
                for news in itertools.combinations(new, k):
                    best = max(best, sum(_overlap(prev, cur, p, c) for p, c in zip(olds, news)))
        assert kept == best, (r, kept, best)


def _split_merge_sequence(rng, n: int, rounds: int) -> List[np.ndarray]:
    """Raw labels of a random history where each round splits one community or merges two, with the
    raw ids shuffled every round (so only the matching can keep track)."""
    part = np.zeros(n, dtype=np.int64)
    out = [part.copy()]
    for _ in range(rounds):
        ids = np.unique(part)
        if ids.size > 1 and (rng.random() < 0.5 or ids.size >= n // 2):
            a, b = rng.choice(ids, 2, replace=False)
            part[part == b] = a
        else:
            sizes = np.array([np.sum(part == i) for i in ids])
            if sizes.max() < 2:
                continue
            a = ids[int(np.argmax(sizes))] if rng.random() < 0.5 else rng.choice(ids[sizes >= 2])
            members = np.flatnonzero(part == a)
            cut = rng.integers(1, members.size)
            part[rng.permutation(members)[:cut]] = part.max() + 1
        out.append(rng.permutation(100)[part])
    return out


def test_stable_labels_keep_the_id_of_the_biggest_overlap():
    """A merge keeps the id of its largest part, a split gives the id to its largest piece (ties: the older
    id, the piece holding the lowest rank), and overall the kept ids maximise the total overlap."""
    rng = np.random.default_rng(7)
    checked = {"merge": 0, "split": 0}
    for trial in range(30):
        seq = _split_merge_sequence(rng, n=int(rng.integers(6, 16)), rounds=8)
        S = stable_labels(seq)
        _assert_max_overlap(S)
        for r in range(1, len(S)):
            prev, cur = S[r - 1], S[r]
            for c in np.unique(cur):
                parts = np.unique(prev[cur == c])
                if parts.size > 1 and all(np.all(cur[prev == p] == c) for p in parts):  # a pure merge
                    sizes = [np.sum(prev == p) for p in parts]
                    biggest = parts[int(np.argmax(sizes))]  # argmax: first, i.e. the smallest (older) id
                    assert c == biggest, (trial, r, dict(zip(parts.tolist(), sizes)), c)
                    checked["merge"] += 1
            for p in np.unique(prev):
                pieces = np.unique(cur[prev == p])
                if pieces.size > 1 and all(np.all(prev[cur == c] == p) for c in pieces):  # a pure split
                    sizes = np.array([np.sum(cur == c) for c in pieces])
                    big = pieces[sizes == sizes.max()]
                    # among equally big pieces, the one holding the lowest rank keeps the id
                    keeper = min(big, key=lambda c: int(np.flatnonzero(cur == c)[0]))
                    assert keeper == p and all(c != p for c in pieces if c != keeper), (trial, r, p, pieces)
                    checked["split"] += 1
    assert checked["merge"] > 20 and checked["split"] > 20, checked


# --------------------------------------------------------------------------- numbers vs scipy / sklearn


@pytest.mark.parametrize("method,metric", [("average", "cosine"), ("ward", "euclidean")])
def test_cophenetic_and_ari_equal_scipy_and_sklearn(tmp_path, method, metric):
    from scipy.cluster.hierarchy import cophenet
    from scipy.spatial.distance import pdist
    from sklearn.metrics import adjusted_rand_score

    run = make_run(tmp_path / "r", n_ranks=12, n_rounds=5, groups=4, method=method, metric=metric,
                   interleave=True, seed=3)
    view = load_view(run)
    groups = json.loads((run / "partition.json").read_text())["groups"]
    aris = []
    for k in range(5):
        d = run / "rounds" / f"round_{k:04d}"
        sig, Z, lab = (np.load(d / f) for f in ("signatures.npy", "Z.npy", "labels.npy"))
        assert view.cophenetic[k] == pytest.approx(cophenet(Z, pdist(sig, metric))[0], abs=1e-12)
        assert view.ari[k] == pytest.approx(adjusted_rand_score(groups, lab), abs=1e-12)
        aris.append(view.ari[k])
    assert aris[0] == pytest.approx(1.0) and min(aris) < 0.5  # the numbers are not all trivial
    assert load.cophenetic_correlation(Z, sig, metric) == pytest.approx(cophenet(Z, pdist(sig, metric))[0])
    assert load.adjusted_rand(lab, None) is None


# --------------------------------------------------------------------------- big trees


def _chain_linkage(n: int) -> np.ndarray:
    """The deepest possible tree: leaf k joins everything before it (depth n - 1)."""
    Z = np.zeros((n - 1, 4))
    for k in range(n - 1):
        Z[k] = [0 if k == 0 else n + k - 1, k + 1, k + 1.0, k + 2]
    return Z


def test_dendrogram_of_2048_leaves_never_hits_the_recursion_limit():
    from matplotlib.figure import Figure
    from scipy.cluster.hierarchy import dendrogram, is_valid_linkage

    Z = _chain_linkage(2048)
    assert is_valid_linkage(Z)
    limit = sys.getrecursionlimit()
    if limit < 2048:  # the hazard is real: plain scipy cannot walk this tree
        with pytest.raises(RecursionError):
            dendrogram(Z, no_plot=True)
    groups = np.arange(2048) % 4
    ax = Figure().add_subplot()
    R = plot_dendrogram(ax, Z, groups=groups, cut_height=100.0)  # default: truncated
    assert len(R["ivl"]) == figures.TRUNCATE_P
    ax = Figure().add_subplot()
    R = plot_dendrogram(ax, Z, groups=groups, max_leaves=None)  # full tree, 2048 leaves
    assert len(R["ivl"]) == 2048
    assert sys.getrecursionlimit() == limit


@pytest.mark.parametrize("n", [512, 2048])
def test_inspect_many_ranks_truncates(tmp_path, n, capsys):
    run = make_run(tmp_path / f"r{n}", n_ranks=n, n_rounds=2, groups=4, dim=8, every=1, seed=5)
    assert main_inspect([str(run)]) == 0
    rep = run / "report"
    for name in ("index.html", "curves.png", "timeline.png", "merge_matrix.png",
                 "dendrogram_round_0000.png", "dendrogram_round_0001.png"):
        assert _nonempty(rep / name), name
    assert not (rep / "dendrogram_round_0000.svg").exists()  # > 128 leaves: PNG only
    # The merge matrix of a population is community x community: a few cells, so its SVG stays small.
    assert (rep / "merge_matrix.svg").stat().st_size < 200_000
    assert f"{n} ranks" in capsys.readouterr().out


# --------------------------------------------------------------------------- partial and damaged runs


def test_partial_run_is_inspectable_up_to_its_last_complete_round(tmp_path, capsys):
    run = make_run(tmp_path / "crashed", n_ranks=8, n_rounds=5, groups=4, partial=True, seed=2)
    assert not (run / "summary.json").exists()
    assert json.loads((run / "meta.json").read_text())["status"] == "running"
    assert list((run / "rounds").glob(".round_*"))  # the half-built hidden round is there
    assert main_inspect([str(run)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert ".round_" not in captured.err and "warning" not in captured.err  # a round being built is no damage
    assert "status running" in out and "partial run" in out
    assert "read up to round 4, t=25" in out
    assert "rounds: 5 " in out
    assert "consensus: unknown" in out
    assert "last evaluations" in out
    rep = run / "report"
    assert _nonempty(rep / "index.html") and _nonempty(rep / "dendrogram_round_0004.png")
    assert not (rep / "dendrogram_round_0005.png").exists()
    view = load_view(run)
    assert 999 not in view.metric_t  # the torn line was dropped


@pytest.mark.parametrize("damage", ['{"t": 25}', "[1, 2]", "{oops"])
def test_partial_run_with_a_damaged_last_round_is_read_up_to_the_round_before(tmp_path, capsys, damage):
    """Issue 3: a run that did not finish stays inspectable; its damaged last round is the crash's tail."""
    run = make_run(tmp_path / "crashed", n_ranks=8, n_rounds=5, groups=4, partial=True, seed=2)
    bad = run / "rounds" / "round_0004" / "round.json"
    bad.write_text(damage)
    assert main_inspect([str(run), "--no-svg"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    warning = [line for line in captured.err.splitlines() if "round_0004" in line]
    assert len(warning) == 1 and str(bad) in warning[0] and warning[0].startswith("warning:"), captured.err
    assert "read up to round 3, t=20" in captured.out and "rounds: 4 " in captured.out
    rep = run / "report"
    assert _nonempty(rep / "dendrogram_round_0003.png") and not (rep / "dendrogram_round_0004.png").exists()
    assert str(bad) in (rep / "index.html").read_text()
    # Damage before the last round is damage, partial run or not.
    (run / "rounds" / "round_0002" / "round.json").write_text(damage)
    assert main_inspect([str(run), "--no-svg"]) == 2
    err = _one_line_error(capsys)
    assert "round_0002/round.json" in err


@pytest.mark.parametrize("missing", ["labels.npy", "round.json", "Z.npy"])
def test_round_directory_with_a_missing_file_is_named_and_the_others_are_read(small_run, tmp_path, capsys, missing):
    """Rounds are renamed into place whole, so a missing file is damage: a warning names it, the rest is read."""
    run = _copy(small_run, tmp_path)
    gone = run / "rounds" / "round_0002" / missing
    gone.unlink()
    out = tmp_path / "rep"
    assert main_inspect([str(run), "--out", str(out), "--no-svg"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and str(gone) in lines[0] and "missing" in lines[0], captured.err
    assert "rounds: 5 " in captured.out
    with open(out / "rounds.csv") as fh:
        assert [int(r["round"]) for r in csv.DictReader(fh)] == [0, 1, 3, 4, 5]
    assert sorted(p.name for p in out.glob("dendrogram_round_*.png")) == [
        f"dendrogram_round_{r:04d}.png" for r in (0, 1, 3, 4, 5)]
    assert str(gone) in (out / "index.html").read_text()
    view = load_view(run)
    assert list(view.round_idx) == [0, 1, 3, 4, 5] and any(str(gone) in n for n in view.notes)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert err.count("\n") == 0, err
    return err


def _write_npy(path: Path, arr) -> None:
    with open(path, "wb") as fh:
        np.save(fh, np.asarray(arr))


DAMAGE = {
    "Z.npy garbage": ("rounds/round_0002/Z.npy", lambda p: p.write_bytes(b"not a numpy file at all")),
    "Z.npy truncated header": ("rounds/round_0002/Z.npy", lambda p: p.write_bytes(p.read_bytes()[:100])),
    "Z.npy truncated data": ("rounds/round_0002/Z.npy", lambda p: p.write_bytes(p.read_bytes()[:-8])),
    "labels.npy empty": ("rounds/round_0004/labels.npy", lambda p: p.write_bytes(b"")),
    "Z.npy wrong shape": ("rounds/round_0002/Z.npy", lambda p: _write_npy(p, np.zeros((3, 4)))),
    "Z.npy not a linkage": ("rounds/round_0002/Z.npy", lambda p: _write_npy(p, -np.ones((7, 4)))),
    "signatures.npy truncated": ("rounds/round_0001/signatures.npy", lambda p: p.write_bytes(p.read_bytes()[:90])),
    "labels.npy wrong length": ("rounds/round_0000/labels.npy", lambda p: _write_npy(p, np.zeros(5, np.int64))),
    "round.json garbage": ("rounds/round_0003/round.json", lambda p: p.write_text("{oops")),
    "round.json no t": ("rounds/round_0003/round.json", lambda p: p.write_text('{"round": 3}')),
    "round.json no round": ("rounds/round_0003/round.json", lambda p: p.write_text('{"t": 5}')),
    "round.json a list": ("rounds/round_0003/round.json", lambda p: p.write_text("[1, 2]")),
    "round.json t a string": ("rounds/round_0003/round.json", lambda p: p.write_text('{"round": 3, "t": "x"}')),
    # a complete run's last round is no crash tail: damage there is an error too
    "round.json last round a list": ("rounds/round_0005/round.json", lambda p: p.write_text("[1, 2]")),
    "meta.json garbage": ("meta.json", lambda p: p.write_text("{not json")),
    "meta.json no world_size": ("meta.json", lambda p: p.write_text('{"status": "complete"}')),
    "meta.json a list": ("meta.json", lambda p: p.write_text("[1, 2]")),
    "meta.json missing": ("meta.json", lambda p: p.unlink()),
    "config.yaml missing": ("config.yaml", lambda p: p.unlink()),
    "summary.json garbage": ("summary.json", lambda p: p.write_text('{"name": ')),
    "partition.json wrong groups": ("partition.json", lambda p: p.write_text('{"groups": [0, 1]}')),
    "metrics.jsonl damaged line": ("metrics.jsonl", lambda p: p.write_text("{bad\n" + p.read_text())),
    "metrics.jsonl no rank": ("metrics.jsonl", lambda p: p.write_text('{"t": 1}\n' + p.read_text())),
    "merges.jsonl no i": ("merges.jsonl", lambda p: p.write_text('{"t": 1, "j": 2}\n' + p.read_text())),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_file_gives_one_line_naming_it_and_exit_2(small_run, tmp_path, capsys, case):
    rel, damage = DAMAGE[case]
    run = _copy(small_run, tmp_path)
    damage(run / rel)
    assert main_inspect([str(run)]) == 2
    err = _one_line_error(capsys)
    assert rel.split("/")[-1] in err, err
    assert "pickle" not in err  # np.load's guess for non-.npy bytes is not the problem
    if "/" in rel:
        assert rel.split("/")[1] in err, err  # the round directory is named too


def test_missing_run_dir_and_bad_arguments(small_run, tmp_path, capsys):
    assert main_inspect([str(tmp_path / "nope")]) == 2
    assert "nope" in _one_line_error(capsys)
    assert main_inspect([str(small_run), "--round", "99", "--out", str(tmp_path / "x")]) == 2
    assert "--round 99" in _one_line_error(capsys)
    assert main_inspect([str(small_run), "--every", "0"]) == 2
    capsys.readouterr()
    assert main_inspect(["--help"]) == 0
    assert "--every" in capsys.readouterr().out


def test_run_without_rounds(small_run, tmp_path, capsys):
    """A strategy that never clusters (or a run killed before its first round) still gets curves."""
    run = _copy(small_run, tmp_path)
    for d in (run / "rounds").iterdir():
        shutil.rmtree(d)
    assert main_inspect([str(run)]) == 0
    assert "rounds: 0" in capsys.readouterr().out
    assert _nonempty(run / "report" / "curves.png") and _nonempty(run / "report" / "merge_matrix.png")


def test_world_of_one(tmp_path, capsys):
    """One rank: the engine saves an empty (0, 4) tree; the report has curves but no dendrogram."""
    run = make_run(tmp_path / "one", n_ranks=1, n_rounds=3, groups=None)
    assert np.load(run / "rounds" / "round_0000" / "Z.npy").shape == (0, 4)
    assert main_inspect([str(run), "--no-svg"]) == 0
    assert "communities per round: 1x3" in capsys.readouterr().out
    assert _nonempty(run / "report" / "curves.png") and _nonempty(run / "report" / "timeline.png")
    assert not list((run / "report").glob("dendrogram_*"))


# --------------------------------------------------------------------------- liveness and checksums


def _lock_of(run: Path, pid: int, age_s: float = 0.0, host: str = "") -> None:
    """The lock file a run's rank 0 leaves when it is killed: it names the holder, nobody holds it."""
    import socket
    import time

    lock = run / ".lock"
    lock.write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid,
                                "start": "2026-01-01T00:00:00+00:00"}))
    os.utime(lock, (time.time() - age_s, time.time() - age_s))


def test_a_killed_run_that_still_says_running_is_read_as_interrupted(tmp_path, capsys):
    run = make_run(tmp_path / "killed", n_ranks=4, n_rounds=3, groups=2, partial=True, seed=2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock_of(run, dead.pid)  # its pid is gone on this host
    assert main_inspect([str(run), "--no-svg"]) == 0
    captured = capsys.readouterr()
    assert "status interrupted" in captured.out
    assert "says 'running', but its process is gone" in captured.err and f"pid {dead.pid}" in captured.err
    _lock_of(run, 12345, age_s=3600, host="node-elsewhere")  # a pid this host cannot check: the heartbeat decides
    view = load_view(run)
    assert view.status == "interrupted" and "heartbeat was 60 min ago" in " ".join(view.notes)
    _lock_of(run, 12345, age_s=5, host="node-elsewhere")  # fresh: it may run where this host cannot see its lock
    assert load_view(run).status == "running"


def test_a_run_whose_lock_is_held_is_running(tmp_path):
    from communities.runlock import RunLock

    run = make_run(tmp_path / "live", n_ranks=4, n_rounds=3, groups=2, partial=True, seed=2)
    lock = RunLock(run)
    lock.acquire()
    try:
        os.utime(run / ".lock", (0, 0))  # even with an old heartbeat: the lock is held
        assert load_view(run).status == "running"
    finally:
        lock.release()


def test_a_damaged_consensus_model_is_named_and_exit_2(small_run, tmp_path, capsys):
    from communities import manifest

    run = _copy(small_run, tmp_path)
    payload = bytes(range(256)) * 8
    (run / "consensus.pt").write_bytes(payload)
    meta = json.loads((run / "meta.json").read_text())
    meta["files"] = {"consensus.pt": manifest.entry(payload)}
    (run / "meta.json").write_text(json.dumps(meta))
    assert main_inspect([str(run), "--no-svg"]) == 0
    capsys.readouterr()
    damaged = bytearray(payload)
    damaged[1000] ^= 1
    (run / "consensus.pt").write_bytes(bytes(damaged))
    assert main_inspect([str(run), "--no-svg"]) == 2
    err = _one_line_error(capsys)
    assert "consensus.pt: damaged" in err and "BLAKE2b digest differs" in err and "meta.json" in err


def test_a_damaged_checkpoint_is_warned_with_what_a_resume_would_do(small_run, tmp_path, capsys):
    from communities import manifest

    run = _copy(small_run, tmp_path)
    for t in (10, 20):
        d = run / "checkpoints" / f"u{t:08d}"
        d.mkdir(parents=True)
        data = f"rank file at {t}".encode() * 10
        (d / "rank00000.pt").write_bytes(data)
        (d / "COMPLETE").write_text(json.dumps({"t": t, "files": {"rank00000.pt": manifest.entry(data)}}))
    victim = run / "checkpoints" / "u00000020" / "rank00000.pt"
    victim.write_bytes(victim.read_bytes()[:7])
    assert main_inspect([str(run), "--no-svg"]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint u00000020 is damaged: {victim}: damaged checkpoint file (7 bytes, the manifest says" in err
    assert "--resume falls back to u00000010" in err


# --------------------------------------------------------------------------- selection and helpers


def test_select_rounds():
    avail = list(range(50))
    picked, note = select_rounds(avail)  # issue 3: a dendrogram per signature round
    assert picked == avail and "all 50 rounds" in note and "--every" in note
    picked, note = select_rounds(avail, cap=12)
    assert picked[0] == 0 and picked[-1] == 49 and len(picked) == 14
    assert "14 of 50" in note and "evenly spaced" in note and "rounds 0, 4, 8," in note
    picked, note = select_rounds(avail, every=10, last=True)
    assert note.endswith("rounds 0, 10, 20, 30, 40, 49")
    assert select_rounds(avail, rounds=[3, 4, 5, 9])[1].endswith("rounds 3-5, 9")
    assert select_rounds(list(range(10)))[0] == list(range(10))
    assert select_rounds(avail, every=10)[0] == [0, 10, 20, 30, 40]
    assert select_rounds(avail, last=True)[0] == [49]
    assert select_rounds(avail, rounds=[3, 7], last=True)[0] == [3, 7, 49]
    assert select_rounds(avail, cap=0)[0] == [0, 49]
    with pytest.raises(ValueError, match="--round 50"):
        select_rounds(avail, rounds=[50])
    assert select_rounds([])[0] == []


def test_round_options_choose_the_dendrograms(small_run, tmp_path):
    out = tmp_path / "o"
    assert main_inspect([str(small_run), "--out", str(out), "--round", "1", "--round", "3", "--no-svg"]) == 0
    assert sorted(p.name for p in out.glob("dendrogram_*.png")) == ["dendrogram_round_0001.png",
                                                                   "dendrogram_round_0003.png"]
    out = tmp_path / "l"
    assert main_inspect([str(small_run), "--out", str(out), "--last", "--no-svg"]) == 0
    assert [p.name for p in out.glob("dendrogram_*.png")] == ["dendrogram_round_0005.png"]
    out = tmp_path / "e"
    assert main_inspect([str(small_run), "--out", str(out), "--every", "2", "--no-svg"]) == 0
    assert sorted(p.name for p in out.glob("dendrogram_*.png")) == [
        f"dendrogram_round_{r:04d}.png" for r in (0, 2, 4)]


def test_compress_counts():
    assert compress_counts([4, 4, 4, 4, 4, 3, 3, 1] + [1] * 9) == "4x5, 3x2, 1x10"
    assert compress_counts([2]) == "2x1"
    assert compress_counts([]) == ""


def test_merge_counts_count_each_exchange_once():
    row = dict(a=0.5, update_norm=0.1, event="merge")
    rows = [
        {"t": 1, "i": 0, "j": 1, "initiator": 0, **row}, {"t": 1, "i": 1, "j": 0, "initiator": 0, **row},
        {"t": 2, "i": 0, "j": 1, "initiator": 1, **row}, {"t": 2, "i": 1, "j": 0, "initiator": 1, **row},
        {"t": 2, "i": 2, "j": 3, "initiator": 2, **row},  # the other side's line was torn off
        {"t": 3, "i": 2, "j": 0, "initiator": 2, **{**row, "event": "skip_diverged"}},
        {"t": 3, "i": 0, "j": 2, "initiator": 2, **{**row, "event": "skip_diverged"}},
    ]
    M = merge_counts(rows, 4)
    assert M[0, 1] == M[1, 0] == 2
    assert M[2, 3] == M[3, 2] == 1
    assert M[0, 2] == 0 and np.all(np.diag(M) == 0)
    assert (M == M.T).all() and M.sum() // 2 == 3


def test_merge_matrix_of_a_synthetic_run(small_run):
    view = load_view(small_run)
    rows = [json.loads(line) for line in (small_run / "merges.jsonl").read_text().splitlines()]
    assert view.merge_matrix.sum() == len(rows)  # two lines per exchange, each counted once per pair side


# --------------------------------------------------------------------------- comparison


def test_compare_runs_overlays_curves(tmp_path, capsys):
    a = make_run(tmp_path / "results" / "a", n_ranks=8, n_rounds=4, groups=4, seed=1, strategy="community")
    b = make_run(tmp_path / "results" / "b", n_ranks=8, n_rounds=6, groups=None, seed=2, strategy="gossip",
                 law="hierarchical")
    assert main_inspect([str(a), str(b)]) == 0
    out = tmp_path / "results" / "compare_report"
    for name in ("index.html", "curves.png", "run1_timeline.png", "run2_timeline.png", "run1_merge_matrix.png",
                 "run1_dendrogram_round_0000.png", "run1_dendrogram_round_0003.png",
                 "run2_dendrogram_round_0005.png", "run1_rounds.csv", "run2_rounds.csv"):
        assert _nonempty(out / name), name
    assert not (out / "run2_dendrogram_round_0002.png").exists()  # comparison: first and last by default
    page = (out / "index.html").read_text()
    assert "a (community)" in page and "b (gossip)" in page
    stdout = capsys.readouterr().out
    assert "== a (community)" in stdout and "== b (gossip)" in stdout


def test_compare_runs_with_the_same_name_get_distinct_labels(tmp_path):
    a = make_run(tmp_path / "seed0" / "run", n_ranks=6, n_rounds=3, groups=2, seed=0)
    b = make_run(tmp_path / "seed1" / "run", n_ranks=6, n_rounds=3, groups=2, seed=1)
    views = [load_view(a), load_view(b)]
    load.disambiguate(views)
    assert views[0].label != views[1].label
    out = tmp_path / "cmp"
    assert main_inspect([str(a), str(b), "--out", str(out), "--last", "--no-svg"]) == 0
    assert _nonempty(out / "curves.png") and _nonempty(out / "run2_dendrogram_round_0002.png")


# --------------------------------------------------------------------------- the size, and real runs


def test_inspect_64_ranks_draws_a_dendrogram_per_round(tmp_path, capsys):
    """64 ranks, the width of issue 3's time budget (64 ranks, 50 rounds; ``communities bench inspect`` times
    that size): the default report holds one dendrogram per round, each on the page."""
    run = make_run(tmp_path / "big", n_ranks=64, n_rounds=16, groups=4, seed=4)
    assert main_inspect([str(run), "--no-svg"]) == 0
    assert "dendrograms for all 16 rounds" in capsys.readouterr().out
    rep = run / "report"
    assert _nonempty(rep / "index.html")
    names = sorted(p.name for p in rep.glob("dendrogram_round_*.png"))
    assert names == [f"dendrogram_round_{r:04d}.png" for r in range(16)]
    page = (rep / "index.html").read_text()
    assert all(f'src="{n}"' in page for n in names)


def test_make_run_needs_no_test_helpers(tmp_path):
    """make_run may become the input of ``communities bench inspect``: it must not import pytest or conftest."""
    code = (
        "import sys\n"
        "for name in ('pytest', '_pytest', 'conftest', 'tests', 'tests.conftest'):\n"
        "    sys.modules[name] = None  # importing any of them now raises ImportError\n"
        f"sys.path.insert(0, {str(REPO / 'tests' / 'helpers')!r})\n"
        "from synthetic_run import make_run\n"
        f"make_run({str(tmp_path / 'r')!r}, n_ranks=4, n_rounds=2, groups=2)\n"
        "print('OK')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-2000:]
    assert (tmp_path / "r" / "summary.json").is_file()


def test_a_lost_rank_is_named_and_crossed_out_on_the_timeline(small_run, tmp_path):
    """comm.fault_tolerance shrink: merges.jsonl's ``lost`` events reach the view, its notes and the timeline."""
    run = _copy(small_run, tmp_path)
    with open(run / "merges.jsonl", "a") as fh:
        fh.write(json.dumps({"t": 10, "i": 3, "j": -1, "initiator": -1, "a": 0.0, "update_norm": 0.0,
                             "distance": None, "bytes": 0, "rule": "shrink", "event": "lost"}) + "\n")
    view = load_view(run)
    assert view.lost == [(3, 10)]
    assert any("rank 3 at t=10" in note for note in view.notes)
    assert view.merge_matrix[3].sum() == load_view(small_run).merge_matrix[3].sum()  # not counted as a merge
    out = tmp_path / "fig"
    out.mkdir()
    files = figures._timeline_figure(view, out, "timeline", svg=True)
    svg = (out / "timeline.svg").read_text()
    assert any(f.endswith(".png") for f in files) and "rank 3 lost at t=10" in svg


# --------------------------------------------------------------------------- populations (hundreds of ranks)


@pytest.fixture(scope="module")
def population_run(tmp_path_factory) -> Path:
    """256 ranks, 4 planted groups, 3 rounds: more ranks than a figure can show one by one."""
    return make_run(tmp_path_factory.mktemp("runs") / "pop", n_ranks=256, n_rounds=3, groups=4, dim=8, every=1,
                    seed=6)


def _record_dendrograms(monkeypatch) -> List[dict]:
    """The keyword arguments of every scipy dendrogram call the report makes, with what it returned."""
    calls: List[dict] = []
    real = figures.hierarchy.dendrogram

    def spy(Z, **kw):
        R = real(Z, **kw)
        calls.append({**kw, "n": len(Z) + 1, "ivl": list(R["ivl"])})
        return R

    monkeypatch.setattr(figures.hierarchy, "dendrogram", spy)
    return calls


def test_population_report_draws_trees_truncated_to_the_communities(population_run, tmp_path, monkeypatch):
    calls = _record_dendrograms(monkeypatch)
    out = tmp_path / "rep"
    assert main_inspect([str(population_run), "--out", str(out), "--no-svg"]) == 0
    view = load_view(population_run)
    assert len(calls) == len(view.infos) == 3
    for k, call in enumerate(calls):
        n_comm = int(view.n_comm[k])
        assert call["truncate_mode"] == "lastp" and call["p"] == max(n_comm, 2)
        assert len(call["ivl"]) == max(n_comm, 2)  # one leaf per community, labelled with its rank count
        counts = [int(re.search(r"\((\d+)\)", label).group(1)) for label in call["ivl"]]
        assert sum(counts) == 256
        if n_comm > 1:  # the leaves are exactly the communities, named by their timeline ids
            ids, sizes = np.unique(view.stable[k], return_counts=True)
            assert sorted(call["ivl"]) == sorted(f"c{c} ({z})" for c, z in zip(ids, sizes))
    for name in ("curves.png", "timeline.png", "merge_matrix.png", "dendrogram_round_0000.png"):
        assert _nonempty(out / name), name
    page = (out / "index.html").read_text()
    assert "truncated to the communities of its round" in page
    assert "aggregated by community" in page
    assert "quantile bands" in page


def test_population_merge_matrix_is_aggregated_by_community(population_run):
    view = load_view(population_run)
    labels = view.stable[0]
    ids, B = load.community_merge_counts(view.merge_matrix, labels)
    assert list(ids) == sorted(set(labels.tolist())) and (B == B.T).all()
    for a, ca in enumerate(ids):  # brute force: every exchange once, by the communities of its two ranks
        for b, cb in enumerate(ids):
            block = view.merge_matrix[np.ix_(labels == ca, labels == cb)].sum()
            assert B[a, b] == (block // 2 if a == b else block)
    assert np.triu(B).sum() == view.merge_matrix.sum() // 2
    assert [k for _, k in figures._community_rounds(view)][0] == 0


def test_population_curves_draw_quantile_bands(population_run, small_run):
    from matplotlib.figure import Figure

    for run, bands in ((population_run, True), (small_run, False)):
        fig = Figure()
        panels = figures._CurvePanels(fig, overlay=False)
        panels.run(load_view(run), None)
        labels = panels.acc.get_legend_handles_labels()[1]
        assert ("ranks 25-75 %" in labels) is bands
        assert any(lab.startswith("each rank") for lab in labels) is not bands


def test_small_runs_keep_their_full_trees_and_rank_matrix(small_run, tmp_path, monkeypatch):
    calls = _record_dendrograms(monkeypatch)
    out = tmp_path / "rep"
    assert main_inspect([str(small_run), "--out", str(out), "--no-svg"]) == 0
    assert calls and all("truncate_mode" not in c and len(c["ivl"]) == 8 for c in calls)
    page = (out / "index.html").read_text()
    assert "aggregated by community" not in page and "quantile bands" not in page


def test_the_one_pass_jsonl_reader_reads_what_a_line_by_line_reader_reads(tmp_path):
    from communities.results import ResultsError, read_jsonl

    def line_by_line(path):  # the reference: complete lines, blank ones skipped, a torn last line dropped
        *lines, torn = path.read_text().split("\n")
        rows = [json.loads(line) for line in lines if line.strip()]
        try:
            return rows + [json.loads(torn)] if torn.strip() else rows
        except json.JSONDecodeError:
            return rows

    p = tmp_path / "m.jsonl"
    rows = [{"t": t, "rank": r, "test_acc": None if t % 2 else 0.5} for t in range(3) for r in range(4)]
    body = "".join(json.dumps(r) + "\n" for r in rows)
    for text in (body, body + '{"t": 9, "ra', body + '{"t": 9}', body.replace("\n", "\n\n", 1), ""):
        p.write_text(text)
        assert read_jsonl(p) == line_by_line(p)
    p.write_text(body + "{damaged\n" + body)
    with pytest.raises(ResultsError, match="line 13"):
        read_jsonl(p)
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_member_lists_of_a_population_are_cut_with_their_count():
    assert load._ranges_plain([0, 1, 2, 5]) == "0-2, 5"
    text = load._ranges_plain(list(range(0, 512, 2)))
    assert text.endswith("... (256 ranks)") and text.count(",") == 12
