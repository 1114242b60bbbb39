"""Where the processes of a hung job are: for the message of a test that timed out.

A timeout that only says "timed out" leaves the next person to reproduce a rare hang. The job's processes are
found by ``communities.tools.jobs`` (by session, or by a variable in their environment); ``describe`` gives a
``ps`` row of each, and a py-spy stack of each Python one (py-spy comes with the dev extra; skipped where it is
missing).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import List

import psutil


def describe(procs: List[psutil.Process], stack_chars: int = 3000) -> str:
    """A ``ps`` row of each process, and the innermost ``stack_chars`` of each Python one's py-spy dump."""
    pids = [str(p.pid) for p in procs]
    if not pids:
        return "\n--- no process left"
    ps = subprocess.run(["ps", "-ww", "-o", "pid,ppid,stat,pcpu,etime,wchan:24,args", "-p", ",".join(pids)],
                        capture_output=True, text=True)
    out = [f"--- processes\n{ps.stdout}"]
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    for pid in pids if Path(spy).exists() else []:
        try:
            argv = psutil.Process(int(pid)).cmdline()
            if not argv or "python" not in argv[0]:
                continue
            res = subprocess.run([spy, "dump", "--pid", pid], capture_output=True, text=True, timeout=30)
            out.append(f"--- py-spy dump --pid {pid} (innermost first)\n{res.stdout[:stack_chars]}{res.stderr[-300:]}")
        except (subprocess.TimeoutExpired, OSError, psutil.Error) as exc:
            out.append(f"--- py-spy dump --pid {pid}: {exc}")
    return "\n" + "\n".join(out)
