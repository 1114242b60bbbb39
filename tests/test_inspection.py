"""Tests for ``communities inspect`` (communities/inspection.py).

Why these: the inspection tool is what users run on a login node after a run, so
it must read exactly the results layout (synthetic runs written by
tests/synthetic_run.py through RunWriter), never pull in torch/mpi4py, agree with
scipy and scikit-learn on the numbers it reports, survive big trees and partial
runs, and turn damaged files into one-line messages with exit status 2.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_run import make_run  # noqa: E402

from communities import inspection  # noqa: E402
from communities.inspection import (  # noqa: E402
    compress_counts,
    load_view,
    main_inspect,
    merge_counts,
    plot_dendrogram,
    select_rounds,
    stable_labels,
)

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]


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
    """The login-node promise: ``python -m communities.inspection`` never imports torch or mpi4py."""
    out = tmp_path / "rep"
    code = (
        "import sys, runpy\n"
        f"sys.argv = ['communities.inspection', {str(small_run)!r}, '--out', {str(out)!r}, '--last']\n"
        "try:\n"
        "    runpy.run_module('communities.inspection', run_name='__main__')\n"
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
    res = subprocess.run([sys.executable, "-c", "import sys, communities.inspection; "
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
    # Matching keeps the id of the bigger overlap in every round.
    for r in range(1, len(seq)):
        for cid in np.unique(base[r]):
            if cid in base[r - 1]:
                here = base[r] == cid
                prev_ids, counts = np.unique(base[r - 1][here], return_counts=True)
                assert counts[list(prev_ids).index(cid)] > 0
    with pytest.raises(ValueError):
        stable_labels([[0, 1], [0, 1, 2]])
    assert stable_labels([]).shape == (0, 0)


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
    assert inspection.cophenetic_correlation(Z, sig, metric) == pytest.approx(cophenet(Z, pdist(sig, metric))[0])
    assert inspection.adjusted_rand(lab, None) is None


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
    assert len(R["ivl"]) == inspection.TRUNCATE_P
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
    assert not (rep / "merge_matrix.svg").exists()
    assert f"{n} ranks" in capsys.readouterr().out


# --------------------------------------------------------------------------- partial and damaged runs


def test_partial_run_is_inspectable_up_to_its_last_complete_round(tmp_path, capsys):
    run = make_run(tmp_path / "crashed", n_ranks=8, n_rounds=5, groups=4, partial=True, seed=2)
    assert not (run / "summary.json").exists()
    assert json.loads((run / "meta.json").read_text())["status"] == "running"
    assert list((run / "rounds").glob(".round_*"))  # the half-built hidden round is there
    assert main_inspect([str(run)]) == 0
    out = capsys.readouterr().out
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


# --------------------------------------------------------------------------- selection and helpers


def test_select_rounds():
    avail = list(range(50))
    picked, note = select_rounds(avail)
    assert picked[0] == 0 and picked[-1] == 49 and len(picked) == 14
    assert "14 of 50" in note and "evenly spaced" in note
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
    inspection._disambiguate(views)
    assert views[0].label != views[1].label
    out = tmp_path / "cmp"
    assert main_inspect([str(a), str(b), "--out", str(out), "--last", "--no-svg"]) == 0
    assert _nonempty(out / "curves.png") and _nonempty(out / "run2_dendrogram_round_0002.png")


# --------------------------------------------------------------------------- performance


def test_inspect_64_ranks_50_rounds_under_30_seconds(tmp_path, capsys):
    """The budget is 30 s on a 2-core machine. inspect is single-threaded, so its CPU time is what it
    costs on an idle machine; wall time only gets a loose bound, since other jobs may share the cores."""
    run = make_run(tmp_path / "big", n_ranks=64, n_rounds=50, groups=4, seed=4)
    wall, cpu = time.perf_counter(), time.process_time()
    assert main_inspect([str(run)]) == 0
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert "14 of 50 rounds" in capsys.readouterr().out
    assert len(list((run / "report").glob("dendrogram_round_*.png"))) == 14
    assert cpu < 30, f"inspect used {cpu:.1f} s CPU ({wall:.1f} s wall)"
    assert wall < 90, f"inspect took {wall:.1f} s wall ({cpu:.1f} s CPU)"
