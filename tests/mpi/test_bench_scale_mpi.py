"""``communities bench scale`` on real 2-process population runs (4 and 8 replicas, 2 units): the rows come from
each run's summary.json, the peak RSS from the ranks' /proc entries. No speed is asserted. The table and the fits
are tested without MPI in tests/unit/test_bench_scale.py."""
import json

import pytest

from communities.tools.bench.main import main_bench
from tests.helpers.mpi import ROOT, mpiexec

pytestmark = pytest.mark.timeout(300)


def test_bench_scale_on_two_tiny_populations(tmp_path, capsys):
    out = tmp_path / "scale.json"
    rc = main_bench(["scale", "--sizes", "4", "8", "--budget", "2", "--config",
                           str(ROOT / "configs" / "population.yaml"), "--set", "signature.every=1",
                           "--set", f"data.root={tmp_path / 'data'}", "--mpiexec", mpiexec(), "--timeout", "240",
                           "--output-root", str(tmp_path / "runs"), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "growth with N" in text and "targets at N = 1024: not measured" in text
    data = json.loads(out.read_text())
    assert [r["n"] for r in data["rows"]] == [4, 8]
    for r in data["rows"]:
        assert r["processes"] == 2 and r["units"] == 2 and r["data_samples"] == 320 * r["n"]
        assert len(r["peak_rss_per_process"]) == 2, r  # both ranks seen under mpiexec
        assert all(50 << 20 < b < 4 << 30 for b in r["peak_rss_per_process"])
        assert r["throughput_rps"] > 0 and 0 <= r["outside_share"] <= 1
        assert r["network_bytes_per_replica_unit"] > 0  # some pairs crossed the two processes
        assert r["partner_ms"] is not None and r["partner_ms"] >= 0
    assert data["rows"][1]["first_round_ari"] >= 0.9  # 4 planted groups of 2 replicas
    assert data["growth"]["throughput_rps"]["points"] == 2
    assert (tmp_path / "runs" / "scale_n8" / "summary.json").exists()
    import yaml

    train = yaml.safe_load((tmp_path / "runs" / "scale_n8" / "config.yaml").read_text())["train"]
    assert (train["unit"], train["steps_per_unit"]) == ("steps", 10)  # the same work a unit for every replica
