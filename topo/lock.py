"""One emulated network per machine: a process-wide flock on /run/gradbed/net.lock.

Two gradbed runs on one machine would fight over the same bridge (gbsw0), host names and
cleanup, so the builder holds this lock for the network's whole life. A second run waits
(saying who holds the lock) and gives up after a timeout. flock is released by the
kernel when the holder dies, so a crashed run never leaves a stale lock behind.

flock works on a read-only descriptor, so a lock file any user may open is a lock any user
may take, and every run would wait on them: the file is 0600 in a directory only its owner
may write (an older file with a wider mode is narrowed before use), opened without following
a link. The holder named in a message is the live process the kernel says holds the lock
(``/proc/locks``), never a pid written in the file by a process that may be long gone.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable
from types import TracebackType

DEFAULT_LOCK_PATH = "/run/gradbed/net.lock"


class LockTimeout(TimeoutError):
    """Another gradbed network held the lock for longer than the timeout."""


class NetLock:
    """Context manager around an exclusive flock.

    timeout_s: how long to wait for another run's network; 0 fails at once.
    log: told once when waiting starts (who holds the lock).
    """

    def __init__(self, path: str = DEFAULT_LOCK_PATH, timeout_s: float = 600.0,
                 log: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.log = log
        self._fd: int | None = None

    def _holder(self, fd: int) -> str:
        """The live processes holding the lock, as ``pid N (command)``; "unknown" if the
        kernel names none that is still alive."""
        pids = holders(os.fstat(fd))
        named = []
        for pid in pids:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
            except OSError:
                continue  # gone since: not a holder to blame
            # A lock held for a run on other servers (topo.server_lock) names that run.
            who = argv[argv.index("--who") + 1] if "--who" in argv[:-1] else ""
            named.append(f"pid {pid} ({comm}{', ' + who if who else ''})")
        return ", ".join(named) or "unknown"

    def acquire(self) -> None:
        fd = open_private(self.path)
        deadline = time.monotonic() + self.timeout_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise
            if time.monotonic() >= deadline:
                holder = self._holder(fd)
                os.close(fd)
                raise LockTimeout(f"{self.path}: another gradbed network ({holder}) still "
                                  f"running after {self.timeout_s:g} s")
            if not told and self.log is not None:
                self.log(f"waiting for another gradbed network ({self._holder(fd)}) "
                         f"holding {self.path}")
                told = True
            time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> NetLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def open_private(path: str) -> int:
    """``path`` opened read-write for this process's user alone: its directory made 0755
    and refused if another user owns it or may write it, the file created 0600 (an existing
    one narrowed to 0600), never through a symbolic link."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, mode=0o755, exist_ok=True)
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{folder}: not a directory of this user's; refusing to keep "
                              "a lock in it")
    if st.st_mode & 0o022:
        os.chmod(folder, stat.S_IMODE(st.st_mode) & ~0o022)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    fst = os.fstat(fd)
    if fst.st_uid != os.geteuid() or not stat.S_ISREG(fst.st_mode):
        os.close(fd)
        raise PermissionError(f"{path}: not a file of this user's; refusing to lock it")
    if fst.st_mode & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def holders(st: os.stat_result) -> list[int]:
    """The pids ``/proc/locks`` says hold a flock on the file ``st`` describes."""
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 10766 fe:00:1523715 0 EOF" ("->" marks waiters)
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == dev:
                    pids.append(int(parts[4]))
    except (OSError, ValueError):
        pass
    return pids
