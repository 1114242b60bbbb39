"""``communities bench`` and ``communities compare`` under a real mpiexec: bench exchange and overhead, the
swap-and-merge over MPI, and a whole comparison. No speed is asserted; the comparison is checked against numpy
over the runs' own summary.json. The in-process parts are in tests/unit/test_bench_compare.py.
"""
import json
import textwrap

import numpy as np
import pytest

from communities.tools import compare
from communities.tools.bench.main import main_bench
from tests.helpers.compare_spec import write_spec
from tests.helpers.mpi import mpiexec, run_mpi

pytestmark = pytest.mark.timeout(600)


# --------------------------------------------------------------------------- exchange


def test_bench_exchange_runs_under_two_ranks_and_prints_a_ratio(tmp_path):
    out = tmp_path / "exchange.json"
    res = run_mpi(2, ["-m", "communities.tools.bench", "exchange", "--sizes-mb", "1", "--reps", "3", "--warmup", "1",
                      "--json", out])
    assert "ratio" in res.stdout and "no flatten" in res.stdout
    assert "the mixer's exchange.PairExchange: a header Sendrecv of 5 float64 (40 bytes" in res.stdout
    assert "check (a=0.5, both ranks end at the pair mean, equal to merge.interpolate_): ok" in res.stdout
    data = json.loads(out.read_text())
    assert data["check_ok"] and data["world_size"] == 2
    (r,) = data["results"]
    assert r["bytes"] == 1 << 20
    for key in ("engine", "engine_nodist", "whole"):
        assert r[key]["ratio_vs_raw"] > 0 and r[key]["GBps"] > 0
    assert r["meta"]["median_s"] > 0  # the metadata Sendrecv alone (it is inside "engine")


MERGE_SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from communities.core import merge
    from communities.engine.mixing import exchange
    from communities.runtime.comm import World
    world = World()
    peer = 1 - world.rank
    g = torch.Generator().manual_seed(7)
    w = [torch.randn(300_007, generator=g) for _ in range(2)]
    mine, theirs = w[world.rank], w[peer]
    mean = (w[0].double() + w[1].double()) / 2
    exact = float(torch.dist(w[0].double(), w[1].double()))
    small = exchange.ChunkBuffers(mine.numel(), mine.dtype, chunk=4096)  # 74 chunks and a short tail
    whole = lambda flat, a: exchange.swap_and_merge(world, flat, torch.empty_like(flat), peer, a)
    chunked = lambda flat, a: exchange.swap_and_merge_chunked(world, flat, peer, a, small)
    chunked_default = lambda flat, a: exchange.swap_and_merge_chunked(
        world, flat, peer, a, exchange.ChunkBuffers(flat.numel(), flat.dtype))
    for name, fn in (("whole", whole), ("chunked", chunked), ("chunked_default", chunked_default)):
        for a in (0.5, 0.3, 1.0):
            flat = mine.clone()
            d = fn(flat, a)
            ref = mine.clone()
            merge.interpolate_(ref, theirs, a)
            assert torch.equal(flat, ref), (name, a)                   # the reference merge, bit for bit
            assert abs(d - exact) <= 1e-4 * exact, (name, d, exact)
            if a == 0.5:                                               # both ranks end at the mean
                assert float((flat.double() - mean).abs().max()) < 1e-6
                both = world.allgather(flat.numpy())
                assert np.allclose(both[0], both[1], rtol=0, atol=1e-6)
    print("MERGE-OK", world.rank)
""")


def test_swap_and_merge_leaves_both_ranks_at_the_mean(tmp_path):
    script = tmp_path / "merge_check.py"
    script.write_text(MERGE_SCRIPT)
    res = run_mpi(2, [script], timeout=120)
    assert res.stdout.count("MERGE-OK") == 2


PARTS_SCRIPT = textwrap.dedent("""
    import numpy as np, torch
    from communities.core import merge
    from communities.engine.mixing import exchange
    from communities.runtime.comm import World
    world = World()
    peer = 1 - world.rank
    g = torch.Generator().manual_seed(11)
    big = exchange.SHARE_MIN + 3001  # parts of 1 MiB and more, and a distance split between the sides
    sides = [(torch.randn(big, generator=g), [torch.randn(big, generator=g), torch.randn(9, generator=g),
              torch.randn(exchange.PART_MIN // 4 + 5, generator=g)]) for _ in range(2)]
    # World.sendrecv_parts: the parts' bytes back to back, as many as the peer's, whatever their dtypes
    parts = [sides[world.rank][0], torch.arange(5, dtype=torch.int64) + 10 * world.rank, sides[world.rank][1][1]]
    nbytes = sum(t.numel() * t.element_size() for t in parts)
    recv = torch.empty(nbytes, dtype=torch.uint8)
    sent0 = world.bytes_sent
    world.sendrecv_parts(parts, recv, peer, tag=2)
    theirs = [sides[peer][0], torch.arange(5, dtype=torch.int64) + 10 * peer, sides[peer][1][1]]
    assert torch.equal(recv, torch.cat([t.view(torch.uint8) for t in theirs]))
    assert world.bytes_sent - sent0 == nbytes
    # the engine's exchange of weights and moments: merged bitwise, the same distance logged on both sides
    flat, moments = sides[world.rank][0].clone(), [m.clone() for m in sides[world.rank][1]]
    pair = exchange.PairExchange(world, big, flat.dtype)
    got = pair.swap(exchange.Payload(flat, state=moments), peer, 0.3)
    got.merge_state_(0.3)
    want = sides[world.rank][0].clone()
    merge.interpolate_(want, sides[peer][0], 0.3)
    assert torch.equal(flat, want)
    for m, mine, other in zip(moments, sides[world.rank][1], sides[peer][1]):
        w = mine.clone()
        merge.interpolate_(w, other, 0.3)
        assert torch.equal(m, w)
    exact = float(torch.dist(sides[0][0].double(), sides[1][0].double()))
    both = world.allgather(np.array([got.distance]))
    assert both.reshape(-1)[0] == both.reshape(-1)[1] and abs(got.distance - exact) <= 1e-6 * exact
    print("PARTS-OK", world.rank)
""")


def test_parts_go_out_as_they_lie_and_the_exchange_of_moments_merges_bitwise(tmp_path):
    script = tmp_path / "parts_check.py"
    script.write_text(PARTS_SCRIPT)
    res = run_mpi(2, [script], timeout=180)
    assert res.stdout.count("PARTS-OK") == 2


# --------------------------------------------------------------------------- overhead


def test_bench_overhead_on_a_tiny_run(tiny_config, tmp_path, capsys):
    rc = main_bench(["overhead", str(tiny_config), "--np", "2", "--mpiexec", mpiexec(), "--profile",
                           "--output-root", str(tmp_path / "ovh"), "--json", str(tmp_path / "ovh.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "sig / wall" in text and "profile of tiny" in text
    out = json.loads((tmp_path / "ovh.json").read_text())
    (r,) = out["results"]
    # the profile found the signature rounds and the clustering in them (by file and function name)
    assert all(out["profiles"]["tiny"][fn]["s_per_rank"] > 0 for fn in ("signature_rounds.py:run", "find_communities"))
    assert set(r["time_split"]) == {"train", "exchange", "signature", "idle", "eval", "other", "turn"}
    assert 0 <= r["signature_share_of_wall"] < 1


# --------------------------------------------------------------------------- compare


def test_compare_writes_mean_std_and_skips_completed_runs(tmp_path, tiny_config, capsys):
    spec = write_spec(tmp_path, tiny_config)
    root = tmp_path / "results"
    argv = [str(spec), "--results-root", str(root), "--mpiexec", mpiexec()]

    assert compare.main_compare(argv + ["--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "tinycmp_community_s0" in dry and "tinycmp_gossip_fast_s1" in dry and "strategy=gossip" in dry
    assert f"output.root={root / 'tinycmp' / 'runs'}" in dry and "merge.lam=1" in dry
    assert not (root / "tinycmp" / "runs").exists()  # a dry run runs nothing

    assert compare.main_compare(argv) == 0
    first = capsys.readouterr().out
    assert "4 runs (0 complete, skipped)" in first
    out = root / "tinycmp"
    for f in ("compare.md", "compare.json", "acc_vs_bytes.png", "acc_vs_wall.png"):
        assert (out / f).stat().st_size > 0, f
    data = json.loads((out / "compare.json").read_text())
    assert list(data["strategies"]) == ["community", "gossip_fast"]
    for label, engine in (("community", "community"), ("gossip_fast", "gossip")):
        summaries = [json.loads((out / "runs" / f"tinycmp_{label}_s{s}" / "summary.json").read_text())
                     for s in (0, 1)]
        assert all(s["strategy"] == engine for s in summaries)
        a = data["strategies"][label]
        assert a["runs"] == 2
        for key, field in (("consensus_test_acc", "consensus_test_acc"), ("best_rank_acc", "best_rank_acc"),
                           ("bytes_sent_per_rank", "bytes_sent_mean"), ("wall_time", "wall_time")):
            v = np.array([s[field] for s in summaries])
            assert a[key]["mean"] == pytest.approx(np.mean(v), rel=1e-12)
            assert a[key]["std"] == pytest.approx(np.std(v, ddof=1), rel=1e-9, abs=1e-15)
        # time to target: the first consensus evaluation at or above it, per seed
        ts = []
        for s in (0, 1):
            run = out / "runs" / f"tinycmp_{label}_s{s}"
            evals = [json.loads(x) for x in (run / "consensus.jsonl").read_text().splitlines() if x.strip()]
            summ = json.loads((run / "summary.json").read_text())
            pts = [(e["t"], e["test_acc"]) for e in evals] + [(summ["units"], summ["consensus_test_acc"])]
            hit = [t for t, acc in pts if acc >= 0.5]
            if hit:
                ts.append(hit[0])
        assert a["target"]["reached"] == len(ts)
        if ts:
            assert a["target"]["t"]["mean"] == pytest.approx(np.mean(ts))
    md = (out / "compare.md").read_text()
    assert "± " in md and "wall_time * t / units" in md and "| community |" in md  # the fallback is explained
    runs = {r["name"]: r for r in data["runs"]}
    assert len(runs) == 4 and all(r["status"] == "done" for r in runs.values())

    # a second invocation finds every run complete and launches nothing
    stamp = (out / "runs" / "tinycmp_community_s0" / "summary.json").stat().st_mtime_ns
    assert compare.main_compare(argv) == 0
    second = capsys.readouterr().out
    assert "4 runs (4 complete, skipped)" in second and "[1/" not in second
    assert (out / "runs" / "tinycmp_community_s0" / "summary.json").stat().st_mtime_ns == stamp
    data2 = json.loads((out / "compare.json").read_text())
    assert data2["strategies"]["community"]["consensus_test_acc"] == data["strategies"]["community"][
        "consensus_test_acc"]
    assert all(r["status"] == "skipped" for r in data2["runs"])
