"""Every server's network lock for a run placed over several servers (``topo.cluster``).

One machine holds one gradbed network at a time (``topo.lock``: a flock on
``/run/gradbed/net.lock``). A run spread over servers uses the networks of all of them, so
it holds the lock of each: a second run on any of those servers waits, as it would on one
machine, and never builds over (or cleans up) the first one's bridges and hosts.

- **Over ssh.** A server's lock is the same ``NetLock`` a run started there takes, held by
  a small process on that server (``python -m topo.server_lock``, this module's
  :func:`main`) under an ssh session of its own. It says ``locked`` once it holds the
  lock and keeps it until its stdin ends. Closing that pipe releases it; so does a
  controller killed with SIGKILL (the kernel closes the pipe), and a lost ssh connection.
- **In a fixed order.** Two runs that took the same locks in different orders could each
  hold one the other waits for. Every run takes them in the order of the servers'
  addresses (:func:`lock_order`), the controller's own machine among them at its own
  address, and releases them in the reverse order. A run that cannot take one within its
  timeout releases the ones it took, and the error names the server and who holds it.
- **Named.** The holder's command line carries ``--who`` (the controller's host and pid),
  which ``NetLock``'s wait and timeout messages show, on any server and in
  ``gradbed cleanup``'s output.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import select
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Protocol

from topo.lock import DEFAULT_LOCK_PATH, LockTimeout, NetLock

REPO = Path(__file__).resolve().parents[1]
# A holder that has not answered this long after its timeout is treated as unreachable.
ANSWER_MARGIN_S = 30.0
LOCKED = "locked"
WAITING = "waiting: "


class Lock(Protocol):
    """What a run holds: this machine's ``NetLock`` or a server's :class:`ServerLock`."""

    def acquire(self) -> None: ...

    def release(self) -> None: ...


def who_am_i() -> str:
    """How a holder names this controller: its host and pid."""
    return f"gradbed run of {socket.gethostname()} pid {os.getpid()}"


def lock_order(addresses: Mapping[str, str]) -> list[str]:
    """The servers of ``addresses`` (server -> IPv4 address) in the order every run takes
    their locks: by address, numerically (10.0.0.9 before 10.0.0.10); a name whose address
    does not parse sorts after every address, by its text."""
    def key(server: str) -> tuple[int, int, str]:
        try:
            return (0, int(ipaddress.IPv4Address(addresses[server])), server)
        except ValueError:
            return (1, 0, addresses[server])

    return sorted(addresses, key=key)


class ServerLock:
    """``server``'s network lock, held by :func:`main` over ``ssh_argv`` (the ssh command
    that runs one command line there, without a shared ControlMaster connection: the lock
    must outlive the run's own connections by the teardown's few seconds)."""

    def __init__(self, server: str, ssh_argv: Sequence[str], timeout_s: float,
                 who: str = "", log: Callable[[str], None] | None = None,
                 lock_path: str = DEFAULT_LOCK_PATH) -> None:
        self.server = server
        self.ssh_argv = list(ssh_argv)
        self.timeout_s = timeout_s
        self.who = who or who_am_i()
        self.log = log
        self.lock_path = lock_path
        self._proc: subprocess.Popen[str] | None = None

    def command(self) -> str:
        """The command line the server runs: gradbed's folder there is this one's."""
        return (f"cd {shlex.quote(str(REPO))} && exec {shlex.quote(sys.executable)} -m "
                f"topo.server_lock --path {shlex.quote(self.lock_path)} "
                f"--timeout-s {self.timeout_s:g} --who {shlex.quote(self.who)}")

    def acquire(self) -> None:
        """Wait until the server says it holds the lock; raise ``LockTimeout`` naming the
        server (and the holder, when there is one) if it does not."""
        argv = [*self.ssh_argv, self.command()]
        self._say(f"$ {shlex.join(argv)}")
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stdout is not None
        deadline = time.monotonic() + self.timeout_s + ANSWER_MARGIN_S
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.5)
            if not ready:
                continue
            line = proc.stdout.readline()
            if line.strip() == LOCKED:
                self._proc = proc
                self._say(f"network lock of {self.server}: taken")
                return
            if line.startswith(WAITING):
                self._say(f"network lock of {self.server}: {line[len(WAITING):].strip()}")
                continue
            break  # EOF: the holder ended without the lock
        why = _stop(proc) or "no answer"
        raise LockTimeout(f"server {self.server}: its network lock was not taken: {why}")

    def let_go(self) -> None:
        """Close the holder's stdin without waiting: it releases the lock there and ends
        (:meth:`release` then waits for it). Several servers' holders end at once."""
        if self._proc is not None and self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass

    def release(self) -> None:
        """Close the holder's stdin: it releases the lock and ends."""
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None
            self._say(f"network lock of {self.server}: released")

    @property
    def held(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _say(self, msg: str) -> None:
        if self.log is not None:
            self.log(msg)


def _stop(proc: subprocess.Popen[str]) -> str:
    """End a holder (stdin closed, then killed if it lingers); its stderr, trimmed."""
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    err = proc.stderr.read() if proc.stderr is not None else ""
    return (err or "").strip()[-400:]


class LockSet:
    """Locks taken in the given order and released in the reverse one; a lock that cannot
    be taken releases the ones already held before its error goes on."""

    def __init__(self, locks: Sequence[Lock]) -> None:
        self.locks = list(locks)
        self._held: list[Lock] = []

    def acquire(self) -> None:
        for lock in self.locks:
            try:
                lock.acquire()
            except BaseException:
                self.release()
                raise
            self._held.append(lock)

    def release(self) -> None:
        held, self._held = self._held[::-1], []
        # Every server's holder is told first, then each is waited for: the ssh round
        # trips of the servers overlap instead of adding up. Releasing never waits on
        # another run, so the order of the waits cannot deadlock.
        for lock in held:
            if isinstance(lock, ServerLock):
                lock.let_go()
        for lock in held:
            lock.release()

    def __enter__(self) -> LockSet:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def main(argv: Sequence[str] | None = None) -> int:
    """The holder on a server: take the lock, say so, keep it until stdin ends."""
    ap = argparse.ArgumentParser(prog="python -m topo.server_lock")
    ap.add_argument("--path", default=DEFAULT_LOCK_PATH)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--who", default="", help="who holds it, for other runs' messages")
    args = ap.parse_args(argv)
    lock = NetLock(args.path, args.timeout_s,
                   log=lambda msg: print(f"{WAITING}{msg}", flush=True))
    try:
        lock.acquire()
    except LockTimeout as exc:
        print(exc, file=sys.stderr)
        return 1
    try:
        print(LOCKED, flush=True)
        while sys.stdin.buffer.read(4096):
            pass
    finally:
        lock.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
