"""A keyless flood of slow connections: processes that each hold many connections open
(one byte of a frame header every ``trickle_s``, never a whole HELLO), reopening each as
soon as the far end closes it. The target is a Unix control socket (:func:`unix_flood`) or
a TCP listener (:func:`tcp_flood`: a PS, a stage, an expert host), the latter from inside a
host's network namespace so the flood comes from that host's address.

The control socket tells its peers apart by process (``SO_PEERCRED``), so a flood from
one background host is one process, and one from many processes is a crowd of sources;
a TCP listener tells them apart by address. The flooders are processes of their own
(``python -m controller.loopback.slow_flood``, no torch) so that the test or benchmark
that starts them can be the real agent beside them. Shared by
``tests/agents/net/test_control_loop.py`` and ``benchmarks/robustness.py``.
"""

from __future__ import annotations

import argparse
import errno
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


def _open(target: str) -> socket.socket | None:
    """A new non-blocking connection to ``target``: ``IP:PORT`` (TCP) or a socket path."""
    ip, _, port = target.rpartition(":")
    tcp = _is_tcp(target)
    try:
        s = socket.socket(socket.AF_INET if tcp else socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # out of descriptors: try again once the far end has closed some
        return None
    s.setblocking(False)
    try:
        if tcp:
            err = s.connect_ex((ip, int(port)))
            if err not in (0, errno.EINPROGRESS):
                raise OSError(err, os.strerror(err))
        else:
            s.connect(target)
        return s
    except OSError:  # backlog full (EAGAIN), no more ports, or the socket is gone
        s.close()
        return None


def _is_tcp(target: str) -> bool:
    ip, sep, port = target.rpartition(":")
    return bool(sep) and port.isdigit() and ip.count(".") == 3


def flood(path: str, n: int, trickle_s: float, seconds: float) -> None:
    """Keep ``n`` slow connections to ``path`` (a socket path, or ``IP:PORT``) open for ``seconds``, as far as the far end
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
    """``processes`` flooders of the Unix socket ``path``, ``per_process`` slow connections
    each; yields the :class:`Flood` once every flooder has made its first ``per_process``
    (or ``ready_s`` passed); they are stopped (and their count of connections read) on
    exit."""
    with _flooders(str(path), (), processes, per_process, trickle_s, seconds,
                   ready_s) as flood:
        yield flood


@contextmanager
def tcp_flood(ip: str, port: int, *, netns_pid: int | None = None, processes: int = 1,
              per_process: int, trickle_s: float = 1.0, seconds: float = 600.0,
              ready_s: float = 60.0) -> Iterator[Flood]:
    """As :func:`unix_flood`, against the TCP listener ``ip:port``, from the network
    namespace of process ``netns_pid`` (an emulated host's: the flood comes from its
    address), or from this one's."""
    prefix = ("nsenter", "-t", str(netns_pid), "-n") if netns_pid is not None else ()
    with _flooders(f"{ip}:{port}", prefix, processes, per_process, trickle_s, seconds,
                   ready_s) as flood:
        yield flood


@contextmanager
def _flooders(target: str, prefix: tuple[str, ...], processes: int, per_process: int,
              trickle_s: float, seconds: float, ready_s: float) -> Iterator[Flood]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(
        [*prefix, sys.executable, "-m", "controller.loopback.slow_flood", target,
         str(per_process), f"--trickle-s={trickle_s}", f"--seconds={seconds}"],
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
    ap.add_argument("path", help="a Unix socket's path, or IP:PORT for a TCP listener")
    ap.add_argument("n", type=int)
    ap.add_argument("--trickle-s", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=600.0)
    a = ap.parse_args()
    flood(a.path, a.n, a.trickle_s, a.seconds)


if __name__ == "__main__":
    main()
