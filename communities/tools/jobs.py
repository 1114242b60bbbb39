"""Launching MPI jobs from Python, and watching or ending them: the launcher, the command line, the job's
processes. Shared by ``compare``, the benchmarks and the tests' helpers (tests/helpers/mpi.py).

A job is started as the leader of a session of its own (``start``), so that everything it starts can be found
again: MPICH's ranks share the launcher's process group, Open MPI's prterun gives each rank a group of its own
in the launcher's session, and a rank whose launcher died is re-parented but stays in the session. ``end``
signals the session and the launcher's descendants (psutil), so no rank outlives a job that was ended.
"""
from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import psutil

ROOT = Path(__file__).resolve().parents[2]  # the source checkout (tools/ -> communities/ -> root)
# where a rank finds its MPI rank in its environment: Open MPI, PMIx, MPICH's Hydra
RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")


# --------------------------------------------------------------------------- the launcher and its command


def find_mpiexec() -> Optional[str]:
    """The mpiexec next to this interpreter (the mpich wheel's, or a virtual environment's), else the one on
    PATH; None where there is none."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec") or shutil.which("mpirun")


def require_mpiexec(given: Optional[str], what: str) -> str:
    """``given``, else ``find_mpiexec()``; a clear exit where there is none."""
    found = given or find_mpiexec()
    if not found:
        raise SystemExit(f"{what}: no mpiexec next to the interpreter or on PATH (use --mpiexec)")
    return found


@functools.lru_cache(maxsize=None)
def launcher_version(exe: str) -> str:
    """What ``EXE --version`` prints ("" where it cannot run): once per launcher and process."""
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def is_open_mpi(exe: str) -> bool:
    out = launcher_version(exe)
    return "Open MPI" in out or "OpenRTE" in out


def launcher_flags(exe: str) -> List[str]:
    """What Open MPI's launcher needs to start more ranks than cores (and, as root, at all); none for MPICH."""
    if not is_open_mpi(exe):
        return []
    return ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])


def engine_cmd(launcher: List[str], n: int, config: str, root: str, extra: Sequence[str],
               *, wrap: Optional[List[str]] = None) -> List[str]:
    """``LAUNCHER -n N python -m communities run CONFIG output.root=ROOT --overwrite --no-progress EXTRA``
    (``wrap``: another module that runs the engine, e.g. a profiler's)."""
    py = [sys.executable, "-m"] + (wrap or ["communities"])
    return launcher + ["-n", str(n)] + py + ["run", config, f"output.root={root}", "--overwrite", "--no-progress",
                                             *extra]


def pythonpath() -> str:
    """PYTHONPATH with this checkout first: the job's ranks import the same package as the caller."""
    pp = os.environ.get("PYTHONPATH", "")
    return str(ROOT) + (os.pathsep + pp if pp else "")


def child_env(**extra: str) -> Dict[str, str]:
    """The caller's environment for a job: one thread per rank and a headless matplotlib unless set, this
    checkout on PYTHONPATH, and ``extra``."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MPLBACKEND", "Agg")
    env["PYTHONPATH"] = pythonpath()
    env.update(extra)
    return env


def start(cmd: Sequence[str], *, env: Optional[Dict[str, str]] = None, cwd=None, stdout=None, stderr=None,
          text: bool = False) -> subprocess.Popen:
    """``cmd`` as the leader of a new session (see the module docstring), so ``end`` finds all it starts."""
    return subprocess.Popen(list(cmd), cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=True)


# --------------------------------------------------------------------------- the job's processes


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def in_session(sid: int) -> List[psutil.Process]:
    """The live processes of session ``sid`` (zombies and this process left out): a launcher started by
    ``start`` and every rank it started, whatever their process group or parent."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) == sid and _alive(p):
                found.append(p)
        except (OSError, psutil.Error):  # gone meanwhile, or not ours to ask
            continue
    return found


def descendants(pid: int) -> List[psutil.Process]:
    """The live processes below ``pid`` (none where it is gone)."""
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if _alive(p)]
    except psutil.Error:
        return []


def job_processes(pid: int) -> List[psutil.Process]:
    """A job started by ``start`` (leader ``pid``): its session's processes and the leader's descendants (a
    rank that started a session of its own, e.g. under ``setsid``, is still a descendant)."""
    seen = {p.pid: p for p in in_session(pid)}
    seen.update({p.pid: p for p in descendants(pid)})
    return list(seen.values())


def only_leader_left(sid: int) -> bool:
    """True when session ``sid`` holds no live process but its leader: a launcher whose ranks have all exited
    (zombies aside)."""
    return all(p.pid == sid for p in in_session(sid))


def with_env(entry: str) -> List[psutil.Process]:
    """The processes whose environment holds ``entry`` (``NAME=value``): a job's ranks wherever their session."""
    name, _, value = entry.partition("=")
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(name) == value:
                found.append(p)
        except (OSError, psutil.Error):
            continue
    return found


def signal_all(procs: Iterable[psutil.Process], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``procs`` that is still there."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.Error:
            continue


def end(proc: subprocess.Popen, grace: float = 0.0) -> None:
    """End a job started by ``start`` and reap its launcher: SIGTERM first where ``grace`` > 0 (the ranks may
    stop cleanly within it), then SIGKILL to every process of it still alive."""
    if grace > 0 and proc.poll() is None:
        signal_all(job_processes(proc.pid), signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    signal_all(job_processes(proc.pid), signal.SIGKILL)
    proc.wait()


def mpi_rank(p: psutil.Process) -> Optional[int]:
    """The MPI rank a Python process carries in its environment (``RANK_VARS``), None for anything else (the
    launcher's proxies, ``setsid``, a wrapper shell)."""
    try:
        argv = p.cmdline()
        if not argv or "python" not in Path(argv[0]).name:  # setsid, setpriv, a shell: the rank is below it
            return None
        env = p.environ()
    except (OSError, psutil.Error):
        return None
    for var in RANK_VARS:
        if var in env:
            return int(env[var])
    return None


def job_ranks(launcher_pid: int) -> Dict[int, int]:
    """{MPI rank: pid} of the launcher's descendants that are ranks (``mpi_rank``), found by their environment
    only; the search does not go below a rank (a rank's own children are not ranks)."""
    out: Dict[int, int] = {}
    try:
        stack = psutil.Process(launcher_pid).children()
    except psutil.Error:
        return out
    while stack:
        p = stack.pop()
        rank = mpi_rank(p)
        if rank is not None:
            out[rank] = p.pid
            continue
        try:
            stack += p.children()
        except psutil.Error:
            continue
    return out


def peak_rss(pid: int) -> Optional[int]:
    """A process's peak resident set (VmHWM in /proc/PID/status, Linux; psutil does not report it), bytes."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def run_polled(cmd: List[str], env: dict, log: Path, timeout: float, every: float = 0.5
               ) -> Tuple[int, float, List[int]]:
    """Run ``cmd`` (``start``), its output to ``log``: (exit code, seconds, peak RSS of each rank), the ranks'
    VmHWM polled every ``every`` seconds; exit code 124 and the job ended after ``timeout`` seconds."""
    seen: Dict[int, int] = {}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = start(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                for pid in job_ranks(proc.pid).values():
                    peak = peak_rss(pid)
                    if peak is not None:
                        seen[pid] = max(seen.get(pid, 0), peak)
                if time.perf_counter() - t0 > timeout:
                    end(proc)
                    return 124, time.perf_counter() - t0, list(seen.values())
                time.sleep(every)
        except BaseException:
            end(proc)
            raise
    return proc.returncode, time.perf_counter() - t0, list(seen.values())
