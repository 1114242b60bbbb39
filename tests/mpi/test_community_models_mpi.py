"""One model or several (issue 15), under a real mpiexec: community models, export, auto, IFCA, fine-tuning.

Every run is the tiny config on 4 ranks (2 planted groups of 2), run as 4 replicas on 2 MPI processes, with each
rank holding out 20% of its shard as its local test data; "label-permuted" means IID shards where group 1 sees every
label under a fixed permutation, the conflict one consensus model cannot serve. The module's uninterrupted runs are
one batch (one mpiexec), the two resumes (of copies of the auto and IFCA runs, from their checkpoint at t=20) a
second.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from communities.results import read_jsonl, read_run
from tests.conftest import TINY
from tests.helpers.mpi import ROOT, Job, TinyRuns, run_batch

pytestmark = pytest.mark.timeout(900)

PERMUTED = ["data.partition=iid", "data.shift=label_permutation", "data.local_test_fraction=0.2"]
IID = ["data.partition=iid", "data.local_test_fraction=0.2", "train.budget=30"]
CHECKPOINTED = ["train.budget=30", "checkpoint.every=10", "checkpoint.at_end=false"]
AUTO = [*PERMUTED, "consensus.mode=auto", *CHECKPOINTED]
IFCA = [*PERMUTED, "strategy=ifca", "ifca.k=2", "merge.period=2", *CHECKPOINTED]
# issue 23: IFCA started fairly and the oracle, on digits (2 label-permuted groups of 2 ranks), a few units each
DIGITS = [*PERMUTED, "data.dataset=digits", "merge.period=2"]
IFCA_WARMUP = [*DIGITS, "strategy=ifca", "ifca.k=2", "ifca.init=warmup", "ifca.warmup_units=6", "train.budget=10"]
IFCA_RESTARTS = [*DIGITS, "strategy=ifca", "ifca.k=2", "ifca.init=restarts", "ifca.restarts=3",
                 "ifca.warmup_units=2", "train.budget=8"]
ORACLE = [*DIGITS, "strategy=oracle", "train.budget=6"]
N = 4
PROCESSES = 2  # the N replicas run as a population on 2 MPI processes (placement changes no bit)
PLUGIN_EXAMPLE = ROOT / "examples" / "plugins" / "config.yaml"
# runs that need more ranks than the world has: {name: (overrides, what the error names)}
BAD = {"shift_groups": ([*PERMUTED, "data.groups=5"], "data.groups=5 planted groups need at least as many ranks"),
       "mode_k": (["consensus.mode=communities", "consensus.k=9"], "consensus.k=9 communities need at least")}


def population(jobs: dict) -> dict:
    """The jobs with their world size pinned to N replicas, for a batch on PROCESSES processes."""
    return {name: job._replace(overrides=[*job.overrides, f"world_size={N}"]) for name, job in jobs.items()}


def identical(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def flat_of(state: dict, run_dir: Path) -> torch.Tensor:
    """A saved state_dict as the engine's flat buffer (workload.models.flatten_ order)."""
    from communities import config
    from communities.workload import data, models

    cfg = config.from_dict(read_run(run_dir).config)
    ds = data.load(cfg.data, cfg.seed)
    model = models.build(cfg.model, ds.input_shape, ds.n_classes)
    flat, _ = models.flatten_(model)
    model.load_state_dict(state)
    return flat


def delivered(run: Path) -> dict:
    """The models a run delivered: consensus.pt and models/*.pt, by file name."""
    return {p.name: torch.load(p, weights_only=True) for p in [run / "consensus.pt", *run.glob("models/*.pt")]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The module's uninterrupted runs, in one batch: consensus.mode communities on label-permuted groups with
    round snapshots (40 units, rounds every 5), auto on the same groups, auto and global (fine-tuned) on IID
    shards, and IFCA with k=2; two runs the world size refuses (BAD); and a sharded reader with local tests."""
    root = tmp_path_factory.mktemp("community_models")
    config = root / "tiny.yaml"
    config.write_text(TINY)
    jobs = {name: Job(config, root / name, overrides) for name, overrides in {
        "communities": [*PERMUTED, "consensus.mode=communities", "output.round_snapshots=true"],
        "auto": AUTO,
        "auto_iid": [*IID, "consensus.mode=auto"],
        "global_iid": [*IID, "consensus.finetune_units=3"],
        "ifca": IFCA,
        "ifca_warmup": IFCA_WARMUP,
        "ifca_restarts": IFCA_RESTARTS,
        "oracle": ORACLE,
        **{name: overrides for name, (overrides, _) in BAD.items()}}.items()}
    # the docs' sharded reader (each rank reads its own shard): its ranks hold out their local tests themselves
    jobs["sharded"] = Job(PLUGIN_EXAMPLE, root / "sharded", ["data.dataset=my_data:blobs_sharded", "train.budget=15",
                                                              "data.local_test_fraction=0.2"])
    results = run_batch(PROCESSES, population(jobs), check=False)
    for name, res in results.items():
        assert name in BAD or res.returncode == 0, f"{name} exited {res.returncode}\n{res.stderr[-3000:]}"
    return TinyRuns(root, config, results)


@pytest.fixture(scope="module")
def resumed(runs, tmp_path_factory):
    """Copies of the auto and IFCA runs, set back to interrupted, resumed from their checkpoint at t=20."""
    root = tmp_path_factory.mktemp("resumed")
    jobs = {}
    for name, overrides in (("auto", AUTO), ("ifca", IFCA)):
        run = root / name / "tiny"
        shutil.copytree(runs[name], run)
        for product in ["summary.json", "consensus.pt", *[str(p.relative_to(run)) for p in run.glob("models/*")]]:
            (run / product).unlink()
        meta = run / "meta.json"
        meta.write_text(meta.read_text().replace('"complete"', '"interrupted"'))
        jobs[name] = Job(runs.config, root / name, overrides, extra=["--resume"])
    run_batch(PROCESSES, population(jobs))
    return {name: root / name / "tiny" for name in jobs}


@pytest.fixture(scope="module")
def communities_run(runs) -> Path:
    return runs["communities"]


def test_community_models_are_the_mean_of_their_members_weights(communities_run):
    record = json.loads((communities_run / "models" / "communities.json").read_text())
    assert record["kind"] == "communities" and record["round"] == 7 and record["t"] == 40  # the last round
    assert record["labels"] == [0, 0, 1, 1] and record["frozen_round"] == 0
    for e in record["models"]:
        snaps = [torch.load(communities_run / "snapshots" / "round_0007" / f"rank{r:05d}.pt", weights_only=True)
                 for r in e["members"]]
        assert all(s["t"] == 40 and s["round"] == 7 for s in snaps)
        # the snapshots at t=40 are the final weights; the engine sums them in float64 (Split + Allreduce)
        mean = torch.stack([s["flat"] for s in snaps]).double().mean(0).float()
        model = torch.load(communities_run / e["file"], weights_only=True)
        assert torch.equal(flat_of(model, communities_run), mean)  # exactly: a float64 sum of 2 floats is exact
        other = [r for r in range(N) if r not in e["members"]][0]
        own = torch.load(communities_run / "snapshots" / "round_0007" / f"rank{other:05d}.pt", weights_only=True)
        assert not torch.equal(own["flat"], mean)


def test_summary_reports_the_decision_and_the_local_test_accuracy(communities_run):
    s = json.loads((communities_run / "summary.json").read_text())
    assert s["consensus_mode"]["decision"] == "communities" and s["consensus_mode"]["communities"] == 2
    lt = s["local_test"]
    assert lt["delivered"] == "communities" and len(lt["acc"]) == N and lt["sizes"] == [30] * N
    # one model per group serves its members; the one consensus cannot serve conflicting labels
    assert lt["mean_acc"] > lt["mean_consensus_acc"] + 0.2
    assert s["first_round_ari"] == 1.0
    meta = json.loads((communities_run / "meta.json").read_text())
    assert {"models/community_0.pt", "models/community_1.pt"} <= set(meta["files"])  # digests for inspect
    metrics = read_jsonl(communities_run / "metrics.jsonl")
    assert all("local_acc" in m for m in metrics) and any(m["local_acc"] is not None for m in metrics)
    rounds = read_run(communities_run).rounds()
    assert rounds[-1].info["consensus_mode"]["frozen_labels"] == [0, 0, 1, 1]
    assert rounds[-1].info["law"] == "frozen" and rounds[-1].info["p_cross"] == 0.0
    merges = read_jsonl(communities_run / "merges.jsonl")
    assert merges and all(m["i"] // 2 == m["j"] // 2 for m in merges if m["t"] > 5)  # no cross merge once frozen


def test_export_reproduces_what_the_engine_saved_at_the_same_round(communities_run, tmp_path, capsys):
    from communities.tools.export import main_export

    out = tmp_path / "export"
    assert main_export([str(communities_run), "--round", "7", "--k", "2", "--out", str(out)]) == 0
    assert "2 communities" in capsys.readouterr().out
    engine = json.loads((communities_run / "models" / "communities.json").read_text())
    mine = json.loads((out / "communities.json").read_text())
    assert mine["labels"] == engine["labels"]
    for a, b in zip(engine["models"], mine["models"]):
        assert a["members"] == b["members"]
        assert identical(torch.load(communities_run / a["file"], weights_only=True),
                         torch.load(out / b["file"], weights_only=True))
        assert b["local_test_acc"] == pytest.approx(a["local_test_acc"], abs=1e-12)
        assert b["test_acc"] == pytest.approx(a["test_acc"], abs=1e-12)
    # an earlier round, by height, lands in RUN/exports/ where inspect finds it
    Z = np.load(communities_run / "rounds" / "round_0002" / "Z.npy")
    assert main_export([str(communities_run), "--round", "2", "--height", str(float(Z[-1, 2]) * 1.01)]) == 0
    assert (communities_run / "exports" / f"round_0002_h{float(Z[-1, 2]) * 1.01:g}" / "community_0.pt").is_file()


def test_export_refuses_bad_input_naming_it(communities_run, tmp_path, capsys):
    from communities.tools.export import main_export

    assert main_export([str(communities_run), "--round", "99", "--k", "2"]) == 2
    err = capsys.readouterr().err
    assert "round_0099: no such round" in err and "rounds 0..7" in err
    assert main_export([str(communities_run), "--round", "1", "--k", "0"]) == 2
    assert "--k 0" in capsys.readouterr().err
    bare = tmp_path / "bare"
    shutil.copytree(communities_run, bare, ignore=shutil.ignore_patterns("snapshots"))
    assert main_export([str(bare), "--round", "1", "--k", "2"]) == 2
    err = capsys.readouterr().err
    assert "rank00000.pt: missing" in err and "output.round_snapshots=true" in err


def test_inspect_shows_the_models_beside_their_round(communities_run, tmp_path, capsys):
    from communities.report.inspection import main_inspect

    assert main_inspect([str(communities_run), "--out", str(tmp_path / "report"), "--round", "7", "--no-svg"]) == 0
    text = capsys.readouterr().out
    assert "froze 2 communities at round 0" in text and "local test accuracy: delivered (communities)" in text
    page = (tmp_path / "report" / "index.html").read_text()
    assert "Community models of round 7" in page and "<h3>Community models</h3>" in page


@pytest.mark.parametrize("name", sorted(BAD))
def test_the_world_size_refuses_bad_keys_before_any_rank_trains(runs, name):
    res = runs.result[name]
    assert res.returncode == 2 and BAD[name][1] in res.stderr and "Traceback" not in res.stderr
    assert not (runs[name] / "metrics.jsonl").exists()


def test_a_sharded_readers_ranks_hold_out_their_own_local_tests(runs):
    run = runs.root / "sharded" / "plugins_example-my_data.blobs_sharded"
    partition = json.loads((run / "partition.json").read_text())
    assert partition["partition"] == "sharded" and partition["local_test_sizes"] == [45] * N  # 20% of 225
    assert partition["shard_sizes"] == [180] * N and [sum(c) for c in partition["label_counts"]] == [180] * N
    lt = json.loads((run / "summary.json").read_text())["local_test"]
    assert lt["delivered"] == "consensus" and lt["sizes"] == [45] * N
    assert lt["mean_acc"] >= 0.9  # three well-separated blobs


def test_auto_freezes_on_label_permuted_groups(runs):
    run = runs["auto"]
    s = json.loads((run / "summary.json").read_text())
    mode = s["consensus_mode"]
    assert mode["decision"] == "communities" and mode["communities"] == 2 and mode["frozen_round"] <= 3
    verdict = mode["evidence"]["last_verdict"]
    assert verdict["decision"] == "freeze" and verdict["harm"] > 0.5 and verdict["cross_merges"] >= 4
    assert s["community_models"]["labels"] == [0, 0, 1, 1]  # the planted groups
    assert s["local_test"]["mean_acc"] > s["local_test"]["mean_consensus_acc"]
    rounds = read_run(run).rounds()
    weighed = [r.info["consensus_mode"]["verdict"] for r in rounds if r.info["consensus_mode"]["verdict"]]
    assert weighed and weighed[-1] == verdict  # the evidence per round in rounds/, the last one in summary.json


def test_auto_resumed_after_the_freeze_ends_with_the_same_bits(runs, resumed):
    saved, again = delivered(runs["auto"]), delivered(resumed["auto"])
    assert saved.keys() == again.keys() and "community_0.pt" in saved
    for name, state in saved.items():
        assert identical(state, again[name]), name
    assert json.loads((resumed["auto"] / "summary.json").read_text())["consensus_mode"] == \
        json.loads((runs["auto"] / "summary.json").read_text())["consensus_mode"]


def test_auto_on_iid_data_keeps_merging_and_changes_no_bit(runs):
    auto, glob = runs["auto_iid"], runs["global_iid"]
    s = json.loads((auto / "summary.json").read_text())
    assert s["consensus_mode"]["decision"] == "consensus" and s["local_test"]["delivered"] == "consensus"
    assert "community_models" not in s and not (auto / "models").exists()
    # scoring merges reads the weights and changes none: the consensus is the global run's, bit for bit
    assert identical(torch.load(auto / "consensus.pt", weights_only=True),
                     torch.load(glob / "consensus.pt", weights_only=True))
    g = json.loads((glob / "summary.json").read_text())["local_test"]
    assert g["delivered"] == "finetuned" and len(g["finetuned_acc"]) == N and g["acc"] == g["finetuned_acc"]
    assert g["mean_consensus_acc"] == pytest.approx(s["local_test"]["mean_consensus_acc"])


def test_ifca_trains_k_shared_models(runs):
    run = runs["ifca"]
    s = json.loads((run / "summary.json").read_text())
    record = s["community_models"]
    assert record["kind"] == "ifca" and record["k"] == 2 and len(record["models"]) == 2
    assert sorted(r for m in record["models"] for r in m["members"]) == list(range(N))  # each rank picked one
    assert s["local_test"]["delivered"] == "ifca" and len(s["local_test"]["acc"]) == N
    averages = [m for m in read_jsonl(run / "merges.jsonl") if m["event"] == "average"]
    assert sorted({m["t"] for m in averages}) == list(range(2, 31, 2)) and all(m["j"] == -1 for m in averages)
    # ranks that picked the same model hold the same weights: their signatures coincide
    last = read_run(run).rounds()[-1]
    for m in record["models"]:
        rows = last.signatures[m["members"]]
        assert all(np.array_equal(rows[0], r) for r in rows)


def digits_run(runs, name: str) -> Path:
    """The run directory of a digits job (the CLI names it after the dataset: tiny-digits)."""
    [run] = (runs.root / name).iterdir()
    return run


def averaged_at(run: Path) -> dict:
    """{rank: the units at which it took part in an average}."""
    out: dict = {}
    for m in read_jsonl(run / "merges.jsonl"):
        if m["event"] == "average":
            out.setdefault(m["i"], []).append(m["t"])
    return out


def test_ifca_warmup_kmeans_recovers_the_planted_groups(runs):
    run, out = digits_run(runs, "ifca_warmup"), runs.result["ifca_warmup"].stdout
    assert "k-means of the local models after 6 units assigns clusters [0, 0, 1, 1]" in out
    # units 1..6 local training; at 6 each cluster's model the mean of its members; then IFCA every 2 units
    assert averaged_at(run) == {r: [6, 8, 10] for r in range(N)}
    record = json.loads((run / "summary.json").read_text())["community_models"]
    assert record["kind"] == "ifca" and record["labels"] == [0, 0, 1, 1]


def test_ifca_restarts_keep_the_lowest_training_loss_start(runs):
    run, out = digits_run(runs, "ifca_restarts"), runs.result["ifca_restarts"].stdout
    [line] = [x for x in out.splitlines() if "ifca.init=restarts" in x]
    losses = json.loads(line.split("per start ")[1].split(";")[0])
    kept = int(line.rsplit("kept start ", 1)[1])
    assert len(losses) == 3 and np.isfinite(losses).all() and kept == int(np.argmin(losses))
    assert averaged_at(run) == {r: [2, 4, 6, 8] for r in range(N)}  # each start's end, then IFCA


def test_the_oracle_trains_exactly_the_planted_groups(runs):
    run = digits_run(runs, "oracle")
    planted = json.loads((run / "partition.json").read_text())["groups"]
    s = json.loads((run / "summary.json").read_text())
    record = s["community_models"]
    assert planted == [0, 0, 1, 1] and record["labels"] == planted and record["k"] == 2
    assert [m["members"] for m in record["models"]] == [[0, 1], [2, 3]]
    assert averaged_at(run) == {r: [2, 4, 6] for r in range(N)}
    # the members of a group end on its model, the groups on different ones
    models = {m["community"]: torch.load(run / m["file"], weights_only=True) for m in record["models"]}
    assert not identical(models[0], models[1])


def test_ifca_resumed_ends_with_the_same_bits(runs, resumed):
    saved, again = delivered(runs["ifca"]), delivered(resumed["ifca"])
    assert saved.keys() == again.keys() and len(saved) == 3  # the consensus and the k=2 models
    for name, state in saved.items():
        assert identical(state, again[name]), name
