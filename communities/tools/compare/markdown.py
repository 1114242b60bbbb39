"""compare.md: a comparison's tables (``tables``), what each figure means, its plots and every run."""
from __future__ import annotations

from pathlib import Path
from typing import List

from .aggregate import plotted_metric, target_of
from .spec import Spec, Target
from .tables import Kinds, markdown, personal_columns, run_columns, run_error, strategy_columns, strategy_rows

# what the plots draw against bytes and wall time: a classifier's accuracy, a language model's loss (or bits per
# byte when that is its target)
CURVE_TITLES = {"acc": "accuracy", "loss": "loss", "bpb": "bits per byte"}

PERSONAL_NOTES = [
    "- *delivered*: the model each rank ends with (summary `local_test.delivered`): the `consensus` (mean of "
    "every rank), its frozen community's model (`communities (C)`: C communities, consensus.mode), its IFCA "
    "pick (`ifca (k)`: k shared models that some rank picked), the consensus fine-tuned on its shard "
    "(`finetuned`), or its `own` model (isolated ranks).",
    "- *mean local-test acc*: that model's accuracy on each rank's local test data (held out of its own "
    "shard, `data.local_test_fraction`, its own group's distribution), averaged over the ranks "
    "(summary `local_test.mean_acc`).",
    "- *consensus test acc*: the mean of every rank's weights on the shared test split (pooled over the "
    "groups under a `data.shift`).",
    "- *first-round ARI*: the first signature round's communities against the planted groups.",
]
LM_NOTES = [
    "- *consensus test loss*: the final Allreduce-mean model's mean cross-entropy per token on the shared "
    "held-out windows, in nats (summary `consensus_test_loss`); *bits/byte*: the same over ln 2 and the "
    "corpus's bytes per token (summary `consensus_test_bpb`; 1 byte per token for a byte corpus); "
    "*next-token acc*: its share of next tokens predicted right.",
    "- *tokens/s / rank*: the tokens a rank trained on (metrics.jsonl `samples`, windows, x summary `context`) "
    "over its loop's wall time (summary `time_split_per_rank`), averaged over the ranks.",
]
CLASSIFIER_NOTES = [
    "- *consensus test acc*: the final Allreduce-mean model on the shared test split (summary.json).",
    "- *best-rank acc*: the best single rank's own model at the end.",
]


def figure_notes(target: Target, lm: bool) -> List[str]:
    """What each figure of the main table means and where it comes from."""
    return (LM_NOTES if lm else CLASSIFIER_NOTES) + [
        "- *MB sent / rank*: bytes sent per rank over the run (mean over ranks; 1 MB = 10^6 bytes) as the engine "
        "counts them: exchanges and their metadata, signature allgathers, Allreduces (as ring traffic). The "
        "Allreduces that only evaluate the consensus model (summary `monitoring_bytes_mean`) and passed training "
        "examples (*data MB / rank*, summary `data_bytes_mean`) are counted apart.",
        "- *epsilon*: with `privacy.enabled`, the worst replica's epsilon at the end (summary `privacy`, at "
        "`privacy.delta`); `inf`: trained without privacy.",
        "- *retired %*: share of the training examples retired at the end (summary `examples`), where tracked.",
        "- *wall s*: the slowest rank's training loop (summary.json `wall_time`), without process start-up.",
        "- *idle %*: the share of its wall time a rank spent waiting for others (summary `time_split_per_rank`: "
        "waits in exchanges, gathers and Allreduces), averaged over the ranks not slowed on purpose "
        "(`faults.speed`).",
        f"- *to target*: the first consensus evaluation (consensus.jsonl, every `output.consensus_every` or "
        f"`train.eval_every` units, plus the final model) with {target.phrase()}; averaged over the "
        "seeds that reached it. *MB to target* is the mean over ranks of the bytes sent up to and including "
        "that unit (metrics.jsonl `bytes_sent`, whose row t is written after unit t's training and before its "
        "exchanges: row t+1 for every strategy, less unit t+1's own gradient Allreduces for allreduce; "
        "interpolated between units). *wall s to target* is the slowest rank's metrics.jsonl `wall` at that "
        "unit (seconds since its run started, taken right after training it); runs written before that field "
        "existed get an estimate, `wall_time * t / units` (marked est.), which assumes units of equal cost. "
        "Under `protocol: async`, ranks are at different units at any moment: the curve is the consensus of "
        "weight snapshots taken every `output.snapshot_seconds` of wall clock (consensus.jsonl `wall`), its t "
        "the mean unit over the ranks then.",
    ]


def write_markdown(agg: dict, path: Path, spec: Spec) -> None:
    target = target_of(agg)
    kinds = Kinds.of(agg["runs"])
    plotted = plotted_metric(target, kinds.lm)
    lines = [f"# Comparison `{agg['name']}`", ""]
    if spec.description:
        lines += [spec.description.strip(), ""]
    lines += [
        f"Base config `{agg['base']}`, {agg['world_size']} ranks, seeds {agg['seeds']}"
        + (f", common overrides `{' '.join(agg['overrides'])}`" if agg["overrides"] else "") + ".",
        "",
    ]
    if kinds.personal:
        lines += markdown(personal_columns(), strategy_rows(agg)) + ["", *PERSONAL_NOTES, ""]
    lines += markdown(strategy_columns(target, kinds), strategy_rows(agg))
    lines += ["", "Figures are mean ± sample standard deviation (ddof=1) over the seeds that completed; one seed "
              "shows no ±.", ""]
    lines += figure_notes(target, kinds.lm)
    lines += ["", f"![consensus {CURVE_TITLES[plotted]} vs bytes]({plotted}_vs_bytes.png)",
              f"![consensus {CURVE_TITLES[plotted]} vs wall time]({plotted}_vs_wall.png)", "", "## Runs", ""]
    lines += markdown(run_columns(kinds), agg["runs"], tail=run_error)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
