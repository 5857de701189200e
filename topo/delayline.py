"""A constant-delay line in user space over NFQUEUE, for kernels without netem.

DESIGN.md section 3: this kernel (and the lent GPU machine's) has no netem, so
a link's one-way ``delay_ms`` is emulated the way Mahimahi's delay shell does it, in user
space, but without copying a single payload. An iptables rule on the *receiving* host's
ingress (``topo.netfilter``) hands each packet to an NFQUEUE; the kernel keeps the packet
and sends this process only its metadata (copy mode META: the packet id, no payload).
For a constant delay the packets leave in arrival order, so one batch verdict
(``NFQNL_MSG_VERDICT_BATCH``: accept every queued id <= X) releases everything older than
the delay. Each packet is timed from the kernel's receive stamp. The loop wakes at the next
release time (``select`` has microsecond resolution)
or when a packet arrives, so a packet leaves within a fraction of a millisecond of its due
time; ``DelayStats`` records how late.

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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

from topo.loss import LossDraw, LossError

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

    def arrive(self, packet_id: int, now_ns: int) -> bool:
        """Hold ``packet_id`` until its due time; False (not held) when it is lost."""
        if self.loss is not None and self.loss.drops(packet_id):
            self.stats.dropped += 1
            return False
        self.held.append((now_ns + self._delay_ns, packet_id))
        self.stats.max_held = max(self.stats.max_held, len(self.held))
        return True

    def next_due_ns(self) -> int | None:
        return self.held[0][0] if self.held else None

    def due(self, now_ns: int) -> int | None:
        last = None
        held, stats = self.held, self.stats
        while held and held[0][0] <= now_ns:
            due_ns, last = held.popleft()
            late_us = (now_ns - due_ns) / 1e3
            stats.packets += 1
            stats.late_sum_us += late_us
            if late_us > stats.late_max_us:
                stats.late_max_us = late_us
        if last is not None:
            stats.batches += 1
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


# The loop sleeps until this long before the next release and spins the rest: a wake-up
# from select lands 20-80 us late here, a spin lands within a few microseconds. At
# 100 Mbit/s (1 ms RTT) a 100 us spin cost the two delay lines 1.16 cores, 30 us 0.65
# and none 0.73 (then 41 us late on average instead of 14).
SPIN_NS = 30_000


def serve(lines: Sequence[DelayLine], *, ready_path: str | None = None,
          stats_path: str | None = None, maxlen_pkts: int = QUEUE_MAXLEN_PKTS,
          realtime: bool = True, spin_ns: int = SPIN_NS) -> None:
    """Bind every queue, then hold and release until SIGTERM/SIGINT; then release what is
    held (the run is over; dropping it would only add losses nobody configured), unbind,
    and write the stats. ``ready_path`` is created once every queue is bound."""
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
    errors: dict[int, int] = {}
    untrusted = 0
    started = time.monotonic_ns()
    try:
        if ready_path:
            with open(ready_path, "w") as f:
                f.write(str(os.getpid()))
        sock.setblocking(False)
        buf = bytearray(1 << 16)
        view = memoryview(buf)
        # A packet's delay runs from the kernel's receive stamp (NFQA_TIMESTAMP, taken when
        # the interface received it), not from when its notice is read: on the shared
        # 2-core machine a notice is read 40-570 us (median 170 us) after the packet
        # arrived, the softirq's latency before the hook runs plus this process's
        # wake-up, and stamping at read time added that to every delay (a 1 ms + 1 ms
        # path gave a 2.33 ms ping). A stamp older than ``stamp_trust_ns(delay)`` is
        # not this arrival's (a clock step, a stamp carried over from another packet):
        # that packet is timed from its read instead, and counted.
        clock = time.time_ns  # CLOCK_REALTIME, the stamps' clock
        trust = {x.queue: stamp_trust_ns(x.delay_ms) for x in lines}
        try:
            while True:
                now = clock()
                nxt = min((d for d in (x.next_due_ns() for x in lines) if d is not None),
                          default=None)
                timeout = 0.5 if nxt is None else (nxt - now - spin_ns) / 1e9
                if timeout > 0:
                    select.select([sock], [], [], timeout)
                elif nxt is not None:
                    # Spin to the due time, still taking notices as they come.
                    select.select([sock], [], [], 0)
                # Drain every notice that is waiting, stamping each with the time it is
                # read: the process never lags the kernel by more than one loop turn.
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
                                untrusted += 1
                                rx = now
                            if not line.arrive(item.packet_id, rx):
                                drop.append(verdict_one(line.queue, item.packet_id))
                        elif item.code != 0:
                            errors[-item.code] = errors.get(-item.code, 0) + 1
                if drop:  # before any batch verdict that covers their ids
                    sock.send(b"".join(drop))
                now = clock()
                for line in lines:
                    last = line.due(now)
                    if last is not None:
                        sock.send(verdict_batch(line.queue, last))
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
                   "tuning": tuning, "timed_from_read": untrusted,
                   "netlink_errors": {errno.errorcode.get(k, str(k)): v
                                      for k, v in errors.items()},
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
    ap.add_argument("--spin-us", type=float, default=SPIN_NS / 1000,
                    help="spin this long before each release instead of sleeping "
                         "(less lateness, more CPU)")
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
              realtime=not args.no_realtime, spin_ns=int(args.spin_us * 1000))
    except DelayLineError as e:
        print(f"delayline: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
