"""The notebook API (communities/report/api.py): frames against the files, trees, models, the notebook itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

import communities as cx
from communities import manifest
from communities.report import api
from communities.report.api import CONSENSUS_COLUMNS, MERGE_COLUMNS, METRIC_COLUMNS, ROUND_COLUMNS, TIMELINE_COLUMNS
from communities.results import ResultsError
from communities.tools.synthetic import make_run

pd = pytest.importorskip("pandas")  # the inspect extra

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "docs" / "notebooks" / "inspect_a_run.ipynb"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """8 ranks, 4 planted groups, 6 rounds: 4 communities, then 2, then 1."""
    return make_run(tmp_path_factory.mktemp("runs") / "small", n_ranks=8, n_rounds=6, groups=4, seed=1)


def _lines(path: Path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_import_stays_light():
    code = ("import sys, communities as cx; f = cx.open_run; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'pandas') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_frames_match_the_files(run_dir):
    run = cx.open_run(run_dir)
    assert run.status == "complete" and run.world_size == 8 and run.notes == []
    assert run.summary is not None and run.summary.world_size == 8
    assert run.config["strategy"] == "community" and "world_size" in run.meta
    assert "8 ranks" in repr(run) and "status complete" in str(run)

    metrics = _lines(run_dir / "metrics.jsonl")
    m = run.metrics
    assert list(m.columns) == list(METRIC_COLUMNS) and len(m) == len(metrics)
    assert m["test_acc"].isna().sum() == sum(r["test_acc"] is None for r in metrics)
    assert m["bytes_sent"].tolist() == [r["bytes_sent"] for r in metrics]

    merges = _lines(run_dir / "merges.jsonl")
    g = run.merges
    assert list(g.columns) == list(MERGE_COLUMNS) + ["round", "community_i", "community_j", "within"]
    assert len(g) == len(merges) and g["event"].tolist() == [r["event"] for r in merges]
    # the merge's round is the last one saved before its unit; its communities are that round's
    rounds = run.rounds
    before = g[g["t"] <= int(rounds["t"].iloc[0])]
    assert before["round"].isna().all() and before["within"].isna().all()
    timeline = run.communities_over_time().set_index(["round", "rank"])["community"]
    row = g[g["t"] > int(rounds["t"].iloc[0])].iloc[0]
    assert int(rounds.set_index("round").loc[int(row["round"]), "t"]) < int(row["t"])
    assert row["community_i"] == timeline[(row["round"], row["i"])]
    assert bool(row["within"]) == (row["community_i"] == row["community_j"])

    c = run.consensus
    lines = _lines(run_dir / "consensus.jsonl")
    assert list(c.columns) == list(CONSENSUS_COLUMNS) and c["t"].tolist() == [r["t"] for r in lines]
    assert c["final"].tolist() == [False] * (len(lines) - 1) + [True]  # the file ends at the headline here

    saved = sorted((run_dir / "rounds").glob("round_*"))
    assert list(rounds.columns) == list(ROUND_COLUMNS) and len(rounds) == len(saved) == 6
    infos = [json.loads((p / "round.json").read_text()) for p in saved]
    assert rounds["n_communities"].tolist() == [i["n_communities"] for i in infos] == [4, 4, 2, 2, 1, 1]
    assert rounds["cut_height"].tolist() == [i["cut_height"] for i in infos]

    over = run.communities_over_time()
    assert list(over.columns) == list(TIMELINE_COLUMNS) and len(over) == 6 * 8
    labels = np.load(saved[2] / "labels.npy")
    assert over[over["round"] == 2]["label"].tolist() == labels.tolist()
    assert over["group"].tolist() == json.loads((run_dir / "partition.json").read_text())["groups"] * 6


def test_round_gives_what_the_engine_wrote(run_dir):
    run = cx.open_run(run_dir)
    p = run_dir / "rounds" / "round_0003"
    r = run.round(3)
    assert r.round == 3 and r.t == json.loads((p / "round.json").read_text())["t"]
    np.testing.assert_array_equal(r.Z, np.load(p / "Z.npy"))
    np.testing.assert_array_equal(r.signatures, np.load(p / "signatures.npy"))
    np.testing.assert_array_equal(r.labels, np.load(p / "labels.npy"))
    assert r.law == "flat" and r.outliers is None and r.cut_height == r.info["cut_height"]
    assert run.round(-1).round == 5 and run.round_numbers == list(range(6))
    with pytest.raises(ValueError, match="round 9: no such complete round"):
        run.round(9)


def test_dendrogram_is_drawn_off_screen(run_dir):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    run = cx.open_run(run_dir)
    ax = Figure().subplots()
    out = run.dendrogram(0, ax=ax)
    assert sorted(int(x) for x in out["ivl"]) == list(range(8))
    assert len(ax.collections) + len(ax.lines) > 0 and "round 0" in ax.get_title()
    out = run.dendrogram(-1, ax=Figure().subplots(), color_threshold=0, no_labels=True)  # scipy keywords pass on
    assert out["ivl"]
    import matplotlib.pyplot as plt

    run.dendrogram(1)  # a pyplot figure of its own, as in a notebook
    plt.close("all")


def test_an_interrupted_run_opens_with_its_notes(tmp_path):
    run_dir = make_run(tmp_path / "crashed", n_ranks=8, n_rounds=5, groups=4, partial=True, seed=2)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / ".lock").write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": dead.pid,
                                                "start": "2026-01-01T00:00:00+00:00"}))
    (run_dir / "rounds" / "round_0004" / "round.json").write_text("{torn")  # the tail of the crash
    run = cx.open_run(run_dir)
    assert run.status == "interrupted" and run.summary is None
    notes = " ".join(run.notes)
    assert "its process is gone" in notes and "round_0004" in notes and "read up to the round before" in notes
    assert run.round_numbers == [0, 1, 2, 3] and len(run.rounds) == 4
    assert len(run.metrics) == 5 * 5 * 8  # every whole line; the torn last one is dropped
    assert len(run.merges) > 0 and len(run.communities_over_time()) == 4 * 8


def test_missing_and_damaged_runs_raise_as_inspect_does(tmp_path, run_dir):
    with pytest.raises(ResultsError, match="not a run directory"):
        cx.open_run(tmp_path / "nothing")
    bad = make_run(tmp_path / "bad", n_ranks=4, n_rounds=2, groups=2)
    (bad / "meta.json").write_text("{")
    with pytest.raises(ResultsError, match="meta.json: damaged JSON"):
        cx.open_run(bad)


def test_open_runs_stacks_frames_with_a_run_column(tmp_path, run_dir):
    other = make_run(tmp_path / "other", n_ranks=4, n_rounds=3, groups=2, seed=3)
    runs = cx.open_runs([run_dir, other])
    assert len(runs) == 2 and runs.labels == ["small (community)", "other (community)"]
    m = runs.metrics
    assert list(m.columns) == ["run"] + list(METRIC_COLUMNS)
    assert m.groupby("run").size().to_dict() == {"small (community)": 6 * 5 * 8, "other (community)": 3 * 5 * 4}
    assert runs.rounds.groupby("run").size().to_dict() == {"small (community)": 6, "other (community)": 3}
    assert set(runs.merges["run"]) == set(runs.consensus["run"]) == set(runs.labels)
    assert len(runs.communities_over_time()) == 6 * 8 + 3 * 4
    assert runs["other (community)"].world_size == 4
    same = cx.open_runs([run_dir, run_dir])  # one name twice: told apart
    assert len(set(same.labels)) == 2
    with pytest.raises(ValueError, match="distinct"):
        cx.open_runs([run_dir, other], labels=["a", "a"])


def test_the_consensus_frame_ends_with_the_final_evaluation(tmp_path):
    """The headline (summary.json's consensus_test_acc, after the last unit) is the last row, at t = units, even
    where the evaluations every output.consensus_every units stop before it (the quickstart: t=90 of 95)."""
    run_dir = make_run(tmp_path / "r", n_ranks=4, n_rounds=4, groups=2)
    lines = _lines(run_dir / "consensus.jsonl")
    units = lines[-1]["t"] + 5
    summary = json.loads((run_dir / "summary.json").read_text())
    summary.update(units=units, consensus_test_acc=0.9756, consensus_test_loss=0.1)
    (run_dir / "summary.json").write_text(json.dumps(summary))
    c = cx.open_run(run_dir).consensus
    assert len(c) == len(lines) + 1 and c["final"].tolist() == [False] * len(lines) + [True]
    assert c.iloc[-1][["t", "test_acc", "test_loss"]].tolist() == [units, 0.9756, 0.1]
    (run_dir / "summary.json").unlink()  # not finished: the file's rows alone
    assert len(cx.open_run(run_dir).consensus) == len(lines) and not cx.open_run(run_dir).consensus["final"].any()


def test_open_runs_table_has_one_row_per_run_with_the_keys_that_differ(tmp_path):
    dirs = [make_run(tmp_path / f"lr{k}", n_ranks=4, n_rounds=3 + k, groups=2, seed=k) for k in range(3)]
    partial = make_run(tmp_path / "crashed", n_ranks=4, n_rounds=3, groups=2, seed=9, partial=True)
    table = cx.open_runs(dirs + [partial]).table()
    assert table["run"].tolist() == ["lr0 (community)", "lr1 (community)", "lr2 (community)", "crashed (community)"]
    keys = [c for c in table.columns if c not in ("run", "status") and c not in api.SUMMARY_COLUMNS]
    assert keys == ["seed", "train.budget"]  # what the runs' configs differ in (name aside)
    assert table["seed"].tolist() == [0, 1, 2, 9] and table["train.budget"].tolist() == [15, 20, 25, 15]
    assert table["status"].tolist()[:3] == ["complete"] * 3 and table["status"].iloc[3] != "complete"
    for d, row in zip(dirs, table.itertuples()):
        s = json.loads((d / "summary.json").read_text())
        assert row.consensus_test_acc == s["consensus_test_acc"] and row.units == s["units"]
    assert table["consensus_test_acc"].isna().tolist() == [False, False, False, True]  # not finished: missing
    assert str(table["units"].dtype) == "Int64" and str(table["wall_time"].dtype) == "float64"
    picked = cx.open_runs(dirs).table(keys=["train.lr", "strategy"])
    assert list(picked.columns[:4]) == ["run", "status", "train.lr", "strategy"] and len(picked) == 3


def test_models_are_loaded_with_their_digests_checked(tmp_path):
    torch = pytest.importorskip("torch")
    import io

    run_dir = make_run(tmp_path / "done", n_ranks=4, n_rounds=2, groups=2)
    state = {"w": torch.arange(6, dtype=torch.float32), "b": torch.zeros(2)}

    def saved(sd) -> bytes:
        buf = io.BytesIO()
        torch.save(sd, buf)
        return buf.getvalue()

    files = {"consensus.pt": saved(state), "models/community_0.pt": saved({"w": torch.ones(3)}),
             "models/community_1.pt": saved({"w": torch.full((3,), 2.0)})}
    (run_dir / "models").mkdir()
    for rel, data in files.items():
        (run_dir / rel).write_bytes(data)
    (run_dir / "models" / "communities.json").write_text(json.dumps({
        "kind": "communities", "t": 10, "round": 1, "labels": [0, 0, 1, 1],
        "models": [{"community": c, "members": [2 * c, 2 * c + 1], "file": f"models/community_{c}.pt"}
                   for c in (0, 1)]}))
    meta = json.loads((run_dir / "meta.json").read_text())
    meta["files"] = {rel: manifest.entry(data) for rel, data in files.items()}
    (run_dir / "meta.json").write_text(json.dumps(meta))

    run = cx.open_run(run_dir)
    models = run.models()
    assert torch.equal(models.consensus["w"], state["w"]) and sorted(models.communities) == [0, 1]
    assert torch.equal(models.communities[1]["w"], torch.full((3,), 2.0)) and models.exports == {}
    damaged = bytearray(files["models/community_1.pt"])
    damaged[-30] ^= 1
    (run_dir / "models" / "community_1.pt").write_bytes(bytes(damaged))
    with pytest.raises(ResultsError, match="community_1.pt: damaged .*BLAKE2b"):
        run.models()


def _execute(cwd: Path, monkeypatch, run_dir: Optional[Path] = None):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    if run_dir is None:
        monkeypatch.delenv("COMMUNITIES_RUN", raising=False)
    else:
        monkeypatch.setenv("COMMUNITIES_RUN", str(run_dir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    return " ".join(str(o.get("text", "")) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_the_notebook_runs_to_the_end(tmp_path, monkeypatch):
    run_dir = make_run(tmp_path / "quickstart", n_ranks=8, n_rounds=6, groups=4, seed=0)
    assert "status complete, 8 ranks" in _execute(tmp_path, monkeypatch, run_dir)


def test_the_notebook_finds_the_run_from_any_directory_or_makes_one(tmp_path, monkeypatch):
    """From a directory under the one holding results/quickstart (Jupyter starts in docs/notebooks/), and from
    one with no run anywhere above it (a synthetic run instead)."""
    make_run(tmp_path / "repo" / "results" / "quickstart", n_ranks=8, n_rounds=6, groups=4, seed=2)
    deep = tmp_path / "repo" / "docs" / "notebooks"
    deep.mkdir(parents=True)
    text = _execute(deep, monkeypatch)
    assert "../../results/quickstart" in text and "synthetic run instead" not in text
    (tmp_path / "elsewhere").mkdir()
    assert "a synthetic run instead" in _execute(tmp_path / "elsewhere", monkeypatch)


def test_the_notebook_is_saved_with_its_outputs():
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code and all(c["outputs"] and c["execution_count"] for c in code)
    assert not any(o["output_type"] == "error" for c in code for o in c["outputs"])
    assert any("image/png" in o.get("data", {}) for c in code for o in c["outputs"])  # the trees, drawn
