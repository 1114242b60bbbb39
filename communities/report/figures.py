"""The figures of ``communities inspect``: matplotlib drawings of the views ``load.py`` reads.

What it writes to the report directory (``--out``), each as PNG:

- ``curves.png``: dispersion, merge update norms, p_cross and temperature
  schedules, test accuracy (ranks, their mean, the consensus model; a language
  model's test loss instead, nats per token with bits per byte on the right axis),
  bytes sent, community count, cophenetic correlation and ARI, all over virtual
  time t; several runs are overlaid in one figure;
- ``loss.png``: a language model's run only: test loss of each rank, their mean,
  the consensus model and the mean training loss over t (lower is better);
- ``timeline.png``: ranks x rounds coloured by community, with ids kept stable
  across rounds (``load.stable_labels``) so splits and merges read as such;
- ``merge_matrix.png``: how often each pair of ranks merged, in the final round's
  dendrogram leaf order;
- ``dendrogram_round_NNNN.png``: one per chosen round (``load.select_rounds``), cut
  drawn at ``cut_height``, leaf labels coloured by planted group;
- SVG copies of the figures that stay small (``--no-svg`` turns them off): a
  dendrogram gets one only when it is drawn untruncated (at most 128 ranks).

A population (more than ``LARGE_WORLD`` = 128 ranks) is drawn by community, since
one mark per rank would be unreadable: each tree is truncated to its round's
communities (``truncate_mode="lastp"``, one leaf ``cX (k)`` per community, ticks for
the merges inside), the merge matrix is community x community
(``load.community_merge_counts``), the timeline's rows are labelled by the first
round's communities, and the per-rank curves are quantile bands. The report of 1,024 ranks
x 50 rounds takes about 10 s of CPU (``communities bench inspect --ranks 1024``).

In a comparison report each run's own figures carry a ``runK_`` prefix. Figures are
made without pyplot (no global state, no GUI backend), and matplotlib is imported
inside the functions that draw, so that importing this module (and the command
line) works without it.
"""
from __future__ import annotations

import contextlib
import math
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from scipy.cluster import hierarchy

from .load import RunView, community_merge_counts, fmt

DPI = 100
MAX_DENDROGRAM_LEAVES = 128  # draw every leaf up to this many ranks; beyond, truncate
TRUNCATE_P = 64  # leaves shown by truncate_mode="lastp" (also the most communities a truncated tree shows)
LARGE_WORLD = MAX_DENDROGRAM_LEAVES  # above this many ranks (a population) the figures are drawn by community
SVG_MAX_ELEMENTS = 40_000  # drawn points/cells (a line counts 50) above which an SVG passes ~1 MB

# --------------------------------------------------------------------------- trees


@contextlib.contextmanager
def recursion_limit(limit: int) -> Iterator[None]:
    """Raise Python's recursion limit for a block: scipy's dendrogram recurses once per tree level."""
    old = sys.getrecursionlimit()
    if limit > old:
        sys.setrecursionlimit(limit)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def _members(Z: np.ndarray, node: int) -> List[int]:
    """Leaves under a node of a linkage tree, without recursion (trees can be 2000 deep)."""
    n = Z.shape[0] + 1
    out, stack = [], [int(node)]
    while stack:
        k = stack.pop()
        if k < n:
            out.append(k)
        else:
            row = Z[k - n]
            stack.extend((int(row[1]), int(row[0])))
    return out


# --------------------------------------------------------------------------- figures


def _palette(k: int) -> List[tuple]:
    """k distinguishable colours: tab10/tab20, then golden-ratio hues."""
    from matplotlib import colormaps
    from matplotlib.colors import hsv_to_rgb

    if k <= 10:
        return [colormaps["tab10"](i) for i in range(max(k, 1))]
    if k <= 20:
        return [colormaps["tab20"](i) for i in range(k)]
    return [tuple(hsv_to_rgb(((i * 0.618034) % 1.0, 0.55 + 0.35 * (i % 3) / 2, 0.95 - 0.3 * (i % 2)))) + (1.0,)
            for i in range(k)]


def _group_palette(k: int) -> List[tuple]:
    """Planted-group colours, from a different palette than communities so no match is implied."""
    from matplotlib import colormaps

    if k <= 8:
        return [colormaps["Dark2"](i) for i in range(max(k, 1))]
    return _palette(k)[::-1]


def community_leaves(communities: np.ndarray, cap: int = TRUNCATE_P) -> int:
    """Leaves of a tree truncated to its communities: one per community (at least 2, at most ``cap``)."""
    return int(min(max(np.unique(np.asarray(communities)).size, 2), cap))


def _contraction_marks(Z: np.ndarray, leaves: Sequence[int]) -> Tuple[np.ndarray, np.ndarray]:
    """(x, height) of every merge hidden inside a contracted leaf, as scipy's ``show_contracted`` marks them.

    Drawn as one scatter rather than scipy's one Ellipse patch per merge (10^3 patches per tree).
    """
    n = Z.shape[0] + 1
    xs: List[float] = []
    ys: List[float] = []
    for pos, leaf in enumerate(leaves):
        stack = [int(Z[leaf - n, 0]), int(Z[leaf - n, 1])] if leaf >= n else []
        while stack:
            k = stack.pop()
            if k >= n:
                xs.append(5.0 + 10.0 * pos)
                ys.append(float(Z[k - n, 2]))
                stack.extend((int(Z[k - n, 0]), int(Z[k - n, 1])))
    return np.asarray(xs), np.asarray(ys)


def _node_communities(Z: np.ndarray, community: np.ndarray) -> np.ndarray:
    """Community of every tree node (leaves then merges), -1 where a node spans several. O(N), no recursion."""
    n = Z.shape[0] + 1
    node = np.empty(2 * n - 1, dtype=np.int64)
    node[:n] = community
    for k in range(n - 1):
        a, b = node[int(Z[k, 0])], node[int(Z[k, 1])]
        node[n + k] = a if a == b else -1
    return node


def _save(fig, out: Path, stem: str, svg: bool, release: bool = True) -> List[str]:
    """Write PNG (and SVG) and, unless the figure is reused, release it; return the file names written."""
    names = [f"{stem}.png"]
    fig.savefig(out / names[0], dpi=DPI)
    if svg:
        names.append(f"{stem}.svg")
        fig.savefig(out / names[1])
    if release:
        fig.clear()
    return names


def _figure(w: float, h: float, constrained: bool = False):
    """A Figure without pyplot: no global state, no GUI backend, nothing to close.

    Constrained layout measures every tick label several times per save; for
    figures with many labels (dendrograms) fixed margins are several times faster.
    """
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=DPI, layout="constrained" if constrained else None)


def plot_dendrogram(ax, Z: np.ndarray, groups: Optional[np.ndarray] = None, cut_height: Optional[float] = None,
                    max_leaves: Optional[int] = MAX_DENDROGRAM_LEAVES, *, p: int = TRUNCATE_P,
                    communities: Optional[np.ndarray] = None, palette: Optional[List[tuple]] = None) -> dict:
    """Draw one round's tree on ``ax``; returns scipy's dendrogram dict.

    More than ``max_leaves`` ranks are truncated to the last ``p`` merged clusters
    (``truncate_mode='lastp'``); ``max_leaves=None`` never truncates. Leaf labels are
    coloured by planted group (a contracted leaf only when all its ranks share one).
    Links inside one community take that community's colour (``palette[id]``, the
    timeline's colours) when ``communities`` is given, else scipy colours the links
    below the cut; the cut is a dashed line.
    """
    Z = np.asarray(Z, dtype=np.float64)
    n = Z.shape[0] + 1
    truncate = max_leaves is not None and n > max_leaves
    shown = min(p, n) if truncate else n
    kw = dict(truncate_mode="lastp", p=p, show_contracted=False) if truncate else {}
    font = 9 if shown <= 32 else 7 if shown <= 64 else 5 if shown <= 160 else 3
    rotation = 90
    color_threshold = float(cut_height) if cut_height is not None and math.isfinite(cut_height) else 0.0
    if communities is not None:
        from matplotlib.colors import to_hex

        node = _node_communities(Z, np.asarray(communities))
        hexes = [to_hex(c) for c in (palette or _palette(int(node.max()) + 1))]
        kw["link_color_func"] = lambda k: hexes[node[k] % len(hexes)] if node[k] >= 0 else "#666666"
        if truncate:  # a contracted leaf says which community it is and how many ranks it holds
            kw["leaf_label_func"] = lambda k: (str(k) if k < n else
                                               f"c{node[k]} ({int(Z[k - n, 3])})" if node[k] >= 0 else
                                               f"({int(Z[k - n, 3])})")
            rotation = 0 if shown <= 16 else 90

    with recursion_limit(2 * n + 1000):
        R = hierarchy.dendrogram(Z, ax=ax, color_threshold=color_threshold, above_threshold_color="#666666",
                                 leaf_rotation=rotation, leaf_font_size=font, no_labels=shown > 512, **kw)
    if truncate:  # the merges inside each contracted leaf, as ticks at their heights
        xs, ys = _contraction_marks(Z, R["leaves"])
        if xs.size:
            ax.scatter(xs, ys, marker="_", s=16, linewidths=0.5, color="k", alpha=0.3, zorder=3)
    if color_threshold > 0:
        ax.axhline(color_threshold, color="k", linestyle="--", linewidth=1, label=f"cut {color_threshold:.3g}")
    if groups is not None and shown <= 512:
        gpal = _group_palette(int(groups.max()) + 1)
        for text, leaf in zip(ax.get_xticklabels(), R["leaves"]):
            g = np.unique(groups[_members(Z, leaf)])
            text.set_color(gpal[int(g[0])] if g.size == 1 else "0.3")
        from matplotlib.patches import Patch

        handles = [Patch(color=gpal[g], label=f"group {g}") for g in range(min(len(gpal), 20))]
        ax.legend(handles=handles + ax.get_legend_handles_labels()[0], fontsize=7, loc="upper right",
                  ncol=2 if len(handles) > 6 else 1, title="leaf colour: planted group", title_fontsize=7)
    elif color_threshold > 0:
        ax.legend(fontsize=7, loc="upper right")
    ax.set_ylabel("linkage height")
    if not truncate:
        ax.set_xlabel("rank")
    elif communities is not None:
        k_comm = int(np.unique(np.asarray(communities)).size)
        what = "the communities" if k_comm == shown else f"{k_comm} communit{'y' if k_comm == 1 else 'ies'}"
        ax.set_xlabel(f"{n} ranks as {shown} leaves ({what}): 'cX (k)' = community X of k ranks; "
                      "ticks: the merges inside", fontsize=9)
    else:
        ax.set_xlabel(f"rank (truncated to the last {shown} clusters; '(k)' = k ranks)")
    return R


class _DendrogramCanvas:
    """One Figure and Axes reused for every dendrogram of a run (they all have the same size).

    Most of the time of drawing a tree goes to matplotlib making one tick object per leaf
    and laying out the leaf labels; a reused Axes keeps its ticks, so each round only
    replaces the links, the cut line, the legend and the texts. A fresh Figure per round
    costs about 0.25 s for 64 ranks, a reused one about 0.15 s (PNG, Agg).
    """

    def __init__(self) -> None:
        self.fig: Any = None  # a matplotlib Figure once drawn
        self.ax: Any = None
        self._size: Optional[Tuple[float, float]] = None

    def axes(self, w: float, h: float):
        """An empty Axes of a (w x h inch) figure, with the leaf ticks of the previous round kept."""
        if self.fig is None or self._size != (w, h):
            self.close()
            self.fig = _figure(w, h)
            self.fig.subplots_adjust(left=0.8 / w, right=1 - 0.25 / w, bottom=0.16, top=0.92)
            self.ax = self.fig.add_subplot()
            self._size = (w, h)
            return self.ax
        ax = self.ax
        for artist in {id(a): a for a in (*ax.collections, *ax.lines, *ax.patches, *ax.texts, *ax.images)}.values():
            artist.remove()
        if ax.get_legend() is not None:
            ax.get_legend().remove()
        return ax

    def close(self) -> None:
        if self.fig is not None:
            self.fig.clear()
        self.fig = self.ax = self._size = None


def _dendrogram_figure(view: RunView, k: int, out: Path, stem: str, svg: bool,
                       *, canvas: Optional[_DendrogramCanvas] = None) -> List[str]:
    Z = view.Zs[k]
    n = view.n
    # A population's tree is truncated to that round's communities, one leaf each (with its rank count).
    p = community_leaves(view.stable[k]) if n > MAX_DENDROGRAM_LEAVES else TRUNCATE_P
    shown = min(p, n) if n > MAX_DENDROGRAM_LEAVES else n
    w = min(18.0, max(7.0 if n <= MAX_DENDROGRAM_LEAVES else 10.0, 0.14 * shown + 2))
    own = canvas is None
    canvas = canvas or _DendrogramCanvas()
    ax = canvas.axes(w, 5.0)
    info = view.infos[k]
    plot_dendrogram(ax, Z, view.groups, info.get("cut_height"), communities=view.stable[k], p=p,
                    palette=_palette(int(view.stable.max()) + 1))
    title = (f"{view.label}: round {int(view.round_idx[k])} (t={int(view.round_t[k])}), "
             f"{int(view.n_comm[k])} communities, {info.get('linkage', '?')}/{info.get('metric', '?')}, "
             f"cophenetic {fmt(float(view.cophenetic[k]))}")
    if view.groups is not None:
        title += f", ARI {fmt(float(view.ari[k]))}"
    # A fixed title position: matplotlib otherwise measures every leaf label to place it.
    ax.set_title(title, fontsize=9, y=1.0)
    # Truncated trees still carry a marker per contracted merge: SVG only for untruncated ones.
    return _save(canvas.fig, out, stem, svg and n <= MAX_DENDROGRAM_LEAVES, release=own)


def _hatched(x: float, y: float, width: float):
    """A grey, cross-hatched band over a lost rank's rounds."""
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), width, 1.0, facecolor="0.85", edgecolor="0.3", hatch="xx", linewidth=0.5)


def _timeline_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    from matplotlib.colors import ListedColormap

    S = view.stable  # rounds x N
    R, n = S.shape
    # Rows grouped by their whole history (first round first), so splits show as a block dividing.
    order = np.lexsort(S[::-1]) if R else np.arange(n)
    n_ids = int(S.max()) + 1
    cmap = ListedColormap(_palette(n_ids))
    w, h = min(16.0, max(7.0, 0.18 * R + 3)), min(14.0, max(4.0, 0.12 * n + 1.5))
    fig = _figure(w, h)
    fig.subplots_adjust(left=0.55 / w, right=1 - 1.3 / w, bottom=0.75 / h, top=1 - 0.4 / h)
    if view.groups is not None:
        gs = fig.add_gridspec(1, 2, width_ratios=[0.35, w - 2.2], wspace=0.6 / w * 4,
                              left=0.2 / w, right=1 - 1.3 / w, bottom=0.75 / h, top=1 - 0.4 / h)
        gax, ax = fig.add_subplot(gs[0]), fig.add_subplot(gs[1])
        gpal = ListedColormap(_group_palette(int(view.groups.max()) + 1))
        gax.imshow(view.groups[order][:, None], aspect="auto", interpolation="nearest", cmap=gpal,
                   vmin=-0.5, vmax=int(view.groups.max()) + 0.5)
        gax.set_xticks([0], ["group"], fontsize=7)
        gax.set_yticks([])
    else:
        ax = fig.add_subplot()
    ax.imshow(S[:, order].T, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=n_ids - 0.5)
    if view.lost:  # a lost rank's cells from its loss on: crossed out (it keeps its last signature in the rounds)
        row_of = {int(r): k for k, r in enumerate(order)}
        for rank, t in view.lost:
            after = np.flatnonzero(view.round_t > t)
            if after.size and rank in row_of:
                ax.add_patch(_hatched(after[0] - 0.5, row_of[rank] - 0.5, R - after[0]))
                ax.annotate(f"rank {rank} lost at t={t}", (after[0] - 0.5, row_of[rank]), fontsize=6, ha="left",
                            va="center", xytext=(3, 0), textcoords="offset points",
                            bbox={"boxstyle": "square,pad=0.1", "facecolor": "white", "linewidth": 0})
    step = max(1, int(math.ceil(R / 25)))
    ax.set_xticks(np.arange(0, R, step), [str(int(t)) for t in view.round_t[::step]], fontsize=7,
                  rotation=90 if R > 12 else 0)
    ax.set_xlabel("virtual time t of the signature round")
    if n <= 64:
        ax.set_yticks(np.arange(n), [str(int(r)) for r in order], fontsize=6 if n > 32 else 8)
        ax.set_ylabel("rank")
    else:  # one tick per block of the first round's communities (the rows are sorted by it first)
        ids, start, count = np.unique(S[0, order], return_index=True, return_counts=True) if R else ((), (), ())
        if 0 < len(ids) <= 40:
            ax.set_yticks(np.asarray(start) + (np.asarray(count) - 1) / 2,
                          [f"c{int(c)} ({int(m)})" for c, m in zip(ids, count)], fontsize=7 if len(ids) <= 20 else 5)
            ax.set_ylabel(f"{n} ranks, grouped by community history (ticks: round {int(view.round_idx[0])}'s "
                          "communities, ranks)")
        else:
            ax.set_yticks([])
            ax.set_ylabel(f"{n} ranks (grouped by community history)")
    if n_ids <= 20:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color=cmap(i), label=str(i)) for i in range(n_ids)], title="community",
                  fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{view.label}: communities per round (ids matched across rounds)", fontsize=9)
    return _save(fig, out, stem, svg and n * R <= SVG_MAX_ELEMENTS and n <= 256)


def _community_rounds(view: RunView) -> List[Tuple[str, int]]:
    """The rounds whose communities aggregate a population's merge matrix: the first (the sharpest) and the
    last with more than one community (the final round when it still has several)."""
    if not view.infos:
        return []
    picks = [("the first round", 0)]
    several = np.flatnonzero(view.n_comm > 1)
    last = len(view.infos) - 1
    if several.size and int(several[-1]) > 0:
        k = int(several[-1])
        picks.append(("the final round" if k == last else "the last round with several communities", k))
    elif last > 0:
        picks.append(("the final round", last))
    return picks


def _community_merge_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    """A population's merge matrix: exchanges between and inside communities (community x community),
    where a rank x rank image would be noise. Ids and colours are the timeline's."""
    picks = _community_rounds(view)
    w = 6.0 * len(picks) + 1.2
    fig = _figure(w, 6.0)
    fig.subplots_adjust(left=0.9 / w, right=1 - 0.3 / w, bottom=0.12, top=0.86, wspace=0.35)
    axes = fig.subplots(1, len(picks), squeeze=False)[0]
    total = int(view.merge_matrix.sum() // 2)
    pal = _palette(int(view.stable.max()) + 1)
    for ax, (where, k) in zip(axes, picks):
        ids, B = community_merge_counts(view.merge_matrix, view.stable[k])
        im = ax.imshow(B, interpolation="nearest", cmap="magma_r", vmin=0, vmax=max(1, int(B.max())))
        m = len(ids)
        if m <= 40:
            sizes = np.bincount(np.searchsorted(ids, view.stable[k]), minlength=m)
            labels = [f"c{int(c)} ({int(z)})" for c, z in zip(ids, sizes)]
            font = 8 if m <= 12 else 6 if m <= 24 else 4
            ax.set_xticks(np.arange(m), labels, fontsize=font, rotation=90)
            ax.set_yticks(np.arange(m), labels, fontsize=font)
            for tick_set in (ax.get_xticklabels(), ax.get_yticklabels()):
                for text, c in zip(tick_set, ids):
                    text.set_color(pal[int(c) % len(pal)])
        else:
            ax.set_xticks([])
            ax.set_yticks([])
        if m <= 12:  # the counts themselves
            hi = B.max() or 1
            for a in range(m):
                for b in range(m):
                    ax.text(b, a, str(int(B[a, b])), ha="center", va="center", fontsize=7,
                            color="white" if B[a, b] > 0.6 * hi else "black")
        inside = int(np.trace(B))
        share = f"{100 * inside / total:.1f}%" if total else "-"
        ax.set_title(f"communities of {where} (round {int(view.round_idx[k])}, t={int(view.round_t[k])}):\n"
                     f"{m} communities, {share} of exchanges inside one", fontsize=9)
        fig.colorbar(im, ax=ax, label="exchanges", shrink=0.8)
    fig.suptitle(f"{view.label}: exchanges between communities ({total} exchanges over the run, {view.n} ranks; "
                 "'cX (k)': community X of k ranks)", fontsize=10)
    return _save(fig, out, stem, svg)


def _merge_matrix_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    """Merges per pair in the final round's leaf order (where the run ended up) and, beside it,
    in the first round's order (where the communities were sharpest), so both who-merged-with-whom
    and how much gossip stayed inside the early communities are visible."""
    n = view.n
    if n > LARGE_WORLD and view.infos:
        return _community_merge_figure(view, out, stem, svg)
    orders = []
    if view.Zs and n > 1:
        orders.append(("the final round's dendrogram leaf order", hierarchy.leaves_list(view.Zs[-1])))
        if len(view.Zs) > 1:
            orders.append(("the first round's dendrogram leaf order", hierarchy.leaves_list(view.Zs[0])))
    else:
        orders.append(("rank order (no rounds)", np.arange(n)))
    w = 7.0 * len(orders) + 0.8
    fig = _figure(w, 6.8)
    fig.subplots_adjust(left=0.5 / w, right=1 - 0.2 / w, bottom=0.08, top=0.9, wspace=0.12)
    axes = fig.subplots(1, len(orders), squeeze=False)[0]
    vmax = max(1, int(view.merge_matrix.max()))
    for ax, (where, order) in zip(axes, orders):
        M = view.merge_matrix[np.ix_(order, order)]
        im = ax.imshow(M, interpolation="nearest", cmap="magma_r", vmin=0, vmax=vmax)
        if n <= 64:
            labels = [str(int(r)) for r in order]
            ax.set_xticks(np.arange(n), labels, fontsize=5 if n > 32 else 7, rotation=90)
            ax.set_yticks(np.arange(n), labels, fontsize=5 if n > 32 else 7)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
        ax.set_title(f"in {where}", fontsize=9)
    fig.colorbar(im, ax=list(axes), label="exchanges", shrink=0.9)
    fig.suptitle(f"{view.label}: merges per pair ({int(view.merge_matrix.sum() // 2)} exchanges)", fontsize=10)
    return _save(fig, out, stem, svg and n <= 128)


def _lines(ax, x: np.ndarray, Y: np.ndarray, color, alpha: float = 0.25, *, lw: float = 0.6) -> int:
    """One thin line per row of Y (NaNs skipped) as a single LineCollection; returns points drawn."""
    from matplotlib.collections import LineCollection

    segs = []
    for row in Y:
        ok = np.isfinite(row)
        if ok.sum() >= 1:
            segs.append(np.column_stack([x[ok], row[ok]]))
    if segs:
        ax.add_collection(LineCollection(segs, colors=[color], alpha=alpha, linewidths=lw))
        ax.autoscale_view()
    return int(sum(len(s) for s in segs)) + 50 * len(segs)


def _bands(ax, x: np.ndarray, Y: np.ndarray, color) -> int:
    """The spread over rows of Y as quantile bands (5-95 %, 25-75 %) and the median: a population's ranks,
    where one line each would be a solid blot. Columns without a value are skipped; returns points drawn."""
    ok = np.isfinite(Y).any(axis=0)
    if not ok.any():
        return 0
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q05, q25, q50, q75, q95 = np.nanquantile(Y[:, ok], [0.05, 0.25, 0.5, 0.75, 0.95], axis=0)
    xs = x[ok]
    ax.fill_between(xs, q05, q95, color=color, alpha=0.15, linewidth=0, label=f"ranks 5-95 % ({Y.shape[0]})")
    ax.fill_between(xs, q25, q75, color=color, alpha=0.35, linewidth=0, label="ranks 25-75 %")
    ax.plot(xs, q50, color=color, linewidth=0.8, label="median rank")
    return 5 * int(ok.sum())


def _nanmean_cols(Y: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Column means over the rows that have a value; the mask of columns with any value."""
    ok = np.isfinite(Y).any(axis=0)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.nanmean(Y[:, ok], axis=0) if ok.any() else np.zeros(0), ok


def bits_axis(ax, factor: Optional[float], label: bool = True) -> None:
    """A right-hand axis in bits per byte beside an axis of nats per token (one factor: a linear rescaling)."""
    if factor is None:
        return
    right = ax.secondary_yaxis("right", functions=(lambda x: x * factor, lambda y: y / factor))
    right.tick_params(labelsize=8)
    if label:
        right.set_ylabel("bits/byte", fontsize=8)


def _shared_factor(views: Sequence[RunView]) -> Optional[float]:
    """The bits-per-byte factor the language-model runs share (None: unknown, or they differ)."""
    factors = {None if v.lm is None else v.lm.factor for v in views}
    return factors.pop() if len(factors) == 1 else None


class _CurvePanels:
    """The nine over-t panels of the curves figure, and what has been drawn on them.

    ``loss``: every run is a language model's, so the accuracy panel shows test losses (lower is better)."""

    def __init__(self, fig, overlay: bool, loss: bool = False) -> None:
        self.axes = fig.subplots(3, 3)
        (self.disp, self.norm, self.pc), (self.temp, self.acc, self.bytes), (self.k, self.coph, self.ari) = self.axes
        self.overlay = overlay
        self.loss = loss
        self.points = 0  # drawn points, for the SVG size limit
        self.has = {id(ax): False for ax in self.axes.ravel()}

    def plot(self, ax, x, y, **kw) -> None:
        """A line through the finite values of ``y``; NaNs are skipped."""
        x, y = np.asarray(x, float), np.asarray(y, float)
        ok = np.isfinite(y)
        if ok.any():
            ax.plot(x[ok], y[ok], **kw)
            self.has[id(ax)] = True
            self.points += int(ok.sum())

    def run(self, v: RunView, c) -> None:
        """One run's series: its own colour when overlaid, else the ranks, their mean and the consensus."""
        overlay, plot = self.overlay, self.plot
        col = c if overlay else "C0"
        lab = v.label if overlay else None
        rt = v.round_t.astype(float)
        plot(self.disp, rt, v.series("dispersion"), color=col, marker=".", label=lab)
        if v.merge_t.size:
            plot(self.norm, v.merge_t, v.merge_norm, color=col, linewidth=0.7, alpha=0.6,
                 label=lab if overlay else "mean per unit (merges.jsonl)")
        plot(self.norm, rt, v.series("mean_update_norm"), color=col if overlay else "C3", marker="o", markersize=3,
             linestyle="none" if not overlay else "--", label=None if overlay else "mean per round (round.json)")
        plot(self.pc, rt, v.series("p_cross"), color=col, marker=".", label=lab)
        plot(self.temp, rt, v.series("temperature"), color=col, marker=".", label=lab)
        if v.test_acc.size:
            self._ranks(v, col, lab)
        if v.consensus_acc.size:
            plot(self.acc, v.consensus_t, v.consensus_loss if self.loss else v.consensus_acc,
                 color=col if overlay else "k", linestyle="--", marker="s", markersize=3,
                 label=None if overlay else "consensus model")
        plot(self.k, rt, v.n_comm, color=col, drawstyle="steps-post", marker=".", label=lab)
        plot(self.coph, rt, v.cophenetic, color=col, marker=".", label=lab)
        if v.groups is not None:
            plot(self.ari, rt, v.ari, color=col, marker=".", label=lab)

    def _ranks(self, v: RunView, col, lab) -> None:
        """Test accuracy (or loss) and bytes sent: the mean over ranks, and each rank's line for a single run."""
        overlay, plot = self.overlay, self.plot
        scores = v.test_loss if self.loss else v.test_acc
        mean, ok = _nanmean_cols(scores)
        tt = v.metric_t.astype(float)
        bands = v.n > LARGE_WORLD  # a population: quantile bands, not one line per rank
        if not overlay and ok.any() and bands:
            self.points += _bands(self.acc, tt, scores, "C0")
        elif not overlay and ok.any():
            self.points += _lines(self.acc, tt, scores, "C0")
            self.acc.plot([], [], color="C0", alpha=0.4, linewidth=0.6, label=f"each rank ({v.n})")
        plot(self.acc, tt[ok], mean, color=col if overlay else "C1", linewidth=2,
             label=lab if overlay else "mean over ranks")
        b_mean, b_ok = _nanmean_cols(v.bytes_sent / 1e6)
        if not overlay and b_ok.any() and bands:
            self.points += _bands(self.bytes, tt, v.bytes_sent / 1e6, "C0")
        elif not overlay and b_ok.any():
            self.points += _lines(self.bytes, tt, v.bytes_sent / 1e6, "C0")
            self.bytes.plot([], [], color="C0", alpha=0.4, linewidth=0.6, label="each rank")
        plot(self.bytes, tt[b_ok], b_mean, color=col if overlay else "C1", linewidth=2,
             label=lab if overlay else "mean over ranks")

    def decorate(self, factor: Optional[float] = None) -> None:
        """Titles, axis labels, grids, 'no data' on empty panels, integer and log scales; a loss panel gets bits per
        byte on its right (``factor``: the runs' shared bits per byte per nat per token)."""
        titles = {
            id(self.disp): "signature dispersion", id(self.norm): "merge update norm ||w_after - w_before||",
            id(self.pc): "p_cross schedule (flat law)", id(self.temp): "temperature schedule (hierarchical law)",
            id(self.acc): (f"test loss, nats/token{' (right: bits/byte)' if factor is not None else ''}" if self.loss
                           else "test accuracy")
            + (" (solid: rank mean, dashed: consensus)" if self.overlay else ""),
            id(self.bytes): "bytes sent per rank, cumulative (MB)", id(self.k): "communities",
            id(self.coph): "cophenetic correlation", id(self.ari): "ARI vs planted groups",
        }
        for ax in self.axes.ravel():
            ax.set_title(titles[id(ax)], fontsize=10)
            ax.set_xlabel("virtual time t", fontsize=8)
            ax.tick_params(labelsize=8)
            if not self.has[id(ax)]:
                empty = "no planted groups" if ax is self.ari else "no data"
                ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="0.5")
            ax.grid(True, alpha=0.3)
        from matplotlib.ticker import MaxNLocator

        self.k.yaxis.set_major_locator(MaxNLocator(integer=True))
        if self.loss and self.has[id(self.acc)]:
            bits_axis(self.acc, factor, label=False)
        for ax in (self.disp, self.temp):
            ys = [ln.get_ydata() for ln in ax.get_lines()]
            if ys and all(np.all(np.asarray(y, float) > 0) for y in ys if len(y)):
                ax.set_yscale("log")


def plot_curves(views: Sequence[RunView], out: Path, stem: str, svg: bool) -> List[str]:
    """The over-t panels; one run shows its ranks too, several runs are overlaid (colour = run)."""
    overlay = len(views) > 1
    fig = _figure(15.0, 11.0)
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.05, top=0.92 if overlay else 0.93, hspace=0.38, wspace=0.18)
    loss = bool(views) and all(v.lm is not None for v in views)  # language models: judged by their loss
    panels = _CurvePanels(fig, overlay, loss)
    colours = _palette(max(len(views), 1)) if overlay else [None]
    for v, c in zip(views, colours):
        panels.run(v, c)
    panels.decorate(_shared_factor(views) if loss else None)
    if overlay:
        handles, labels = panels.k.get_legend_handles_labels()
        if not handles:  # runs without rounds: take the accuracy panel's
            handles, labels = panels.acc.get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=min(4, len(views)), fontsize=9, frameon=False)
    else:
        for ax in (panels.norm, panels.acc, panels.bytes):
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        fig.suptitle(f"{views[0].label}: {views[0].path}", fontsize=11)
    return _save(fig, out, stem, svg and panels.points <= SVG_MAX_ELEMENTS)


# --------------------------------------------------------------------------- one run's figures


@dataclass
class RunFigures:
    """The file names (PNG first, then SVG) of one run's figures, as ``draw_run`` wrote them."""

    timeline: Optional[List[str]]  # None: no complete round to draw
    merge_matrix: List[str]
    dendrograms: List[Tuple[int, List[str]]] = field(default_factory=list)  # (round, names)
    views: Optional[List[str]] = None  # protocol async: how far each rank's views agreed with rank 0's
    privacy: Optional[List[str]] = None  # privacy.enabled: each replica's epsilon over t
    hyper: Optional[List[str]] = None  # pbt: each replica's learnt hyperparameters over t
    loss: Optional[List[str]] = None  # a language model's: test and training losses over t


def _views_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    """protocol async: each rank's communities against rank 0's at the same wall time (ARI; 1 = the same)."""
    fig = _figure(7, 3.2, constrained=True)
    ax = fig.add_subplot()
    for k, (r, (wall, ari)) in enumerate(sorted(view.view_agreement.items())):
        ax.plot(wall, ari, lw=1, marker=".", ms=3, color=f"C{k % 10}", label=f"rank {r}")
    ax.set_xlabel("wall time, s (each rank's clock since the loop started)")
    ax.set_ylabel("ARI vs rank 0's view")
    ax.set_ylim(-0.1, 1.05)
    ax.set_title("Agreement of the ranks' community views (protocol async)")
    if len(view.view_agreement) <= 16:
        ax.legend(fontsize=7, ncol=4, loc="lower right")
    return _save(fig, out, stem, svg)


def _privacy_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    """privacy.enabled: each replica's epsilon (at privacy.delta) after every unit, and the worst one."""
    fig = _figure(7, 3.2, constrained=True)
    ax = fig.add_subplot()
    t = view.metric_t.astype(float)
    eps = view.epsilon
    if view.n > LARGE_WORLD:
        _bands(ax, t, eps, "C0")
    else:
        _lines(ax, t, eps, "C0", alpha=0.5, lw=0.8)
        ax.plot([], [], color="C0", alpha=0.5, lw=0.8, label=f"each replica ({view.n})")
    worst = np.nanmax(np.where(np.isfinite(eps), eps, -np.inf), axis=0)
    ok = np.isfinite(worst)
    ax.plot(t[ok], worst[ok], color="C3", lw=1.5, label="worst replica")
    dp = view.run.record.privacy if view.run.record is not None else None
    if dp and dp.get("target_epsilon") is not None:
        ax.axhline(dp["target_epsilon"], color="0.4", ls="--", lw=0.8, label="target")
    delta = f" at delta {dp['delta']}" if dp else ""
    ax.set_xlabel("virtual time t")
    ax.set_ylabel("epsilon" + delta)
    ax.set_title("Privacy spent by each replica (Opacus RDP accountant)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out, stem, svg)


def _loss_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    """A language model's losses over t (nats per token, bits per byte on the right; lower is better): each rank's
    test loss, their mean, the consensus model's and the ranks' mean training loss."""
    assert view.lm is not None
    fig = _figure(7, 3.6, constrained=True)
    ax = fig.add_subplot()
    t = view.metric_t.astype(float)
    points = 0
    if view.test_loss.size and np.isfinite(view.test_loss).any():
        if view.n > LARGE_WORLD:
            points += _bands(ax, t, view.test_loss, "C0")
        else:
            points += _lines(ax, t, view.test_loss, "C0", alpha=0.35, lw=0.7)
            ax.plot([], [], color="C0", alpha=0.5, lw=0.7, label=f"each rank, test ({view.n})")
        mean, ok = _nanmean_cols(view.test_loss)
        ax.plot(t[ok], mean, color="C1", lw=2, label="rank mean, test")
    if view.train_loss.size and np.isfinite(view.train_loss).any():
        mean, ok = _nanmean_cols(view.train_loss)
        ax.plot(t[ok], mean, color="C2", lw=1, ls=":", label="rank mean, training")
    good = np.isfinite(view.consensus_loss)
    if good.any():
        ax.plot(view.consensus_t[good], view.consensus_loss[good], color="k", ls="--", marker="s", ms=3,
                label="consensus model, test")
    if not ax.get_lines() and not points:
        ax.text(0.5, 0.5, "no loss recorded yet", transform=ax.transAxes, ha="center", va="center", color="0.5")
    ax.set_xlabel("virtual time t")
    ax.set_ylabel("loss, nats/token")
    bits_axis(ax, view.lm.factor)
    ax.set_title(f"{view.label}: loss (lower is better)", fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper right")
    return _save(fig, out, stem, svg and points <= SVG_MAX_ELEMENTS)


def _hyper_figure(view: RunView, out: Path, stem: str, svg: bool) -> List[str]:
    """pbt: each replica's learnt hyperparameters over t, coloured by its community in the last complete round
    (a population: each community's median and quantile bands). Log axes where a value spans a decade or more."""
    names = sorted(view.hyper)
    fig = _figure(7, 2.4 * len(names) + 0.6, constrained=True)
    axes = fig.subplots(len(names), 1, sharex=True, squeeze=False)[:, 0]
    t = view.metric_t.astype(float)
    labels = view.stable[-1] if view.stable.size else np.zeros(view.n, dtype=np.int64)
    points = 0
    for ax, name in zip(axes, names):
        Y = view.hyper[name]
        for k, c in enumerate(np.unique(labels)):
            rows = Y[labels == c]
            color = f"C{k % 10}"
            if view.n > LARGE_WORLD:
                points += _bands(ax, t, rows, color)
            else:
                points += _lines(ax, t, rows, color, alpha=0.6, lw=0.9)
                ax.plot([], [], color=color, lw=0.9, label=f"community {int(c)} ({len(rows)})")
        finite = Y[np.isfinite(Y)]
        if finite.size and finite.min() > 0 and finite.max() / finite.min() >= 10:
            ax.set_yscale("log")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("virtual time t")
    if view.n <= LARGE_WORLD and np.unique(labels).size <= 12:
        axes[0].legend(fontsize=7, loc="best")
    axes[0].set_title("Learnt hyperparameters (pbt), coloured by community in the last round")
    return _save(fig, out, stem, svg and points <= SVG_MAX_ELEMENTS)


def draw_run(view: RunView, out: Path, prefix: str, picked: Sequence[int], svg: bool) -> RunFigures:
    """One run's timeline (when it has rounds), merge matrix and the dendrograms of the ``picked`` rounds."""
    timeline = _timeline_figure(view, out, f"{prefix}timeline", svg) if view.infos else None
    figs = RunFigures(timeline, _merge_matrix_figure(view, out, f"{prefix}merge_matrix", svg))
    if view.lm is not None:
        figs.loss = _loss_figure(view, out, f"{prefix}loss", svg)
    if view.view_agreement:
        figs.views = _views_figure(view, out, f"{prefix}view_agreement", svg)
    if view.epsilon.size and np.isfinite(view.epsilon).any():
        figs.privacy = _privacy_figure(view, out, f"{prefix}privacy", svg)
    if view.hyper:
        figs.hyper = _hyper_figure(view, out, f"{prefix}hyperparameters", svg)
    pos = {int(r): k for k, r in enumerate(view.round_idx)}
    canvas = _DendrogramCanvas()
    try:
        for r in picked:
            names = _dendrogram_figure(view, pos[r], out, f"{prefix}dendrogram_round_{r:04d}", svg, canvas=canvas)
            figs.dendrograms.append((r, names))
    finally:
        canvas.close()
    return figs
