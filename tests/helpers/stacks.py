"""Where the processes of a hung job are: for the message of a test that timed out.

A timeout that only says "timed out" leaves the next person to reproduce a rare hang; these helpers find a
job's processes (by session, or by a variable in their environment) and describe them: a ``ps`` row
each, and a py-spy stack of each Python one (py-spy comes with the dev extra; skipped where it is missing).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, List


def _pids(keep: Callable[[str], bool]) -> List[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and int(pid) != os.getpid() and keep(pid):
                found.append(pid)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _stat(pid: str) -> List[str]:
    """/proc/PID/stat after "pid (comm) ": state, ppid, pgrp, session, ..."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2:].split()


def in_session(sid: int) -> List[str]:
    """The live processes of session ``sid``: a launcher started with ``start_new_session`` and its ranks
    (Open MPI's prterun gives each rank a process group of its own, in the launcher's session)."""
    def live_member(pid: str) -> bool:
        state, _, _, session = _stat(pid)[:4]
        return state != "Z" and int(session) == sid
    return _pids(live_member)


def kill(pids: List[str]) -> None:
    """SIGKILL each of ``pids`` that is still there."""
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except OSError:
            continue


def kill_session(sid: int) -> None:
    """SIGKILL every live process of session ``sid`` (the ranks' process groups as well as the launcher's)."""
    kill(in_session(sid))


def only_leader_left(sid: int) -> bool:
    """True when session ``sid`` holds no live process but its leader: a launcher whose ranks have all
    exited (zombies aside)."""
    return all(int(pid) == sid for pid in in_session(sid))


def with_env(entry: str) -> List[str]:
    """The processes whose environment holds ``entry`` (``NAME=value``): ranks wherever their session is."""
    needle = entry.encode()
    return _pids(lambda pid: needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))


def describe(pids: List[str], stack_chars: int = 3000) -> str:
    """A ``ps`` row of each process, and the innermost ``stack_chars`` of each Python one's py-spy dump."""
    if not pids:
        return "\n--- no process left"
    ps = subprocess.run(["ps", "-ww", "-o", "pid,ppid,stat,pcpu,etime,wchan:24,args", "-p", ",".join(pids)],
                        capture_output=True, text=True)
    out = [f"--- processes\n{ps.stdout}"]
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    for pid in pids if Path(spy).exists() else []:
        try:
            if b"python" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]:
                continue
            res = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=30)
            out.append(f"--- py-spy dump --pid {pid} (innermost first)\n{res.stdout[:stack_chars]}{res.stderr[-300:]}")
        except (subprocess.TimeoutExpired, OSError) as exc:
            out.append(f"--- py-spy dump --pid {pid}: {exc}")
    return "\n" + "\n".join(out)
