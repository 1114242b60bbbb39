"""A language model's reports: bits per byte in the records, lower-is-better targets in ``compare``, loss curves
in ``inspect``; and a classifier's records as they were (no language-model key added)."""
from __future__ import annotations

import json
import logging
import math
import os

import numpy as np
import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from communities.engine.record.runlog import lm_lines, print_summary
from communities.results import (  # noqa: E402
    LANGUAGE_MODEL,
    LanguageModel,
    MetricRow,
    Summary,
    bits_per_byte,
)
from communities.tools import compare  # noqa: E402
from communities.tools.compare.curves import time_to_target, tokens_per_second  # noqa: E402
from communities.tools.compare.runs import plan_runs, validate  # noqa: E402
from communities.tools.compare.spec import SpecError, Target, load_specs, spec_from_dict  # noqa: E402

# --------------------------------------------------------------------------- records


def test_bits_per_byte_is_nats_over_ln2_over_bytes_per_token():
    assert bits_per_byte(math.log(2), 1.0) == pytest.approx(1.0)
    assert bits_per_byte(2.0, 1.0) == pytest.approx(2.0 / math.log(2))
    assert bits_per_byte(math.log(2) * 8, 4.0) == pytest.approx(2.0)  # 4 bytes per token: a quarter of the bits
    for loss, bpt in ((None, 1.0), (float("nan"), 1.0), (float("inf"), 1.0), (2.0, None), (2.0, 0.0)):
        assert bits_per_byte(loss, bpt) is None
    lm = LanguageModel(1.0, 64)
    assert lm.factor == pytest.approx(1 / math.log(2)) and lm.bpb(2.0) == pytest.approx(2.0 * lm.factor)
    assert LanguageModel(None, 64).factor is None and LanguageModel(None, 64).bpb(2.0) is None


def test_rows_carry_test_bpb_after_test_loss_and_a_classifiers_rows_stay_as_they_were():
    row = MetricRow(3, 2.5, 0.3, 0.28, 2.0, 96, 1024, 1.5)
    plain = row.to_json(1)
    assert "test_bpb" not in plain
    assert list(plain) == ["t", "rank", "loss", "train_acc", "test_acc", "test_loss", "samples", "bytes_sent", "wall"]
    lm = row.to_json(1, lm=LanguageModel(1.0, 32))
    assert list(lm) == ["t", "rank", "loss", "train_acc", "test_acc", "test_loss", "test_bpb", "samples",
                        "bytes_sent", "wall"]
    assert lm["test_bpb"] == pytest.approx(2.0 / math.log(2))
    assert {k: v for k, v in lm.items() if k != "test_bpb"} == plain
    # a unit without an evaluation: null, like its loss
    assert MetricRow(1, 2.5, 0.3, float("nan"), float("nan"), 8, 0, 0.1).to_json(0, lm=LanguageModel(1.0))[
        "test_bpb"] is None
    # a token corpus without data.lm.bytes_per_token: no bits per byte to give
    assert "test_bpb" not in row.to_json(1, lm=LanguageModel(None, 32))
    consensus = LanguageModel(2.0).with_bpb({"t": 5, "test_acc": 0.3, "test_loss": 1.0, "local_acc": 0.2})
    assert list(consensus) == ["t", "test_acc", "test_loss", "test_bpb", "local_acc"]
    assert consensus["test_bpb"] == pytest.approx(0.5 / math.log(2))


def _summary(**extra) -> Summary:
    return Summary(name="x", strategy="community", world_size=2, n_params=10, units=4, rounds=2, merges=3,
                   consensus_test_acc=0.29, consensus_test_loss=2.876, rank_test_acc=[0.28, 0.3], best_rank_acc=0.3,
                   worst_rank_acc=0.28, mean_rank_acc=0.29, communities_per_round=[1, 1], first_round_ari=None,
                   final_dispersion=0.01, consensus_reached_t=None, consensus_distance=0.02,
                   bytes_sent_per_rank=[10, 12], bytes_sent_mean=11.0, wall_time=3.0, **extra)


def test_summary_of_a_language_model_says_so_and_a_classifiers_has_none_of_its_keys():
    plain = _summary().to_dict()
    assert not {"task", "context", "bytes_per_token", "bits_per_byte_factor", "consensus_test_bpb",
                "rank_test_loss", "mean_rank_loss", "mean_rank_bpb"} & set(plain)
    assert Summary.from_dict(plain).language_model is None
    fields = LanguageModel(1.0, 64).summary_fields(2.876, np.array([2.9, float("nan"), 3.1]))
    s = _summary(**fields)
    d = s.to_dict()
    assert d["task"] == LANGUAGE_MODEL and d["context"] == 64 and d["bytes_per_token"] == 1.0
    assert d["consensus_test_bpb"] == pytest.approx(2.876 / math.log(2))
    assert d["bits_per_byte_factor"] * d["consensus_test_loss"] == pytest.approx(d["consensus_test_bpb"])
    assert d["rank_test_loss"] == [2.9, None, 3.1] and d["mean_rank_loss"] == pytest.approx(3.0)
    back = Summary.from_dict(json.loads(json.dumps(d)))
    assert back.language_model == LanguageModel(1.0, 64)
    # without bytes per token: the task and the losses, no bits
    d = _summary(**LanguageModel(None, 64).summary_fields(2.876, [2.9])).to_dict()
    assert d["task"] == LANGUAGE_MODEL and "consensus_test_bpb" not in d and "bytes_per_token" not in d


def test_a_run_directory_says_whether_it_is_a_language_models():
    assert LanguageModel.of_run(None, {}, {}) is None
    assert LanguageModel.of_run({"name": "x"}, {"groups": None}, {"data": {"dataset": "digits"}}) is None
    # a partial run: partition.json (written at the start) holds a text corpus's bytes per token
    assert LanguageModel.of_run(None, {"bytes_per_token": 1.0}, {"data": {"lm": {"context": 32}}}) == \
        LanguageModel(1.0, 32)
    assert LanguageModel.of_run({"task": LANGUAGE_MODEL, "context": 16}, {}, {}) == LanguageModel(None, 16)


def test_console_speaks_nats_and_bits_for_a_language_model(caplog, tmp_path):
    lm = LanguageModel(1.0, 64)
    s = _summary(**lm.summary_fields(2.876, [2.9, 3.1]))
    first, second = lm_lines(s, lm)
    assert first == "consensus test loss      2.876 nats/token, 4.149 bits/byte; next-token accuracy 0.2900"
    assert "best 2.900  worst 3.100" in second and "next-token accuracy mean 0.2900" in second
    with caplog.at_level(logging.INFO, logger="communities"):
        print_summary(s, tmp_path)
        print_summary(_summary(), tmp_path)
    text = caplog.text
    assert "bits/byte" in text and "consensus test accuracy  0.2900" in text  # the classifier's line as it was


def test_tensorboard_logs_bits_per_byte(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from communities import config
    from communities.engine.record.tensorboard_log import TensorBoardLog

    cfg = config.from_dict({"name": "x", "logging": {"tensorboard": True, "dendrograms": False}})
    board = TensorBoardLog(cfg, tmp_path)
    lm = LanguageModel(1.0, 8)
    board.metrics([MetricRow(2, 3.0, 0.2, 0.25, 2.0, 8, 0, 0.5).to_json(r, lm=lm) for r in range(2)])
    board.consensus([lm.with_bpb({"t": 2, "test_acc": 0.3, "test_loss": 1.5})])
    board.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    scalars = {tag: acc.Scalars(tag)[-1].value for tag in acc.Tags()["scalars"]}
    assert scalars["bpb/rank_test_mean"] == pytest.approx(2.0 / math.log(2), rel=1e-6)
    assert scalars["bpb/consensus_test"] == pytest.approx(1.5 / math.log(2), rel=1e-6)


# --------------------------------------------------------------------------- compare


SPEC = {"name": "lm", "base": "b.yaml", "strategies": ["community"]}


def test_compare_spec_takes_one_target_of_three_kinds():
    assert spec_from_dict(SPEC).target == Target("acc", 0.9)  # the default, as before
    spec = spec_from_dict({**SPEC, "target_loss": 2.5})
    assert spec.target == Target("loss", 2.5) and spec.target_accuracy is None
    assert spec.target.lower_is_better and spec.target.key == "target_loss"
    spec = spec_from_dict({**SPEC, "target_bpb": 3})
    assert spec.target == Target("bpb", 3.0) and spec.target.text() == "bpb <= 3"
    with pytest.raises(SpecError, match="target_accuracy and target_loss are set together; give one target"):
        spec_from_dict({**SPEC, "target_accuracy": 0.5, "target_loss": 2.5})
    with pytest.raises(SpecError, match="target_loss and target_bpb"):
        spec_from_dict({**SPEC, "target_loss": 2.5, "target_bpb": 3.0})
    for bad in (0, -1.0, float("nan"), float("inf"), True, "2.5", [2.5]):
        with pytest.raises(SpecError, match=r"target_loss: must be a positive number \(nats per token"):
            spec_from_dict({**SPEC, "target_loss": bad})
        with pytest.raises(SpecError, match=r"target_bpb: must be a positive number \(bits per byte"):
            spec_from_dict({**SPEC, "target_bpb": bad})
    with pytest.raises(SpecError, match="did you mean 'target_loss'"):
        spec_from_dict({**SPEC, "target_los": 2.5})


def test_a_cases_target_replaces_the_specs_of_any_kind(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("name: m\nbase: b.yaml\nstrategies: [community]\ntarget_accuracy: 0.8\ncases:\n"
                    "  - {name: digits}\n  - {name: text, target_bpb: 2.5}\n  - {name: bad, target_los: 1}\n")
    with pytest.raises(SpecError, match=r"cases\[2\]: unknown key"):
        load_specs(path)
    path.write_text(path.read_text().replace("  - {name: bad, target_los: 1}\n", ""))
    digits, text = load_specs(path)
    assert digits.target == Target("acc", 0.8) and text.target == Target("bpb", 2.5)


def test_target_bpb_needs_a_corpus_with_known_bytes_per_token(tiny_config):
    spec = spec_from_dict({**SPEC, "base": str(tiny_config), "world_size": 2, "target_bpb": 2.0})
    plans = plan_runs(spec, tiny_config.parent / "results", ["mpiexec", "-n", "2"])
    (problem,) = validate(spec, plans)
    assert "target_bpb needs a language model's corpus" in problem and "target_loss" in problem
    loss = spec_from_dict({**SPEC, "base": str(tiny_config), "world_size": 2, "target_loss": 2.0})
    assert validate(loss, plan_runs(loss, tiny_config.parent, ["mpiexec"])) == []


def _curve(acc, loss, bpb=None):
    t = np.arange(1, len(acc) + 1, dtype=float)
    return {"t": t, "acc": np.asarray(acc, float), "loss": np.asarray(loss, float),
            "bpb": np.asarray(bpb if bpb is not None else [np.nan] * len(acc), float), "bytes": 100 * t,
            "wall": 0.5 * t, "wall_measured": True}


def test_time_to_a_loss_target_is_the_first_evaluation_at_or_below_it():
    c = _curve([0.1, 0.2, 0.3, 0.25], [5.0, float("nan"), 3.0, 2.5], [7.2, 5.0, 4.3, 3.6])
    hit = time_to_target(c, Target("loss", 3.0))
    assert hit == {"t": 3.0, "bytes": 300.0, "wall": 1.5, "wall_measured": True, "loss": 3.0}
    assert time_to_target(c, Target("bpb", 5.0))["t"] == 2.0  # NaN loss there, bpb known
    assert time_to_target(c, Target("loss", 2.0)) is None
    # an accuracy target is still higher-is-better, and a plain float is an accuracy
    assert time_to_target(c, Target("acc", 0.25))["t"] == 3.0
    assert time_to_target(c, 0.2) == {"t": 2.0, "bytes": 200.0, "wall": 1.0, "wall_measured": True,
                                              "acc": 0.2}
    assert time_to_target({k: v for k, v in c.items() if k != "bpb"}, Target("bpb", 9.0)) is None


def test_tokens_per_second_per_rank_from_samples_context_and_wall():
    rows = [{"t": t, "rank": r, "samples": 10 * t * (r + 1)} for t in (1, 2) for r in (0, 1)]
    s = _summary(**LanguageModel(1.0, 8).summary_fields(2.9, [2.9, 3.0]))
    s.time_split_per_rank = {"wall": [2.0, 4.0]}
    # rank 0: 20 windows x 8 tokens / 2 s = 80; rank 1: 40 x 8 / 4 s = 80
    assert tokens_per_second(rows, s) == pytest.approx(80.0)
    s.time_split_per_rank = {}  # older summaries: the slowest rank's wall time
    assert tokens_per_second(rows, s) == pytest.approx((160 + 320) / 2 / 3.0)
    s.context = None
    assert tokens_per_second(rows, s) is None


# --------------------------------------------------------------------------- a language model's run, read back


def _as_language_model(run):
    """Turn a synthetic classifier run into a language model's, as the engine writes one (byte corpus)."""
    lm = LanguageModel(1.0, 16)
    for name in ("metrics.jsonl", "consensus.jsonl"):
        rows = [json.loads(x) for x in (run / name).read_text().splitlines() if x.strip()]
        for r in rows:
            if r.get("test_loss") is not None:
                r["test_loss"] = 3.0 + r["test_loss"]
        (run / name).write_text("".join(json.dumps(lm.with_bpb(r)) + "\n" for r in rows))
    s = json.loads((run / "summary.json").read_text())
    s["consensus_test_loss"] = 3.1
    s.update(lm.summary_fields(3.1, [3.2] * s["world_size"]))
    (run / "summary.json").write_text(json.dumps(s))
    return lm


def test_compare_reports_losses_of_language_model_runs(tmp_path, capsys):
    from communities.tools import synthetic

    runs = tmp_path / "results" / "lm" / "runs"
    for seed in (0, 1):
        _as_language_model(synthetic.make_run(runs / f"lm_community_s{seed}", n_ranks=4, n_rounds=4, groups=2,
                                              seed=seed))
    spec = spec_from_dict({**SPEC, "seeds": [0, 1], "world_size": 4, "target_loss": 3.2})
    plans = plan_runs(spec, tmp_path / "results", ["mpiexec", "-n", "4"])
    public = compare.write_report(spec, plans, tmp_path / "results")
    assert public["target_loss"] == 3.2 and "target_accuracy" not in public
    a = public["strategies"]["community"]
    assert a["consensus_test_loss"]["mean"] == pytest.approx(3.1)
    assert a["consensus_test_bpb"]["mean"] == pytest.approx(3.1 / math.log(2))
    assert a["tokens_per_s_per_rank"]["n"] == 2 and a["tokens_per_s_per_rank"]["mean"] > 0
    assert a["target"]["loss"] == 3.2 and a["target"]["lower_is_better"] and a["target"]["reached"] == 2
    first = [r for r in public["runs"] if r["seed"] == 0][0]
    assert first["task"] == LANGUAGE_MODEL and first["target"]["loss"] <= 3.2
    out = tmp_path / "results" / "lm"
    md = (out / "compare.md").read_text()
    assert "consensus test loss (nats/token) | bits/byte | next-token acc" in md and "reached loss <= 3.2" in md
    assert "with test loss <= 3.2 nats per token" in md and "(loss_vs_bytes.png)" in md
    assert (out / "loss_vs_bytes.png").is_file() and not (out / "acc_vs_bytes.png").exists()
    table = compare.summary_table(public)  # what the command prints, from compare.json's figures
    assert "consensus loss" in table and "tokens/s/rank" in table and "t to loss <= 3.2" in table


def test_inspect_draws_a_language_models_losses(tmp_path, capsys):
    from communities.report.inspection import main_inspect
    from communities.report.load import load_view, summary_text
    from communities.tools import synthetic

    run = synthetic.make_run(tmp_path / "lm", n_ranks=4, n_rounds=3, groups=2)
    plain = summary_text(load_view(run))
    assert "final accuracy:" in plain and "nats/token" not in plain
    _as_language_model(run)
    view = load_view(run)
    assert view.lm == LanguageModel(1.0, 16) and np.isfinite(view.test_loss).any()
    assert np.isfinite(view.consensus_loss).all()
    text = summary_text(view)
    assert "final loss: consensus 3.1 nats/token (4.472 bits/byte)" in text
    assert "next-token accuracy: consensus" in text and "final accuracy:" not in text
    out = tmp_path / "report"
    assert main_inspect([str(run), "--out", str(out), "--last", "--no-svg"]) == 0
    assert (out / "loss.png").stat().st_size > 0 and 'src="loss.png"' in (out / "index.html").read_text()
    assert "final loss:" in capsys.readouterr().out
