"""``communities slurm``: a ready SLURM batch script for a config, optionally submitted.

    communities slurm CONFIG [--nodes N] [--ntasks-per-node M] [--cpus-per-task C] [--time T]
                             [--partition P] [--account A] [--gpus-per-node G | --gpus-per-task G]
                             [--launcher auto|srun|mpirun] [--srun-mpi pmi2|pmix] [--setup LINE ...]
                             [--warn-before S] [--python PATH] [--out FILE] [--overwrite | --resume]
                             [--sbatch-option OPT ...] [--submit] [key.path=value ...]

The script is ``launch/slurm.sbatch`` with its values filled in: that file is the one
template (the package reads it through ``communities/templates/slurm.sbatch``, a link to
it), so a hand-edited copy and a generated script behave the same. Every ``#SBATCH
--option=value`` line, every variable of its "what to run" block and its ``setup`` block
are replaced by name; a template edit that drops one of them fails loudly here and in the tests.

It is written to ``<output.root>/<name>.sbatch`` (or ``--out``), with the job's log at
``<output.root>/<name>-<jobid>.out``, beside the run directory: generating a script creates
no ``results/<name>/`` (the job does, on the compute node). The config and overrides are
validated now, against the job's ``nodes x ntasks-per-node`` processes, so a bad key fails
here and not in the queue.

The launcher (``slurm_launcher.py``): srun where this SLURM's ``srun --mpi=list`` offers the
PMI that mpi4py's MPI library speaks, else mpirun; stderr says which and why. GPUs
(``--gpus-per-node``, ``--gpus-per-task``, or such an ``--sbatch-option``) add ``device=cuda``
to the overrides, and each rank takes one GPU; a config that sets ``device: cpu`` is refused.
The setup block (``--setup``, repeatable, after the config's ``slurm.setup`` lines) runs first
in the job: module loads, activating an environment.

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
from . import slurm_launcher

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # communities/
# the package's link to launch/slurm.sbatch, then the file itself in a source checkout
TEMPLATE_PATHS = (PACKAGE_DIR / "templates" / "slurm.sbatch", PACKAGE_DIR.parent / "launch" / "slurm.sbatch")
SBATCH_OPTIONS = ("job-name", "nodes", "ntasks-per-node", "cpus-per-task", "time", "partition", "account",
                  "gpus-per-node", "gpus-per-task", "output", "signal")
VARIABLES = ("CONFIG", "OVERRIDES", "LAUNCHER", "SRUN_MPI", "PYTHON", "WORKDIR", "RUN_DIR", "FIRST_RUN_ARGS", "ULFM")
WARN_BEFORE_S = 120  # the default USR1 warning before the time limit
POPULATION_NOTE = ("A requeue onto fewer nodes just works for a population: with world_size set, the same\n"
                   "world_size on fewer MPI processes (any number that divides it) resumes bitwise from the\n"
                   "per-replica checkpoints.")
# SLURM's time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})$")
# sbatch options that ask for GPUs
_GPU_OPTION = re.compile(r"^--(gpus(-per-(node|task|socket))?=|gres=(\S*,)?gpu\b)")
_SETUP = re.compile(r"^setup\(\) \{[^\n]*\n(?:.*\n)*?\}$", re.M)  # the template's setup block, whole


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
           extra_sbatch: Sequence[str] = (), header: str = "", *, setup: Optional[Sequence[str]] = None) -> str:
    """Fill the template: ``#SBATCH --opt=`` values (None leaves the template's line as is,
    a value also switches on a ``##SBATCH`` line), variables by name, the ``setup`` block's lines
    (None leaves it as is), extra ``#SBATCH`` lines after the last one, and ``header`` comment
    lines after the shebang."""
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
    blocks = _SETUP.findall(out)
    if len(blocks) != 1:
        raise SlurmError(f"template {template_path()}: expected exactly one 'setup() {{ ... }}' block, "
                         f"found {len(blocks)}")
    if setup is not None:
        first = blocks[0].split("\n", 1)[0]
        body = "".join(f"    {line}\n" for line in setup) or "    :\n"
        out = _SETUP.sub(lambda _m: f"{first}\n{body}}}", out)
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
        description="Write a ready SLURM batch script for a config (<output.root>/<name>.sbatch) "
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
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument("--gpus-per-node", type=int, default=None,
                      help="GPUs per node, at least --ntasks-per-node: sets device=cuda, one GPU per rank")
    gpus.add_argument("--gpus-per-task", type=int, default=None,
                      help="GPUs per rank (1: one each): sets device=cuda; a rank uses one")
    p.add_argument("--launcher", choices=slurm_launcher.LAUNCHERS, default="auto",
                   help="auto (default): srun where `srun --mpi=list` offers the PMI that mpi4py's MPI library "
                        "speaks (pmi2: MPICH, Intel MPI; pmix: Open MPI), else mpirun; mpirun (alias mpiexec): "
                        "the library's own launcher, next to --python else on PATH, needed for ULFM")
    p.add_argument("--srun-mpi", default=None, metavar="PLUGIN",
                   help="srun --mpi=PLUGIN (default: pmix for Open MPI, pmi2 for the others)")
    p.add_argument("--setup", action="append", default=[], metavar="LINE",
                   help="a shell line the job runs first, e.g. --setup 'module load openmpi' --setup "
                        "'source ~/env/bin/activate' (repeatable; after the config's slurm.setup lines)")
    p.add_argument("--warn-before", type=int, default=WARN_BEFORE_S, metavar="S",
                   help="SLURM signals the job S seconds before its time limit (default 120): enough for "
                        "signature.every units and a checkpoint")
    p.add_argument("--python", default=None, help="interpreter with communities installed (default: this one)")
    p.add_argument("--out", default=None, help="where to write the script (default <output.root>/<name>.sbatch)")
    first = p.add_mutually_exclusive_group()
    first.add_argument("--overwrite", action="store_true",
                       help="the job's first attempt replaces an existing results/<name>/")
    first.add_argument("--resume", action="store_true",
                       help="the job's first attempt continues results/<name>/ from its last checkpoint")
    p.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                   help="an extra '#SBATCH OPT' line, e.g. --sbatch-option=--constraint=a100 (repeatable)")
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


def time_seconds(text: str) -> int:
    """A SLURM time limit in seconds (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S)."""
    days, _, rest = text.rpartition("-") if "-" in text else ("", "", text)
    parts = [int(x) for x in rest.split(":")]
    if days:
        h, m, s = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


def _check_options(args: argparse.Namespace) -> None:
    for name in ("nodes", "ntasks-per-node", "cpus-per-task", "gpus-per-node", "gpus-per-task", "warn-before"):
        _positive(name, getattr(args, name.replace("-", "_")))
    if args.time is not None and not _TIME.match(args.time):
        raise SlurmError(f"--time={args.time!r}: use HH:MM:SS, MM, D-HH:MM:SS or another SLURM time format")
    if args.warn_before > 65535:
        raise SlurmError(f"--warn-before={args.warn_before}: SLURM's signal delay is at most 65535 s")
    if args.time is not None and args.warn_before >= time_seconds(args.time):
        raise SlurmError(f"--warn-before={args.warn_before} s is not shorter than --time={args.time}: the stop "
                         "signal would come at the start")
    for line in args.setup:
        if "\n" in line or not line.strip():
            raise SlurmError(f"--setup {line!r}: give one shell line per --setup")


def _placement(cfg, nodes: int, per_node: Optional[int]) -> int:
    """Ranks per node (given, or the config's world_size over the nodes), checked against the config."""
    from ..config import ConfigError
    from ..refusals import check_placement

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
    return per_node


def gpu_request(args: argparse.Namespace) -> Optional[str]:
    """The option that asks for GPUs (``--gpus-per-node=4``), or None."""
    if args.gpus_per_node is not None:
        return f"--gpus-per-node={args.gpus_per_node}"
    if args.gpus_per_task is not None:
        return f"--gpus-per-task={args.gpus_per_task}"
    return next((o for o in args.sbatch_option if _GPU_OPTION.match(o)), None)


def gpu_overrides(cfg, asked: Optional[str], per_node: int, gpus_per_node: Optional[int]) -> List[str]:
    """``["device=cuda"]`` when GPUs are asked for and the config leaves the device open; a config that sets
    ``device: cpu`` is refused (no silent CPU run on GPU nodes), and so is a node with fewer GPUs than ranks."""
    if asked is None:
        return []
    if cfg.device == "cpu" and "device" in cfg.model_fields_set:
        raise SlurmError(f"{asked} asks for GPUs but the config sets device: cpu, so the job would train on the "
                         "CPUs; set device=cuda (or drop the GPU request)")
    given = re.match(r"^--gpus-per-node=(\d+)$", asked)
    if gpus_per_node is None and given:
        gpus_per_node = int(given.group(1))
    if gpus_per_node is not None and gpus_per_node < per_node:
        raise SlurmError(f"--gpus-per-node={gpus_per_node} is fewer than --ntasks-per-node={per_node}: each rank "
                         "takes a GPU of its own; ask for as many GPUs per node as ranks per node")
    return [] if cfg.device == "cuda" else ["device=cuda"]


def _python(args: argparse.Namespace) -> str:
    python = args.python or sys.executable
    if args.python and not (shutil.which(python) or Path(python).exists()):
        raise SlurmError(f"--python={python!r}: no such interpreter")
    if Path(python).is_absolute() or os.sep in python:
        python = str(Path(python).absolute())
    return python


def _launch(args: argparse.Namespace, cfg, python: str) -> slurm_launcher.Launch:
    ulfm = cfg.comm.fault_tolerance == "shrink"
    try:
        launch = slurm_launcher.choose(args.launcher, python=python, srun_mpi=args.srun_mpi, ulfm=ulfm)
    except ValueError as exc:
        raise SlurmError(str(exc)) from None
    if launch.launcher == "mpirun" and not (Path(python).parent / "mpiexec").exists() \
            and not (shutil.which("mpiexec") or shutil.which("mpirun")):
        print(f"communities slurm: warning: no mpiexec next to {python} nor on PATH here; the job needs one "
              "on the compute nodes (or --launcher srun)", file=sys.stderr)
    shown = f"srun --mpi={launch.srun_mpi}" if launch.launcher == "srun" else "mpirun"
    print(f"communities slurm: launcher {shown} ({launch.why})", file=sys.stderr)
    return launch


def generate(args: argparse.Namespace) -> Tuple[Path, Path]:
    """Validate, render and write the script; return (script, run directory)."""
    from ..config import load

    cfg = load(args.config, args.overrides)
    workdir = Path.cwd()
    run_dir = (workdir / cfg.output.root / cfg.name).resolve()
    if args.print_run_dir:
        return run_dir, run_dir
    _check_options(args)
    nodes = args.nodes or 1
    per_node = _placement(cfg, nodes, args.ntasks_per_node)
    overrides = list(args.overrides) + gpu_overrides(cfg, gpu_request(args), per_node, args.gpus_per_node)
    if len(overrides) > len(args.overrides):
        cfg = load(args.config, overrides)
    python = _python(args)
    launch = _launch(args, cfg, python)
    if _has_run(run_dir) and not (args.overwrite or args.resume):
        raise SlurmError(f"{run_dir} already holds a run, so the job would refuse to start; pass --overwrite "
                         "(its first attempt replaces the run) or --resume (it continues from the last checkpoint)")

    out = Path(args.out).resolve() if args.out else run_dir.parent / f"{cfg.name}.sbatch"
    first_args = ["--overwrite"] if args.overwrite else ["--resume"] if args.resume else []
    command = " ".join(shlex.quote(a) for a in ["communities", "slurm"] + list(args.argv))
    header = (f"Generated by `{command}`\n"
              f"on {_dt.datetime.now().astimezone().isoformat(timespec='seconds')} from launch/slurm.sbatch.\n"
              f"Submit with: sbatch {out}\n"
              f"{POPULATION_NOTE}")
    setup = [line for entry in cfg.slurm.setup for line in entry.splitlines() if line.strip()] + list(args.setup)
    text = render(
        template_text(),
        sbatch={"job-name": args.job_name or cfg.name, "nodes": nodes, "ntasks-per-node": per_node,
                "cpus-per-task": args.cpus_per_task, "time": args.time, "partition": args.partition,
                "account": args.account, "gpus-per-node": args.gpus_per_node, "gpus-per-task": args.gpus_per_task,
                "output": str(run_dir.parent / f"{cfg.name}-%j.out"), "signal": f"B:USR1@{args.warn_before}"},
        variables={"CONFIG": str(Path(args.config).resolve()), "OVERRIDES": overrides,
                   "LAUNCHER": launch.launcher, "SRUN_MPI": launch.srun_mpi, "PYTHON": python,
                   "WORKDIR": str(workdir), "RUN_DIR": str(run_dir), "FIRST_RUN_ARGS": first_args,
                   "ULFM": int(cfg.comm.fault_tolerance == "shrink")},
        extra_sbatch=args.sbatch_option, header=header, setup=setup)
    _check_syntax(text, setup)
    # SLURM opens the log in output.root before the script runs; the run directory is the job's to make
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    _write_script(out, text)
    return out, run_dir


def _check_syntax(text: str, setup: Sequence[str]) -> None:
    """``bash -n`` on the script, where bash is: a setup line that breaks it fails here, not in the queue."""
    bash = shutil.which("bash")
    if bash is None:
        return
    res = subprocess.run([bash, "-n"], input=text, capture_output=True, text=True)
    if res.returncode != 0:
        where = f" (setup lines: {list(setup)})" if setup else ""
        raise SlurmError(f"the generated script is not valid bash{where}: {res.stderr.strip()}")


def _write_script(out: Path, text: str) -> None:
    """Atomically, executable as far as the umask lets (created 0777 less the umask)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o777)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, out)


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


def log_path(run_dir: Path, job: str) -> Path:
    """Where the generated script's job writes its log: ``<output.root>/<name>-<jobid>.out``."""
    return run_dir.parent / f"{run_dir.name}-{job}.out"


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
        print(f"communities slurm: submitted {path} as job {job} (squeue -j {job}; log {log_path(run_dir, job)})",
              file=sys.stderr)
        return 0
    except (SlurmError, ConfigError, OSError) as exc:
        print(f"communities slurm: error: {exc}", file=sys.stderr)
        return EXIT_USER


if __name__ == "__main__":
    sys.exit(main_slurm())
