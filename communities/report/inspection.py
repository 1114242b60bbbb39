"""Post-hoc inspection of run directories: ``communities inspect RUN_DIR [RUN_DIR ...]``.

Why a separate tool: runs end on compute nodes; users look at them afterwards on a
login node that has no MPI and often no torch. So the report reads only the
results layout (docs/reference/results-layout.md) through ``communities.results`` and uses
numpy, scipy, matplotlib, json and scikit-learn (for the adjusted Rand index). It
never imports torch or mpi4py. (This module is not called ``inspect.py``: that would
shadow the standard library module.)

This module is the command line; the work is done in three parts, in this order:

- ``load.py`` reads each run directory into a ``RunView`` (partial and damaged runs
  are described there) and writes the terminal summary;
- ``figures.py`` draws ``curves.png``, ``timeline.png``, ``merge_matrix.png`` and
  ``dendrogram_round_NNNN.png`` (one per complete round by default; ``--round``,
  ``--every``, ``--last`` pick fewer), with SVG copies where small;
- ``html.py`` writes ``index.html`` and ``rounds.csv``.

Everything is written to ``--out`` (default ``RUN_DIR/report``, or
``FIRST_RUN/../compare_report`` for several runs). It also prints a short terminal
summary. A missing or damaged file is reported in one line naming it, with exit
status 2; damage that only warns is printed as ``warning:`` lines and the rest is
read.

It also checks what a run vouches for: ``consensus.pt`` against the size and
BLAKE2b digest in ``meta.json`` (a mismatch is an error naming it) and each
complete checkpoint against its manifest (a mismatch is a warning saying which
checkpoint ``--resume`` would take instead). A run whose ``meta.json`` says
``running`` but whose process is gone (nobody holds its lock, and its pid is dead
or its heartbeat old: communities/runlock.py) is reported as ``interrupted``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..errors import EXIT_FAILURE, EXIT_OK, EXIT_USER
from ..results import ResultsError
from . import figures, html
from .load import RunView, disambiguate, load_view, one_line, select_rounds, summary_text

# --------------------------------------------------------------------------- report


def write_report(views: Sequence[RunView], out: Path, picks: Sequence[Tuple[List[int], str]], svg: bool = True) -> Path:
    """Write every figure, each run's rounds.csv and ``index.html`` into ``out``; return the index path."""
    out.mkdir(parents=True, exist_ok=True)
    generated = time.strftime("%Y-%m-%d %H:%M:%S")
    curves = figures.plot_curves(views, out, "curves", svg)
    compare = len(views) > 1
    sections = []
    for k, (view, (picked, note)) in enumerate(zip(views, picks), 1):
        prefix = f"run{k}_" if compare else ""
        if view.n < 2:
            picked, note = [], "no dendrograms: a world of one rank has no tree"
        figs = figures.draw_run(view, out, prefix, picked, svg)
        sections.append(html.run_section(view, out, prefix, figs, note, heading=compare))
    return html.write_index(out, views, curves, sections, generated)


# --------------------------------------------------------------------------- command line


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="communities inspect",
        description="Inspect finished or partial runs: dendrograms, community timeline, curves, merge matrix, "
        "HTML report. Several RUN_DIRs are compared in one report.",
        epilog="--round, --every and --last choose which dendrograms are drawn (their union). Without them: "
        "one per complete round (a comparison: each run's first and last; --every 1 draws all). Curves, "
        "timeline and tables always cover every complete round. "
        "Exit status: 0 done, 2 a missing or damaged file or a bad argument, 1 the report could not be written.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="results/<name> directory of a run")
    p.add_argument("--round", dest="rounds", type=int, action="append", metavar="N",
                   help="draw the dendrogram of round N (the NNNN of rounds/round_NNNN); repeatable")
    p.add_argument("--every", type=_positive, metavar="K",
                   help="draw every K-th saved round's dendrogram, from the first")
    p.add_argument("--last", action="store_true", help="draw the last complete round's dendrogram")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="report directory (default RUN_DIR/report; for several runs FIRST_RUN/../compare_report)")
    p.add_argument("--no-svg", action="store_true", help="PNG only (SVG copies are otherwise written where small)")
    return p


def main_inspect(argv: Optional[List[str]] = None) -> int:
    """``communities inspect``: returns 0 on success, 2 for a missing/damaged file or a bad argument."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help or a usage error: return the code instead of exiting the caller
        return exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USER)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("communities inspect: error: matplotlib is needed for the report: pip install 'communities[inspect]'",
              file=sys.stderr)
        return EXIT_FAILURE
    start = time.perf_counter()
    try:
        views = [load_view(Path(p)) for p in args.run_dirs]
    except ResultsError as exc:
        print(f"communities inspect: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USER
    disambiguate(views)
    picks = []
    for v in views:
        try:
            # One run: a dendrogram per round. A comparison shows each run's first and last tree
            # unless told otherwise (its point is the overlaid curves).
            cap = 0 if len(views) > 1 else None
            picks.append(select_rounds([int(r) for r in v.round_idx], args.rounds, args.every, args.last, cap=cap))
        except ValueError as exc:
            print(f"communities inspect: error: {v.path}: {one_line(exc)}", file=sys.stderr)
            return EXIT_USER
    if args.out is not None:
        out = args.out
    elif len(views) == 1:
        out = views[0].path / "report"
    else:
        out = views[0].path.resolve().parent / "compare_report"
    for v, (_, note) in zip(views, picks):
        print(summary_text(v))
        for msg in v.notes:
            print(f"warning: {msg}", file=sys.stderr)
        if v.infos:
            print(note)
    try:
        index = write_report(views, out, picks, svg=not args.no_svg)
    except OSError as exc:
        print(f"communities inspect: error: cannot write the report to {out}: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"report: {index} ({time.perf_counter() - start:.1f} s)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main_inspect(sys.argv[1:]))
