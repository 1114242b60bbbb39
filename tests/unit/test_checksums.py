"""Checkpoint manifests (communities/manifest.py): every committed file's size and BLAKE2b digest, checked on
resume, so a flipped bit or a truncated file is found and the newest intact checkpoint is taken instead."""
from __future__ import annotations

import shutil

import pytest
import torch

from communities import manifest
from communities.engine.loop import Engine
from communities.engine.state import checkpoint
from communities.engine.state.run_dir import Resume
from communities.errors import ResultsError
from tests.helpers.damage import as_if_interrupted, flip_payload_bit, truncate
from tests.unit.test_disk_errors import world_
from tests.unit.test_engine_parts import make_cfg

pytestmark = pytest.mark.timeout(300)


def test_a_flipped_bit_loads_silently_but_fails_its_digest(tmp_path):
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    directory = tmp_path / "u00000001"
    directory.mkdir()
    expected = checkpoint.save_rank(directory, 0, state)
    path = checkpoint.rank_file(directory, 0)
    assert manifest.file_mismatch(path, expected) is None
    flip_payload_bit(path)
    loaded = torch.load(path, weights_only=True)  # the hole: torch loads it without a word ...
    assert not torch.equal(loaded["w"], state["w"])  # ... with one number changed
    assert "BLAKE2b digest differs" in manifest.file_mismatch(path, expected)
    truncate(path)
    assert "bytes, the manifest says" in manifest.file_mismatch(path, expected)
    path.unlink()
    assert manifest.file_mismatch(path, expected) == "missing"


def run(tmp_path, name="cut", resume=Resume.FRESH, **overrides):
    cfg = make_cfg(**{"output.root": str(tmp_path), "name": name, "checkpoint.every": 4,
                      "checkpoint.at_end": False, **overrides})
    return Engine(cfg, world_(), tmp_path / name, progress=False, resume=resume).run()


def consensus(path):
    return torch.load(path / "consensus.pt", weights_only=True)


def identical(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A finished one-rank run with complete checkpoints at t=4 and t=8 (the copies are damaged)."""
    root = tmp_path_factory.mktemp("ck")
    run(root, name="tiny")
    assert [d.name for d in manifest.complete_dirs(root / "tiny" / "checkpoints")] == ["u00000008", "u00000004"]
    return root / "tiny"


def interrupted_copy(ref, tmp_path, name="tiny"):
    shutil.copytree(ref, tmp_path / name)
    as_if_interrupted(tmp_path / name)
    return tmp_path / name


def test_the_manifest_lists_every_rank_file(ref):
    info = manifest.read_info(ref / "checkpoints" / "u00000008")
    assert set(info["files"]) == {"rank00000.pt"}
    assert manifest.problems(ref / "checkpoints" / "u00000008") == []


@pytest.mark.parametrize("damage", [flip_payload_bit, truncate])
def test_a_damaged_newest_checkpoint_falls_back_to_the_older_one_bitwise(ref, tmp_path, capsys, damage):
    cut = interrupted_copy(ref, tmp_path)
    damage(cut / "checkpoints" / "u00000008" / "rank00000.pt")
    run(tmp_path, name="tiny", resume=Resume.RESUME)
    out = capsys.readouterr().out
    assert "checkpoint u00000008 is damaged" in out and "rank00000.pt: damaged checkpoint file" in out
    assert "falling back to checkpoint u00000004 (t=4)" in out
    assert (cut / "checkpoints" / "damaged" / "u00000008" / "rank00000.pt").exists()  # kept, out of the way
    assert identical(consensus(cut), consensus(ref))


def test_no_intact_checkpoint_is_an_error_naming_every_damaged_file(ref, tmp_path):
    cut = interrupted_copy(ref, tmp_path)
    flip_payload_bit(cut / "checkpoints" / "u00000008" / "rank00000.pt")
    (cut / "checkpoints" / "u00000004" / manifest.COMPLETE).write_text("{torn")
    before = sorted(p.relative_to(cut) for p in cut.rglob("*"))
    with pytest.raises(ResultsError) as err:
        run(tmp_path, name="tiny", resume=Resume.RESUME)
    msg = str(err.value)
    assert "no intact checkpoint to resume from" in msg
    assert "u00000008/rank00000.pt: damaged checkpoint file" in msg and "u00000004/COMPLETE: damaged" in msg
    assert sorted(p.relative_to(cut) for p in cut.rglob("*")) == before  # nothing moved or deleted


def test_a_renamed_run_directory_resumes_under_its_new_name(ref, tmp_path):
    cut = interrupted_copy(ref, tmp_path, name="trunc")
    run(tmp_path, name="trunc", resume=Resume.RESUME)
    assert identical(consensus(cut), consensus(ref))
    import json

    assert json.loads((cut / "summary.json").read_text())["name"] == "trunc"
