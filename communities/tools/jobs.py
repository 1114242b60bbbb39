"""Launching MPI jobs from Python and watching or killing them: the launcher, the command, the ranks'
process tree. Shared by the benchmarks, ``compare`` and ``chaos``."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]  # the source checkout (tools/ -> communities/ -> root)


def find_mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    import shutil

    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise SystemExit("communities bench: no mpiexec next to the interpreter or on PATH (use --mpiexec)")
    return found


def children_of() -> Dict[int, List[int]]:
    """{ppid: [pid, ...]} of every process in /proc (Linux)."""
    tree: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])  # the name may hold spaces and ')'
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def launch_polled(cmd: List[str], env: dict, log: Path, timeout: float, every: float = 0.5):
    """(exit code, seconds, peak RSS of each rank) of ``cmd``, polling /proc for the ranks' VmHWM."""
    seen: Dict[int, int] = {}
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)

        def stop():
            os.killpg(proc.pid, signal.SIGKILL)  # mpiexec's own group: its proxy and the ranks with it
            proc.wait()

        try:
            while proc.poll() is None:
                rank_peaks(proc.pid, seen)
                if time.perf_counter() - t0 > timeout:
                    stop()
                    return 124, time.perf_counter() - t0, list(seen.values())
                time.sleep(every)
        except BaseException:
            stop()
            raise
    return proc.returncode, time.perf_counter() - t0, list(seen.values())


def rank_peaks(root_pid: int, seen: Dict[int, int]) -> None:
    """Update ``seen`` {pid: VmHWM bytes} with the python ranks under ``root_pid`` (mpiexec -> proxy -> ranks)."""
    tree, stack = children_of(), [root_pid]
    while stack:
        pid = stack.pop()
        for child in tree.get(pid, []):
            try:
                with open(f"/proc/{child}/cmdline", "rb") as fh:
                    cmd = fh.read().split(b"\0")
                if b"communities" not in cmd or b"run" not in cmd:
                    stack.append(child)  # the proxy (a rank's own children are not ranks)
                    continue
                with open(f"/proc/{child}/status") as fh:
                    for line in fh:
                        if line.startswith("VmHWM:"):
                            seen[child] = max(seen.get(child, 0), int(line.split()[1]) * 1024)
            except OSError:
                continue


def engine_cmd(launcher: List[str], n: int, config: str, root: str, extra: Sequence[str],
                wrap: Optional[List[str]] = None) -> List[str]:
    py = [sys.executable, "-m"] + (wrap or ["communities"])
    return launcher + ["-n", str(n)] + py + ["run", config, f"output.root={root}", "--overwrite", "--no-progress",
                                             *extra]


def pythonpath() -> str:
    pp = os.environ.get("PYTHONPATH", "")
    return str(ROOT) + (os.pathsep + pp if pp else "")
