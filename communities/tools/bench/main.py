"""Benchmarks: ``communities bench NAME``, each a module of ``communities/tools/bench/``.

Each prints a table of measured figures (and writes them with ``--json PATH``).
Nothing here asserts a speed: targets are printed next to the figures so a
reader can judge them on their own machine.

- ``exchange`` (under ``mpiexec -n 2``, or any even number of ranks paired
  0-1, 2-3, ...): the engine's own ``exchange.PairExchange`` (the 40-byte header
  ``Sendrecv``, then the payload swap and merge)
  against a raw mpi4py ``Sendrecv`` of the same weight bytes, plus its variants.
- ``signature``: count-sketch and Gaussian signature throughput against
  ``torch.sum`` over the same buffer, peak memory overhead, distance distortion.
- ``clustering``: linkage + cut + partner law + partner draws for all ranks.
- ``calibration``: the community test's false-positive rate on clouds without communities and its detection
  rate on planted groups, simulated and on the saved first rounds of real runs.
- ``partners``: one round's partner law and one unit's exchange list at N replicas
  (flat, hierarchical, least_recent), with the law's peak memory.
- ``overhead``: real engine runs; the orchestration share of wall time, and with
  ``--profile`` where the signature rounds spend it.
- ``inspect``: ``communities inspect`` (``inspection.main_inspect``) on a synthetic
  run directory (``communities.tools.synthetic.make_run``, 64 ranks and 50 rounds by default).
- ``vectorize``: replica-units per second of a process's replicas trained one after
  another (``train.train_unit``) against stacked (``workload.vectorized``), side by
  side, on digits with the quickstart MLP, one thread.
- ``chaos`` (``bench/chaos.py``): a ULFM soak that SIGKILLs a random rank every few
  seconds until a set number remain, then audits the run directory.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, List, Optional

from ...parsers import Parser, hide_subcommands, plain_text
from . import (
    calibration,
    chaos,
    clustering,
    exchange,
    inspection,
    overhead,
    partners,
    privacy,
    scale,
    signature,
    vectorize,
)

# the benchmarks in the order ``communities bench --help`` lists them; each module adds its subcommands, and each
# subcommand names its handler (``set_defaults(handler=...)``)
BENCHMARKS = (exchange, signature, clustering, calibration, partners, overhead, inspection, vectorize, privacy, scale,
              chaos)
HIDDEN = ("_signature-one", "_profile-rank")  # what ranks and child processes run, not users


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="communities bench", description=plain_text(__doc__))
    sub = parser.add_subparsers(dest="what", required=True)
    for module in BENCHMARKS:
        module.add_parser(sub)
    hide_subcommands(sub, *HIDDEN)
    return parser


def visible_benchmarks() -> List[str]:
    """The benchmarks users run, in ``BENCHMARKS`` order (``communities --help`` lists them)."""
    sub: Any = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    return list(sub.shown)


def main_bench(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.what == "_profile-rank" and args.argv and args.argv[0] == "--":
        args.argv = args.argv[1:]
    return args.handler(args)
