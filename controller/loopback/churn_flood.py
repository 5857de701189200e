"""A keyless host's flood of a TCP listener, as a process of its own: ``slow`` connections
that hold handshake slots (ten bytes of a frame header, then nothing; each reopened as soon
as the far end closes it, at its handshake deadline or at once when refused) and, with
``churn_per_s``, a stream of connections that each send a few bytes that are not a frame
and hang up: every one a refusal at admission or a failed handshake.

The flooder is a process (``python -m controller.loopback.churn_flood HOST PORT``) so that
it can run where the flood comes from: inside a Mininet host, from that host's own
address (``--netns-pid-stdin``: started ahead, it enters the network namespace of the
pid it is then given, a host's shell, the moment the host exists), or on loopback from a
background address of its own (``--source 127.0.0.N``). Until the listener exists one
connection at a time probes it, every millisecond; the first that connects brings the
others, so a flood started before the agent is in the listener's backlog within a
millisecond or two of its listen. It prints one JSON line when it ends: connections
made, those that connected, and when all ``slow`` were first held at once. Used by
``tests/agents/net/test_admission.py`` (what a flood costs a log) and
``tests/agents/moe/test_moe_mininet.py`` (through ``tests/support/mininet_run.py``).

:mod:`controller.loopback.slow_flood` is the other flooder: thousands of slow
connections from several processes, for a listener's or the control socket's bounds on
descriptors and threads; this one is for a listener's slots from its first accept and its
log's growth.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import select
import signal
import socket
import sys
import time
from dataclasses import asdict, dataclass

#: What a slow connection sends: the first bytes of a gradbed frame header, never a whole
#: one, so the far end waits for the rest until its handshake deadline.
SLOW_BYTES = b"GBED\x01\x00\x01\x00\x00\x00"
#: What a churning connection sends before it hangs up: not a frame (wrong magic).
CHURN_BYTES = b"not a gradbed frame\n"
#: A round's poll while a slow connection is not yet connected, or a churn runs: short,
#: so a refused connection is reopened at once (the listener may not exist yet: the flood
#: is in its backlog within a millisecond of its listen) and the churn keeps its rate.
ROUND_S = 0.001
#: A round's poll once every slow connection is held: only a close wakes it.
IDLE_ROUND_S = 0.1
#: How soon slow connections the far end closed are reopened once the listener is there
#: (the probe before it is one connection a round): a few hundred a second at most, so
#: the refusals of a flood beyond its bound cost the listener little.
SLOW_REOPEN_S = 0.01
CLONE_NEWNET = 0x40000000


@dataclass
class FloodCount:
    """What the flooder did: ``opened`` connections in all, ``connected`` of them (the
    far end's kernel completed the handshake), ``held_ns``: when all ``slow`` ones were
    first connected at once (``time.time_ns``; 0 if never)."""

    opened: int = 0
    connected: int = 0
    held_ns: int = 0


class _Flooder:
    def __init__(self, host: str, port: int, source: str, slow: int, churn_per_s: float
                 ) -> None:
        self.addr, self.source = (host, port), source
        self.slow, self.churn_per_s = slow, churn_per_s
        self.count = FloodCount()
        self.reopen_at = 0.0  # when closed slow connections may be reopened
        self.poller = select.poll()
        # fd -> (socket, kind, connected): kind "slow" or "churn".
        self.live: dict[int, tuple[socket.socket, str, bool]] = {}

    def _open(self, kind: str) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if self.source:
                s.bind((self.source, 0))
            s.setblocking(False)
            err = s.connect_ex(self.addr)
        except OSError:
            s.close()
            return
        if err not in (0, errno.EINPROGRESS):
            s.close()
            return
        self.count.opened += 1
        self.live[s.fileno()] = (s, kind, False)
        self.poller.register(s, select.POLLOUT | select.POLLIN)

    def _drop(self, fd: int) -> None:
        s, _, _ = self.live.pop(fd)
        self.poller.unregister(fd)
        s.close()

    def _event(self, fd: int, ev: int) -> None:
        s, kind, connected = self.live[fd]
        if connected or ev & (select.POLLIN | select.POLLHUP | select.POLLERR) or \
                s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._drop(fd)  # refused, or closed by the far end: reopened next round
            return
        self.count.connected += 1
        try:
            s.send(SLOW_BYTES if kind == "slow" else CHURN_BYTES)
        except OSError:
            self._drop(fd)
            return
        if kind == "churn":
            self._drop(fd)
            return
        self.live[fd] = (s, kind, True)
        self.poller.modify(s, select.POLLIN)

    def _top_up(self, now: float) -> None:
        """Open the slow connections that are missing: one probe at a time until one
        has connected (nobody listens yet), then all of them at once, and after that
        every SLOW_REOPEN_S at most."""
        slow = [c for _, k, c in self.live.values() if k == "slow"]
        if not any(slow):
            if not slow:
                self._open("slow")
            self.reopen_at = 0.0  # the first that connects brings the others at once
        elif now >= self.reopen_at:
            self.reopen_at = now + SLOW_REOPEN_S
            for _ in range(self.slow - len(slow)):
                self._open("slow")

    def run(self, seconds: float, stop: list[int]) -> FloodCount:
        end = time.monotonic() + seconds
        churn_due, last = 0.0, time.monotonic()
        while time.monotonic() < end and not stop:
            now = time.monotonic()
            if self.slow:
                self._top_up(now)
            churn_due = min(churn_due + (now - last) * self.churn_per_s, 64.0)
            last = now
            while churn_due >= 1:
                churn_due -= 1
                self._open("churn")
            held = sum(1 for _, k, c in self.live.values() if k == "slow" and c)
            if self.slow and not self.count.held_ns and held >= self.slow:
                self.count.held_ns = time.time_ns()
            busy = self.churn_per_s > 0 or held < self.slow
            for fd, ev in self.poller.poll((ROUND_S if busy else IDLE_ROUND_S) * 1e3):
                if fd in self.live:
                    self._event(fd, ev)
            if self.slow and not held:  # a probe may have just connected: the rest now
                self._top_up(time.monotonic())
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


def flood(host: str, port: int, *, source: str = "", slow: int = 0,
          churn_per_s: float = 0.0, seconds: float = 600.0) -> FloodCount:
    """Flood ``host:port`` from ``source`` (the host's own address when empty) for
    ``seconds`` or until SIGTERM (see the module docstring)."""
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    return _Flooder(host, port, source, slow, churn_per_s).run(seconds, stop)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("--source", default="", help="the address to flood from")
    ap.add_argument("--slow", type=int, default=0, help="slow connections kept open")
    ap.add_argument("--churn-per-s", type=float, default=0.0,
                    help="connections a second that send garbage and hang up")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--netns-pid-stdin", action="store_true",
                    help="first read a pid from stdin and enter its network namespace")
    a = ap.parse_args()
    if a.netns_pid_stdin:
        enter_netns(int(sys.stdin.readline()))
    count = flood(a.host, a.port, source=a.source, slow=a.slow, churn_per_s=a.churn_per_s,
                  seconds=a.seconds)
    print(json.dumps(asdict(count)), flush=True)


if __name__ == "__main__":
    main()
