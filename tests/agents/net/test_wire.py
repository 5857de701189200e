"""Socket tests of agents/net/wire.py over real socketpairs and real TCP loopback
connections (threads): multi-part messages survive byte-exactly, partial sends and
reads resume correctly, truncation and clean closes raise the right errors."""

from __future__ import annotations

import fcntl
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from agents.net import codec, wire
from agents.net.codec import (
    HEADER_SIZE,
    FrameError,
    MsgType,
    buffer_address,
    frame_for_tensor,
    run_tag,
)
from agents.net.wire import (
    ConnectionClosed,
    FrameReader,
    FrameWriter,
    read_message,
    send_frame,
    send_message,
    send_tensor,
    set_kernel_timeouts,
    set_socket_options,
)

TAG = run_tag("wire-test", b"s3cret")
TIMEOUT_S = 20.0


def messages() -> list[list[torch.Tensor]]:
    """Several chunks' messages: dense, compressed multi-part, odd sizes, empty, 10 MB."""
    g = torch.Generator().manual_seed(1234)
    return [
        [torch.randn(10 * 2**20 // 4, generator=g)],  # 10 MB dense float32
        [torch.randn(1001, generator=g).half(),  # top-k: values, indices, scales
         torch.randint(0, 2**40, (1001,), generator=g),
         torch.randn(3, generator=g).bfloat16()],
        [torch.randint(0, 2, (77,), generator=g).bool(), torch.empty(0),
         torch.randint(-128, 127, (5,), generator=g, dtype=torch.int8)],
        [torch.randn(12345, generator=g).double(),
         torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8),
         torch.randint(-2**15, 2**15 - 1, (9,), generator=g, dtype=torch.int16),
         torch.randint(-2**31, 2**31 - 1, (11,), generator=g, dtype=torch.int32)],
    ]


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.reshape(-1).view(torch.uint8).numpy())


@contextmanager
def tcp_pair(sndbuf: int | None = None, rcvbuf: int | None = None
             ) -> Iterator[tuple[socket.socket, socket.socket]]:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    set_socket_options(cli, sndbuf=sndbuf)
    cli.settimeout(TIMEOUT_S)
    cli.connect(srv.getsockname())
    conn, _ = srv.accept()
    srv.close()
    set_socket_options(conn, rcvbuf=rcvbuf)
    conn.settimeout(TIMEOUT_S)
    try:
        yield cli, conn
    finally:
        cli.close()
        conn.close()


@contextmanager
def unix_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    a.settimeout(TIMEOUT_S)
    b.settimeout(TIMEOUT_S)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def in_thread(fn: Callable[[], Any]) -> Callable[[], None]:
    """Run fn in a thread; the returned join() re-raises its exception."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in join
            err.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()

    def join() -> None:
        th.join(TIMEOUT_S)
        assert not th.is_alive(), "sender thread hung"
        if err:
            raise err[0]
    return join


def exchange(sender: Any, receiver: socket.socket) -> None:
    msgs = messages()

    def send() -> None:
        for i, m in enumerate(msgs):
            send_message(sender, m, msg_type=MsgType.GRAD, run_tag=TAG, worker=3,
                         iteration=42, chunk=i)
        sender.shutdown(socket.SHUT_WR)

    join = in_thread(send)
    reader = FrameReader(receiver, expect_tag=TAG)
    got = [read_message(reader) for _ in msgs]
    with pytest.raises(ConnectionClosed, match="closed by peer after 11 frames"):
        reader.read_message()
    join()
    for i, (m, g) in enumerate(zip(msgs, got, strict=True)):
        assert len(g) == len(m)
        for j, (t, (h, r)) in enumerate(zip(m, g, strict=True)):
            assert (h.chunk, h.part, h.nparts, h.worker, h.iteration) == (i, j, len(m), 3, 42)
            assert r.dtype == t.dtype and r.shape == (t.numel(),)
            assert bits(r) == bits(t)
    # Each received tensor owns distinct memory (not a view of a shared buffer).
    ptrs = [r.data_ptr() for g in got for _, r in g if r.numel()]
    assert len(set(ptrs)) == len(ptrs)


def test_messages_over_socketpair() -> None:
    with unix_pair() as (a, b):
        exchange(a, b)


def test_messages_over_tcp_loopback() -> None:
    with tcp_pair() as (a, b):
        set_socket_options(a, nodelay=True)
        assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        exchange(a, b)


class Counting:
    """A pass-through socket that counts sendmsg calls the kernel only partly accepted."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.partial = 0

    def sendmsg(self, bufs: list[memoryview], *rest: Any) -> int:
        n = self.sock.sendmsg(bufs, *rest)
        self.partial += n < sum(len(b) for b in bufs)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_messages_over_tcp_with_small_buffers() -> None:
    # A small send buffer makes the kernel take the 10 MB payload in many partial
    # sendmsg calls. (4 KiB on both ends also works but crawls: the tiny window
    # meets delayed ACKs, ~6 s per 10 MB.)
    with tcp_pair(sndbuf=8192, rcvbuf=65536) as (a, b):
        assert a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) <= 32768
        tx = Counting(a)
        exchange(tx, b)
    assert tx.partial > 10


class Dribble:
    """A socket whose sendmsg/recv_into move at most `step` bytes per call, so every
    partial-transfer branch runs deterministically."""

    def __init__(self, sock: socket.socket, step: int) -> None:
        self.sock, self.step = sock, step
        self.calls = 0
        self.addrs: list[int] = []

    def sendmsg(self, bufs: list[memoryview], *rest: Any) -> int:
        self.calls += 1
        out, left = [], self.step
        for b in bufs:
            if left == 0:
                break
            out.append(b[:left])
            left -= len(out[-1])
        return self.sock.sendmsg(out, *rest)

    def recv_into(self, mv: memoryview, n: int = 0) -> int:
        self.calls += 1
        if len(mv):
            self.addrs.append(buffer_address(mv))
        return self.sock.recv_into(mv, min(n or len(mv), self.step))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


@pytest.mark.parametrize("step", [1, 7, 63, 65, 1000])
def test_partial_sends_and_reads(step: int) -> None:
    t = torch.arange(300, dtype=torch.int64)
    s = torch.randn(50).bfloat16()
    with unix_pair() as (a, b):
        tx: Any = Dribble(a, step)
        join = in_thread(lambda: send_message(tx, [t, s], msg_type=MsgType.UPDATE, run_tag=TAG,
                                              worker=1, iteration=2, chunk=3))
        rx: Any = Dribble(b, step)
        reader = FrameReader(rx, expect_tag=TAG)
        (h0, r0), (h1, r1) = reader.read_message()
        join()
    assert torch.equal(r0, t) and bits(r1) == bits(s)
    # The payloads were received straight into the returned tensors' storage.
    assert r0.data_ptr() in rx.addrs and r1.data_ptr() in rx.addrs
    total = 2 * HEADER_SIZE + t.numel() * 8 + s.numel() * 2
    assert tx.calls >= total // step
    assert reader.bytes_read == total


def test_send_frame_returns_bytes_and_does_not_copy() -> None:
    t = torch.randn(1000)
    hb, mv = frame_for_tensor(t, msg_type=MsgType.WEIGHTS, run_tag=TAG, worker=0,
                              iteration=0, chunk=0)
    assert buffer_address(mv) == t.data_ptr()
    with unix_pair() as (a, b):
        join = in_thread(lambda: send_frame(a, hb, mv))
        h, payload = FrameReader(b).read_frame(TAG)
        join()
    assert bytes(payload) == bits(t) and h.numel == 1000


def test_read_frame_reuses_buffer_and_read_frame_into() -> None:
    with unix_pair() as (a, b):
        def send() -> None:
            for n in (100, 50, 400):
                send_tensor(a, torch.full((n,), float(n)), msg_type=MsgType.GRAD,
                            run_tag=TAG, worker=0, iteration=0, chunk=n)
            send_tensor(a, torch.ones(4), msg_type=MsgType.GRAD, run_tag=TAG, worker=0,
                        iteration=0, chunk=9)
        join = in_thread(send)
        reader = FrameReader(b, expect_tag=TAG)
        _, p1 = reader.read_frame()
        addr1 = buffer_address(p1)
        _, p2 = reader.read_frame()
        assert buffer_address(p2) == addr1  # smaller frame: same buffer, no allocation
        assert np.all(np.frombuffer(p2, np.float32) == 50.0)
        _, p3 = reader.read_frame()  # larger: a new buffer; old views stay valid
        assert np.all(np.frombuffer(p3, np.float32) == 400.0)
        mine = bytearray(64)
        h, p4 = reader.read_frame_into(mine)
        assert buffer_address(p4) == buffer_address(memoryview(mine)) and len(p4) == 16
        assert h.chunk == 9
        join()


def test_caller_buffer_too_small() -> None:
    with unix_pair() as (a, b):
        join = in_thread(lambda: send_tensor(a, torch.ones(10), msg_type=MsgType.GRAD,
                                             run_tag=TAG, worker=0, iteration=0, chunk=0))
        with pytest.raises(FrameError, match="buffer of 8 bytes too small for payload_len 40"):
            FrameReader(b).read_frame_into(bytearray(8))
        join()


def test_truncated_payload_names_peer_and_progress() -> None:
    hb, mv = frame_for_tensor(torch.zeros(1000), msg_type=MsgType.GRAD, run_tag=TAG,
                              worker=4, iteration=5, chunk=6)
    with tcp_pair() as (a, b):
        a.sendall(hb + bytes(mv[:1234]))
        a.close()
        peer = f"127.0.0.1:{a_port(b)}"
        with pytest.raises(FrameError, match=(
                f"{peer}: truncated frame \\(payload of GRAD worker=4 iter=5 chunk=6 "
                "part=0/1\\): connection closed after 1234 of 4000 bytes")):
            FrameReader(b, expect_tag=TAG).read_frame()


def a_port(conn: socket.socket) -> int:
    return int(conn.getpeername()[1])


def test_truncated_header_on_stream() -> None:
    hb, _ = frame_for_tensor(torch.zeros(2), msg_type=MsgType.GRAD, run_tag=TAG, worker=0,
                             iteration=0, chunk=0)
    with unix_pair() as (a, b):
        a.sendall(hb[:10])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="truncated frame \\(header\\).*after 10 of 64"):
            FrameReader(b).read_frame()


def test_clean_close_raises_connection_closed() -> None:
    with tcp_pair() as (a, b):
        a.close()
        with pytest.raises(ConnectionClosed, match="127.0.0.1:.*closed by peer after 0 frames"):
            FrameReader(b).read_message()


def test_wrong_secret_rejected_with_peer() -> None:
    other = run_tag("wire-test", b"not-the-secret")
    with tcp_pair() as (a, b):
        send_tensor(a, torch.ones(3), msg_type=MsgType.HELLO, run_tag=other, worker=0,
                    iteration=0, chunk=0)
        with pytest.raises(FrameError, match="127.0.0.1:\\d+: frame 0: run_tag.*wrong secret"):
            FrameReader(b, expect_tag=TAG).read_frame()


def test_garbage_stream_rejected() -> None:
    with unix_pair() as (a, b):
        a.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"\0" * 64)
        with pytest.raises(FrameError, match="magic: got b'GET '"):
            FrameReader(b).read_frame()


def test_inconsistent_message_parts_rejected() -> None:
    with unix_pair() as (a, b):
        send_tensor(a, torch.ones(2), msg_type=MsgType.GRAD, run_tag=TAG, worker=0,
                    iteration=0, chunk=0, part=0, nparts=2)
        send_tensor(a, torch.ones(2), msg_type=MsgType.GRAD, run_tag=TAG, worker=0,
                    iteration=0, chunk=1, part=1, nparts=2)
        with pytest.raises(FrameError, match="chunk: part 1 has 1, message started with 0"):
            FrameReader(b).read_message()
    with unix_pair() as (a, b):
        send_tensor(a, torch.ones(2), msg_type=MsgType.GRAD, run_tag=TAG, worker=0,
                    iteration=0, chunk=0, part=1, nparts=2)
        with pytest.raises(FrameError, match="part: message starts at part 1"):
            FrameReader(b).read_message()


def test_send_error_names_peer() -> None:
    with tcp_pair() as (a, b):
        b.close()
        writer = FrameWriter(a, run_tag=TAG, worker=2)
        big = torch.zeros(4 * 2**20)
        with pytest.raises(OSError) as ei:
            for i in range(50):  # the first sends may still land in the socket buffer
                writer.send_message([big], msg_type=MsgType.GRAD, iteration=i, chunk=0)
        assert writer.frames_sent < 50
        assert any("while sending a frame to 127.0.0.1:" in n
                   for n in getattr(ei.value, "__notes__", []))


def test_socket_options() -> None:
    with tcp_pair() as (a, _):
        set_socket_options(a, congestion="reno", sndbuf=65536, rcvbuf=65536)
        cc = a.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16)
        assert cc.rstrip(b"\0") == b"reno"
        with pytest.raises(ValueError, match="congestion: 'no-such-cc' rejected.*available"):
            set_socket_options(a, congestion="no-such-cc")
        with pytest.raises(ValueError, match="sndbuf"):
            set_socket_options(a, sndbuf=0)
    with unix_pair() as (u, _):
        set_socket_options(u)  # nodelay silently skipped on a Unix socket
        with pytest.raises(ValueError, match="congestion.*needs a TCP socket"):
            set_socket_options(u, congestion="reno")


def test_read_message_into_caller_tensors() -> None:
    vals, idx = torch.randn(100), torch.arange(100, dtype=torch.int64)
    out = [torch.zeros(128), torch.zeros(128, dtype=torch.int64)]
    with unix_pair() as (a, b):
        for it in range(2):
            send_message(a, [vals * it, idx], msg_type=MsgType.GRAD, run_tag=TAG, worker=0,
                         iteration=it, chunk=0)
        reader = FrameReader(b, expect_tag=TAG)
        for it in range(2):
            (_, v), (_, i) = reader.read_message(out=out)
            assert v.data_ptr() == out[0].data_ptr() and i.data_ptr() == out[1].data_ptr()
            assert torch.equal(v, vals * it) and torch.equal(i, idx)
        send_message(a, [vals], msg_type=MsgType.GRAD, run_tag=TAG, worker=0, iteration=0,
                     chunk=0)
        with pytest.raises(FrameError, match="out: torch.float16 tensor of 128 elements"):
            reader.read_message(out=[torch.zeros(128).half()])


def test_send_frame_reports_progress_as_the_kernel_takes_bytes() -> None:
    """With ``progress``, a frame larger than the socket buffers is reported piece by
    piece as the reader drains it, and the pieces add up to the frame."""
    t = torch.randn(2_000_000)  # 8 MB
    hb, mv = frame_for_tensor(t, msg_type=MsgType.WEIGHTS, run_tag=TAG, worker=0,
                              iteration=0, chunk=0)
    pieces: list[int] = []
    with unix_pair() as (a, b):
        join = in_thread(lambda: send_frame(a, hb, mv, progress=pieces.append))
        h, payload = FrameReader(b).read_frame(TAG)
        join()
    assert bytes(payload) == bits(t) and h.numel == t.numel()
    assert sum(pieces) == HEADER_SIZE + t.numel() * 4
    assert len(pieces) > 1 and all(p > 0 for p in pieces)


SIOCOUTQNSD = 0x894B  # linux/sockios.h: bytes in the send queue not yet sent


@pytest.mark.parametrize("lowat", [None, 16_384])
def test_notsent_lowat_bounds_what_a_blocked_write_parks_in_the_kernel(lowat: int | None
                                                                        ) -> None:
    """With TCP_NOTSENT_LOWAT a blocking write waits while the kernel holds that many
    unsent bytes; without it an 8 MB send buffer takes megabytes the peer cannot yet
    accept. The worker relies on this under the adaptive policy (agents/core/config.py
    ``adaptive.notsent_lowat_bytes``): "sent" must mean sent, not buffered."""
    total = 6 << 20
    with tcp_pair(sndbuf=4 << 20, rcvbuf=65_536) as (a, b):
        set_socket_options(a, notsent_lowat=lowat)
        writer = threading.Thread(target=a.sendall, args=(bytes(total),))
        writer.start()
        time.sleep(0.5)  # the peer reads nothing: its window closes, the writer blocks
        unsent = struct.unpack("i", fcntl.ioctl(a.fileno(), SIOCOUTQNSD, b"\0" * 4))[0]
        got = 0
        while got < total:
            got += len(b.recv(1 << 20))
        writer.join(TIMEOUT_S)
    assert got == total
    if lowat is None:
        assert unsent > 1 << 20
    else:
        assert unsent <= lowat + 65_536 + 4096, unsent  # the bound plus one GSO segment


def test_notsent_lowat_rejected_off_tcp() -> None:
    with unix_pair() as (u, _):
        with pytest.raises(ValueError, match="notsent_lowat.*needs a TCP socket"):
            set_socket_options(u, notsent_lowat=16_384)
    with tcp_pair() as (a, _):
        with pytest.raises(ValueError, match="notsent_lowat: 0 bytes"):
            set_socket_options(a, notsent_lowat=0)


def test_kernel_timeouts_name_the_peer_on_either_side() -> None:
    """set_kernel_timeouts (the worker's data socket): the kernel's SO_RCVTIMEO and
    SO_SNDTIMEO replace Python's timeout, and running out of either is a TimeoutError that
    names the peer, as a Python timeout is."""
    with tcp_pair(sndbuf=65_536, rcvbuf=65_536) as (a, b):
        set_kernel_timeouts(b, 0.3)
        assert b.gettimeout() is None
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"127\.0\.0\.1:\d+: receive timed out") as ei:
            FrameReader(b, expect_tag=TAG).read_frame()
        assert 0.25 <= time.monotonic() - t0 < 3.0
        assert any("while reading header from 127.0.0.1:" in n
                   for n in getattr(ei.value, "__notes__", []))
        set_kernel_timeouts(a, 0.3)
        writer = FrameWriter(a, run_tag=TAG, worker=1)
        with pytest.raises(TimeoutError, match=r"127\.0\.0\.1:\d+: send timed out") as ei:
            writer.send_message([torch.zeros(4 * 2**20)], msg_type=MsgType.GRAD,
                                iteration=0, chunk=0)
        assert any("bytes sent" in n for n in getattr(ei.value, "__notes__", []))
        with pytest.raises(ValueError, match="timeout_s=0"):
            set_kernel_timeouts(a, 0)


def test_message_buffers_with_precomputed_crcs_are_the_same_bytes() -> None:
    """The PS frames one chunk for every worker with the CRCs computed once: the bytes
    are those framing computes itself, and a CRC that does not match is caught."""
    gen = torch.Generator().manual_seed(3)
    parts = [torch.randn(1000, generator=gen), torch.arange(50, dtype=torch.int32)]
    kw = dict(msg_type=codec.MsgType.WEIGHTS, run_tag=7, worker=2, iteration=1, chunk=0)
    plain = b"".join(bytes(b) for b in wire.message_buffers(parts, **kw))
    crcs = wire.payload_crcs(parts)
    assert b"".join(bytes(b) for b in wire.message_buffers(parts, crcs=crcs, **kw)) == plain
    with pytest.raises(ValueError, match="crcs"):
        wire.message_buffers(parts, crcs=crcs[:1], **kw)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"".join(bytes(x) for x in wire.message_buffers(
            parts, crcs=[crcs[0] ^ 1, crcs[1]], **kw)))
        with pytest.raises(codec.FrameError, match="payload_crc"):
            wire.FrameReader(b).read_message()
