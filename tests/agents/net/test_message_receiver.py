"""wire.MessageReceiver: the PS's non-blocking reader, checked against the blocking
FrameReader it shares its checks with.

The same bytes, cut anywhere and delivered in any number of pieces, give the same
messages and the same final error as ``FrameReader.read_message``; an error never
swallows a message completed before it; a frame's bound is checked from its header
alone, before its payload has arrived.
"""

from __future__ import annotations

import select
import socket
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents.net import codec, wire
from agents.net.codec import FrameError, MsgType

TAG = codec.run_tag("receiver-test", b"s3cret")
Message = list[tuple[codec.FrameHeader, torch.Tensor]]


def encode(messages: list[list[torch.Tensor]], mac: codec.FrameMac | None = None) -> bytes:
    out = bytearray()
    for i, tensors in enumerate(messages):
        for b in wire.message_buffers(tensors, msg_type=MsgType.GRAD, run_tag=TAG, worker=2,
                                      iteration=7, chunk=i, mac=mac):
            out += b
    return bytes(out)


def same(a: list[Message], b: list[Message]) -> bool:
    return len(a) == len(b) and all(
        len(x) == len(y) and all(hx == hy and tx.dtype == ty.dtype and torch.equal(tx, ty)
                                 for (hx, tx), (hy, ty) in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True))


def blocking_read(data: bytes) -> tuple[list[Message], type[BaseException]]:
    """What the blocking FrameReader makes of ``data`` followed by EOF."""
    a, b = socket.socketpair()

    def write() -> None:
        with a:
            a.sendall(data)

    threading.Thread(target=write, daemon=True).start()
    reader = wire.FrameReader(b, max_payload_bytes=1 << 16)
    got: list[Message] = []
    try:
        while True:
            got.append(reader.read_message())
    except (FrameError, wire.ConnectionClosed) as e:
        return got, type(e)
    finally:
        b.close()


def receive_in_pieces(data: bytes, cuts: list[int]
                      ) -> tuple[list[Message], type[BaseException], list[int]]:
    """What the MessageReceiver makes of ``data`` sent in pieces at ``cuts`` with a
    ``receive`` after each, then EOF. Also returns how many messages each call gave."""
    a, b = socket.socketpair()
    b.setblocking(False)
    rx = wire.MessageReceiver(b, max_payload_bytes=1 << 16)
    got: list[Message] = []
    per_call: list[int] = []
    try:
        edges = [0, *sorted(set(c for c in cuts if 0 < c < len(data))), len(data)]
        pieces = [data[lo:hi] for lo, hi in zip(edges, edges[1:], strict=False)]
        for i in range(len(pieces) + 100):  # each piece, then EOF, then until the error
            if i < len(pieces):
                a.sendall(pieces[i])
            elif i == len(pieces):
                a.close()
            else:
                select.select([b], [], [], 5)
            try:
                done = rx.receive()
            except (FrameError, wire.ConnectionClosed) as e:
                return got, type(e), per_call
            per_call.append(len(done))
            got += done
        raise AssertionError("EOF never reported")
    finally:
        a.close()
        b.close()


def tensors_of(sizes: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kinds = [lambda n: torch.randn(n, generator=g),
             lambda n: torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32),
             lambda n: torch.randn(n, generator=g).half()]
    return [kinds[i % 3](n) for i, n in enumerate(sizes)]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=3), max_size=3),
       st.integers(0, 2**16), st.sampled_from(["intact", "flip", "truncate", "junk"]),
       st.integers(0, 10**6), st.lists(st.integers(0, 10**6), max_size=12))
def test_same_messages_and_error_as_the_blocking_reader(
        shapes: list[list[int]], seed: int, mutation: str, where: int,
        cuts: list[int]) -> None:
    data = encode([tensors_of(s, seed + i) for i, s in enumerate(shapes)])
    if data and mutation == "flip":
        i = where % len(data)
        data = data[:i] + bytes([data[i] ^ 0x5A]) + data[i + 1:]
    elif data and mutation == "truncate":
        data = data[:where % len(data)]
    elif mutation == "junk":
        data += bytes(range(where % 97))
    want, want_error = blocking_read(data)
    got, error, _ = receive_in_pieces(data, [c % (len(data) + 1) for c in cuts])
    assert same(got, want)
    assert error is want_error


def test_a_message_completes_on_its_last_byte_and_not_before() -> None:
    data = encode([[torch.arange(10.0), torch.arange(3, dtype=torch.int32)]])
    got, error, per_call = receive_in_pieces(data, list(range(1, len(data))))
    assert per_call[:len(data)] == [0] * (len(data) - 1) + [1]
    assert len(got) == 1 and torch.equal(got[0][0][1], torch.arange(10.0))
    assert error is wire.ConnectionClosed


def test_eof_between_two_parts_of_a_message_is_a_truncated_message() -> None:
    """EOF right after part 0 of a two-part message: a FrameError for both readers (only
    EOF between messages is a clean close)."""
    whole = encode([[torch.ones(3)], [torch.ones(4), torch.arange(2, dtype=torch.int32)]])
    cut = len(encode([[torch.ones(3)]])) + codec.HEADER_SIZE + 16  # after part 0
    want, want_error = blocking_read(whole[:cut])
    got, error, _ = receive_in_pieces(whole[:cut], [])
    assert len(want) == len(got) == 1
    assert want_error is error is FrameError


def test_an_error_after_a_message_comes_on_the_next_call() -> None:
    """A complete message followed by garbage in the same read: the message is returned,
    the error is raised by the next call, and again after that."""
    a, b = socket.socketpair()
    b.setblocking(False)
    a.sendall(encode([[torch.ones(4)]]) + b"GET / HTTP/1.1\r\n" + b"\0" * 64)
    rx = wire.MessageReceiver(b, peer="10.0.0.9:41000")
    try:
        assert len(rx.receive()) == 1
        for _ in range(2):
            with pytest.raises(FrameError, match="10.0.0.9:41000.*magic"):
                rx.receive()
    finally:
        a.close()
        b.close()


def test_the_bound_is_checked_from_the_header_alone() -> None:
    """A header announcing more than the receiver allows is refused before any of its
    payload has been sent (so nothing is allocated for it)."""
    seen: list[int] = []

    def bound(h: codec.FrameHeader) -> None:
        seen.append(h.payload_len)
        if h.payload_len > 1000:
            raise FrameError(f"{h.payload_len} bytes is more than chunk {h.chunk} may weigh")

    header, _ = codec.frame_for_tensor(torch.ones(1 << 20), msg_type=MsgType.GRAD,
                                       run_tag=TAG, worker=0, iteration=0, chunk=3)
    a, b = socket.socketpair()
    b.setblocking(False)
    a.sendall(header)  # the 4 MB payload never follows
    rx = wire.MessageReceiver(b, bound=bound)
    try:
        with pytest.raises(FrameError, match="4194304 bytes is more than chunk 3"):
            rx.receive()
        assert seen == [4 << 20]
    finally:
        a.close()
        b.close()


def test_frames_are_verified_under_the_connection_mac() -> None:
    """Sealed frames pass; the same bytes with one payload bit changed do not."""
    msgs = [[torch.arange(5.0)], [torch.ones(3), torch.arange(2, dtype=torch.int32)]]
    data = encode(msgs, mac=codec.FrameMac(b"m" * 32))
    for bad in (False, True):
        a, b = socket.socketpair()
        b.setblocking(False)
        raw = bytearray(data)
        if bad:
            raw[-1] ^= 1
        a.sendall(raw)
        a.close()
        rx = wire.MessageReceiver(b, mac=codec.FrameMac(b"m" * 32))
        try:
            got = rx.receive()
            assert len(got) == (1 if bad else 2)
            with pytest.raises(FrameError if bad else wire.ConnectionClosed):
                rx.receive()
        finally:
            b.close()


def test_one_call_reads_at_most_about_max_bytes() -> None:
    """A peer with a lot to say cannot hold the event loop: each call stops after about
    ``max_bytes`` and the message completes over later calls."""
    a, b = socket.socketpair()
    b.setblocking(False)
    payload = torch.arange(100_000, dtype=torch.float32)  # 400 KB
    done = threading.Event()

    def send() -> None:
        a.sendall(encode([[payload]]))
        done.set()

    threading.Thread(target=send, daemon=True).start()
    rx = wire.MessageReceiver(b, max_payload_bytes=1 << 20)
    calls = 0
    got: list[Message] = []
    try:
        while not got:
            select.select([b], [], [], 5)
            before = rx.bytes_read
            got = rx.receive(max_bytes=64 << 10)
            assert rx.bytes_read - before <= 64 << 10
            calls += 1
        assert calls >= 4 and torch.equal(got[0][0][1], payload)
        assert done.wait(5)
    finally:
        a.close()
        b.close()
