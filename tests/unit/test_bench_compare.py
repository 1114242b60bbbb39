"""``communities bench`` and ``communities compare``: they run, print, and their figures are right.

The ones that launch mpiexec (bench exchange and overhead, the merge over MPI, a whole comparison) are in
tests/mpi/test_bench_compare_mpi.py.

Benchmarks are only checked to run and to print their tables: no speed is asserted.
The comparison harness is checked against numpy over the runs' own summary.json.
"""
import json
import sys

import numpy as np
import pytest
import torch

from communities.core import clustering, merge
from communities.engine.mixing import exchange
from communities.tools import compare
from communities.tools.bench import clustering as bench_clustering
from communities.tools.bench.main import main_bench
from communities.tools.compare.aggregate import aggregate
from communities.tools.compare.curves import _bytes_after_unit, _sync_gradients, run_curve, time_to_target
from communities.tools.compare.markdown import write_markdown
from communities.tools.compare.runs import launcher_argv, plan_runs
from communities.tools.compare.spec import SpecError, load_specs, spec_from_dict
from tests.helpers.compare_spec import write_spec

pytestmark = pytest.mark.timeout(600)


# --------------------------------------------------------------------------- exchange


@pytest.mark.parametrize("n", [1, 100, (1 << 18) + 7, 3 * (1 << 18)])
@pytest.mark.parametrize("a", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_blocked_merge_is_bitwise_the_plain_merge(n, a):
    g = torch.Generator().manual_seed(n)
    x, y = torch.randn(n, generator=g), torch.randn(n, generator=g)
    plain = x.clone()
    merge.interpolate_(plain, y, a)
    blocked = x.clone()
    d = exchange.merge_with_distance_(blocked, y, a)
    assert torch.equal(plain, blocked)
    exact = float(torch.dist(x.double(), y.double()))
    assert d == pytest.approx(exact, rel=1e-6)


# --------------------------------------------------------------------------- signature and clustering


def test_bench_signature_runs_small_prints_and_skips_slow_gaussian_sizes(capsys, tmp_path):
    out = tmp_path / "sig.json"
    # A budget of 1e-9 s skips every Gaussian size after the first (which sets the rate) whatever this
    # machine's speed: the skip is deterministic, not a race between the 3M prediction and a budget.
    rc = main_bench(["signature", "--params", "100K", "3M", "--reps", "2", "--n-pairs", "1",
                           "--gaussian-reps", "1", "--gaussian-budget", "1e-9", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "countsketch" in text and "gaussian" in text and "ratio" in text
    assert "skipped gaussian at 3M params" in text
    data = json.loads(out.read_text())
    kinds = {(r["kind"], r["params"]) for r in data["results"]}
    assert kinds == {("countsketch", 100_000), ("gaussian", 100_000), ("countsketch", 3_000_000)}
    for r in data["results"]:
        assert r["sketch_rate"] > 0 and r["sum_rate"] > 0
        for pair in ("dense", "block", "lowrank"):  # d=256: JL scale ~0.04
            assert r["distortion"][pair]["max_rel_err"] < 0.5, pair


def test_bench_clustering_runs_small_and_prints(capsys, tmp_path):
    out = tmp_path / "clu.json"
    assert main_bench(["clustering", "--n", "16", "64", "--reps", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "find_communities ms" in text and "same labels" in text and "DIFFERENT" not in text
    data = json.loads(out.read_text())
    assert len(data["results"]) == 2 * 2 * 2
    assert all(r["communities"] == 8 for r in data["results"] if r["n"] == 64)  # the 8 planted groups


def test_bench_calibration_reports_rates_beside_the_level(capsys, tmp_path):
    from communities.tools.synthetic import make_run

    for name, groups in (("planted", 4), ("none", None)):
        for seed in range(2):
            make_run(tmp_path / f"{name}_s{seed}", n_ranks=16, n_rounds=2, groups=groups, seed=seed)
    out = tmp_path / "cal.json"
    assert main_bench(["calibration", "--kinds", "gaussian", "planted", "--n", "16", "--reps", "2", "--runs",
                       f"planted={tmp_path}/planted_s*", f"none={tmp_path}/none_s*", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "level alpha=0.05" in text and "simulated planted" in text and "planted" in text
    data = json.loads(out.read_text())
    by_source = {r["source"]: r for r in data["results"]}
    assert len(by_source["planted"]["decisions"]) == 2 and by_source["planted"]["planted"]
    assert all(d["communities"] == 4 and d["ari"] == 1.0 for d in by_source["planted"]["decisions"])
    assert not by_source["none"]["planted"] and all(d["ari"] is None for d in by_source["none"]["decisions"])
    assert main_bench(["calibration", "--kinds", "--runs", f"{tmp_path}/nothing_*"]) == 2


def test_fast_silhouettes_equal_sklearn_and_pick_the_same_cut():
    from scipy.cluster import hierarchy
    from scipy.spatial.distance import squareform
    from sklearn.metrics import silhouette_score

    rng = np.random.default_rng(1)
    for trial in range(25):
        n, d, g = int(rng.integers(4, 120)), int(rng.integers(2, 40)), int(rng.integers(1, 8))
        S = rng.normal(size=(g, d))[np.arange(n) % g] * rng.uniform(0, 3) + rng.normal(size=(n, d))
        if trial % 5 == 0:
            S[: n // 2] = S[0]  # ties and duplicates
        method = ("average", "complete", "single", "ward")[trial % 4]
        metric = "euclidean" if method == "ward" or trial % 2 else "cosine"
        Z, dist = clustering.build_tree(S, method, metric)
        labs = [hierarchy.fcluster(Z, t=k, criterion="maxclust") for k in range(2, min(16, n - 1) + 1)]
        labs = [lab for lab in labs if len(np.unique(lab)) >= 2]
        ours = clustering.silhouette_scores(dist, labs)
        ref = [silhouette_score(squareform(dist), lab, metric="precomputed") for lab in labs]
        assert np.allclose(ours, ref, rtol=0, atol=1e-12)
        for sep in (0.0, 0.1):
            assert np.array_equal(clustering.cut_auto(Z, dist, min_separation=sep),
                                  bench_clustering.cut_auto_sklearn(Z, dist, min_separation=sep))


# --------------------------------------------------------------------------- compare


def test_compare_rejects_bad_specs_before_running_anything(tmp_path, tiny_config, capsys):
    root = tmp_path / "results"
    bad = write_spec(tmp_path, tiny_config, strategies=["community", "no_such_strategy"])
    assert compare.main_compare([str(bad), "--results-root", str(root)]) == 2
    assert "no_such_strategy" in capsys.readouterr().err
    assert not root.exists()
    with pytest.raises(SpecError, match="did you mean 'seeds'"):
        spec_from_dict({"name": "x", "base": "b.yaml", "strategies": ["ring"], "sedes": [1]})
    with pytest.raises(SpecError, match="repeat"):
        spec_from_dict({"name": "x", "base": "b.yaml", "strategies": ["ring", "ring"]})
    with pytest.raises(SpecError, match="seeds"):
        spec_from_dict({"name": "x", "base": "b.yaml", "strategies": ["ring"], "seeds": [-1]})


def test_cases_are_picked_by_their_exact_name(capsys):
    """``--cases iid_64`` is the case iid_64 only, not also first_iid_64 (whose results name ends the same)."""
    from pathlib import Path

    spec = str(Path(__file__).resolve().parents[2] / "configs" / "compare" / "calibration.yaml")
    assert compare.main_compare([spec, "--cases", "iid_64", "--dry-run", "--results-root", "/nonexistent"]) == 0
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert runs and all(line.startswith("# calibration_iid_64_") for line in runs), runs
    assert compare.main_compare([spec, "--cases", "calibration_first_iid_64", "--dry-run",
                                 "--results-root", "/nonexistent"]) == 0
    runs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# ")]
    assert runs and all(line.startswith("# calibration_first_iid_64_") for line in runs), runs
    assert compare.main_compare([spec, "--cases", "first", "--dry-run"]) == 2


def test_launcher_prefixes():
    assert launcher_argv(4, "srun --mpi=pmix -n {n}") == ["srun", "--mpi=pmix", "-n", "4"]
    assert launcher_argv(3, ["srun", "--mpi=pmi2"]) == ["srun", "--mpi=pmi2", "-n", "3"]
    assert launcher_argv(2, mpiexec=sys.executable)[:3] == [sys.executable, "-n", "2"]


def test_shipped_specs_parse():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "configs" / "compare"
    specs = {s.name: s for p in sorted(root.glob("*.yaml")) for s in load_specs(p)}
    assert {"digits_groups", "mnist1d_iid", "mnist1d_dirichlet"} <= set(specs)
    assert specs["digits_groups"].base.name == "quickstart.yaml" and len(specs["digits_groups"].seeds) == 3
    assert "consensus.stop=false" in specs["digits_groups"].overrides
    assert "data.alpha=0.1" in specs["mnist1d_dirichlet"].overrides
    assert {"stragglers_digits", "stragglers_mnist1d"} <= set(specs)
    assert specs["stragglers_mnist1d"].base.name == "mnist1d.yaml"
    assert "train.budget=150" in specs["stragglers_mnist1d"].overrides
    for s in specs.values():
        assert s.base.exists()


# --------------------------------------------------------------------------- inspect


def test_bench_inspect_runs_tiny_and_prints_parseable_figures(capsys, tmp_path):
    import re

    out = tmp_path / "insp.json"
    assert main_bench(["inspect", "--ranks", "8", "--rounds", "4", "--no-svg", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "main_inspect" in text and "8 ranks x 4 rounds" in text
    rows = [ln.split() for ln in text.splitlines() if re.match(r"^\d+\s+\d+\.\d+\s+\d+\.\d+\s+\d+$", ln)]
    assert len(rows) == 1, text
    _, wall, cpu, drawn = rows[0]
    assert float(wall) > 0 and float(cpu) > 0 and int(drawn) == 4  # one dendrogram per round
    data = json.loads(out.read_text())
    (r,) = data["results"]
    assert r["dendrograms"] == 4 and r["wall_s"] > 0 and r["cpu_s"] > 0


def test_synthetic_run_is_importable_from_the_package_and_the_tests(tmp_path):
    from communities.tools import synthetic
    from tests.helpers.synthetic_run import make_run

    assert make_run is synthetic.make_run
    run = synthetic.make_run(tmp_path / "r", n_ranks=4, n_rounds=2, groups=2)
    assert (run / "summary.json").is_file() and len(list((run / "rounds").glob("round_*"))) == 2


# --------------------------------------------------------------------------- compare: bytes and wall by unit


def _rows(values, key="bytes_sent"):
    """metrics.jsonl rows for 2 ranks: values[t-1] is the per-rank figure of row t."""
    return [{"t": t, "rank": r, key: v} for t, v in enumerate(values, 1) for r in (0, 1)]


def test_bytes_to_target_count_the_units_exchanges_for_pairwise_strategies():
    # row t is written after unit t's training and before its exchanges: unit 1's exchange shows in row 2
    at = _bytes_after_unit(_rows([0, 100, 100, 250]), units=4, final_mean=300.0)
    assert [at(t) for t in range(5)] == [0.0, 100.0, 100.0, 250.0, 300.0]
    assert at(1.5) == pytest.approx(100.0)


def test_bytes_to_target_are_not_a_unit_ahead_for_allreduce():
    # allreduce: 1000 bytes of gradient Allreduces inside each unit's training (already in row t), plus a
    # 10-byte signature allgather after unit 2; the bytes by the end of unit t are row t+1 less 1000
    rows = _rows([1000, 2000, 3010, 4010])
    at = _bytes_after_unit(rows, units=4, final_mean=4010.0, trains_with_traffic=True)
    assert [at(t) for t in range(5)] == [0.0, 1000.0, 2010.0, 3010.0, 4010.0]
    # read as a pairwise strategy, row t+1 would count unit t+1's gradients: one unit too many
    wrong = _bytes_after_unit(rows, units=4, final_mean=4010.0)
    assert wrong(1) == 2000.0
    assert _sync_gradients("allreduce") and not _sync_gradients("gossip")
    assert not _sync_gradients("local_sgd") and not _sync_gradients(None)


def test_wall_to_target_is_the_slowest_ranks_wall_and_falls_back_to_the_estimate(tmp_path):
    from communities.tools import synthetic

    run = synthetic.make_run(tmp_path / "r", n_ranks=4, n_rounds=4, groups=2, every=5, seed=3)
    c = run_curve(run)
    assert c["wall_measured"]
    # synthetic rows: wall = 0.19 t + 0.001 rank; the slowest rank is rank 3
    assert np.allclose(c["wall"], 0.19 * c["t"] + 0.003)
    tt = time_to_target(c, float(c["acc"].min()))
    assert tt["wall"] == pytest.approx(0.19 * tt["t"] + 0.003) and tt["wall_measured"]

    # a run written before the field existed: the estimate wall_time * t / units
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in m.items() if k != "wall"}) + "\n"
                                               for m in lines))
    old = run_curve(run)
    assert not old["wall_measured"]
    assert np.allclose(old["wall"], old["wall_time"] * old["t"] / old["units"])


def test_compare_report_marks_estimated_wall_times(tmp_path):
    from communities.tools import synthetic

    runs = tmp_path / "results" / "cmp" / "runs"
    for seed in (0, 1):
        synthetic.make_run(runs / f"cmp_community_s{seed}", n_ranks=4, n_rounds=4, groups=2, seed=seed)
    spec = spec_from_dict({"name": "cmp", "base": "b.yaml", "strategies": ["community"], "seeds": [0, 1],
                                   "world_size": 4, "target_accuracy": 0.01})
    plans = plan_runs(spec, tmp_path / "results", ["mpiexec", "-n", "4"])
    agg = aggregate(spec, plans)
    tg = agg["strategies"]["community"]["target"]
    assert tg["reached"] == 2 and tg["wall_measured"] == 2
    write_markdown(agg, tmp_path / "a.md", spec)
    assert "(est.)" not in (tmp_path / "a.md").read_text()
    m = runs / "cmp_community_s1" / "metrics.jsonl"
    m.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "wall"}) + "\n"
                         for x in m.read_text().splitlines() if x.strip()))
    agg = aggregate(spec, plans)
    assert agg["strategies"]["community"]["target"]["wall_measured"] == 1
    write_markdown(agg, tmp_path / "b.md", spec)
    assert "(est.)" in (tmp_path / "b.md").read_text()


def test_spec_errors_name_the_file_the_case_and_the_key(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("name: m\nbase: b.yaml\nstrategies: [community]\n"
                    "cases:\n  - {name: a}\n  - {name: b, world_size: 0}\n")
    with pytest.raises(SpecError, match=r"spec\.yaml: cases\[1\]: world_size: must be a positive integer \(got 0\)"):
        load_specs(path)
    base = {"name": "x", "base": "b.yaml"}
    with pytest.raises(SpecError, match=r"unknown key 'strategies\[1\]\.strateg' \(did you mean 'strategy'\?\)"):
        spec_from_dict({**base, "strategies": ["ring", {"name": "g", "strateg": "gossip"}]})
    with pytest.raises(SpecError, match=r"strategies\[0\]: needs a name or a strategy"):
        spec_from_dict({**base, "strategies": [{"overrides": ["a=1"]}]})
    with pytest.raises(SpecError, match=r"processes: 3 does not divide world_size=8"):
        spec_from_dict({**base, "strategies": ["ring"], "processes": 3})
    with pytest.raises(SpecError, match=r"world_size: must be a positive integer \(got True\)"):
        spec_from_dict({**base, "strategies": ["ring"], "world_size": True})
    spec = spec_from_dict({**base, "strategies": ["ring", {"name": "g", "strategy": "gossip"}], "seeds": 3,
                           "overrides": {"train.lr": 0.1, "data.groups": 2}})
    assert [(a.label, a.strategy) for a in spec.arms] == [("ring", "ring"), ("g", "gossip")]
    assert spec.seeds == [0, 1, 2] and spec.overrides == ["train.lr=0.1", "data.groups=2"]


def test_markdown_tables_are_rendered_from_their_columns():
    from communities.tools.compare.tables import Column, markdown, plain

    cols = [Column("a", lambda r: str(r["a"])), Column("b b", lambda r: f"{r['b']:.1f}")]
    rows = [{"a": 1, "b": 2.0}, {"a": 10, "b": 0.25}]
    assert markdown(cols, rows, tail=lambda r: " !" if r["a"] > 5 else "") == [
        "| a | b b |", "|---|---|", "| 1 | 2.0 |", "| 10 | 0.2 | !"]
    assert plain(cols, rows) == "a   b b\n1   2.0\n10  0.2"
