"""The ranks' TCP connections, read with sock_diag (``NETLINK_SOCK_DIAG``, what ``ss -ti``
reads) from outside the processes, one netlink socket per host opened in its namespace.

Two sockets per host: one dumps every TCP socket with its ``struct tcp_info`` (a sample,
on the run's shared clock); the other listens to the kernel's destroy broadcast
(``SKNLGRP_INET_TCP_DESTROY``, what ``ss -E`` shows), which carries a socket's last
``tcp_info`` as it is freed. A periodic dump alone would miss what a connection moved
after its last sample (a script that exits right after its last all-reduce); with the
destroy message every connection's final ``bytes_acked`` and ``bytes_received`` are
known exactly. Messages are built and parsed by pure functions (tested without root).
"""

from __future__ import annotations

import ipaddress
import os
import selectors
import socket
import struct
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from agents.core.events import now_ns
from agents.net.tcpinfo import TCP_STATES, parse_tcp_info

T = TypeVar("T")

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
INET_DIAG_INFO = 2
#: Multicast groups of the destroy broadcast (linux/sock_diag.h: SKNLGRP_*).
SKNLGRP_INET_TCP_DESTROY = 1
SKNLGRP_INET6_TCP_DESTROY = 3
CLONE_NEWNET = 0x40000000
_DIAG_MSG = struct.Struct("=BBBB HH 16s 16s I 8s IIIII")  # struct inet_diag_msg (72 bytes)


@dataclass(frozen=True)
class ConnSample:
    """One TCP socket as sock_diag reported it. ``final``: from the destroy broadcast, the
    socket's last counters."""

    cookie: int
    family: int
    state: str
    src: str
    sport: int
    dst: str
    dport: int
    bytes_acked: int
    bytes_received: int
    bytes_retrans: int
    total_retrans: int
    rtt_us: int
    snd_cwnd_pkts: int
    delivery_rate_bps: float
    final: bool = False
    #: Bytes that arrived and wait in the socket for its process to read them (the
    #: kernel's receive queue, ``idiag_rqueue``): a process that stopped reading (stopped,
    #: hung) leaves its peers' bytes there.
    unread_bytes: int = 0


def dump_request(family: int, seq: int) -> bytes:
    """``SOCK_DIAG_BY_FAMILY`` dump of every TCP socket of ``family``, with tcp_info."""
    req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 1 << (INET_DIAG_INFO - 1),
                      0xFFFFFFFF) + b"\0" * 48
    return struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY,
                       NLM_F_REQUEST | NLM_F_DUMP, seq, 0) + req


def _addr(family: int, raw: bytes) -> str:
    return str(ipaddress.ip_address(raw[:4] if family == socket.AF_INET else raw))


def parse_messages(data: bytes, final: bool = False) -> tuple[list[ConnSample], bool]:
    """The sockets in a netlink buffer, and whether it ended the dump (NLMSG_DONE).
    Sockets without tcp_info (listening, TIME_WAIT) are left out."""
    out: list[ConnSample] = []
    off, done = 0, False
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16 or off + length > len(data):
            break
        if kind == NLMSG_DONE:
            done = True
        elif kind == NLMSG_ERROR:
            err = struct.unpack_from("=i", data, off + 16)[0]
            if err:
                raise OSError(-err, f"sock_diag: {os.strerror(-err)}")
        elif kind == SOCK_DIAG_BY_FAMILY:
            s = _parse_one(data[off + 16:off + length], final)
            if s is not None:
                out.append(s)
        off += (length + 3) & ~3
    return out, done


def _parse_one(body: bytes, final: bool) -> ConnSample | None:
    if len(body) < _DIAG_MSG.size:
        return None
    (family, state, _timer, _retrans, sport, dport, src, dst, _if, cookie,
     _expires, rqueue, *_rest) = _DIAG_MSG.unpack_from(body)
    info = None
    off = _DIAG_MSG.size
    while off + 4 <= len(body):
        alen, atype = struct.unpack_from("=HH", body, off)
        if alen < 4:
            break
        if atype & 0x3FFF == INET_DIAG_INFO:
            info = parse_tcp_info(body[off + 4:off + alen])
        off += (alen + 3) & ~3
    if info is None:
        return None
    return ConnSample(
        cookie=struct.unpack("=Q", cookie)[0], family=family,
        state=TCP_STATES[state] if state < len(TCP_STATES) else str(state),
        src=_addr(family, src), sport=socket.ntohs(sport),
        dst=_addr(family, dst), dport=socket.ntohs(dport),
        bytes_acked=info.bytes_acked or 0, bytes_received=info.bytes_received or 0,
        bytes_retrans=info.bytes_retrans or 0, total_retrans=info.total_retrans,
        rtt_us=info.rtt_us, snd_cwnd_pkts=info.snd_cwnd_pkts,
        delivery_rate_bps=float(info.delivery_rate_bps or 0.0), final=final,
        # Only an established socket's (1): a listening one's is its accept backlog.
        unread_bytes=rqueue if state == 1 else 0)


def is_local(c: ConnSample, host_ip: str) -> bool:
    """A connection that never leaves the host: loopback, or to the host's own address
    (the kernel routes that over ``lo`` too)."""
    a = ipaddress.ip_address(c.dst)
    return a.is_loopback or c.dst == host_ip or (
        isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None
        and (a.ipv4_mapped.is_loopback or str(a.ipv4_mapped) == host_ip))


_libc: Any = None


def in_netns(pid: int, fn: Callable[[], T]) -> T:
    """``fn()`` run in the network namespace of ``pid`` (this thread only, restored)."""
    import ctypes

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into the namespace of {pid}")
        try:
            return fn()
        finally:
            _libc.setns(own, CLONE_NEWNET)
    finally:
        os.close(own)
        os.close(target)


class HostDiag:
    """The two sock_diag sockets of one host's namespace: dump and destroy broadcast."""

    def __init__(self, host: str, netns_pid: int) -> None:
        self.host = host
        self._seq = 0

        def open_both() -> tuple[socket.socket, socket.socket]:
            dump = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
            events = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG)
            return dump, events

        self.dump_sock, self.destroy_sock = in_netns(netns_pid, open_both)
        self.dump_sock.bind((0, 0))
        self.dump_sock.settimeout(5.0)
        groups = (1 << (SKNLGRP_INET_TCP_DESTROY - 1)) | (1 << (SKNLGRP_INET6_TCP_DESTROY - 1))
        self.destroy_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.destroy_sock.bind((0, groups))
        self.destroy_sock.setblocking(False)

    def dump(self) -> list[ConnSample]:
        out: list[ConnSample] = []
        for family in (socket.AF_INET, socket.AF_INET6):
            self._seq += 1
            self.dump_sock.send(dump_request(family, self._seq))
            done = False
            while not done:
                got, done = parse_messages(self.dump_sock.recv(1 << 17))
                out += got
        return out

    def destroyed(self) -> Iterator[ConnSample]:
        while True:
            try:
                data = self.destroy_sock.recv(1 << 17)
            except BlockingIOError:
                return
            yield from parse_messages(data, final=True)[0]

    def close(self) -> None:
        self.dump_sock.close()
        self.destroy_sock.close()


class ConnSampler(threading.Thread):
    """Every ``period_s``, every host's TCP sockets (rows for ``tcp.parquet``); between
    samples, the destroy broadcasts as they come. ``progress[host]``: the host's total
    payload bytes (acked + received) over its connections that leave it, and the time
    (``now_ns``) that total last grew: what the stall check reads."""

    def __init__(self, hosts: dict[str, tuple[int, str]], period_s: float = 0.2,
                 store_port: int = 0, fed: Mapping[str, str] | None = None) -> None:
        super().__init__(name="tcp-sampler", daemon=True)
        self.period_s = period_s
        # ``fed``: host -> IP of the hosts of other servers, whose samples arrive through
        # :meth:`feed` (controller.torchrun.remote_watch) instead of a socket here.
        self.ips = {h: ip for h, (_, ip) in hosts.items()} | dict(fed or {})
        self.diags = {h: HostDiag(h, pid) for h, (pid, _) in hosts.items()}
        self.rows: list[dict[str, Any]] = []
        self.last: dict[tuple[str, int], ConnSample] = {}  # (host, cookie) -> newest
        started = now_ns()
        self.progress: dict[str, tuple[int, int]] = {h: (0, started) for h in self.ips}
        # Per host, the client connections to the c10d store (``dport == store_port``)
        # ever seen: torchrun's agent opens one, and each rank one more in
        # init_process_group (the agent's store, TORCHELASTIC_USE_AGENT_STORE).
        self.store_port = store_port
        self.store_clients: dict[str, set[int]] = {h: set() for h in self.ips}
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.error: str | None = None

    def mark_start(self) -> None:
        """The ranks start now: the time before (the servers' checks, the admission
        rules: seconds over ssh on a loaded machine) is no host's idle time."""
        now = now_ns()
        with self.lock:
            self.progress = {h: (total, max(ts, now)) for h, (total, ts) in
                             self.progress.items()}

    def feed(self, host: str, ts: int, conns: list[ConnSample]) -> None:
        """Samples of a host of another server, ``ts`` on this machine's clock."""
        self._keep(host, ts, conns)

    def _keep(self, host: str, ts: int, conns: list[ConnSample]) -> None:
        with self.lock:
            for c in conns:
                self.last[(host, c.cookie)] = c
                # A refused connect (torchrun retries until the store listens) moves
                # nothing: only a connection that carried a byte beyond its SYN counts.
                if (self.store_port and c.dport == self.store_port
                        and c.bytes_acked + c.bytes_received > 1):
                    self.store_clients[host].add(c.cookie)
                self.rows.append({"ts_ns": ts, "host": host, "local": is_local(c, self.ips[host]),
                                  **c.__dict__})
            total = sum(c.bytes_acked + c.bytes_received for (h, _), c in self.last.items()
                        if h == host and not is_local(c, self.ips[host]))
            if total > self.progress[host][0]:
                self.progress[host] = (total, ts)

    def sample_once(self) -> None:
        sel_ts = now_ns()
        for host, d in self.diags.items():
            self._keep(host, sel_ts, list(d.destroyed()))
            self._keep(host, sel_ts, d.dump())

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        for host, d in self.diags.items():
            sel.register(d.destroy_sock, selectors.EVENT_READ, host)
        try:
            next_ns = now_ns()
            while not self.stop_event.is_set():
                if now_ns() >= next_ns:
                    self.sample_once()
                    next_ns += int(self.period_s * 1e9)
                for key, _ in sel.select(max(0.0, (next_ns - now_ns()) / 1e9)):
                    host = str(key.data)
                    self._keep(host, now_ns(), list(self.diags[host].destroyed()))
        except Exception as e:  # noted in the summary; the run itself goes on
            self.error = f"{type(e).__name__}: {e}"
        finally:
            sel.close()

    def stop(self) -> None:
        """Stop sampling, read the last destroy messages, close the sockets."""
        self.stop_event.set()
        self.join(timeout=5)
        try:
            for host, d in self.diags.items():
                self._keep(host, now_ns(), list(d.destroyed()))
        finally:
            for d in self.diags.values():
                d.close()

    def unread_bytes(self, host: str) -> int:
        """What ``host``'s open connections to other hosts hold unread, at their latest
        samples: bytes its peers sent that its processes have not read."""
        with self.lock:
            return sum(c.unread_bytes for (h, _), c in self.last.items()
                       if h == host and not c.final and not is_local(c, self.ips[host]))

    def final_connections(self) -> list[tuple[str, ConnSample]]:
        """Each connection's newest counters (its last ones when it was destroyed)."""
        with self.lock:
            return [(h, c) for (h, _), c in self.last.items()]


def interface_bytes(netns_pid: int, dev: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of ``dev`` in the namespace of ``netns_pid``, from
    ``/proc/PID/net/dev`` (that file shows the reading process's namespace)."""
    with open(f"/proc/{netns_pid}/net/dev") as f:
        for line in f.read().splitlines()[2:]:
            name, _, rest = line.partition(":")
            if name.strip() == dev:
                fields = rest.split()
                return int(fields[0]), int(fields[8])
    raise OSError(f"no interface {dev} in the namespace of {netns_pid}")
