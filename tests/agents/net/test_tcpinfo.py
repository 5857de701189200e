"""TCP_INFO parsing and SO_MAX_PACING_RATE, checked against the running kernel over
loopback (no root, no Mininet) and against synthetic buffers."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from agents.net.pacing import (
    UNLIMITED,
    clear_max_pacing_rate,
    get_max_pacing_rate,
    rate_bps_to_bytes_per_s,
    set_max_pacing_rate,
)
from agents.net.tcpinfo import RateSampler, parse_tcp_info, read_tcp_info


class Sink:
    """A loopback TCP receiver that counts what it gets, in a thread."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.received = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while True:
                data = conn.recv(1 << 20)
                if not data:
                    break
                self.received += len(data)
        self.done.set()

    def wait_for(self, n_bytes: int, timeout_s: float = 10.0) -> float:
        """Block until ``n_bytes`` have arrived; returns the monotonic time they had."""
        deadline = time.monotonic() + timeout_s
        while self.received < n_bytes:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {self.received} of {n_bytes} bytes arrived")
            time.sleep(0.0005)
        return time.monotonic()


@pytest.fixture
def conn() -> Iterator[tuple[socket.socket, Sink]]:
    sink = Sink()
    sock = socket.create_connection(sink.listener.getsockname())
    try:
        yield sock, sink
    finally:
        sock.close()
        sink.thread.join(timeout=5)
        sink.listener.close()


def test_tcp_info_after_sending_10_mb(conn: tuple[socket.socket, Sink]) -> None:
    sock, sink = conn
    before = read_tcp_info(sock)
    assert before.state_name == "ESTABLISHED"
    payload = b"\x00" * 10_000_000
    sock.sendall(payload)
    sink.wait_for(len(payload))
    # The last ACK may trail the data by a moment.
    deadline = time.monotonic() + 2.0
    info = read_tcp_info(sock)
    while (info.bytes_acked or 0) < len(payload) and time.monotonic() < deadline:
        time.sleep(0.001)
        info = read_tcp_info(sock)
    assert info.bytes_acked is not None and info.bytes_acked >= len(payload)
    assert info.bytes_acked <= len(payload) + 1  # the SYN counts as one acknowledged byte
    assert info.rtt_us > 0 and info.snd_mss_bytes > 0 and info.snd_cwnd_pkts > 0
    assert info.min_rtt_us is not None and 0 < info.min_rtt_us <= info.rtt_us + info.rttvar_us
    assert info.delivery_rate_bps is not None and info.delivery_rate_bps > 0
    assert info.max_pacing_rate_bytes_per_s == UNLIMITED
    assert info.bytes_sent is None or info.bytes_sent >= len(payload)
    ev = info.as_event()
    assert ev["bytes_acked"] == info.bytes_acked and ev["cwnd"] == info.snd_cwnd_pkts


def test_pacing_rate_round_trip(conn: tuple[socket.socket, Sink]) -> None:
    sock, _ = conn
    assert get_max_pacing_rate(sock) == UNLIMITED
    assert set_max_pacing_rate(sock, 40e6) == 5_000_000  # the kernel wants bytes/s
    assert get_max_pacing_rate(sock) == 5_000_000
    assert read_tcp_info(sock).max_pacing_rate_bytes_per_s == 5_000_000
    set_max_pacing_rate(sock, 80e9)  # above 4 GB/s: needs the 64-bit form
    assert get_max_pacing_rate(sock) == 10_000_000_000
    clear_max_pacing_rate(sock)
    assert get_max_pacing_rate(sock) == UNLIMITED
    with pytest.raises(ValueError, match="rate_bps"):
        rate_bps_to_bytes_per_s(0)


def test_kernel_really_paces_at_40_mbit(conn: tuple[socket.socket, Sink]) -> None:
    # 5 MB at 40 Mbit/s (5 MB/s) should take 1 s; unpaced loopback takes a few ms.
    sock, sink = conn
    set_max_pacing_rate(sock, 40e6)
    payload = b"\x00" * 5_000_000
    t0 = time.monotonic()
    sock.sendall(payload)
    elapsed = sink.wait_for(len(payload)) - t0
    assert elapsed == pytest.approx(1.0, rel=0.15), f"5 MB took {elapsed:.3f} s"
    info = read_tcp_info(sock)
    assert info.pacing_rate_bps is not None and info.pacing_rate_bps <= 40e6


# -- sans-I/O parts ------------------------------------------------------------------------


def _buffer(size: int) -> bytes:
    buf = bytearray(size)
    buf[0] = 1  # ESTABLISHED
    struct.pack_into("=I", buf, 68, 1234)  # rtt_us
    struct.pack_into("=I", buf, 80, 42)  # snd_cwnd
    struct.pack_into("=I", buf, 100, 7)  # total_retrans
    if size >= 128:
        struct.pack_into("=Q", buf, 120, 10**10)  # bytes_acked
    if size >= 168:
        struct.pack_into("=Q", buf, 160, 12_500_000)  # delivery_rate, bytes/s
    return bytes(buf)


def test_parse_full_and_short_buffers() -> None:
    full = parse_tcp_info(_buffer(232))
    assert (full.state_name, full.rtt_us, full.snd_cwnd_pkts, full.total_retrans) == (
        "ESTABLISHED", 1234, 42, 7)
    assert full.bytes_acked == 10**10 and full.delivery_rate_bps == 100e6
    assert full.snd_wnd_bytes == 0
    old = parse_tcp_info(_buffer(104))  # a 3.x kernel: nothing past total_retrans
    assert old.rtt_us == 1234 and old.bytes_acked is None and old.delivery_rate_bps is None
    mid = parse_tcp_info(_buffer(160))  # 4.6: min_rtt but no delivery_rate yet
    assert mid.bytes_acked == 10**10 and mid.min_rtt_us == 0 and mid.delivery_rate_bps is None
    with pytest.raises(ValueError, match="at least 104"):
        parse_tcp_info(b"\x00" * 50)


def test_rate_sampler() -> None:
    s = RateSampler()
    assert s.feed(0, 0, delivery_rate_bps=8e6) is None
    assert s.best_rate_bps == 8e6  # only the kernel's estimate so far
    assert s.feed(100_000_000, 1_250_000) == pytest.approx(100e6)  # 1.25 MB in 100 ms
    assert s.feed(100_000_000, 1_300_000) is None  # no time passed
    assert s.feed(200_000_000, 1_875_000) == pytest.approx(50e6)
    assert s.best_rate_bps == pytest.approx(50e6)
    with pytest.raises(ValueError, match="backwards"):
        s.feed(100, 2_000_000)
    with pytest.raises(ValueError, match="went down"):
        s.feed(300_000_000, 10)
    s.reset()
    assert s.feed(5, 10) is None and s.rate_bps is None
