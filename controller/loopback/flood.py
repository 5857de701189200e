"""A keyless host's flood of a listening socket, as a process of its own: ``slow``
connections that hold handshake slots (the first bytes of a frame header, never a whole
one: at once, or one byte every ``trickle_s``), each reopened as soon as the far end closes
it (at its handshake deadline, or at once when refused), and, with ``churn_per_s``, a
stream of connections that each send a line that is not a frame and hang up: every one a
refusal at admission or a failed handshake.

The target is a TCP listener (``IP:PORT``: a PS, a stage, an expert host), which tells its
peers apart by address, or a Unix control socket (a path), which tells them apart by
process (``SO_PEERCRED``): a flood from one background host is then one process, and one
from many hosts a crowd of processes. A flooder is a process
(``python -m controller.loopback.flood TARGET --slow N ...``, no torch) so that it can run
where the flood comes from and beside the real agents of the test or benchmark that
starts it: inside a Mininet host, from that host's own address (``--netns-pid PID``, or
``--netns-pid-stdin``: started ahead, it enters the namespace of the pid it is then given,
a host's shell, the moment the host exists), or on loopback from a background address of
its own (``--source 127.0.0.N``).

With ``--probe``, until the listener exists one connection at a time probes it, every
millisecond; the first that connects brings the others, so a flood started before the agent
is in the listener's backlog within a millisecond or two of its listen. Without it, the
first ``slow`` are opened at once (a listener that drops a flood's SYNs answers no probe).
Once the first ``slow`` are made it
prints ``open N``; when it ends, one JSON line: connections made, those that connected,
and when all ``slow`` were first held at once.

Thousands of connections from one address to one port exhaust the kernel's search for a
free ephemeral port (every ``connect`` scans the ports in use: quadratic, and it was the
flooder's own CPU, not the target's, that a 20,000-connection flood spent): ``--ports
LO-HI`` binds each connection to the next port of that range instead.

Used by ``tests/agents/net/test_control_loop.py`` (:func:`unix_flood`),
``tests/agents/net/test_admission.py`` (on loopback), ``tests/agents/moe/test_moe_mininet.py``
(through ``tests/support/mininet_run.py``) and ``benchmarks/robustness.py``
(:func:`tcp_flood`, :func:`unix_flood`).
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: What a slow connection sends: the first bytes of a gradbed frame header, never a whole
#: one, so the far end waits for the rest until its handshake deadline.
SLOW_BYTES = b"GBED\x01\x00\x01\x00\x00\x00"
#: What a churning connection sends before it hangs up: not a frame (wrong magic).
CHURN_BYTES = b"not a gradbed frame\n"
#: A round's wait while a probe is not yet connected, slow connections are missing, or a
#: churn runs: short, so a refused connection is reopened at once and the churn keeps its
#: rate.
ROUND_S = 0.001
#: A round's wait otherwise: only a close (or a byte to trickle) wakes it.
IDLE_ROUND_S = 0.1
#: Once the first ``slow`` are made, closed ones are reopened at most REOPEN_PER_ROUND
#: every SLOW_REOPEN_S: a flood, not a busy loop that takes the cores the run under attack
#: needs on a machine that emulates both.
SLOW_REOPEN_S = 0.01
REOPEN_PER_ROUND = 100
#: The source ports :func:`tcp_flood` hands out, split among its processes.
FLOOD_PORTS = (10_000, 61_000)
CLONE_NEWNET = 0x40000000


@dataclass
class FloodCount:
    """What the flooder did: ``opened`` connections in all, ``connected`` of them (the
    far end's kernel completed the handshake), ``held_ns``: when all ``slow`` ones were
    first connected at once (``time.time_ns``; 0 if never)."""

    opened: int = 0
    connected: int = 0
    held_ns: int = 0


def parse_target(text: str) -> tuple[str, int] | str:
    """``IP:PORT`` as a TCP address, anything else as a Unix socket's path."""
    ip, sep, port = text.rpartition(":")
    if sep and port.isdigit() and ip.count(".") == 3:
        return ip, int(port)
    return text


@dataclass
class _Conn:
    sock: socket.socket
    slow: bool
    connected: bool = False
    sent: int = 0  # of SLOW_BYTES


class _Flooder:
    def __init__(self, target: tuple[str, int] | str, *, source: str = "", slow: int = 0,
                 churn_per_s: float = 0.0, trickle_s: float = 0.0,
                 ports: tuple[int, int] | None = None, probe: bool = False) -> None:
        self.target, self.source, self.probe = target, source, probe
        self.slow, self.churn_per_s, self.trickle_s = slow, churn_per_s, trickle_s
        self.ports, self.next_port = ports, ports[0] if ports else 0
        self.count = FloodCount()
        self.poller = select.epoll()  # thousands registered: a poll() would scan them all
        self.live: dict[int, _Conn] = {}
        self.slow_live = self.slow_held = 0
        self.reopen_at = 0.0  # when closed slow connections may be reopened
        self.said_open = False

    def _socket(self) -> socket.socket:
        if isinstance(self.target, str):
            return socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if self.ports is None:
            if self.source:
                s.bind((self.source, 0))
            return s
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lo, hi = self.ports
        for _ in range(hi - lo):  # the next port of the range that is free
            port, self.next_port = self.next_port, lo + (self.next_port + 1 - lo) % (hi - lo)
            try:
                s.bind((self.source, port))
                return s
            except OSError:
                continue
        s.close()
        raise OSError(errno.EADDRNOTAVAIL, f"no free port in {lo}-{hi}")

    def _open(self, slow: bool) -> bool:
        try:
            s = self._socket()
        except OSError:  # out of descriptors or ports: again once the far end closed some
            return False
        s.setblocking(False)
        try:
            err = s.connect_ex(self.target)
        except OSError:
            err = errno.ECONNREFUSED
        if err not in (0, errno.EINPROGRESS):  # refused, backlog full (EAGAIN), no socket
            s.close()
            return False
        self.count.opened += 1
        self.live[s.fileno()] = _Conn(s, slow)
        self.slow_live += slow
        self.poller.register(s, select.EPOLLOUT | select.EPOLLIN)
        return True

    def _drop(self, fd: int) -> None:
        c = self.live.pop(fd)
        self.slow_live -= c.slow
        self.slow_held -= c.slow and c.connected
        self.poller.unregister(fd)
        c.sock.close()

    def _event(self, fd: int, ev: int) -> None:
        c = self.live[fd]
        if c.connected or ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR) or \
                c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._drop(fd)  # refused, or closed by the far end: reopened in a later round
            return
        self.count.connected += 1
        c.connected = True
        self.slow_held += c.slow
        first = len(SLOW_BYTES) if not c.slow or not self.trickle_s else 1
        if not self._send(c, CHURN_BYTES if not c.slow else SLOW_BYTES[:first]) or not c.slow:
            self._drop(fd)
            return
        self.poller.modify(fd, select.EPOLLIN)

    def _send(self, c: _Conn, data: bytes) -> bool:
        try:
            c.sock.send(data)
        except OSError:
            return False
        c.sent += len(data)
        return True

    def _trickle(self) -> None:
        """One more byte on every held slow connection that has not sent them all."""
        for fd, c in list(self.live.items()):
            if c.slow and c.connected and c.sent < len(SLOW_BYTES) and \
                    not self._send(c, SLOW_BYTES[c.sent:c.sent + 1]):
                self._drop(fd)

    def _top_up(self, now: float, stop: list[int]) -> None:
        """Open the slow connections that are missing: all of them at once (with
        ``probe``: one at a time until one has connected, as nobody may listen yet), and
        after that at most REOPEN_PER_ROUND every SLOW_REOPEN_S."""
        if self.probe and not self.slow_held and not self.said_open:
            if not self.slow_live:
                self._open(True)
            return
        if now < self.reopen_at:
            return
        self.reopen_at = now + SLOW_REOPEN_S
        missing = self.slow - self.slow_live
        for i in range(missing if not self.said_open else min(missing, REOPEN_PER_ROUND)):
            if (i % REOPEN_PER_ROUND == 0 and stop) or not self._open(True):
                break
        if not self.said_open and self.count.opened >= self.slow:
            print(f"open {self.slow_live}", flush=True)
            self.said_open = True

    def run(self, seconds: float, stop: list[int]) -> FloodCount:
        end = time.monotonic() + seconds
        churn_due, last = 0.0, time.monotonic()
        next_byte = time.monotonic() + self.trickle_s
        while time.monotonic() < end and not stop:
            now = time.monotonic()
            if self.slow:
                self._top_up(now, stop)
            churn_due = min(churn_due + (now - last) * self.churn_per_s, 64.0)
            last = now
            while churn_due >= 1:
                churn_due -= 1
                self._open(False)
            if self.slow and not self.count.held_ns and self.slow_held >= self.slow:
                self.count.held_ns = time.time_ns()
            if self.trickle_s and now >= next_byte:
                next_byte = now + self.trickle_s
                self._trickle()
            busy = (self.churn_per_s > 0 or self.slow_live < self.slow
                    or (self.probe and self.slow and not self.slow_held))
            wait_s = ROUND_S if busy else IDLE_ROUND_S
            if self.trickle_s:
                wait_s = max(0.0, min(wait_s, next_byte - time.monotonic()))
            for fd, ev in self.poller.poll(wait_s):
                if fd in self.live:
                    self._event(fd, ev)
        for fd in list(self.live):
            self._drop(fd)
        return self.count


def enter_netns(pid: int) -> None:
    """Move this thread (the flooder's only one) into the network namespace of ``pid``,
    which must be another than this process's: a flood meant to come from a host must
    not come from the root namespace."""
    if os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat("/proc/self/ns/net").st_ino:
        raise OSError(f"pid {pid} is in this process's network namespace")
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into pid {pid}'s network namespace: "
                               f"{os.strerror(err)}")
    finally:
        os.close(fd)


def _room_for(fds: int) -> None:
    """Raise this process's descriptor limit to ``fds`` where it is lower (root may)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < fds:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fds, max(hard, fds)))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def flood(target: tuple[str, int] | str, *, source: str = "", slow: int = 0,
          churn_per_s: float = 0.0, trickle_s: float = 0.0,
          ports: tuple[int, int] | None = None, probe: bool = False,
          seconds: float = 600.0) -> FloodCount:
    """Flood ``target`` (see the module docstring) for ``seconds`` or until SIGTERM."""
    _room_for(slow + 64 + int(churn_per_s))
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    return _Flooder(target, source=source, slow=slow, churn_per_s=churn_per_s,
                    trickle_s=trickle_s, ports=ports, probe=probe).run(seconds, stop)


# -- started from a test or a benchmark: several flooding processes at once ---------------

@dataclass
class Flood:
    """A running flood: its processes' ``pids`` (each one source to a Unix socket); once
    it has ended, ``opened``: the connections they made in all (each refused one
    reopened)."""

    pids: list[int]
    opened: int = 0
    said: list[str] = field(default_factory=list)


@contextmanager
def unix_flood(path: Path, *, processes: int, per_process: int, trickle_s: float = 1.0,
               seconds: float = 600.0, ready_s: float = 60.0) -> Iterator[Flood]:
    """``processes`` flooders of the Unix socket ``path``, ``per_process`` slow connections
    each (a byte every ``trickle_s``); yields the :class:`Flood` once every flooder has
    made its first ``per_process`` (or ``ready_s`` passed); they are stopped (and their
    count of connections read) on exit."""
    args = [[str(path), "--slow", str(per_process), f"--trickle-s={trickle_s}",
             f"--seconds={seconds}"] for _ in range(processes)]
    with _flooders(args, ready_s) as f:
        yield f


@contextmanager
def tcp_flood(ip: str, port: int, *, netns_pid: int | None = None, source: str = "",
              processes: int = 1, per_process: int, trickle_s: float = 1.0,
              seconds: float = 600.0, ready_s: float = 60.0) -> Iterator[Flood]:
    """As :func:`unix_flood`, against the TCP listener ``ip:port``, from the network
    namespace of process ``netns_pid`` (an emulated host's: the flood comes from its
    address, or from ``source``, one of its addresses), or from this one's; each process
    binds its connections to ports of its own slice of :data:`FLOOD_PORTS`."""
    lo, hi = FLOOD_PORTS
    span = (hi - lo) // processes
    netns = ["--netns-pid", str(netns_pid)] if netns_pid is not None else []
    netns += ["--source", source] if source else []
    args = [[f"{ip}:{port}", "--slow", str(per_process), f"--trickle-s={trickle_s}",
             f"--seconds={seconds}", f"--ports={lo + i * span}-{lo + (i + 1) * span}",
             *netns] for i in range(processes)]
    with _flooders(args, ready_s) as f:
        yield f


@contextmanager
def _flooders(args: list[list[str]], ready_s: float) -> Iterator[Flood]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-m", "controller.loopback.flood", *a],
                              stdout=subprocess.PIPE, text=True, env=env) for a in args]
    f = Flood([p.pid for p in procs])
    try:
        deadline = time.monotonic() + ready_s
        for p in procs:
            assert p.stdout is not None
            while time.monotonic() < deadline:
                r, _, _ = select.select([p.stdout], [], [], deadline - time.monotonic())
                if not r or p.stdout.readline().startswith("open") or p.poll() is not None:
                    break
        yield f
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                out, _ = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                out, _ = p.communicate()
            f.said += out.splitlines()
            if out.strip() and out.strip().splitlines()[-1].startswith("{"):
                f.opened += int(json.loads(out.strip().splitlines()[-1])["opened"])


def _port_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not (sep and lo.isdigit() and hi.isdigit() and 0 < int(lo) < int(hi) <= 65536):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LO-HI, 0 < LO < HI <= 65536")
    return int(lo), int(hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", help="IP:PORT of a TCP listener, or a Unix socket's path")
    ap.add_argument("--slow", type=int, default=0, help="slow connections kept open")
    ap.add_argument("--trickle-s", type=float, default=0.0,
                    help="send a slow connection's bytes one every this many seconds "
                         "(0: all at once)")
    ap.add_argument("--churn-per-s", type=float, default=0.0,
                    help="connections a second that send garbage and hang up")
    ap.add_argument("--source", default="", help="the address to flood from")
    ap.add_argument("--ports", type=_port_range, default=None,
                    help="LO-HI: bind each TCP connection to the next port of this range")
    ap.add_argument("--probe", action="store_true",
                    help="one connection at a time until one connects (the listener may "
                         "not exist yet), then the rest")
    ap.add_argument("--seconds", type=float, default=600.0)
    ns = ap.add_mutually_exclusive_group()
    ns.add_argument("--netns-pid", type=int, default=None,
                    help="enter this process's network namespace first")
    ns.add_argument("--netns-pid-stdin", action="store_true",
                    help="first read a pid from stdin and enter its network namespace")
    a = ap.parse_args()
    if a.netns_pid is not None or a.netns_pid_stdin:
        enter_netns(a.netns_pid if a.netns_pid is not None else int(sys.stdin.readline()))
    count = flood(parse_target(a.target), source=a.source, slow=a.slow,
                  churn_per_s=a.churn_per_s, trickle_s=a.trickle_s, ports=a.ports,
                  probe=a.probe, seconds=a.seconds)
    print(json.dumps(asdict(count)), flush=True)


if __name__ == "__main__":
    main()
