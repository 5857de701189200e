"""The error-queue reader of agents/net/txstamps.py on a real loopback TCP connection.

Why the reader is a thread: a transmit stamp waiting on the socket's error queue makes
``poll`` report POLLERR, so CPython's timed ``recv`` (poll, then a non-blocking recv that
says EAGAIN, then poll again) spins until the reply comes. These tests time that spin with
the waiting thread's own CPU clock: with stamps switched on and nobody reading them, a
300 ms wait burns a core for as long as it can get one (the control, which shows that the check can
fail); with the reader, it burns next to nothing.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from agents.net import wire
from agents.net.codec import MsgType
from agents.net.txstamps import FLAGS, SO_TIMESTAMPING, TxStampReader

WAIT_S = 0.3


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected loopback TCP pair: (the uploader with a timeout, the peer)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    up = socket.create_connection(lsock.getsockname(), timeout=5.0)
    peer, _ = lsock.accept()
    lsock.close()
    try:
        yield up, peer
    finally:
        up.close()
        peer.close()


@pytest.fixture
def stamped(pair: tuple[socket.socket, socket.socket]
            ) -> Iterator[tuple[TxStampReader, socket.socket, socket.socket]]:
    """A reader on the uploader of ``pair``: (reader, uploader, peer); closed afterwards."""
    up, peer = pair
    reader = TxStampReader(up)
    try:
        yield reader, up, peer
    finally:
        reader.close()


def _upload(up: socket.socket, writes: int, size: int = 1000) -> int:
    for _ in range(writes):
        up.sendall(b"x" * size)
    return writes * size


def _write(reader: TxStampReader, up: socket.socket, writes: int, size: int = 1000) -> None:
    """``_upload`` through ``reader``: each write reported with the time it was begun."""
    for _ in range(writes):
        begun_ns = time.time_ns()
        reader.wrote(_upload(up, 1, size), begun_ns)


def _reply_after(peer: socket.socket, n_bytes: int, delay_s: float) -> threading.Thread:
    """The peer reads the upload, waits ``delay_s`` and answers one byte."""
    def serve() -> None:
        got = 0
        while got < n_bytes:
            got += len(peer.recv(1 << 16))
        time.sleep(delay_s)
        peer.sendall(b"!")
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def _cpu_of_timed_recv(up: socket.socket) -> tuple[float, float]:
    """(CPU seconds, wall seconds) this thread spends in one timed recv of the reply."""
    cpu0, wall0 = time.thread_time(), time.monotonic()
    assert up.recv(1) == b"!"
    return time.thread_time() - cpu0, time.monotonic() - wall0


def test_pending_stamps_make_a_timed_recv_spin_without_the_reader(
        pair: tuple[socket.socket, socket.socket]) -> None:
    up, peer = pair
    up.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, FLAGS)
    server = _reply_after(peer, _upload(up, 20), WAIT_S)
    cpu_s, wall_s = _cpu_of_timed_recv(up)
    server.join()
    assert wall_s >= WAIT_S * 0.9
    assert cpu_s > 0.2 * wall_s, (cpu_s, wall_s)


def test_kernel_timeouts_keep_a_recv_asleep_while_stamps_pile_up(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """The worker's socket: the kernel's own timeouts (wire.set_kernel_timeouts), so the
    thread waiting for the PS's reply blocks in the kernel, which pending stamps do not
    wake into user space. The same pile of unread stamps as in the test above (the
    control) costs the waiting thread next to nothing."""
    up, peer = pair
    wire.set_kernel_timeouts(up, 5.0)
    up.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, FLAGS)
    server = _reply_after(peer, _upload(up, 20), WAIT_S)
    cpu_s, wall_s = _cpu_of_timed_recv(up)
    server.join()
    assert wall_s >= WAIT_S * 0.9
    assert cpu_s < 0.05 * wall_s, (cpu_s, wall_s)


def test_the_reader_works_on_a_socket_with_kernel_timeouts(
        pair: tuple[socket.socket, socket.socket]) -> None:
    """The reader's duplicate descriptor shares the socket's open file: it must not make
    the worker's blocking socket non-blocking (a recv would then fail at once)."""
    up, peer = pair
    wire.set_kernel_timeouts(up, 5.0)
    reader = TxStampReader(up)
    try:
        reader.start_upload()
        _write(reader, up, 5)
        assert [s.key for s in reader.collect(limit_s=2.0)][-1] == 4999
        server = _reply_after(peer, 5000, WAIT_S)
        _cpu_s, wall_s = _cpu_of_timed_recv(up)
        server.join()
        assert wall_s >= WAIT_S * 0.9
    finally:
        reader.close()


def test_the_reader_keeps_a_timed_recv_asleep_and_collects_each_upload(
        stamped: tuple[TxStampReader, socket.socket, socket.socket]) -> None:
    reader, up, peer = stamped
    reader.start_upload()
    for _ in range(20):
        _write(reader, up, 1)
    stamps = reader.collect(limit_s=2.0)
    # A pair per packet, keyed by the last byte of a write (writes TCP merged into one
    # packet share the later key), in key order, ending with the upload's last byte.
    keys = [s.key for s in stamps]
    assert keys == sorted(set(keys)) and keys[-1] == 19_999 and len(keys) >= 5
    assert set(keys) <= {1000 * (i + 1) - 1 for i in range(20)}
    assert all(s.snd_ns >= s.sched_ns for s in stamps)
    # The next upload's stamps arrive while the main thread waits for the reply.
    reader.start_upload()
    for _ in range(20):
        _write(reader, up, 1)
    server = _reply_after(peer, 40 * 1000, WAIT_S)
    cpu_s, wall_s = _cpu_of_timed_recv(up)
    server.join()
    assert wall_s >= WAIT_S * 0.9
    assert cpu_s < 0.05 * wall_s, (cpu_s, wall_s)
    later = [s.key for s in reader.collect(limit_s=2.0)]
    assert later and later[0] >= 20_000 and later[-1] == 39_999


def test_collect_waits_for_the_last_departure_and_forgets_what_it_returned(
        stamped: tuple[TxStampReader, socket.socket, socket.socket]) -> None:
    reader, up, _peer = stamped
    reader.start_upload()
    t0 = time.time_ns()
    _write(reader, up, 1, 5000)
    first = reader.collect(limit_s=2.0)
    assert first and first[-1].key == 4999
    assert reader.collect(limit_s=0.05) == []  # nothing new: returned once, then forgotten
    assert [w.key for w in reader.writes] == [0]
    assert t0 <= reader.writes[0].ts_ns <= first[-1].sched_ns  # begun before it left
    reader.start_upload()
    assert reader.upload_from == 5000 and reader.writes == []
    _write(reader, up, 2, 700)
    reader.wrote(0, time.time_ns())  # an empty write holds no byte: not a write
    assert [w.key for w in reader.writes] == [5000, 5700]


def test_close_stops_the_thread_and_a_closed_reader_does_not_wait(
        pair: tuple[socket.socket, socket.socket]) -> None:
    up, _peer = pair
    reader = TxStampReader(up)
    thread = next(t for t in threading.enumerate() if t.name == "tx-stamps" and t.is_alive())
    reader.close()
    assert not thread.is_alive()
    reader.start_upload()
    _write(reader, up, 1)
    t0 = time.monotonic()
    assert reader.collect(limit_s=5.0) == []  # the thread is gone: no stamp will come
    assert time.monotonic() - t0 < 1.0


def test_keys_count_the_bytes_written_since_the_option_was_set(
        pair: tuple[socket.socket, socket.socket]) -> None:
    up, _peer = pair
    _upload(up, 3, 700)  # written before stamping starts: not in the key space
    reader = TxStampReader(up)
    try:
        reader.start_upload()
        _write(reader, up, 1, 300)
        stamps = reader.collect(limit_s=2.0)
        assert [s.key for s in stamps] == [299]
    finally:
        reader.close()


def test_a_chunks_frames_leave_in_one_write(
        stamped: tuple[TxStampReader, socket.socket, socket.socket]) -> None:
    """wire.send_message gathers a compressed chunk's frames (values, indices) into one
    sendmsg: the kernel stamps the last byte of each write, so one write gives one key at
    the message's end. Written frame by frame, the first frame's end (100 KB in, another
    packet) would carry a key of its own."""
    reader, up, peer = stamped
    values, indices = torch.zeros(25_000), torch.zeros(25_000, dtype=torch.int32)
    server = _reply_after(peer, 2 * 100_000, 0.0)
    reader.start_upload()
    begun_ns = time.time_ns()
    n = wire.send_message(up, [values, indices], msg_type=MsgType.GRAD, run_tag=1,
                          worker=0, iteration=0, chunk=0)
    reader.wrote(n, begun_ns)
    assert n > 200_000
    assert [s.key for s in reader.collect(limit_s=2.0)] == [n - 1]
    server.join()
