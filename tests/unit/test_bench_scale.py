"""``communities bench scale``: the per-N row, the growth fit and the table, from summaries (no MPI)."""
import math

import pytest

from communities.tools.bench import scale as bench
from communities.tools.bench.main import build_parser


def _summary(n, units=10, wall=20.0, shares=(0.9, 0.8), network=4000.0, acc=0.95, t=40):
    return {"units": units, "wall_time": wall, "first_round_ari": 1.0, "consensus_reached_t": t,
            "consensus_test_acc": acc, "bytes_sent_mean": 9e9,
            "placement": {"processes": 2, "replicas_per_process": n // 2, "bytes_network_mean": network,
                          "bytes_in_process_mean": 1.0, "train_share_per_process": list(shares)}}


def test_row_reads_the_summary():
    r = bench.scale_row(32, _summary(32), launch_s=30.0, peak_rss=[1 << 30, 3 << 29], partner_ms=2.5)
    assert r["throughput_rps"] == pytest.approx(32 * 10 / 20.0)
    assert r["outside_share"] == pytest.approx(0.15)
    assert r["outside_share_max"] == pytest.approx(0.2)
    assert r["network_bytes_per_replica_unit"] == pytest.approx(400.0)  # placement's network bytes, not all sent
    assert r["peak_rss_max"] == 3 << 29 and r["peak_rss_total"] == (1 << 30) + (3 << 29)
    assert (r["processes"], r["consensus_t"], r["consensus_acc"]) == (2, 40, 0.95)


def test_row_without_placement_uses_each_rank():
    s = _summary(2)
    del s["placement"]
    s["time_split_per_rank"] = {"train": [3.0, 1.0], "wall": [4.0, 4.0]}
    r = bench.scale_row(2, s, 1.0, [], None)
    assert r["outside_share"] == pytest.approx(0.5) and r["outside_share_max"] == pytest.approx(0.75)
    assert r["network_bytes_per_replica_unit"] == pytest.approx(9e8)
    assert r["peak_rss_max"] is None


def test_fit_recovers_a_power_law():
    ns = [8, 32, 128, 512]
    f = bench.fit_growth(ns, [3.0 * n ** 1.5 for n in ns])
    assert f["exponent"] == pytest.approx(1.5) and f["coefficient"] == pytest.approx(3.0)
    assert f["r2"] == pytest.approx(1.0) and f["points"] == 4


def test_fit_skips_missing_and_needs_two_sizes():
    assert bench.fit_growth([8, 32], [5.0, None]) is None
    assert bench.fit_growth([8, 8], [1.0, 2.0]) is None
    f = bench.fit_growth([8, 32, 128], [2.0, None, 2.0])  # a run that never reached consensus drops out
    assert f["points"] == 2 and math.isclose(f["exponent"], 0.0, abs_tol=1e-12)


def test_table_and_targets():
    rows = [bench.scale_row(n, _summary(n, wall=n / 4, shares=(0.95, 0.93)), 10.0, [n << 20, n << 20], 1.0)
            for n in (8, 1024)]
    text = bench.scale_table(rows)
    assert "r-units/s" in text and "units to consensus" in text
    fit_line = next(line for line in text.splitlines() if line.startswith("wall s"))
    assert "+1.00" in fit_line  # wall grows as N here
    targets = "\n".join(bench.scale_targets(rows))
    assert "6.0% (worst process 7.0%) met" in targets
    assert "2.00 GiB met" in targets and "1.0 ms met" in targets
    assert "not measured" in bench.scale_targets(rows[:1])[0]


def test_parser_passes_overrides():
    args = build_parser().parse_args(["scale", "--sizes", "4", "8", "--budget", "2", "--set", "a=1",
                                            "--set", "b=2"])
    assert (args.sizes, args.budget, args.set, args.processes) == ([4, 8], 2, ["a=1", "b=2"], 2)
    assert args.steps_per_unit == 10  # equal work a unit unless asked (0: the config's unit)
    assert build_parser().parse_args(["scale", "--steps-per-unit", "0"]).steps_per_unit == 0
