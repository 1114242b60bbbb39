"""Results readers and writers: atomic files, torn JSONL tails, round ordering."""
import json

import numpy as np
import pytest

from communities import results
from communities.results import ResultsError, RunWriter


def test_torn_last_line_is_dropped_but_damage_elsewhere_is_named(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text('{"a": 1}\n{"a": 2}\n{"a": 3')
    assert [r["a"] for r in results.read_jsonl(p)] == [1, 2]
    p.write_text('{"a": 1}\n{"a": 2}')  # no trailing newline but complete: kept
    assert [r["a"] for r in results.read_jsonl(p)] == [1, 2]
    p.write_text('{"a": 1}\n{"a": \n{"a": 3}\n')
    with pytest.raises(ResultsError, match="m.jsonl: line 2"):
        results.read_jsonl(p)


def test_repair_then_append_keeps_every_complete_line(tmp_path):
    w = RunWriter(tmp_path / "run")
    w.append_jsonl("m.jsonl", [{"a": 1}, {"a": 2}])
    w.close()
    with open(tmp_path / "run" / "m.jsonl", "a") as fh:
        fh.write('{"a": 3, "tor')
    results.repair_jsonl(tmp_path / "run" / "m.jsonl")
    w = RunWriter(tmp_path / "run", resume=True)
    w.append_jsonl("m.jsonl", [{"a": 4}])
    assert [r["a"] for r in results.read_jsonl(tmp_path / "run" / "m.jsonl")] == [1, 2, 4]


def test_rounds_are_listed_in_numeric_order_and_partial_ones_skipped(tmp_path):
    w = RunWriter(tmp_path / "run")
    w.write_text("config.yaml", "name: x\n")
    w.write_json("meta.json", {"world_size": 3, "status": "running"})
    for i in (2, 10000, 9999):
        w.write_round(i, np.zeros((3, 4), np.float32), np.zeros((2, 4)), np.zeros(3, np.int64), {"round": i, "t": i})
    (tmp_path / "run" / "rounds" / ".round_10001.tmp").mkdir()
    run = results.read_run(tmp_path / "run")
    assert [p.name for p in run.round_paths] == ["round_0002", "round_9999", "round_10000"]
    assert not run.complete and run.summary is None


def test_refuses_existing_dir_and_atomic_write_replaces(tmp_path):
    RunWriter(tmp_path / "run").write_json("a.json", {"v": 1})
    with pytest.raises(ResultsError, match="--overwrite"):
        RunWriter(tmp_path / "run")
    results.atomic_write_json(tmp_path / "run" / "a.json", {"v": 2})
    assert json.loads((tmp_path / "run" / "a.json").read_text()) == {"v": 2}
    assert not list((tmp_path / "run").glob(".*tmp"))


def test_damaged_files_are_named(tmp_path):
    (tmp_path / "Z.npy").write_bytes(b"garbage")
    with pytest.raises(ResultsError, match="Z.npy"):
        results.read_npy(tmp_path / "Z.npy")
    (tmp_path / "meta.json").write_text("{nope")
    with pytest.raises(ResultsError, match="meta.json"):
        results.read_json(tmp_path / "meta.json")
