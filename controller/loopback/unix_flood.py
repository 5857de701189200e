"""A keyless flood of a Unix control socket: processes that each hold many slow
connections open (one byte of a frame header every ``trickle_s``, never a whole HELLO),
reopening each as soon as the far end closes it.

The control socket tells its peers apart by process (``SO_PEERCRED``), so a flood from
one background host is one process, and one from many processes is a crowd of sources;
the flooders are processes of their own (``python -m controller.loopback.unix_flood``,
no torch) for that reason, and so that the test or benchmark that starts them can be the
real agent beside them. Shared by ``tests/agents/net/test_control_loop.py`` and
``benchmarks/robustness.py``.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

#: The first bytes of a gradbed frame header: what a slow peer trickles.
TRICKLE = b"GBED\x01\x00\x01\x00"
#: Connections a flooder reopens per round (of up to 100 ms) once it has made its first
#: ``n``: a flood, not a busy loop that takes the cores the run under attack needs.
REOPEN_PER_ROUND = 100


def _open(path: str) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
        return s
    except OSError:  # backlog full (EAGAIN), or the socket is gone
        s.close()
        return None


def flood(path: str, n: int, trickle_s: float, seconds: float) -> None:
    """Keep ``n`` slow connections to ``path`` open for ``seconds``, as far as the far end
    lets them stay; prints ``open`` once the first ``n`` are made, and ``opened M`` (all
    connections made) when it ends."""
    _room_for(n + 64)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    live: dict[int, tuple[socket.socket, int]] = {}  # fd -> (socket, bytes sent)
    poller = select.poll()
    opened, said_open = 0, False
    end = time.monotonic() + seconds
    next_byte = time.monotonic()
    while time.monotonic() < end and not stop:
        for _ in range(min(n - len(live), n if opened < n else REOPEN_PER_ROUND)):
            s = _open(path)
            if s is None:
                break
            opened += 1
            live[s.fileno()] = (s, 0)
            poller.register(s, select.POLLIN | select.POLLHUP)
        if not said_open and opened >= n:
            print(f"open {len(live)}", flush=True)
            said_open = True
        for fd, _ev in poller.poll(100):
            s, _ = live.pop(fd)  # closed (or refused) by the far end: reopen next round
            poller.unregister(fd)
            s.close()
        if time.monotonic() >= next_byte:
            next_byte += trickle_s
            for fd, (s, sent) in list(live.items()):
                if sent < len(TRICKLE):
                    try:
                        s.send(TRICKLE[sent:sent + 1])
                        live[fd] = (s, sent + 1)
                    except OSError:
                        pass
    print(f"opened {opened}", flush=True)


def _room_for(fds: int) -> None:
    """Raise this process's descriptor limit to ``fds`` where it is lower (root may)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < fds:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fds, max(hard, fds)))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


@dataclass
class Flood:
    """A running flood: its processes' ``pids``; once it has ended, ``opened``: the
    connections they made in all (each refused one reopened)."""

    pids: list[int]
    opened: int = 0
    said: list[str] = field(default_factory=list)


@contextmanager
def unix_flood(path: Path, *, processes: int, per_process: int, trickle_s: float = 1.0,
               seconds: float = 600.0, ready_s: float = 60.0) -> Iterator[Flood]:
    """``processes`` flooders of ``path``, ``per_process`` slow connections each; yields
    the :class:`Flood` once every flooder has made its first ``per_process`` (or
    ``ready_s`` passed); they are stopped (and their count of connections read) on exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "controller.loopback.unix_flood", str(path), str(per_process),
         f"--trickle-s={trickle_s}", f"--seconds={seconds}"],
        stdout=subprocess.PIPE, text=True, env=env) for _ in range(processes)]
    flood = Flood([p.pid for p in procs])
    try:
        deadline = time.monotonic() + ready_s
        for p in procs:
            assert p.stdout is not None
            while time.monotonic() < deadline:
                r, _, _ = select.select([p.stdout], [], [], deadline - time.monotonic())
                if not r or p.stdout.readline().startswith("open") or p.poll() is not None:
                    break
        yield flood
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                out, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            for line in out.splitlines():
                if line.startswith("opened "):
                    flood.opened += int(line.split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("n", type=int)
    ap.add_argument("--trickle-s", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=600.0)
    a = ap.parse_args()
    flood(a.path, a.n, a.trickle_s, a.seconds)


if __name__ == "__main__":
    main()
