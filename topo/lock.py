"""One emulated network per machine: a process-wide flock on /run/gradbed/net.lock.

Two gradbed runs on one machine would fight over the same bridge (gbsw0), host names and
cleanup, so the builder holds this lock for the network's whole life. A second run waits
(saying who holds the lock) and gives up after a timeout. flock is released by the
kernel when the holder dies, so a crashed run never leaves a stale lock behind.
"""

from __future__ import annotations

import errno
import fcntl
import os
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

    def _holder(self) -> str:
        try:
            with open(self.path) as f:
                return f.read().strip() or "unknown"
        except OSError:
            return "unknown"

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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
                os.close(fd)
                raise LockTimeout(f"{self.path}: another gradbed network (pid "
                                  f"{self._holder()}) still running after {self.timeout_s:g} s")
            if not told and self.log is not None:
                self.log(f"waiting for another gradbed network (pid {self._holder()}) "
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
