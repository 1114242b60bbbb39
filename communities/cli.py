"""The command line: ``communities COMMAND ...``, every subcommand one row of ``COMMANDS``.

The table gives the help, the usage line, the dispatch and the error for an unknown
command; ``bench`` lists its benchmarks from its own table (``tools/bench/main.py``).

``run`` is launched by ``mpiexec``/``srun``; every other command is a plain process.
Exit codes: 0 done, 2 a user error (nothing trained), 75 stopped by SIGUSR1/SIGTERM or a
``results/<name>/STOP`` file after writing a checkpoint (continue with ``--resume``),
anything else a failure. Errors a user can fix (config, data, run directory) print one
line from rank 0 and exit 2 on every rank, before any rank trains; ``--debug`` shows the
traceback. Any other exception on any rank prints that rank's traceback and aborts the
whole MPI job, so nothing hangs.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

from . import __version__, console
from .errors import EXIT_PREEMPTED, EXIT_USER, UserError, is_collective
from .parsers import Parser, plain_text

log = logging.getLogger("communities")


@dataclass(frozen=True)
class Command:
    """One subcommand: its name, its line in ``--help``, and who takes its arguments.

    ``delegate`` (``module:function``) is a command with a parser of its own, imported only when called (most need
    neither MPI nor torch); without one, ``arguments`` adds its options here and ``handler`` runs it.
    """

    name: str
    help: Union[str, Callable[[], str]]
    delegate: str = ""
    arguments: Optional[Callable[[argparse.ArgumentParser], None]] = None
    handler: Optional[Callable[[argparse.Namespace], int]] = None

    @property
    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help

    def call(self, argv: List[str]) -> int:
        module, function = self.delegate.split(":")
        return getattr(importlib.import_module(module, __package__), function)(argv)


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.1 merge.rule=clock")
    start = p.add_mutually_exclusive_group()  # replacing a run and continuing it are opposites
    start.add_argument("--overwrite", action="store_true", help="replace an existing results/<name>/")
    start.add_argument("--resume", action="store_true",
                       help="continue results/<name>/ from its last complete checkpoint (automatic when "
                            "SLURM_RESTART_COUNT > 0)")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for user errors")
    p.add_argument("--no-progress", action="store_true", help="no progress output on rank 0")
    _verbosity(p)


def _validate_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Check a config without MPI and print it resolved (stdout). A dry run (stderr) loads the "
                     "dataset, calls a module:function dataset twice to see that it is deterministic, partitions it, "
                     "builds the model and runs one forward pass.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--processes", type=int, default=None, metavar="P",
                   help="also check the placement on P MPI processes: world_size replicas on P processes (P divides "
                        "it: a population), or one replica per process without world_size")
    p.add_argument("--world-size", dest="processes", type=int, help=argparse.SUPPRESS)  # the old name of --processes
    p.add_argument("--no-dry-run", action="store_true", help="check the config alone: load no data, build no model")
    p.add_argument("--debug", action="store_true")
    _verbosity(p)


def _verbosity(p) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help="print warnings and errors only")
    group.add_argument("-v", "--verbose", action="store_true", help="also print debugging detail (data, shards, "
                       "every signature round)")


def version_text() -> str:
    """``communities X (torch Y, mpi4py Z, Python W)``, without importing torch or MPI."""
    from importlib import metadata

    def v(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return (f"communities {__version__} (torch {v('torch')}, mpi4py {v('mpi4py')}, "
            f"Python {sys.version.split()[0]})")


def _bench_help() -> str:
    from .tools.bench.main import visible_benchmarks  # (light: the benchmarks import torch when they run)

    return "benchmarks: bench " + " | ".join(visible_benchmarks())


def build_parser(helps: bool = True) -> argparse.ArgumentParser:
    """The parser of ``run`` and ``validate``, with every command of ``COMMANDS`` in its help.

    ``helps=False`` leaves out the help lines that must import something to be written (the benchmarks' list):
    every rank of a job parses its command line, and only ``--help`` prints them."""
    names = " | ".join(c.name for c in COMMANDS)
    parser = Parser(prog="communities", description=f"communities {names}. " + plain_text(__doc__.split("\n\n")[2]))
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        if command.delegate:  # listed here; its own parser reads its arguments
            sub.add_parser(command.name, help=command.help_text if helps or not callable(command.help) else "",
                           add_help=False)
        else:
            assert command.arguments is not None
            command.arguments(sub.add_parser(command.name, help=command.help_text))
    return parser


def hook_search_path(config: str) -> None:
    """Let a config's module:function hooks be imported from the current directory and the config's directory."""
    from .workload import plugins

    plugins.add_search_path(os.getcwd(), Path(config).resolve().parent)


def cmd_validate(args) -> int:
    from .config import load
    from .refusals import check_placement

    cfg = load(args.config, args.overrides)
    replicas = cfg.world_size
    if args.processes is not None:
        source = f"{args.processes} MPI processes (--processes {args.processes})"
        replicas = check_placement(cfg, args.processes, source=source)
        if replicas != args.processes and not args.quiet:
            print(f"communities: world_size={replicas} replicas on {args.processes} MPI processes, "
                  f"{replicas // args.processes} per process (a population)", file=sys.stderr)
    if not args.no_dry_run:
        from .workload.dry_run import dry_run

        hook_search_path(args.config)
        for line in dry_run(cfg, replicas):
            if not args.quiet:  # stderr: stdout is the resolved config
                print(f"communities: {line}", file=sys.stderr)
    print(cfg.to_yaml(), end="")
    return 0


def cmd_run(args) -> int:
    from .runtime import stopflag

    stopflag.install()  # before MPI and torch load: a SIGUSR1/SIGTERM during start-up stops at the first round
    # MPI_Init before torch and scipy load: under Open MPI 5.0's ULFM with the threaded failure detector on, an
    # MPI_Init that followed their import crashed (SIGSEGV inside it) in 2 of 6 8-rank start-ups here, none of
    # 6 when it came first
    from mpi4py import MPI  # noqa: F401

    from .config import from_json, load
    from .engine import loop
    from .engine.state import survival
    from .engine.state.run_dir import Resume
    from .errors import ConfigError, Preempted, RunComplete, collective
    from .refusals import check_placement
    from .runtime import population
    from .runtime.comm import World
    from .runtime.launcher import launcher_mismatch

    global _WORLD
    world = _WORLD = World()
    text, err = None, ""
    if world.rank == 0:
        try:
            cfg = load(args.config, args.overrides)
            text = cfg.to_json()
            mismatch = launcher_mismatch(world.size)
            if mismatch:
                raise ConfigError(mismatch)
        except ConfigError as exc:
            err = str(exc)
    err = world.bcast_text(err)
    if err:
        raise collective(ConfigError(err))
    cfg = from_json(world.bcast_text(text))
    hook_search_path(args.config)  # on every rank: each imports the hooks itself
    resume = Resume.of(args.resume, int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    code = 0
    # the survivors of a lost rank resume one replica per process, as many as survived (engine/state/survival.py)
    survived = resume is not Resume.FRESH and survival.survivors(world, Path(cfg.output.root) / cfg.name) is not None
    try:  # the same answer on every rank
        replicas = world.size if survived else check_placement(
            cfg, world.size, source=f"the {world.size} MPI processes of this job")
    except ConfigError as exc:
        raise collective(exc) from None
    options = dict(overwrite=args.overwrite, argv=sys.argv, progress=not (args.no_progress or args.quiet),
                   resume=resume)
    try:
        if replicas == world.size:
            loop.run(cfg, world, **options)
        else:  # a population: this process hosts world_size / (MPI processes) replicas
            population.run_population(world, replicas, lambda replica_world: loop.run(cfg, replica_world, **options))
    except Preempted:
        code = EXIT_PREEMPTED
    except RunComplete as exc:
        if world.leads:
            log.info(f"communities: {exc}")
    world.close()  # every rank ends here together (a stop and a complete run are collective decisions)
    return code


def exit_without_finalize(code: int) -> None:
    """Leave without MPI_Finalize, which under Open MPI 5.0's ULFM may never return: with the threaded failure
    detector on (``--mca mpi_ft_detector_thread true``, launch/mpirun.sh DETECTOR=1), and at times after a
    peer was lost (``ulfm.lost_a_peer``).

    Every collective of the job is done by now and every file written and closed: flush what is printed, exit.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


COMMANDS = (
    Command("run", "train under mpiexec/srun: communities run CONFIG [key.path=value ...]",
            arguments=_run_arguments, handler=cmd_run),
    Command("validate", "check a config without MPI (a dry run of its data and model) and print it resolved",
            arguments=_validate_arguments, handler=cmd_validate),
    Command("inspect", "dendrograms, timeline and report of runs: inspect RUN_DIR [RUN_DIR ...]",
            ".report.inspection:main_inspect"),
    Command("compare", "run a config under several strategies and seeds: compare SPEC.yaml",
            ".tools.compare:main_compare"),
    Command("bench", _bench_help, ".tools.bench.main:main_bench"),
    Command("slurm", "write (and --submit) an sbatch script for a config", ".tools.slurm:main_slurm"),
    Command("export", "one model per community of a saved round: export RUN --round R --k K",
            ".tools.export:main_export"),
    Command("dp-reference", "single-process Opacus DP-SGD on the pooled data, the privacy reference: dp-reference "
            "CONFIG --epsilon 1 3 8 inf", ".tools.dp_reference:main_dp_reference"),
    Command("lm-reference", "the language model trained centrally on the whole training split for the run's tokens, "
            "the reference: lm-reference CONFIG", ".tools.lm_reference:main_lm_reference"),
)
BY_NAME: Dict[str, Command] = {c.name: c for c in COMMANDS}


def main(argv: Optional[List[str]] = None) -> int:
    code = _main(argv)
    from .runtime import ulfm  # (light: MPI loads only if a command used it)

    detector = os.environ.get("OMPI_MCA_mpi_ft_detector_thread", "").lower() in ("1", "true")
    if ulfm.enabled() and (detector or ulfm.lost_a_peer()):
        exit_without_finalize(code)
    return code


def _main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--version", "-V"):
        print(version_text())
        return 0
    command = BY_NAME.get(argv[0]) if argv else None
    if command is not None and command.delegate:
        return command.call(argv[1:])
    parser = build_parser(helps=not argv or any(a in ("-h", "--help") for a in argv))
    args, extra = parser.parse_known_args(argv)
    # overrides may follow options (``run cfg.yaml --overwrite train.lr=0.1``)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    console.configure(args.quiet, args.verbose)
    try:
        handler = BY_NAME[args.command].handler
        assert handler is not None
        return handler(args)
    except UserError as exc:
        if _mpi_world_size() > 1 and not is_collective(exc):
            _abort_job()  # raised on some ranks only: the others would wait forever
        if getattr(args, "debug", False):
            traceback.print_exc()
        if not _is_mpi_worker():
            log.error(f"communities: error: {exc}")
        return EXIT_USER
    except KeyboardInterrupt:
        return 130
    except BaseException:
        _abort_job()
        raise


def _mpi_world_size() -> int:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return 1
    return mpi.COMM_WORLD.Get_size()


_WORLD = None  # the run command's World, once it exists: its lead prints what every rank would


def _is_mpi_worker() -> bool:
    """True on ranks other than the lead once MPI is up (so a user error prints once).

    The lead is rank 0 until it is lost (``comm.fault_tolerance: shrink``), then the lowest survivor.
    """
    if _WORLD is not None:
        return not _WORLD.leads
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi and mpi.Is_initialized() and mpi.COMM_WORLD.Get_rank() != 0)


ABORT_FLUSH_S = 1.0  # how long a failing rank waits, after printing its traceback, before MPI_Abort
REMOTE_GRACE_S = 5.0  # how long a rank stopped by another's failure waits for that rank's own abort


def _failed_elsewhere(exc: Optional[BaseException], rank: int) -> Optional[int]:
    """The rank whose set-up failure ``exc`` relays (``runtime.collective.collective_check`` marks it), or None."""
    origin = getattr(exc, "failed_rank", None)
    return origin if origin is not None and origin != rank else None


def _abort_job() -> None:
    """Abort every rank, with the traceback printed once, by the rank that failed: a failure never hangs the job.

    A rank that only relays another rank's failure prints one line and gives the failed rank a few seconds
    to print its traceback and abort the job itself (an early MPI_Abort here could cut that traceback off).
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return
    rank, size = mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    exc = sys.exc_info()[1]
    origin = _failed_elsewhere(exc, rank)
    if origin is not None:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        sys.stderr.write(f"communities: rank {rank} stopping: {first_line}\n")
        sys.stderr.flush()
        time.sleep(REMOTE_GRACE_S)  # rank ``origin`` aborts the job meanwhile; this is the fallback
    else:
        sys.stderr.write(f"communities: rank {rank} failed; aborting all {size} ranks\n")
        traceback.print_exc()
        sys.stderr.flush()
        # The launcher forwards a rank's stderr through its proxy, and MPI_Abort makes it kill the job: give it a
        # moment to pass the traceback on (under load, tracebacks were seen cut mid-way without this).
        time.sleep(ABORT_FLUSH_S)
    mpi.COMM_WORLD.Abort(1)
    # MPICH's MPI_Abort returns once the launcher has the message, and the launcher's kill comes a moment later:
    # re-raising meanwhile would print the traceback a second time (cut off by the kill). Leave now instead.
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
