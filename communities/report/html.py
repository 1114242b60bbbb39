"""The HTML report and tables of ``communities inspect``.

What it writes to the report directory (``--out``), beside the figures of ``figures.py``:

- ``index.html``: opens from disk (relative image paths, no server, no JS): the
  curves, then per run its terminal summary, warnings, a language model's losses, timeline, merge matrix,
  dendrograms, the per-round table, ``summary.json`` and ``meta.json``; a
  comparison adds a table of the runs' summaries side by side;
- ``rounds.csv``: the per-round table (t, communities, dispersion, cophenetic, ARI);
  in a comparison report one per run, ``runK_rounds.csv``.
"""
from __future__ import annotations

import csv
import html
from pathlib import Path
from typing import List, Sequence, Tuple

from .figures import LARGE_WORLD, RunFigures
from .load import RunView, community_model_rows, compress_counts, fmt, models_at_round, round_rows, summary_text

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1600px;color:#222}
img{max-width:100%;border:1px solid #ddd;margin:.3em 0}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;vertical-align:top}
th{background:#f3f3f3} td.k{text-align:left;font-family:monospace}
pre{background:#f7f7f7;padding:.6em;overflow-x:auto} .note{color:#a50}
section{margin-bottom:2em}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _value_html(v) -> str:
    """A summary/meta value in a table cell; long lists are shortened."""
    if isinstance(v, dict):
        return ", ".join(f"{_e(k)}: {_e(fmt(x))}" for k, x in v.items())
    if isinstance(v, list):
        shown = ", ".join(_e(fmt(x)) for x in v[:16])
        return f"[{shown}{', ...' if len(v) > 16 else ''}]" + (f" ({len(v)} values)" if len(v) > 16 else "")
    return _e(fmt(v, 4))


def _img(names: List[str], alt: str) -> str:
    links = " ".join(f'<a href="{_e(n)}">{_e(n.rsplit(".", 1)[1])}</a>' for n in names)
    return f'<figure><img src="{_e(names[0])}" alt="{_e(alt)}" loading="lazy"><figcaption>{links}</figcaption></figure>'


def _kv_table(d: dict) -> str:
    rows = "".join(f'<tr><td class="k">{_e(k)}</td><td style="text-align:left">{_value_html(v)}</td></tr>'
                   for k, v in d.items())
    return f"<table>{rows}</table>"


def _round_table(rows: List[dict]) -> str:
    if not rows:
        return "<p>No complete signature round.</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{_e(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_e(fmt(r[c], 4))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_csv(path: Path, rows: List[dict]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        if not rows:
            return
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)



def run_section(view: RunView, out: Path, prefix: str, figs: RunFigures, note: str, *, heading: bool) -> str:
    """One run's figures and tables (shared by the single-run and the comparison report); writes its rounds.csv."""
    parts = [f'<section><h2>{_e(view.label)}</h2><p><code>{_e(view.path)}</code></p>' if heading else "<section>"]
    parts.append(f"<pre>{_e(summary_text(view))}</pre>")
    for msg in view.notes:
        parts.append(f'<p class="note">{_e(msg)}</p>')
    if figs.loss is not None:
        parts.append("<h3>Loss</h3><p>A language model: its test loss is the mean cross-entropy per token on the "
                     "held-out windows, in nats (bits per byte on the right axis where the corpus's bytes per "
                     "token are known); lower is better. Its accuracies are next-token accuracies.</p>")
        parts.append(_img(figs.loss, "loss over t"))
    if figs.timeline is not None:
        parts.append("<h3>Community timeline</h3><p>Each round's communities are matched to the previous "
                     "round's by largest overlap: a community keeps its id (and colour) across rounds, the "
                     "smaller part of a split gets a new id, and a merge keeps the id of its larger part. "
                     "Dendrogram links use the same colours.</p>")
        parts.append(_img(figs.timeline, "community timeline"))
    large = view.n > LARGE_WORLD and bool(view.infos)
    parts.append("<h3>Merge matrix</h3>")
    if large:
        parts.append(f"<p>{view.n} ranks: the exchanges are aggregated by community (community x community "
                     "counts of the whole run, under the communities of the first round and of the last round "
                     "with several), as a rank x rank matrix would be unreadable.</p>")
    parts.append(_img(figs.merge_matrix, "merge matrix"))
    if figs.views is not None:
        parts.append("<h3>Agreement of the views</h3><p>Under <code>protocol: async</code> each rank clusters its "
                     "own signature table, so the ranks' communities may differ for a while. The dendrograms "
                     "below are rank 0's view; this is how far every other rank's view agreed with rank 0's at "
                     "the same wall time (adjusted Rand index, from views.jsonl).</p>")
        parts.append(_img(figs.views, "agreement of the views"))
    if figs.privacy is not None:
        parts.append("<h3>Privacy</h3><p>Each replica's epsilon after every unit (<code>privacy.enabled</code>, "
                     "from metrics.jsonl): how much of its shard's privacy the run has spent.</p>")
        parts.append(_img(figs.privacy, "privacy spent"))
    if figs.hyper is not None:
        parts.append("<h3>Learnt hyperparameters</h3><p>Each replica's values after every unit (<code>pbt</code>, "
                     "from metrics.jsonl), coloured by its community in the last round: a step is an adoption of "
                     "a better partner's values, perturbed.</p>")
        parts.append(_img(figs.hyper, "learnt hyperparameters"))
    parts.append(f"<h3>Dendrograms</h3><p>{_e(note)}.</p>")
    if large and figs.dendrograms:
        parts.append(f"<p>{view.n} ranks: each tree is truncated to the communities of its round (one leaf per "
                     "community, <code>cX (k)</code>: community X of k ranks, colours as in the timeline); ticks "
                     "on a leaf mark the merges inside it.</p>")
    for r, names in figs.dendrograms:
        models = [row for rec in models_at_round(view, r) for row in community_model_rows(rec)]
        if models:  # side by side: the tree and the accuracies of the community models cut from it
            parts.append('<div style="display:flex;gap:1em;align-items:flex-start"><div style="flex:3">'
                         + _img(names, f"dendrogram of round {r}") + '</div><div style="flex:2">'
                         + f"<p>Community models of round {r}</p>" + _round_table(models) + "</div></div>")
        else:
            parts.append(_img(names, f"dendrogram of round {r}"))
    if view.community_models:
        rows = [row for rec in view.community_models for row in community_model_rows(rec)]
        parts.append("<h3>Community models</h3><p>One model per community: delivered by the engine "
                     "(<code>models/</code>, consensus.mode or IFCA) and built by <code>communities export</code> "
                     "(<code>exports/</code>). <i>local test acc</i> is the mean over the members of the model's "
                     "accuracy on each member's local test data; <i>shared test acc</i> is on the shared (pooled) "
                     "test split.</p>" + _round_table(rows))
    rows = round_rows(view)
    write_csv(out / f"{prefix}rounds.csv", rows)
    parts.append(f'<h3>Rounds</h3><p><a href="{_e(prefix)}rounds.csv">rounds.csv</a></p>')
    parts.append(f"<details open><summary>{len(rows)} rounds</summary>{_round_table(rows)}</details>")
    if view.run.summary is not None:
        parts.append("<h3>summary.json</h3>" + _kv_table(view.run.summary))
    else:
        parts.append("<h3>summary.json</h3><p>Not written: the run has not finished (partial run).</p>")
    parts.append("<details><summary>meta.json</summary>" + _kv_table(view.run.meta) + "</details>")
    parts.append("</section>")
    return "\n".join(parts)


def _compare_table(views: Sequence[RunView]) -> str:
    keys: List[str] = []
    for v in views:
        for k in (v.run.summary or {}):
            if k not in keys:
                keys.append(k)
    head = "<tr><th></th>" + "".join(f"<th>{_e(v.label)}</th>" for v in views) + "</tr>"
    extra: List[Tuple[str, list]] = [("status", [v.status for v in views]),
             ("rounds read", [len(v.infos) for v in views]),
             ("communities per round", [compress_counts([int(k) for k in v.n_comm]) for v in views])]
    body = "".join(f'<tr><td class="k">{_e(k)}</td>' + "".join(f"<td>{_value_html(x)}</td>" for x in vals) + "</tr>"
                   for k, vals in extra)
    for k in keys:
        body += f'<tr><td class="k">{_e(k)}</td>' + "".join(
            f"<td>{_value_html((v.run.summary or {}).get(k))}</td>" for v in views) + "</tr>"
    return f"<table>{head}{body}</table>"


def write_index(out: Path, views: Sequence[RunView], curves: List[str], sections: Sequence[str],
                generated: str) -> Path:
    """Write ``index.html``: the curves, the summaries side by side (a comparison), each run's section."""
    compare = len(views) > 1
    title = "comparison: " + ", ".join(v.label for v in views) if compare else views[0].label
    body = [f"<h1>communities inspect: {_e(title)}</h1>"]
    body.append(f"<p>Generated {_e(generated)}. Virtual time t counts completed units.</p>")
    body.append("<h2>Curves</h2>")
    if not compare and views[0].n > LARGE_WORLD:
        body.append(f"<p>{views[0].n} ranks: the per-rank accuracy and bytes are drawn as quantile bands "
                    "(5-95 % and 25-75 % of the ranks, and the median) instead of one line per rank.</p>")
    body.append(_img(curves, "curves over t"))
    if compare:
        body.append("<h2>Summaries</h2>" + _compare_table(views))
    body.extend(sections)
    doc = (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
           f"<style>{_CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
    index = out / "index.html"
    index.write_text(doc, encoding="utf-8")
    return index
