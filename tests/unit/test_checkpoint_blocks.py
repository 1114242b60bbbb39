"""A population's checkpoint (engine/state/blocks.py): a process's replicas in one file, found through the
manifest's rank map, checked once per process, each replica taking its own state; damage is found as in a rank's
own file, and a rank not in the map is in its own file."""
from __future__ import annotations

import json

import pytest
import torch

from communities.engine.state import blocks, checkpoint
from communities.errors import ResultsError


def _state(rank):
    return {"version": checkpoint.VERSION, "rank": rank, "world_size": 6, "t": 10,
            "parts": {"replica": {"flat": torch.full((5,), float(rank))}}}


def _checkpoint(tmp_path):
    """Ranks 0-3 in one process's block, 4 and 5 each a process of one (their own files), committed."""
    d = checkpoint.step_dir(tmp_path, 10)
    statuses = blocks.write(d, [(r, _state(r), "", False) for r in range(4)], world_size=6,
                            serialize=checkpoint.serialize)
    statuses += ["ok " + json.dumps(checkpoint.save_rank(d, r, _state(r))) for r in (4, 5)]
    files, ranks = blocks.manifest(statuses, [True] * 6)
    checkpoint.commit(tmp_path, 10, {"version": checkpoint.VERSION, "t": 10, "files": files, "ranks": ranks})
    return d, files, ranks


def test_one_file_per_process_and_a_rank_map(tmp_path):
    d, files, ranks = _checkpoint(tmp_path)
    assert sorted(files) == ["block00000.pt", "rank00004.pt", "rank00005.pt"]
    assert ranks == {str(r): "block00000.pt" for r in range(4)}
    info = checkpoint.read_info(d)
    assert blocks.holder(info, d, 2) == d / "block00000.pt" and blocks.holder(info, d, 5) == d / "rank00005.pt"
    block = blocks.Block(d / "block00000.pt", files["block00000.pt"], checkpoint._deserialize)
    for r in (3, 0, 2, 1):  # each replica takes its own state, in any order; the block empties
        assert torch.equal(block.take(r)["parts"]["replica"]["flat"], torch.full((5,), float(r)))
    assert not block.states
    with pytest.raises(ResultsError, match="no state of rank 1"):
        block.take(1)


def test_a_post_hoc_reader_finds_each_rank_in_its_block_or_its_own_file(tmp_path):
    """``load_rank`` without bytes needs no layout: a population's rank comes out of its block, checked."""
    d, _, _ = _checkpoint(tmp_path)
    for r in range(6):
        assert torch.equal(checkpoint.load_rank(d, r)["parts"]["replica"]["flat"], torch.full((5,), float(r)))
    data = bytearray((d / "block00000.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (d / "block00000.pt").write_bytes(bytes(data))
    with pytest.raises(ResultsError, match="block00000.pt: damaged checkpoint file"):
        checkpoint.load_rank(d, 2)


def test_a_block_is_checked_once_per_process_and_its_ranks_get_no_bytes(tmp_path):
    d, _, _ = _checkpoint(tmp_path)
    memo, computed = {}, []

    def shared(key, compute):
        if key not in memo:
            computed.append(key)
            memo[key] = compute()
        return memo[key]

    for r in range(4):
        assert checkpoint.verify_own(d, r, shared) == ("", None, True)
    assert len(computed) == 1
    problem, data, checked = checkpoint.verify_own(d, 4, shared)  # a rank of its own: its bytes, as before
    assert problem == "" and data == (d / "rank00004.pt").read_bytes() and checked


def test_a_damaged_block_is_found_by_its_ranks_and_by_the_load(tmp_path):
    d, files, _ = _checkpoint(tmp_path)
    path = d / "block00000.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    problem, _, _ = checkpoint.verify_own(d, 1)
    assert "block00000.pt: damaged checkpoint file" in problem and "digest" in problem
    with pytest.raises(ResultsError, match="damaged checkpoint file"):
        blocks.Block(path, files["block00000.pt"], checkpoint._deserialize)
    assert checkpoint.verify_own(d, 4)[0] == ""  # the other processes' files are intact


def test_a_full_disk_fails_every_replica_of_the_block(tmp_path):
    d = checkpoint.step_dir(tmp_path, 10)
    statuses = blocks.write(d, [(0, _state(0), "", False), (1, _state(1), "disk earlier", True)], world_size=6,
                            serialize=checkpoint.serialize)
    assert statuses[1] == "disk earlier" and statuses[0].startswith("disk ")
    assert not (d / "block00000.pt").exists()
