"""Kernel rate measurement from Linux ``TCP_INFO`` (DESIGN.md section 1.1, step 3).

The adaptive ratio of seeds/004 needs the worker's real sending rate r(t). Timing the
application's own ``send()`` calls measures how fast the socket buffer fills, not how fast
the network drains it, so gradbed reads the kernel's view instead: ``tcpi_bytes_acked``
(RFC 4898 ``tcpEStatsAppHCThruOctetsAcked``) deltas and ``tcpi_delivery_rate`` (the
delivery-rate estimator of Cheng et al., draft-cheng-iccrg-delivery-rate-estimation, as BBR
uses). The parser is sans-I/O (bytes in, :class:`TcpInfo` out) and follows the layout of
``struct tcp_info`` in ``include/uapi/linux/tcp.h``; fields a shorter (older-kernel) buffer
does not reach are None.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

# (field, byte offset, struct code) in struct tcp_info. The kernel lays the struct out with
# natural alignment, so every field sits at a multiple of its size and "=" (standard sizes,
# native byte order, no padding) reads it at its offset. Comments give the kernel version
# that appended the field, which is why a short buffer ends before it.
_FIELDS: tuple[tuple[str, int, str], ...] = (
    ("state", 0, "B"),
    ("ca_state", 1, "B"),
    ("retransmits", 2, "B"),
    ("probes", 3, "B"),
    ("backoff", 4, "B"),
    ("options", 5, "B"),
    ("wscale", 6, "B"),  # snd_wscale : 4, rcv_wscale : 4
    ("app_limited_flags", 7, "B"),  # delivery_rate_app_limited : 1 (4.9)
    ("rto_us", 8, "I"),
    ("ato_us", 12, "I"),
    ("snd_mss_bytes", 16, "I"),
    ("rcv_mss_bytes", 20, "I"),
    ("unacked_pkts", 24, "I"),
    ("sacked_pkts", 28, "I"),
    ("lost_pkts", 32, "I"),
    ("retrans_pkts", 36, "I"),
    ("fackets", 40, "I"),
    ("last_data_sent_ms", 44, "I"),
    ("last_ack_sent_ms", 48, "I"),
    ("last_data_recv_ms", 52, "I"),
    ("last_ack_recv_ms", 56, "I"),
    ("pmtu_bytes", 60, "I"),
    ("rcv_ssthresh", 64, "I"),
    ("rtt_us", 68, "I"),
    ("rttvar_us", 72, "I"),
    ("snd_ssthresh_pkts", 76, "I"),
    ("snd_cwnd_pkts", 80, "I"),
    ("advmss_bytes", 84, "I"),
    ("reordering", 88, "I"),
    ("rcv_rtt_us", 92, "I"),
    ("rcv_space_bytes", 96, "I"),
    ("total_retrans", 100, "I"),
    ("pacing_rate_bytes_per_s", 104, "Q"),  # 3.15
    ("max_pacing_rate_bytes_per_s", 112, "Q"),  # 3.15
    ("bytes_acked", 120, "Q"),  # 4.1
    ("bytes_received", 128, "Q"),  # 4.1
    ("segs_out", 136, "I"),  # 4.2
    ("segs_in", 140, "I"),  # 4.2
    ("notsent_bytes", 144, "I"),  # 4.6
    ("min_rtt_us", 148, "I"),  # 4.6
    ("data_segs_in", 152, "I"),  # 4.6
    ("data_segs_out", 156, "I"),  # 4.6
    ("delivery_rate_bytes_per_s", 160, "Q"),  # 4.9
    ("busy_time_us", 168, "Q"),  # 4.10
    ("rwnd_limited_us", 176, "Q"),  # 4.10
    ("sndbuf_limited_us", 184, "Q"),  # 4.10
    ("delivered_pkts", 192, "I"),  # 4.18
    ("delivered_ce_pkts", 196, "I"),  # 4.18
    ("bytes_sent", 200, "Q"),  # 4.19
    ("bytes_retrans", 208, "Q"),  # 4.19
    ("dsack_dups", 216, "I"),  # 4.19
    ("reord_seen", 220, "I"),  # 4.19
    ("rcv_ooopack", 224, "I"),  # 5.4
    ("snd_wnd_bytes", 228, "I"),  # 5.4
)

# What getsockopt asks for: more than any kernel's struct, which then reports its own size.
TCP_INFO_BUFSIZE = 256

# The kernel's "no limit" for max_pacing_rate (~0UL).
UNLIMITED_PACING = 2**64 - 1

TCP_STATES = ("", "ESTABLISHED", "SYN_SENT", "SYN_RECV", "FIN_WAIT1", "FIN_WAIT2",
              "TIME_WAIT", "CLOSE", "CLOSE_WAIT", "LAST_ACK", "LISTEN", "CLOSING",
              "NEW_SYN_RECV")


@dataclass(frozen=True)
class TcpInfo:
    """One ``struct tcp_info`` snapshot. Names carry units; None means the kernel's struct
    was too short to hold the field. Rates in the kernel are bytes per second."""

    state: int
    ca_state: int
    retransmits: int
    probes: int
    backoff: int
    options: int
    wscale: int
    app_limited_flags: int
    rto_us: int
    ato_us: int
    snd_mss_bytes: int
    rcv_mss_bytes: int
    unacked_pkts: int
    sacked_pkts: int
    lost_pkts: int
    retrans_pkts: int
    fackets: int
    last_data_sent_ms: int
    last_ack_sent_ms: int
    last_data_recv_ms: int
    last_ack_recv_ms: int
    pmtu_bytes: int
    rcv_ssthresh: int
    rtt_us: int
    rttvar_us: int
    snd_ssthresh_pkts: int
    snd_cwnd_pkts: int
    advmss_bytes: int
    reordering: int
    rcv_rtt_us: int
    rcv_space_bytes: int
    total_retrans: int
    pacing_rate_bytes_per_s: int | None = None
    max_pacing_rate_bytes_per_s: int | None = None
    bytes_acked: int | None = None
    bytes_received: int | None = None
    segs_out: int | None = None
    segs_in: int | None = None
    notsent_bytes: int | None = None
    min_rtt_us: int | None = None
    data_segs_in: int | None = None
    data_segs_out: int | None = None
    delivery_rate_bytes_per_s: int | None = None
    busy_time_us: int | None = None
    rwnd_limited_us: int | None = None
    sndbuf_limited_us: int | None = None
    delivered_pkts: int | None = None
    delivered_ce_pkts: int | None = None
    bytes_sent: int | None = None
    bytes_retrans: int | None = None
    dsack_dups: int | None = None
    reord_seen: int | None = None
    rcv_ooopack: int | None = None
    snd_wnd_bytes: int | None = None

    @property
    def state_name(self) -> str:
        return TCP_STATES[self.state] if self.state < len(TCP_STATES) else str(self.state)

    @property
    def delivery_rate_bps(self) -> float | None:
        """The kernel's delivery-rate estimate in bit/s."""
        d = self.delivery_rate_bytes_per_s
        return None if d is None else d * 8.0

    @property
    def pacing_rate_bps(self) -> float | None:
        p = self.pacing_rate_bytes_per_s
        return None if p is None else p * 8.0

    @property
    def delivery_rate_app_limited(self) -> bool:
        """True when the last delivery-rate sample was limited by the application, not the
        network: such samples underestimate the path."""
        return bool(self.app_limited_flags & 1)

    def as_event(self) -> dict[str, object]:
        """The ``tcp_info`` event's fields (agents/core/events.py schema)."""
        return {"bytes_acked": self.bytes_acked, "delivery_rate_bps": self.delivery_rate_bps,
                "rtt_us": self.rtt_us, "cwnd": self.snd_cwnd_pkts,
                "pacing_rate_bps": self.pacing_rate_bps, "total_retrans": self.total_retrans}


_REQUIRED = 104  # everything up to total_retrans has been in the struct since Linux 2.6


def parse_tcp_info(buf: bytes) -> TcpInfo:
    """Decode a ``struct tcp_info`` buffer as returned by ``getsockopt(TCP_INFO)``.

    Buffers shorter than the 104 bytes every kernel since 2.6 returns are an error; fields
    past the end of a longer-but-old buffer come back as None.
    """
    if len(buf) < _REQUIRED:
        raise ValueError(f"tcp_info buffer is {len(buf)} bytes; at least {_REQUIRED} expected")
    values: dict[str, int] = {}
    for name, offset, code in _FIELDS:
        end = offset + struct.calcsize("=" + code)
        if end > len(buf):
            break
        values[name] = struct.unpack_from("=" + code, buf, offset)[0]
    return TcpInfo(**values)  # type: ignore[arg-type]


def read_tcp_info(sock: socket.socket) -> TcpInfo:
    """``getsockopt(IPPROTO_TCP, TCP_INFO)`` of a connected TCP socket, parsed."""
    try:
        buf = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BUFSIZE)
    except OSError as e:
        raise OSError(e.errno, f"TCP_INFO on fd {sock.fileno()}: {e.strerror}") from e
    return parse_tcp_info(buf)


class RateSampler:
    """Turns successive ``(ts_ns, bytes_acked)`` readings into a rate r(t) (sans-I/O).

    The rate is the bytes acknowledged between two readings over the time between them,
    which is what the adaptive ratio calls r(t). The kernel's own ``delivery_rate`` is kept
    alongside (:attr:`delivery_rate_bps`) for logging and as a fallback before two readings
    exist.
    """

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None
        self.rate_bps: float | None = None
        self.delivery_rate_bps: float | None = None

    def reset(self) -> None:
        self._last = None
        self.rate_bps = None
        self.delivery_rate_bps = None

    def feed(self, ts_ns: int, bytes_acked: int,
             delivery_rate_bps: float | None = None) -> float | None:
        """Add a reading; returns the rate since the previous reading in bit/s (None for the
        first reading, or when the clock did not advance)."""
        if delivery_rate_bps is not None:
            self.delivery_rate_bps = delivery_rate_bps
        rate: float | None = None
        if self._last is not None:
            ts0, acked0 = self._last
            if ts_ns < ts0:
                raise ValueError(f"ts_ns={ts_ns} goes backwards (previous {ts0})")
            if bytes_acked < acked0:
                raise ValueError(f"bytes_acked={bytes_acked} went down (previous {acked0}); "
                                 f"a new connection needs reset()")
            if ts_ns == ts0:
                return None
            rate = (bytes_acked - acked0) * 8 * 1e9 / (ts_ns - ts0)
            self.rate_bps = rate
        self._last = (ts_ns, bytes_acked)
        return rate

    def feed_info(self, ts_ns: int, info: TcpInfo) -> float | None:
        """:meth:`feed` from a :class:`TcpInfo` (needs a kernel with bytes_acked, 4.1+)."""
        if info.bytes_acked is None:
            raise ValueError("this kernel's tcp_info has no bytes_acked (needs Linux 4.1+)")
        return self.feed(ts_ns, info.bytes_acked, info.delivery_rate_bps)

    @property
    def best_rate_bps(self) -> float | None:
        """The bytes_acked-delta rate, else the kernel's delivery rate."""
        return self.rate_bps if self.rate_bps is not None else self.delivery_rate_bps
