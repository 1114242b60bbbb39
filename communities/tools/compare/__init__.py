"""``communities compare SPEC.yaml``: run strategies x seeds in the same engine and compare them.

A spec (``spec.py``; the shipped ones in ``configs/compare/``) names a base config, the strategies (each with
optional overrides), the seeds, the world size, a target (an accuracy; for a language model a loss or bits per
byte, where lower is better) and an output name. Every (strategy, seed) is its own job, launched one after
another (``runs.py``), and the comparison (``aggregate.py``) is written to ``results/<spec>/compare.md``
(``markdown.py``, its tables from column lists in ``tables.py``), ``compare.json`` and two plots
(``plots.py``: consensus accuracy against bytes sent and against wall time). Completed runs (``summary.json``
present, ``meta.json`` status complete) are skipped unless ``--overwrite``, so an interrupted comparison
resumes where it stopped. ``--dry-run`` prints the commands.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from ...errors import EXIT_USER
from .aggregate import aggregate, target_of
from .curves import finite
from .markdown import write_markdown
from .plots import write_plots
from .runs import RunPlan, execute, launcher_argv, plan_runs, run_complete, validate
from .spec import Spec, SpecError, load_specs, spec_name
from .tables import fmt, plain, strategy_rows, summary_columns


def write_report(spec: Spec, plans: Sequence[RunPlan], results_root: Path) -> dict:
    from ...results import atomic_write_json

    out = results_root / spec.name
    out.mkdir(parents=True, exist_ok=True)
    agg = aggregate(spec, plans)
    write_markdown(agg, out / "compare.md", spec)
    write_plots(agg, out)
    public = {k: v for k, v in agg.items() if not k.startswith("_")}
    atomic_write_json(out / "compare.json", public)
    return public


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="communities compare",
                                description="Run strategies x seeds of one base config and compare them.")
    p.add_argument("spec", help="comparison spec (YAML), e.g. configs/compare/digits_groups.yaml")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--overwrite", action="store_true", help="rerun runs that are already complete")
    p.add_argument("--report-only", action="store_true", help="run nothing; rewrite compare.md/json from what exists")
    p.add_argument("--results-root", default="results", help="where results/<name>/ goes (default: results)")
    p.add_argument("--mpiexec", default=None, help="mpiexec to use (default: next to python, else on PATH)")
    p.add_argument("--launcher", default=None,
                   help="launch prefix replacing mpiexec, e.g. 'srun --mpi=pmix -n {n}' (overrides the spec's)")
    p.add_argument("--only", nargs="+", default=None, metavar="LABEL", help="only these strategies of the spec")
    p.add_argument("--seeds", nargs="+", type=int, default=None, help="only these seeds (default: the spec's)")
    p.add_argument("--cases", nargs="+", default=None, metavar="CASE", help="only these cases of a spec with cases")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run (overrides the spec's)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failed run")
    return p


def main_compare(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        specs = load_specs(args.spec)
    except SpecError as exc:
        print(f"communities compare: error: {exc}", file=sys.stderr)
        return EXIT_USER
    if args.cases:  # a multi-case spec: only these cases (named as in results/<spec>_<case>/, or that name whole)
        names = {s.name for s in specs}
        base = f"{spec_name(args.spec)}_"  # a case is exactly its name past "<spec>_"
        wanted = {c if c in names else base + c for c in args.cases}
        missing = sorted(c for c in args.cases if (c if c in names else base + c) not in names)
        if missing:
            print(f"communities compare: error: --cases {missing}: not among {sorted(names)}", file=sys.stderr)
            return EXIT_USER
        specs = [s for s in specs if s.name in wanted]
    rc = 0
    for spec in specs:
        rc = max(rc, compare_one(spec, args))
        if rc == EXIT_USER or (rc and args.fail_fast):
            break
    return rc


def compare_one(spec: Spec, args) -> int:
    """Run (or report) one spec: its strategies x seeds; writes results/<spec>/compare.md and .json."""
    try:
        if args.only:
            missing = sorted(set(args.only) - {a.label for a in spec.arms})
            if missing:
                raise SpecError(f"--only {missing}: not in the spec's strategies {[a.label for a in spec.arms]}")
        if not spec.base.exists():
            raise SpecError(f"{args.spec}: base config {str(spec.base)!r} not found")
        results_root = Path(args.results_root)
        launch = (launcher_argv(spec.processes or spec.world_size, args.launcher or spec.launcher, args.mpiexec)
                  if not args.report_only else [])
        plans = plan_runs(spec, results_root, launch, args.only, args.seeds)
        problems = validate(spec, plans)
    except SpecError as exc:
        print(f"communities compare: error: {exc}", file=sys.stderr)
        return EXIT_USER
    if problems:
        stream = sys.stdout if args.dry_run else sys.stderr
        print("communities compare: " + ("warning" if args.dry_run else "error") + ": invalid run configs:\n  "
              + "\n  ".join(problems), file=stream)
        if not (args.dry_run or args.report_only):
            return EXIT_USER
    timeout = args.timeout or spec.timeout
    logs = results_root / spec.name / "logs"
    if args.dry_run:
        try:
            for p in plans:
                state = "complete, skipped" if run_complete(p.path) and not args.overwrite else "to run"
                print(f"# {p.name} ({state})")
                print(" ".join(shlex.quote(c) for c in p.cmd), flush=True)
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    failed = 0 if args.report_only else run_plans(plans, args, spec, logs, timeout)
    agg = write_report(spec, plans, results_root)
    out = results_root / spec.name
    print(summary_table(agg))
    print(f"wrote {out / 'compare.md'}, {out / 'compare.json'} and plots")
    return 1 if failed else 0


def run_plans(plans: Sequence[RunPlan], args, spec: Spec, logs: Path, timeout: Optional[float]) -> int:
    """Run the plans not complete yet (all with ``--overwrite``), one after another: how many failed."""
    failed = 0
    try:  # a SIGTERM (a batch system's cancel) unwinds like Ctrl-C, ending the running job
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    except ValueError:  # not the main thread
        pass
    todo = [p for p in plans if args.overwrite or not run_complete(p.path)]
    print(f"compare {spec.name}: {len(plans)} runs ({len(plans) - len(todo)} complete, skipped), "
          f"{spec.world_size} ranks each; logs in {logs}", flush=True)
    for k, p in enumerate(todo, 1):
        print(f"[{k}/{len(todo)}] {p.name} ...", end=" ", flush=True)
        execute(p, logs / f"{p.name}.log", timeout)
        if p.status == "done":
            print(f"done in {p.seconds:.1f}s, {_final_figure(p.path)}", flush=True)
        else:
            failed += 1
            print(f"FAILED ({p.error})", flush=True)
            if args.fail_fast:
                break
    for p in plans:
        if p.status == "pending" and run_complete(p.path):
            p.status = "skipped"
    return failed


def _final_figure(path: Path) -> str:
    """A finished run's headline: ``consensus acc 0.9756``, or a language model's loss in both units."""
    s = json.loads((path / "summary.json").read_text())
    if s.get("task") is None:
        return f"consensus acc {s['consensus_test_acc']:.4f}"
    bpb = s.get("consensus_test_bpb")
    return (f"consensus loss {fmt(finite(s.get('consensus_test_loss')), '{:.3f}')} nats/token"
            + (f", {bpb:.3f} bits/byte" if bpb is not None else ""))


def summary_table(agg: dict) -> str:
    """What the command prints: a line per strategy (from compare.json's figures)."""
    personal = any(a["local_test_acc"]["n"] for a in agg["strategies"].values())
    lm = any("task" in r for r in agg["runs"])
    return plain(summary_columns(target_of(agg), personal, lm), strategy_rows(agg))
