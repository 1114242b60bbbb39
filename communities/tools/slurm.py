"""``communities slurm``: a ready SLURM batch script for a config, optionally submitted.

    communities slurm CONFIG [--nodes N] [--ntasks-per-node M] [--cpus-per-task C] [--time T]
                             [--partition P] [--account A] [--launcher srun|mpiexec] [--python PATH]
                             [--out FILE] [--overwrite | --resume] [--sbatch-option OPT ...] [--submit]
                             [key.path=value ...]

The script is ``launch/slurm.sbatch`` with its values filled in: that file is the one
template (the package reads it through ``communities/templates/slurm.sbatch``, a link to
it), so a hand-edited copy and a generated script behave the same. Every ``#SBATCH
--option=value`` line and every variable of its "what to run" block is replaced by name;
a template edit that drops one of them fails loudly here and in the tests.

It is written to ``results/<name>/job.sbatch`` (or ``--out``), next to the run it will
produce, with the job's log at ``results/<name>/slurm-<jobid>.out``; the engine does not
count these two as an existing run. The config and overrides are validated now, against the
world size ``nodes x ntasks-per-node``, so a bad key fails here and not in the queue.

A population (``world_size`` replicas on fewer MPI processes, any number that divides it) may
run on fewer nodes, so a requeue or a resubmission onto fewer nodes just works: its
checkpoints are per replica, and the same ``world_size`` on fewer processes resumes from them
bitwise. The script says so in its header.

stdout is the script's path, then, with ``--submit``, the job id (``sbatch --parsable``);
a human-readable line goes to stderr. Exit 2 for an error the user can fix.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ..errors import EXIT_USER

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # communities/
# the package's link to launch/slurm.sbatch, then the file itself in a source checkout
TEMPLATE_PATHS = (PACKAGE_DIR / "templates" / "slurm.sbatch", PACKAGE_DIR.parent / "launch" / "slurm.sbatch")
SBATCH_OPTIONS = ("job-name", "nodes", "ntasks-per-node", "cpus-per-task", "time", "partition", "account", "output")
VARIABLES = ("CONFIG", "OVERRIDES", "LAUNCHER", "PYTHON", "WORKDIR", "RUN_DIR", "FIRST_RUN_ARGS")
LAUNCHERS = ("mpiexec", "srun")
POPULATION_NOTE = ("A requeue onto fewer nodes just works for a population: with world_size set, the same\n"
                   "world_size on fewer MPI processes (any number that divides it) resumes bitwise from the\n"
                   "per-replica checkpoints.")
# SLURM's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")


class SlurmError(ValueError):
    """A user error in ``communities slurm`` options or template."""


def template_path() -> Path:
    for p in TEMPLATE_PATHS:
        if p.is_file():
            return p
    raise SlurmError("cannot find the batch script template (launch/slurm.sbatch); reinstall the package")


def template_text() -> str:
    return template_path().read_text(encoding="utf-8")


# --------------------------------------------------------------------------- rendering


def _sub_once(text: str, pattern: str, repl: str, what: str) -> str:
    rx = re.compile(pattern, re.M)
    found = rx.findall(text)
    if len(found) != 1:
        raise SlurmError(f"template {template_path()}: expected exactly one {what} line, found {len(found)}")
    return rx.sub(lambda _m: repl, text)


def _bash_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return "(" + " ".join(shlex.quote(str(v)) for v in value) + ")"
    return shlex.quote(str(value))


def render(template: str, sbatch: Dict[str, Optional[object]], variables: Dict[str, object],
           extra_sbatch: Sequence[str] = (), header: str = "") -> str:
    """Fill the template: ``#SBATCH --opt=`` values (None leaves the template's line as is,
    a value also switches on a ``##SBATCH`` line), variables by name, extra ``#SBATCH`` lines
    after the last one, and ``header`` comment lines after the shebang."""
    out = template
    for opt, value in sbatch.items():
        if opt not in SBATCH_OPTIONS:
            raise SlurmError(f"unknown sbatch option {opt!r}")
        pattern = rf"^##?SBATCH --{re.escape(opt)}=.*$"
        if value is None:
            _sub_once(out, pattern, "", f"#SBATCH --{opt}=")  # still check the template has it
            continue
        text = str(value)
        if not text or any(c.isspace() for c in text):
            raise SlurmError(f"--{opt}={text!r}: a value without spaces is needed")
        out = _sub_once(out, pattern, f"#SBATCH --{opt}={text}", f"#SBATCH --{opt}=")
    for name, value in variables.items():
        if name not in VARIABLES:
            raise SlurmError(f"unknown template variable {name!r}")
        out = _sub_once(out, rf"^{name}=.*$", f"{name}={_bash_value(value)}", f"{name}=")
    if extra_sbatch:
        lines = out.split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH "))
        for opt in extra_sbatch:
            if "\n" in opt or not opt.startswith("-"):
                raise SlurmError(f"--sbatch-option {opt!r}: give one sbatch option, e.g. --gpus-per-node=4")
        lines[last + 1:last + 1] = [f"#SBATCH {opt}" for opt in extra_sbatch]
        out = "\n".join(lines)
    if header:
        first, _, rest = out.partition("\n")
        out = first + "\n" + "".join(f"# {line}\n" for line in header.split("\n")) + rest
    return out


# --------------------------------------------------------------------------- the command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="communities slurm",
        description="Write a ready SLURM batch script for a config (results/<name>/job.sbatch) "
                    "and optionally submit it.",
        epilog=POPULATION_NOTE + " --nodes x --ntasks-per-node may be any divisor of world_size.")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=0.1 seed=2")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default 1)")
    p.add_argument("--ntasks-per-node", type=int, default=None,
                   help="MPI ranks per node (default: the config's world_size / nodes, else the template's)")
    p.add_argument("--cpus-per-task", type=int, default=None, help="cores per rank; sets OMP_NUM_THREADS")
    p.add_argument("--time", default=None, help="time limit, e.g. 02:00:00 or 1-00:00:00")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default=None, help="default: the config's name")
    p.add_argument("--launcher", choices=LAUNCHERS, default="mpiexec",
                   help="mpiexec (next to --python, else on PATH; default) or srun --mpi=pmi2")
    p.add_argument("--python", default=None, help="interpreter with communities installed (default: this one)")
    p.add_argument("--out", default=None, help="where to write the script (default results/<name>/job.sbatch)")
    first = p.add_mutually_exclusive_group()
    first.add_argument("--overwrite", action="store_true",
                       help="the job's first attempt replaces an existing results/<name>/")
    first.add_argument("--resume", action="store_true",
                       help="the job's first attempt continues results/<name>/ from its last checkpoint")
    p.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                   help="an extra '#SBATCH OPT' line, e.g. --sbatch-option=--gpus-per-node=4 (repeatable)")
    p.add_argument("--submit", action="store_true", help="submit with sbatch --parsable and print the job id")
    p.add_argument("--print-run-dir", action="store_true", help=argparse.SUPPRESS)
    return p


def _parse(argv: List[str]) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides = list(args.overrides) + extra
    return args


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise SlurmError(f"--{name}={value}: must be at least 1")


def _has_run(run_dir: Path) -> bool:
    from ..results import is_bookkeeping

    if not run_dir.is_dir():
        return False
    return any(not is_bookkeeping(p) for p in run_dir.iterdir())


def generate(args: argparse.Namespace) -> Tuple[Path, Path]:
    """Validate, render and write the script; return (script, run directory)."""
    from ..config import ConfigError, load
    from ..refusals import check_placement

    cfg = load(args.config, args.overrides)
    workdir = Path.cwd()
    run_dir = (workdir / cfg.output.root / cfg.name).resolve()
    if args.print_run_dir:
        return run_dir, run_dir
    for name in ("nodes", "ntasks-per-node", "cpus-per-task"):
        _positive(name, getattr(args, name.replace("-", "_")))
    if args.time is not None and not _TIME.match(args.time):
        raise SlurmError(f"--time={args.time!r}: use HH:MM:SS, MM, D-HH:MM:SS or another SLURM time format")
    nodes = args.nodes or 1
    per_node = args.ntasks_per_node
    if per_node is None:
        if cfg.world_size is not None:
            if cfg.world_size % nodes:
                raise SlurmError(f"world_size={cfg.world_size} does not split over --nodes={nodes}; "
                                 "give --ntasks-per-node")
            per_node = cfg.world_size // nodes
        else:
            found = re.search(r"^#SBATCH --ntasks-per-node=(\d+)", template_text(), re.M)
            per_node = int(found.group(1)) if found else 1
    ranks = nodes * per_node
    tasks = f"{ranks} MPI processes (--nodes={nodes} x --ntasks-per-node={per_node})"
    try:  # the placement check of communities run and validate: world_size replicas on the job's tasks
        check_placement(cfg, ranks, source=tasks)
    except ConfigError as exc:
        raise SlurmError(str(exc) if tasks in str(exc) else f"{exc} (the job has {tasks})") from None

    python = args.python or sys.executable
    if args.python and not (shutil.which(python) or Path(python).exists()):
        raise SlurmError(f"--python={python!r}: no such interpreter")
    if Path(python).is_absolute() or os.sep in python:
        python = str(Path(python).absolute())
    if args.launcher == "mpiexec" and not (Path(python).parent / "mpiexec").exists() and not shutil.which("mpiexec"):
        print(f"communities slurm: warning: no mpiexec next to {python} nor on PATH here; the job needs one "
              "on the compute nodes (or use --launcher srun)", file=sys.stderr)
    if _has_run(run_dir) and not (args.overwrite or args.resume):
        raise SlurmError(f"{run_dir} already holds a run, so the job would refuse to start; pass --overwrite "
                         "(its first attempt replaces the run) or --resume (it continues from the last checkpoint)")

    config_path = Path(args.config).resolve()
    out = Path(args.out).resolve() if args.out else run_dir / "job.sbatch"
    first_args = ["--overwrite"] if args.overwrite else ["--resume"] if args.resume else []
    command = " ".join(shlex.quote(a) for a in ["communities", "slurm"] + list(args.argv))
    header = (f"Generated by `{command}`\n"
              f"on {_dt.datetime.now().astimezone().isoformat(timespec='seconds')} from launch/slurm.sbatch.\n"
              f"Submit with: sbatch {out}\n"
              f"{POPULATION_NOTE}")
    text = render(
        template_text(),
        sbatch={"job-name": args.job_name or cfg.name, "nodes": nodes, "ntasks-per-node": per_node,
                "cpus-per-task": args.cpus_per_task, "time": args.time, "partition": args.partition,
                "account": args.account, "output": str(run_dir / "slurm-%j.out")},
        variables={"CONFIG": str(config_path), "OVERRIDES": list(args.overrides), "LAUNCHER": args.launcher,
                   "PYTHON": python, "WORKDIR": str(workdir), "RUN_DIR": str(run_dir),
                   "FIRST_RUN_ARGS": first_args},
        extra_sbatch=args.sbatch_option, header=header)
    run_dir.mkdir(parents=True, exist_ok=True)  # SLURM opens the log there before the script runs
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.chmod(0o755)
    os.replace(tmp, out)
    return out, run_dir


def submit(script: Path, cwd: Path) -> str:
    """``sbatch --parsable SCRIPT``; return the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SlurmError(f"sbatch not found on PATH: run this on a SLURM login node, or submit later with "
                         f"`sbatch {script}`")
    res = subprocess.run([sbatch, "--parsable", str(script)], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SlurmError(f"sbatch {script} failed (exit {res.returncode}): {res.stderr.strip() or res.stdout.strip()}")
    job = res.stdout.strip().splitlines()[-1].split(";")[0] if res.stdout.strip() else ""
    if not job:
        raise SlurmError(f"sbatch {script} printed no job id: {res.stderr.strip()}")
    return job


def main_slurm(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse(argv)
    args.argv = argv
    from ..config import ConfigError

    try:
        path, run_dir = generate(args)
        if args.print_run_dir:
            print(run_dir)
            return 0
        print(path, flush=True)
        if not args.submit:
            print(f"communities slurm: wrote {path}; submit it with: sbatch {path}", file=sys.stderr)
            return 0
        job = submit(path, Path.cwd())
        print(job, flush=True)
        log = run_dir / f"slurm-{job}.out"
        print(f"communities slurm: submitted {path} as job {job} (squeue -j {job}; log {log})", file=sys.stderr)
        return 0
    except (SlurmError, ConfigError, OSError) as exc:
        print(f"communities slurm: error: {exc}", file=sys.stderr)
        return EXIT_USER


if __name__ == "__main__":
    sys.exit(main_slurm())
