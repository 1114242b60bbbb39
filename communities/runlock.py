"""The run directory's lock: one run at a time writes a run directory.

Why: a second ``--overwrite`` or ``--resume`` of a run that is still going would
delete or interleave its files, and two runs started at the same moment could both
find the directory free. So rank 0 takes an exclusive ``flock`` on
``RUN_DIR/.lock`` before anything in the directory is deleted or written, and
holds it until the run ends. The file names the holder (host, pid, start,
command); a thread touches it every ``HEARTBEAT_S`` seconds, so its mtime is a
heartbeat. The kernel drops a flock when its process dies: a lock file that names
a holder but is not held is what a killed run leaves, and the next run takes it
over, saying so. ``communities inspect`` probes the lock (a shared lock for an
instant) to tell a live run from a killed one whose ``meta.json`` still says
``running``. On a filesystem without ``flock`` the holder's pid (same host) or
heartbeat (another host) decides instead.
"""
from __future__ import annotations

import atexit
import datetime as _dt
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import RunLocked
from .results import LOCK_FILE, disk_error

HEARTBEAT_S = 30.0  # how often the holder touches the lock file
STALE_AFTER_S = 120.0  # a heartbeat older than this, with the lock not held: the run is gone
WAIT_S = 1.0  # how long acquire retries a held lock (covers inspect's instant probe) before refusing
# errnos of a filesystem that does not do flock (Lustre without -o flock, some NFS mounts)
UNSUPPORTED = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _read_holder(path: Path) -> Optional[dict]:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    if not text:
        return None
    try:
        holder = json.loads(text)
    except json.JSONDecodeError:
        return {"unreadable": text[:80]}
    return holder if isinstance(holder, dict) else {"unreadable": text[:80]}


def describe(holder: Optional[dict]) -> str:
    """``host node7, pid 1234, started 2026-...``: who holds (or held) a lock."""
    if not holder:
        return "holder not recorded yet"
    if "unreadable" in holder:
        return f"unreadable lock file ({holder['unreadable']!r})"
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {holder.get('start', '?')}"


def pid_alive(holder: Optional[dict]) -> Optional[bool]:
    """Whether the holder's process exists: only knowable on its own host (None elsewhere)."""
    if not holder or holder.get("host") != socket.gethostname() or not isinstance(holder.get("pid"), int):
        return None
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RunLock:
    """Rank 0's exclusive lock on a run directory, from ``acquire`` until ``release`` (or the process ends)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: Optional[int] = None
        self._stop = threading.Event()
        self.flock = True  # False: the filesystem has no flock; the holder file alone guards the directory

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, argv=None, wait: float = WAIT_S) -> Optional[str]:
        """Take the lock, or raise RunLocked naming the holder. Returns a note to print, or None."""
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # 0666: the umask decides who may read it, as for every file of the run
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as exc:
            raise disk_error(self.path, exc, "create") from None
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                os.close(fd)
                raise RunLocked(f"{self.run_dir} is in use by another run ({describe(_read_holder(self.path))}): "
                                f"wait for it to end, or stop it (touch {self.run_dir / 'STOP'}), then try again; "
                                f"its lock is {self.path}") from None
            except OSError as exc:
                if exc.errno not in UNSUPPORTED:
                    os.close(fd)
                    raise disk_error(self.path, exc, "lock") from None
                self.flock = False
                break
        previous = _read_holder(self.path)
        note = None
        if previous and not self.flock:
            alive = pid_alive(previous)
            age = self.heartbeat_age()
            if alive or (alive is None and age is not None and age < STALE_AFTER_S):
                os.close(fd)
                raise RunLocked(f"{self.run_dir} is in use by another run ({describe(previous)}; this filesystem "
                                f"does not support flock, so its pid or heartbeat decides): wait for it to end, or "
                                f"remove {self.path} if you know it is gone")
        if previous:
            note = (f"communities: {self.run_dir}: taking over the lock of a run that ended without releasing it "
                    f"({describe(previous)})")
        if not self.flock:
            note = (note + "; " if note else "communities: ") + \
                f"{self.path}: this filesystem does not support flock; guarding the directory by pid and heartbeat"
        self._fd = fd
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "start": _now(),
                  "command": " ".join(argv if argv is not None else sys.argv)[:300]}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as exc:
            self.release()
            raise disk_error(self.path, exc) from None
        self._stop.clear()
        threading.Thread(target=self._beat, name="communities-lock-heartbeat", daemon=True).start()
        atexit.register(self.release)
        return note

    def heartbeat_age(self) -> Optional[float]:
        try:
            return max(0.0, time.time() - self.path.stat().st_mtime)
        except OSError:
            return None

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            fd = self._fd
            if fd is None:
                return
            try:
                os.utime(fd)
            except OSError:
                pass

    def release(self) -> None:
        """Empty the lock file and drop the lock: an empty, unheld lock file is a run that ended cleanly."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._stop.set()
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the next run will take it over as stale
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass
        os.close(fd)


# --------------------------------------------------------------------------- readers


@dataclass
class LockState:
    """What a reader can tell about a run directory's lock."""

    present: bool  # the lock file exists (runs written before the lock have none)
    held: Optional[bool]  # True: a live process holds it; False: nobody does; None: cannot tell (no flock)
    holder: Optional[dict]  # who holds or last held it
    age: Optional[float]  # seconds since the last heartbeat

    @property
    def holder_alive(self) -> Optional[bool]:
        return pid_alive(self.holder)


def probe(run_dir: Path) -> LockState:
    """The lock's state, without holding it for more than an instant (a shared lock, never exclusive)."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return LockState(False, None, None, None)
    held: Optional[bool]
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        held = False
    except BlockingIOError:
        held = True
    except OSError:
        held = None
    finally:
        os.close(fd)
    try:
        age: Optional[float] = max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        age = None
    return LockState(True, held, _read_holder(path), age)


def effective_status(status: str, state: LockState, stale_after: float = STALE_AFTER_S) -> str:
    """``meta.json``'s status as it stands: a ``running`` run whose process is gone is ``interrupted``.

    Gone: nobody holds the lock (or it cannot be told) and either the holder's pid is dead on this host
    or its heartbeat is older than ``stale_after``. A fresh heartbeat with the lock free is still
    ``running``: on some network filesystems a lock held on another node cannot be seen.
    """
    if status != "running" or not state.present or state.held:
        return status
    if state.holder_alive is False:
        return "interrupted"
    if state.age is not None and state.age > stale_after:
        return "interrupted"
    return status
