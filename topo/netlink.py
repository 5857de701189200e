"""``tc class change`` for an HTB class, and ``tc -s class show``'s counters, over
rtnetlink from this process.

Trace replay and link/N change a rate every few hundred ms, and each change must land on
time: a change that lands 30 ms late after a 100 -> 20 Mbit/s step puts 12 % too many
bytes in that second. Running the ``tc`` binary costs a fork and an exec, and on these
virtual machines a new process woken on an idle vCPU often starts 15-60 ms later
(measured: ``subprocess.run(["true"])`` after 0.3 s of quiet takes 15-25 ms, back to back
1-3 ms). So the hot path sends the very message ``tc class change ... htb rate R ceil R
burst B cburst B quantum Q`` sends -- ``RTM_NEWTCLASS`` with ``TCA_HTB_PARMS`` -- on a
netlink socket opened once, in the right network namespace, and waits for the kernel's
ACK: well under a millisecond.

The counters of the HTB classes (bytes and packets the class let out, drops,
overlimits, the leaf's backlog) come the same way: one ``RTM_GETTCLASS`` dump of the
device, the kernel's answer parsed here (:func:`parse_class_dump`), about 0.1 ms where
``tc -s class show`` in a namespace costs a fork, an exec and a ``setns``; that is what
lets the controller sample every access link of a fabric every few milliseconds
(``controller/class_sampler.py``).

The message is built by a pure function (unit-tested byte for byte against what iproute2
sends); the kernel's result is checked in ``tests/topo/test_netlink.py`` against the class that
the ``tc`` binary installs for the same arguments. Rate tables (``TCA_HTB_RTAB/CTAB``) are
left out: the kernel reads them only for link-layer-unaware rate specs, and these say
Ethernet, as iproute2's do.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

NETLINK_ROUTE = 0
RTM_NEWQDISC = 36
RTM_GETQDISC = 38
RTM_NEWTCLASS = 40
RTM_GETTCLASS = 42
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
TCA_KIND = 1
TCA_OPTIONS = 2
TCA_STATS = 3     # struct tc_stats (the compat copy; 32-bit packets)
TCA_STATS2 = 7    # nested gnet_stats
TCA_STATS_BASIC = 1   # struct gnet_stats_basic: u64 bytes, u32 packets
TCA_STATS_QUEUE = 3   # struct gnet_stats_queue: qlen, backlog, drops, requeues, overlimits
TCA_STATS_PKT64 = 8   # u64 packets (when they do not fit 32 bits)
TCA_HTB_PARMS = 1
TC_LINKLAYER_ETHERNET = 1
CLONE_NEWNET = 0x40000000
TIME_UNITS_PER_SEC = 1_000_000
# iproute2's default MTU for rate tables (2047) gives cell_log 3; kept for a byte-identical
# rate spec even though the kernel does not use it without a table.
CELL_LOG = 3


class NetlinkError(OSError):
    """The kernel refused a netlink request; ``errno`` is the kernel's."""


@dataclass(frozen=True)
class HtbClass:
    """What ``tc class change dev D parent 1: classid 1:1 htb rate R ceil R burst B
    cburst B quantum Q`` asks for (one rate, ceil = rate, as gradbed installs)."""

    rate_bytes_per_s: int
    burst_bytes: int
    quantum_bytes: int
    parent: int = 0x0001_0000   # 1:
    classid: int = 0x0001_0001  # 1:1


def tick_in_usec(psched: str) -> float:
    """Kernel ticks per microsecond, from ``/proc/net/psched`` (iproute2's tc_core_init)."""
    t2us, us2t, clock_res = (int(x, 16) for x in psched.split()[:3])
    if clock_res == 1_000_000_000:
        t2us = us2t
    return t2us / us2t * (clock_res / TIME_UNITS_PER_SEC)


def xmit_ticks(rate_bytes_per_s: int, size_bytes: int, ticks_per_usec: float) -> int:
    """Time to send ``size_bytes`` at the rate, in kernel ticks (tc_calc_xmittime)."""
    return int(TIME_UNITS_PER_SEC * (size_bytes / rate_bytes_per_s) * ticks_per_usec)


def _rtattr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _ratespec(rate_bytes_per_s: int) -> bytes:
    # cell_log, linklayer, overhead, cell_align, mpu, rate (struct tc_ratespec)
    return struct.pack("BBHhHI", CELL_LOG, TC_LINKLAYER_ETHERNET, 0, -1, 0,
                       min(rate_bytes_per_s, 0xFFFF_FFFF))


def htb_change_message(ifindex: int, cls: HtbClass, ticks_per_usec: float, seq: int) -> bytes:
    """The ``RTM_NEWTCLASS`` request of ``tc class change`` for ``cls`` on ``ifindex``."""
    if cls.rate_bytes_per_s <= 0 or cls.burst_bytes <= 0:
        raise ValueError(f"rate_bytes_per_s={cls.rate_bytes_per_s}, "
                         f"burst_bytes={cls.burst_bytes}: both must be > 0")
    buffer = xmit_ticks(cls.rate_bytes_per_s, cls.burst_bytes, ticks_per_usec)
    # struct tc_htb_opt: rate, ceil, buffer, cbuffer, quantum, level, prio
    opt = (_ratespec(cls.rate_bytes_per_s) + _ratespec(cls.rate_bytes_per_s)
           + struct.pack("IIIII", buffer, buffer, cls.quantum_bytes, 0, 0))
    attrs = _rtattr(TCA_KIND, b"htb\0") + _rtattr(TCA_OPTIONS, _rtattr(TCA_HTB_PARMS, opt))
    tcmsg = struct.pack("BxHiIII", socket.AF_UNSPEC, 0, ifindex, cls.classid, cls.parent, 0)
    body = tcmsg + attrs
    return struct.pack("IHHII", 16 + len(body), RTM_NEWTCLASS, NLM_F_REQUEST | NLM_F_ACK,
                       seq, 0) + body


@dataclass(frozen=True)
class ClassCounters:
    """One traffic class's counters as ``tc -s class show`` prints them: ``sent_bytes``
    and ``sent_pkts`` the class let out (cumulative; for HTB, Ethernet frames as its
    rate accounting sees them), ``drops``, ``overlimits`` (times it was throttled), and
    the backlog of its leaf queue (``backlog_bytes``, ``backlog_pkts``; 0 for an inner
    class)."""

    classid: int
    parent: int
    kind: str
    sent_bytes: int
    sent_pkts: int
    drops: int
    overlimits: int
    backlog_bytes: int
    backlog_pkts: int
    requeues: int = 0


def class_dump_message(ifindex: int, seq: int, request: int = RTM_GETTCLASS) -> bytes:
    """The ``RTM_GETTCLASS`` dump request of ``tc -s class show dev D`` (``D`` = ifindex);
    with ``request=RTM_GETQDISC`` that of ``tc -s qdisc show dev D``."""
    tcmsg = struct.pack("BxHiIII", socket.AF_UNSPEC, 0, ifindex, 0, 0, 0)
    return struct.pack("IHHII", 16 + len(tcmsg), request, NLM_F_REQUEST | NLM_F_DUMP,
                       seq, 0) + tcmsg


def _attrs(data: bytes, off: int, end: int) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    while off + 4 <= end:
        length, kind = struct.unpack_from("HH", data, off)
        if length < 4 or off + length > end:
            raise NetlinkError(0, f"netlink: attribute {kind} of length {length} at "
                                  f"{off} overruns its message (ends at {end})")
        out[kind & 0x3FFF] = data[off + 4:off + length]  # without NLA_F_NESTED/BYTEORDER
        off += (length + 3) & ~3
    return out


def _counters(ifindex: int, classid: int, parent: int, attrs: dict[int, bytes]
              ) -> ClassCounters:
    kind = attrs.get(TCA_KIND, b"").split(b"\0", 1)[0].decode("ascii", "replace")
    sent_bytes = sent_pkts = drops = overlimits = backlog = qlen = requeues = 0
    if TCA_STATS2 in attrs:
        st = attrs[TCA_STATS2]
        nested = _attrs(st, 0, len(st))
        if TCA_STATS_BASIC in nested and len(nested[TCA_STATS_BASIC]) >= 12:
            sent_bytes, sent_pkts = struct.unpack_from("QI", nested[TCA_STATS_BASIC])
        if TCA_STATS_PKT64 in nested and len(nested[TCA_STATS_PKT64]) >= 8:
            (sent_pkts,) = struct.unpack_from("Q", nested[TCA_STATS_PKT64])
        if TCA_STATS_QUEUE in nested and len(nested[TCA_STATS_QUEUE]) >= 20:
            qlen, backlog, drops, requeues, overlimits = struct.unpack_from(
                "IIIII", nested[TCA_STATS_QUEUE])
    elif TCA_STATS in attrs and len(attrs[TCA_STATS]) >= 36:
        sent_bytes, sent_pkts, drops, overlimits, _bps, _pps, qlen, backlog = \
            struct.unpack_from("QIIIIIII", attrs[TCA_STATS])
    else:
        raise NetlinkError(0, f"netlink: class {classid:#x} on ifindex {ifindex} came "
                              "without counters (no TCA_STATS2 or TCA_STATS)")
    return ClassCounters(classid=classid, parent=parent, kind=kind, sent_bytes=sent_bytes,
                         sent_pkts=sent_pkts, drops=drops, overlimits=overlimits,
                         backlog_bytes=backlog, backlog_pkts=qlen, requeues=requeues)


def parse_class_dump(data: bytes, seq: int, ifindex: int,
                     into: list[ClassCounters], answer: int = RTM_NEWTCLASS) -> bool:
    """Append the classes of ``ifindex`` in one ``recv`` of a dump answering ``seq`` to
    ``into``; True once the dump's ``NLMSG_DONE`` came. A kernel error raises
    :class:`NetlinkError`; messages of other requests are skipped. Every length is
    checked against the buffer (the kernel is trusted to answer, not to be right).
    ``answer=RTM_NEWQDISC``: a qdisc dump's, each qdisc's handle as ``classid``."""
    off = 0
    done = False
    while off + 16 <= len(data):
        length, kind, _flags, got_seq, _pid = struct.unpack_from("IHHII", data, off)
        if length < 16 or off + length > len(data):
            raise NetlinkError(0, f"netlink: message of length {length} at {off} overruns "
                                  f"the {len(data)} bytes received")
        if got_seq == seq:
            if kind == NLMSG_DONE:
                done = True
            elif kind == NLMSG_ERROR:
                (err,) = struct.unpack_from("i", data, off + 16)
                if err:
                    raise NetlinkError(-err, f"tc dump: {os.strerror(-err)}")
            elif kind == answer:
                if length < 36:
                    raise NetlinkError(0, f"netlink: tc message {kind} of length {length}")
                _fam, got_if, handle, parent, _info = struct.unpack_from("BxxxiIII", data,
                                                                         off + 16)
                if got_if == ifindex:
                    into.append(_counters(got_if, handle, parent,
                                          _attrs(data, off + 36, off + length)))
        off += (length + 3) & ~3
    return done


def parse_ack(data: bytes, seq: int) -> int | None:
    """The error code of the kernel's ACK for ``seq`` in ``data`` (0 = success, else
    -errno), or None when ``data`` holds no ACK for it (a late reply to an older one)."""
    off = 0
    while off + 16 <= len(data):
        length, kind, _flags, got_seq, _pid = struct.unpack_from("IHHII", data, off)
        if length < 16:
            break
        if kind == NLMSG_ERROR and got_seq == seq:
            return int(struct.unpack_from("i", data, off + 16)[0])
        off += (length + 3) & ~3
    return None


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetlinkError(err, f"setns: {os.strerror(err)}")


class RtNetlink:
    """One rtnetlink socket in the network namespace of ``netns_pid`` (None: our own).

    A netlink socket stays in the namespace it was created in, so entering the namespace
    is needed only to open it and to look up interface indexes (on this thread only;
    the thread's namespace is restored before returning). Thread-safe."""

    def __init__(self, netns_pid: int | None = None) -> None:
        self.netns_pid = netns_pid
        self._lock = threading.Lock()
        self._seq = 0
        self._ifindex: dict[str, int] = {}
        with open("/proc/net/psched") as f:
            self.ticks_per_usec = tick_in_usec(f.read())
        self.sock = self._in_netns(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW,
                                                         NETLINK_ROUTE))
        self.sock.bind((0, 0))
        self.sock.settimeout(5.0)

    def _in_netns(self, fn: Callable[[], T]) -> T:
        if self.netns_pid is None:
            return fn()
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        target = os.open(f"/proc/{self.netns_pid}/ns/net", os.O_RDONLY)
        try:
            _setns(target)
            try:
                return fn()
            finally:
                _setns(own)
        finally:
            os.close(own)
            os.close(target)

    def ifindex(self, dev: str) -> int:
        if dev not in self._ifindex:
            self._ifindex[dev] = self._in_netns(lambda: socket.if_nametoindex(dev))
        return self._ifindex[dev]

    def change_htb_class(self, dev: str, cls: HtbClass) -> None:
        """Apply ``cls`` to ``dev``'s class and wait for the kernel's ACK."""
        index = self.ifindex(dev)
        with self._lock:
            self._seq += 1
            seq = self._seq
            self.sock.send(htb_change_message(index, cls, self.ticks_per_usec, seq))
            err = None
            while err is None:
                err = parse_ack(self.sock.recv(65536), seq)
        if err != 0:
            raise NetlinkError(-err, f"RTM_NEWTCLASS on {dev}: {os.strerror(-err)}")

    def class_counters(self, dev: str) -> list[ClassCounters]:
        """Every traffic class of ``dev`` with its counters (``tc -s class show dev``)."""
        return self._dump(dev, RTM_GETTCLASS, RTM_NEWTCLASS)

    def qdisc_counters(self, dev: str) -> list[ClassCounters]:
        """Every qdisc of ``dev`` with its counters (``tc -s qdisc show dev``), each
        qdisc's handle as ``classid``: no fork, where the ``tc`` binary in a host's
        namespace is an ``nsenter`` and a ``tc`` process, which the link sampler paid
        every 100 ms for every point."""
        return self._dump(dev, RTM_GETQDISC, RTM_NEWQDISC)

    def _dump(self, dev: str, request: int, answer: int) -> list[ClassCounters]:
        index = self.ifindex(dev)
        out: list[ClassCounters] = []
        with self._lock:
            self._seq += 1
            seq = self._seq
            self.sock.send(class_dump_message(index, seq, request))
            while not parse_class_dump(self.sock.recv(1 << 16), seq, index, out, answer):
                pass
        return out

    def close(self) -> None:
        self.sock.close()
