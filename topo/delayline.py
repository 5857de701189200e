"""A constant-delay line in user space over NFQUEUE, for kernels without netem.

DESIGN.md section 3: this kernel (and the lent GPU machine's) has no netem, so
a link's one-way ``delay_ms`` is emulated the way Mahimahi's delay shell does it, in user
space, but without copying a single payload. An iptables rule on the *receiving* host's
ingress (``topo.netfilter``) hands each packet to an NFQUEUE; the kernel keeps the packet
and sends this process only its metadata (copy mode META: the packet id, no payload).
For a constant delay the packets leave in arrival order, so one batch verdict
(``NFQNL_MSG_VERDICT_BATCH``: accept every queued id <= X) releases everything older than
the delay. Each packet is timed from the kernel's receive stamp. The loop sleeps until a
window before the next release (or until a notice arrives) and spins the rest; the window
is learnt from how late its own timed wake-ups land (``topo.spin``), and the verdict is
built before the spin, so a release leaves a few microseconds after its due time when the
wake-up was within the window. ``DelayStats`` records how late each release was sent, and
the stats file what the wake-ups and the verdict sends cost.

Seeded loss (``net.loss_model = "seeded"``): a queue may also lose packets, each decided
by ``topo.loss`` from the run's seed, the link's name and the kernel's packet id; a lost
packet gets its own ``NF_DROP`` verdict as its notice is read (all of one read's drops in
one datagram), before any batch verdict covers its id, and is never held.

Because the delay is on the receiving side, the sender's own stack is untouched: TCP small
queues, the pacing and the qdiscs see an ordinary link, and the RTT the sender measures
includes the delay (a sender-side hold would stall the socket through TCP small queues).

Failure is closed, never silently open: the rule has no ``--queue-bypass`` and the queue
has no ``NFQA_CFG_F_FAIL_OPEN``, so a dead delay line (its queue unbound when the socket
closes) or a full queue drops packets instead of passing them undelayed. The owner checks
that the process is alive (``topo.netfilter``) and reads the kernel's drop counters
(``/proc/net/netfilter/nfnetlink_queue``) into the run's record.

Layers, h11 style: the netlink codec (``config_messages``, ``verdict_batch``,
``parse_messages``) and the release schedule (``DelayLine``) are pure and unit-tested;
``serve`` is the only I/O. Run as ``python -m topo.delayline --queue Q:DELAY_MS ...``
inside the receiving host's namespace.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from topo.loss import LossDraw, LossError
from topo.spin import SpinConfig, SpinError, SpinWindow

# linux/netlink.h, linux/netfilter/nfnetlink.h, linux/netfilter/nfnetlink_queue.h
NETLINK_NETFILTER = 12
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET = 0
NFQNL_MSG_VERDICT = 1
NFQNL_MSG_CONFIG = 2
NFQNL_MSG_VERDICT_BATCH = 3
NFQA_PACKET_HDR = 1
NFQA_VERDICT_HDR = 2
NFQA_TIMESTAMP = 4
NFQA_CFG_CMD = 1
NFQA_CFG_PARAMS = 2
NFQA_CFG_QUEUE_MAXLEN = 3
NFQA_CFG_MASK = 4
NFQA_CFG_FLAGS = 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_CFG_CMD_UNBIND = 2
NFQNL_COPY_META = 1
NFQA_CFG_F_FAIL_OPEN = 0x1
# Hand GSO/GRO packets to the queue whole: without it the kernel segments every GRO packet
# before queueing it, a cost paid only so that a payload nobody reads is split.
NFQA_CFG_F_GSO = 0x4
NF_DROP = 0
NF_ACCEPT = 1
AF_UNSPEC = 0
AF_INET = 2
NFNETLINK_V0 = 0
SOL_NETLINK = 270
SO_TIMESTAMPNS = 35  # asm-generic/socket.h; Python's socket module does not export it
NETLINK_NO_ENOBUFS = 5

NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
NFGEN_HDR = struct.Struct("!BBH")  # family, version, res_id (big endian)
NLA_HDR = struct.Struct("=HH")  # len, type
PACKET_HDR = struct.Struct("!IHB")  # packet_id, hw_protocol, hook
TIMESTAMP = struct.Struct("!QQ")  # sec, usec of skb->tstamp (CLOCK_REALTIME)

# Packets the kernel may hold per queue before it drops (fail closed). Enough for
# 10 Gbit/s of 1514-byte frames held 200 ms (165k); each held packet is the received skb,
# which the receiving host would otherwise have queued in its socket.
QUEUE_MAXLEN_PKTS = 200_000
# Room for the per-packet notices (about 80 bytes each, charged as a netlink skb of ~768
# bytes) while the process is busy: 64 MB is ~80k notices, half a second at 1 Gbit/s.
RCVBUF_BYTES = 64 << 20
QUEUE_MIN, QUEUE_MAX = 0, 65_535
DELAY_MAX_MS = 10_000.0


class DelayLineError(RuntimeError):
    """A netlink failure or a bad argument; the message names the queue or the argument."""


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _attr(kind: int, payload: bytes) -> bytes:
    raw = NLA_HDR.pack(NLA_HDR.size + len(payload), kind) + payload
    return raw + b"\0" * (_align4(len(raw)) - len(raw))


def _message(msg: int, queue: int, attrs: bytes, *, family: int = AF_UNSPEC, seq: int = 0,
             flags: int = NLM_F_REQUEST) -> bytes:
    body = NFGEN_HDR.pack(family, NFNETLINK_V0, queue) + attrs
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg,
                          flags, seq, 0) + body


def _check_queue(queue: int) -> None:
    if isinstance(queue, bool) or not isinstance(queue, int) or not QUEUE_MIN <= queue <= QUEUE_MAX:
        raise DelayLineError(f"queue={queue!r}; allowed {QUEUE_MIN}..{QUEUE_MAX}")


def config_messages(queue: int, maxlen_pkts: int = QUEUE_MAXLEN_PKTS) -> list[bytes]:
    """Bind ``queue``, then ask for metadata only, a queue of ``maxlen_pkts``, GSO packets
    whole and fail-closed (FAIL_OPEN cleared). Each asks for an ack."""
    _check_queue(queue)
    bind = _message(NFQNL_MSG_CONFIG, queue,
                    _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, AF_INET)),
                    seq=1, flags=NLM_F_REQUEST | NLM_F_ACK)
    params = (_attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META))
              + _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", maxlen_pkts))
              + _attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO))
              + _attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_GSO)))
    conf = _message(NFQNL_MSG_CONFIG, queue, params, seq=2, flags=NLM_F_REQUEST | NLM_F_ACK)
    return [bind, conf]


def unbind_message(queue: int) -> bytes:
    _check_queue(queue)
    return _message(NFQNL_MSG_CONFIG, queue,
                    _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_UNBIND, AF_INET)))


def verdict_batch(queue: int, last_id: int, verdict: int = NF_ACCEPT) -> bytes:
    """One message releasing every packet of ``queue`` with an id <= ``last_id``."""
    _check_queue(queue)
    return _message(NFQNL_MSG_VERDICT_BATCH, queue,
                    _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, last_id)))


def verdict_one(queue: int, packet_id: int, verdict: int = NF_DROP) -> bytes:
    """One message giving the packet ``packet_id`` of ``queue`` its own verdict."""
    _check_queue(queue)
    return _message(NFQNL_MSG_VERDICT, queue,
                    _attr(NFQA_VERDICT_HDR, struct.pack("!II", verdict, packet_id)))


@dataclass(frozen=True)
class Packet:
    """A queued packet's notice: which queue, the kernel's packet id, and when the
    interface received it (CLOCK_REALTIME ns, microsecond resolution; None when the kernel
    did not stamp it)."""

    queue: int
    packet_id: int
    rx_real_ns: int | None = None


@dataclass(frozen=True)
class NetlinkError:
    """An NLMSG_ERROR: ``code`` is the negated errno (0 is an ack)."""

    code: int
    seq: int


def parse_messages(buf: bytes) -> Iterator[Packet | NetlinkError]:
    """Netlink messages in one datagram from the kernel. Anything malformed raises
    DelayLineError naming the offset (the kernel is trusted, but a parser never loops)."""
    off = 0
    while off + NLMSG_HDR.size <= len(buf):
        length, kind, _flags, seq, _pid = NLMSG_HDR.unpack_from(buf, off)
        if length < NLMSG_HDR.size or off + length > len(buf):
            raise DelayLineError(f"netlink message at offset {off}: length {length} "
                                 f"does not fit the {len(buf)}-byte datagram")
        body = off + NLMSG_HDR.size
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", buf, body)
            yield NetlinkError(code=code, seq=seq)
        elif kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            _fam, _ver, queue = NFGEN_HDR.unpack_from(buf, body)
            pos, end = body + NFGEN_HDR.size, off + length
            packet_id = rx_ns = None
            while pos + NLA_HDR.size <= end:
                alen, atype = NLA_HDR.unpack_from(buf, pos)
                if alen < NLA_HDR.size or pos + alen > end:
                    raise DelayLineError(f"netlink attribute at offset {pos}: length {alen}")
                atype &= 0x3FFF
                if atype == NFQA_PACKET_HDR and alen >= NLA_HDR.size + PACKET_HDR.size:
                    packet_id = PACKET_HDR.unpack_from(buf, pos + NLA_HDR.size)[0]
                elif atype == NFQA_TIMESTAMP and alen >= NLA_HDR.size + TIMESTAMP.size:
                    sec, usec = TIMESTAMP.unpack_from(buf, pos + NLA_HDR.size)
                    rx_ns = sec * 1_000_000_000 + usec * 1000
                pos += _align4(alen)
            if packet_id is None:
                raise DelayLineError(f"packet notice at offset {off} without NFQA_PACKET_HDR")
            yield Packet(queue=queue, packet_id=packet_id, rx_real_ns=rx_ns)
        off += _align4(length)


@dataclass
class DelayStats:
    """What one queue's delay line did; ``late_*`` is release time minus due time."""

    queue: int
    delay_ms: float
    packets: int = 0
    dropped: int = 0
    batches: int = 0
    max_held: int = 0
    late_max_us: float = 0.0
    late_sum_us: float = 0.0
    # Packets already due when their notice was read: late however the loop sleeps.
    read_late: int = 0

    @property
    def late_mean_us(self) -> float:
        return self.late_sum_us / self.packets if self.packets else 0.0


@dataclass
class DelayLine:
    """Release schedule of one queue (sans-I/O): ``arrive`` records a packet at ``now_ns``,
    ``due`` returns the largest id whose delay has passed (for one batch verdict), or None.

    Ids rise by one per packet in each queue, and a constant delay keeps arrival order, so
    the held packets are a FIFO and releasing "every id <= X" is exactly "every packet
    older than the delay". With ``loss``, ``arrive`` returns False for a packet the seeded
    draw loses: it is not held, and the caller drops it (``verdict_one``) before the next
    batch verdict.
    """

    queue: int
    delay_ms: float
    loss: LossDraw | None = None
    held: deque[tuple[int, int]] = field(default_factory=deque)  # (due_ns, packet_id)
    stats: DelayStats = field(init=False)

    def __post_init__(self) -> None:
        _check_queue(self.queue)
        if not 0.0 <= self.delay_ms <= DELAY_MAX_MS:
            raise DelayLineError(f"queue {self.queue}: delay_ms={self.delay_ms!r}; "
                                 f"allowed 0..{DELAY_MAX_MS:g}")
        self.stats = DelayStats(queue=self.queue, delay_ms=self.delay_ms)
        self._delay_ns = round(self.delay_ms * 1e6)

    def arrive(self, packet_id: int, now_ns: int, read_ns: int | None = None) -> bool:
        """Hold ``packet_id`` (received at ``now_ns``) until its due time; False (not
        held) when it is lost. ``read_ns``: when its notice was read, to count the packets
        that were due before the loop even knew of them."""
        if self.loss is not None and self.loss.drops(packet_id):
            self.stats.dropped += 1
            return False
        due_ns = now_ns + self._delay_ns
        if read_ns is not None and read_ns >= due_ns:
            self.stats.read_late += 1
        self.held.append((due_ns, packet_id))
        self.stats.max_held = max(self.stats.max_held, len(self.held))
        return True

    def next_due_ns(self) -> int | None:
        return self.held[0][0] if self.held else None

    def last_due_id(self, until_ns: int) -> int | None:
        """The largest held id due by ``until_ns`` (nothing is released), or None."""
        last = None
        for due_ns, packet_id in self.held:
            if due_ns > until_ns:
                break
            last = packet_id
        return last

    def release_through(self, last_id: int, now_ns: int) -> None:
        """Forget every held packet with an id <= ``last_id``, released at ``now_ns``."""
        held, stats = self.held, self.stats
        while held and held[0][1] <= last_id:
            due_ns, _ = held.popleft()
            late_us = (now_ns - due_ns) / 1e3
            stats.packets += 1
            stats.late_sum_us += late_us
            if late_us > stats.late_max_us:
                stats.late_max_us = late_us
        stats.batches += 1

    def due(self, now_ns: int) -> int | None:
        """Release everything due by ``now_ns``: the id for one batch verdict, or None."""
        last = self.last_due_id(now_ns)
        if last is not None:
            self.release_through(last, now_ns)
        return last


def parse_queue_arg(text: str) -> tuple[int, float]:
    """``Q:DELAY_MS`` (queue number, one-way delay in ms) from the command line."""
    q, sep, d = text.partition(":")
    try:
        if not sep:
            raise ValueError
        queue, delay_ms = int(q), float(d)
    except ValueError:
        raise DelayLineError(f"--queue {text!r}: expected QUEUE:DELAY_MS, e.g. 1:20") from None
    DelayLine(queue, delay_ms)  # validates both
    return queue, delay_ms


def parse_loss_arg(text: str) -> tuple[int, LossDraw]:
    """``Q:LOSS_PCT:SEED:LINK`` (queue, loss in percent, seed, the link's name) from the
    command line; the link name may itself hold colons."""
    parts = text.split(":", 3)
    try:
        if len(parts) != 4:
            raise ValueError
        queue, loss_pct, seed, link = int(parts[0]), float(parts[1]), int(parts[2]), parts[3]
        _check_queue(queue)
        return queue, LossDraw(seed, link, loss_pct)
    except (ValueError, LossError, DelayLineError) as e:
        detail = "" if type(e) is ValueError else f" ({e})"
        raise DelayLineError(f"--loss {text!r}: expected QUEUE:LOSS_PCT:SEED:LINK, e.g. "
                             f"100:1:42:ps-eth0{detail}") from None


class _Stop(Exception):
    pass


# prctl(PR_SET_TIMERSLACK): the kernel may fire a sleeping process's timer up to its slack
# late (50 us by default) to batch wake-ups; a delay line wants its wake-ups on time.
PR_SET_TIMERSLACK = 29
# SCHED_FIFO priority of the delay line: above every ordinary process, so on a busy
# 2-core machine a release is not queued behind a training step. It sleeps between
# releases, and the kernel's real-time throttling bounds it at 95 % of a core anyway.
RT_PRIORITY = 10


def tune_process(realtime: bool) -> dict[str, object]:
    """Timer slack 1 ns and (``realtime``) SCHED_FIFO; returns what took effect."""
    import ctypes

    out: dict[str, object] = {}
    libc = ctypes.CDLL(None, use_errno=True)
    out["timerslack_ns"] = 1 if libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0) == 0 else None
    out["sched"] = "other"
    if realtime:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
            out["sched"] = f"fifo:{RT_PRIORITY}"
        except OSError as e:
            out["sched_error"] = str(e)
    return out


def _enable_rx_timestamps() -> socket.socket:
    """A socket asking for receive timestamps switches on skb stamping for every
    interface (a global static key), so each notice carries its packet's receive time."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    return s


def stamp_trust_ns(delay_ms: float) -> int:
    """How old a receive stamp may be when its notice is read and still be trusted: half
    the delay, at most 2 ms (measured read lags: 40-570 us)."""
    return int(min(delay_ms / 2, 2.0) * 1e6)


def _open(queues: Sequence[int], maxlen_pkts: int) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    try:
        sock.bind((0, 0))
        try:
            sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF_BYTES)  # SO_RCVBUFFORCE (root)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        # A notice lost to a full socket buffer is harmless here: the next batch verdict
        # (every id <= X) releases that packet too. Without this, recv raises ENOBUFS.
        sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
        for queue in queues:
            for msg in config_messages(queue, maxlen_pkts):
                sock.send(msg)
                for item in parse_messages(sock.recv(65536)):
                    if isinstance(item, NetlinkError) and item.code != 0:
                        raise DelayLineError(
                            f"queue {queue}: nfnetlink_queue config refused: "
                            f"{os.strerror(-item.code)} (is the queue already bound?)")
    except BaseException:
        sock.close()
        raise
    return sock


# How the loop tells what it did apart from what the kernel and the machine did: a release
# is late either because its notice was read after its due time (``read_late``: the read
# lag, nothing the loop's timing can fix), or because the loop woke or turned late, which
# ``SpinWindow`` measures (timed wake-ups' overshoot) and answers by spinning.
@dataclass
class LoopStats:
    untrusted: int = 0  # packets timed from the read of their notice (stamp_trust_ns)
    errors: dict[int, int] = field(default_factory=dict)  # errno -> netlink errors
    verdicts: int = 0
    verdict_send_sum_ns: int = 0  # how long the batch verdicts' send() took (the kernel
    verdict_send_max_ns: int = 0  # reinjects the released packets inside it)

    def record(self) -> dict[str, object]:
        return {"timed_from_read": self.untrusted,
                "netlink_errors": {errno.errorcode.get(k, str(k)): v
                                   for k, v in self.errors.items()},
                "verdict_send_mean_us": self.verdict_send_sum_ns / self.verdicts / 1e3
                if self.verdicts else 0.0,
                "verdict_send_max_us": self.verdict_send_max_ns / 1e3}


def _drain(sock: socket.socket, buf: bytearray, by_queue: dict[int, DelayLine],
           trust: dict[int, int], loop: LoopStats) -> None:
    """Read every notice that is waiting (the process never lags the kernel by more than
    one loop turn), hold or drop each packet, and send the drops' verdicts."""
    view = memoryview(buf)
    clock = time.time_ns  # CLOCK_REALTIME, the stamps' clock
    drop: list[bytes] = []
    while True:
        try:
            n = sock.recv_into(buf)
        except BlockingIOError:
            break
        now = clock()
        for item in parse_messages(bytes(view[:n])):
            if isinstance(item, Packet):
                line = by_queue.get(item.queue)
                if line is None:
                    continue
                rx = item.rx_real_ns
                if rx is None or not 0 <= now - rx <= trust[item.queue]:
                    loop.untrusted += 1
                    rx = now
                if not line.arrive(item.packet_id, rx, read_ns=now):
                    drop.append(verdict_one(line.queue, item.packet_id))
            elif item.code != 0:
                loop.errors[-item.code] = loop.errors.get(-item.code, 0) + 1
    if drop:  # before any batch verdict that covers their ids
        sock.send(b"".join(drop))


def _send_verdicts(sock: socket.socket, msgs: bytes, loop: LoopStats) -> None:
    t0 = time.monotonic_ns()
    sock.send(msgs)
    took = time.monotonic_ns() - t0
    loop.verdicts += 1
    loop.verdict_send_sum_ns += took
    loop.verdict_send_max_ns = max(loop.verdict_send_max_ns, took)


# A spin that overran its due time by more than this (a burst of notices read in it, a
# late wake-up) also releases the packets that fell due meanwhile, in the same verdict:
# otherwise each waits a loop turn for its own (at 100 Mbit/s the data side's releases
# were 37-52 us late on average instead of 21-30). Below it, the send is not delayed by
# the extra planning (one loop turn of the spin is a few microseconds).
FOLD_AFTER_NS = 10_000


def _next_due_ns(lines: Sequence[DelayLine]) -> int | None:
    return min((d for d in (x.next_due_ns() for x in lines) if d is not None), default=None)


def _sleep(sock: socket.socket, nxt: int, spin: SpinWindow, drain: Callable[[], None],
           next_due: Callable[[], int | None]) -> tuple[int, int | None]:
    """Sleep until ``spin``'s window before ``nxt``, reading notices as they come (the
    plan stands: new packets of a queue fall due after its held ones); return the time
    and, if the timer ended the sleep, how late. Returns early if a notice brought a
    packet due before ``nxt`` (a shorter-delay queue's)."""
    clock = time.time_ns
    while True:
        now = clock()
        wake_ns = nxt - spin.window_ns(now)
        if wake_ns <= now:
            return now, None
        if not select.select([sock], [], [], (wake_ns - now) / 1e9)[0]:
            now = clock()
            return now, now - wake_ns
        drain()
        if (next_due() or nxt) < nxt:
            return clock(), None


def _run(sock: socket.socket, lines: Sequence[DelayLine], spin: SpinWindow,
         loop: LoopStats) -> None:
    """Hold and release until _Stop. A packet's delay runs from the kernel's receive stamp
    (NFQA_TIMESTAMP, taken when the interface received it), not from when its notice is
    read: on the shared 2-core machine a notice is read 40-570 us (median 170 us) after
    the packet arrived, the softirq's latency before the hook runs plus this process's
    wake-up, and stamping at read time added that to every delay (a 1 ms + 1 ms path gave
    a 2.33 ms ping). A stamp older than ``stamp_trust_ns(delay)`` is not this arrival's (a
    clock step, a stamp carried over from another packet): that packet is timed from its
    read instead, and counted.

    The loop sleeps until ``spin.window_ns`` before the next release and spins the rest.
    The spin is only the clock and a zero-timeout poll (notices arriving meanwhile are
    still read), so the release lands within one such turn of its due time; the wake-up's
    lateness (the timer's, plus the return to Python) is what ``spin`` learns from."""
    by_queue = {line.queue: line for line in lines}
    trust = {x.queue: stamp_trust_ns(x.delay_ms) for x in lines}
    buf = bytearray(1 << 16)
    clock = time.time_ns
    poll = select.select
    planned: list[tuple[DelayLine, int]] = []
    msgs = b""

    def drain() -> None:
        _drain(sock, buf, by_queue, trust, loop)

    while True:
        nxt = _next_due_ns(lines)
        if nxt is None:
            poll([sock], [], [], 0.5)
            _drain(sock, buf, by_queue, trust, loop)
            continue
        # The verdicts are built before the sleep and the bookkeeping is done after the
        # send: between the wake-up and the send there are only clock reads (Python on the
        # shared development machine takes tens of microseconds for a few lines, cold).
        batch = [(x, last) for x in lines if (last := x.last_due_id(nxt)) is not None]
        if batch != planned:  # unchanged after a spin that a notice cut short
            planned = batch
            msgs = b"".join(verdict_batch(x.queue, last) for x, last in batch)
        now, overshoot_ns = _sleep(sock, nxt, spin, drain, lambda: _next_due_ns(lines))
        if (_next_due_ns(lines) or nxt) < nxt:
            continue  # a packet of a shorter-delay queue is due first: plan again
        start = now
        while now < nxt:
            if poll([sock], [], [], 0)[0]:
                # Notices came: read them; only a shorter-delay queue's packet due first
                # changes the plan (the new packets of the planned queues fall due later).
                _drain(sock, buf, by_queue, trust, loop)
                if (_next_due_ns(lines) or nxt) < nxt:
                    break
            now = clock()
        if now < nxt:
            spin.spun(now - start, now)
            continue
        if now - nxt > FOLD_AFTER_NS:  # the spin overran: release what fell due meanwhile
            batch = [(x, last) for x in lines if (last := x.last_due_id(now)) is not None]
            if batch != planned:
                planned = batch
                msgs = b"".join(verdict_batch(x.queue, last) for x, last in batch)
        _send_verdicts(sock, msgs, loop)
        if overshoot_ns is not None:
            spin.woke(overshoot_ns)
        for x, last in batch:
            x.release_through(last, now)
        spin.spun(now - start, now)


def serve(lines: Sequence[DelayLine], *, ready_path: str | None = None,
          stats_path: str | None = None, maxlen_pkts: int = QUEUE_MAXLEN_PKTS,
          realtime: bool = True, spin: SpinConfig | None = None) -> None:
    """Bind every queue, then hold and release until SIGTERM/SIGINT; then release what is
    held (the run is over; dropping it would only add losses nobody configured), unbind,
    and write the stats. ``ready_path`` is created once every queue is bound. ``spin``:
    how the loop learns how long to spin before each release (``topo.spin``)."""
    by_queue = {line.queue: line for line in lines}
    if len(by_queue) != len(lines):
        raise DelayLineError(f"queues {[x.queue for x in lines]}: each queue at most once")

    def stop(_sig: int, _frame: object) -> None:
        raise _Stop

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    tuning = tune_process(realtime)
    sock = _open(list(by_queue), maxlen_pkts)
    stamper = _enable_rx_timestamps()
    window = SpinWindow(spin or SpinConfig())
    loop = LoopStats()
    started = time.monotonic_ns()
    try:
        if ready_path:
            with open(ready_path, "w") as f:
                f.write(str(os.getpid()))
        sock.setblocking(False)
        try:
            _run(sock, lines, window, loop)
        except _Stop:
            pass
        for line in lines:
            if line.held:
                sock.send(verdict_batch(line.queue, line.held[-1][1]))
                line.held.clear()
        for queue in by_queue:
            sock.send(unbind_message(queue))
    finally:
        sock.close()
        stamper.close()
        if stats_path:
            out = {"pid": os.getpid(), "ran_s": (time.monotonic_ns() - started) / 1e9,
                   "tuning": tuning, **loop.record(),
                   "spin": {**asdict(window.config), **window.record()},
                   "queues": [{**asdict(x.stats), "late_mean_us": x.stats.late_mean_us}
                              for x in lines]}
            tmp = stats_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, stats_path)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m topo.delayline", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("--queue", action="append", required=True, metavar="Q:DELAY_MS",
                    help="an NFQUEUE number and the one-way delay its packets get")
    ap.add_argument("--loss", action="append", default=[], metavar="Q:LOSS_PCT:SEED:LINK",
                    help="seeded loss on queue Q (topo.loss): LOSS_PCT percent of its "
                         "packets, drawn from SEED and the link's name LINK")
    ap.add_argument("--ready", help="file created once every queue is bound")
    ap.add_argument("--stats", help="JSON file written at exit with what was released")
    ap.add_argument("--maxlen", type=int, default=QUEUE_MAXLEN_PKTS,
                    help="packets the kernel holds per queue before it drops")
    ap.add_argument("--spin-us", type=float, default=None,
                    help="spin this long before each release instead of learning the "
                         "window from the wake-ups (topo.spin); for control runs")
    ap.add_argument("--no-realtime", action="store_true",
                    help="stay SCHED_OTHER (releases then wait behind busy processes)")
    args = ap.parse_args(argv)
    try:
        losses = dict(parse_loss_arg(x) for x in args.loss)
        lines = [DelayLine(q, d, losses.pop(q, None))
                 for q, d in (parse_queue_arg(x) for x in args.queue)]
        if losses:
            raise DelayLineError(f"--loss for queue(s) {sorted(losses)} without a --queue")
        serve(lines, ready_path=args.ready, stats_path=args.stats, maxlen_pkts=args.maxlen,
              realtime=not args.no_realtime,
              spin=None if args.spin_us is None else SpinConfig.fixed(int(args.spin_us * 1000)))
    except (DelayLineError, SpinError) as e:
        where = "--spin-us: " if isinstance(e, SpinError) else ""
        print(f"delayline: {where}{e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
