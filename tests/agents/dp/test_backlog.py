"""Downlink link/N with catch-up: the pure split (invariants) and the PS applying it to
real sockets (``SO_MAX_PACING_RATE`` read back from the kernel, backlog from SIOCOUTQ)."""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time

import pytest
import torch

from agents.core.policies.backlog import backlog_shares
from agents.dp.ps import ParameterServer, _Conn
from agents.net import codec, wire
from agents.net.pacing import get_max_pacing_rate
from controller.loopback.dp import any_session, make_run_dir, ps_keys

CASES = [
    {0: 100, 1: 100, 2: 100},
    {0: 300, 1: 100},
    {0: 1, 1: 10_000_000, 2: 5_000_000, 3: 0},
    {0: 0, 1: 0},
    {7: 42},
    {i: i * 1000 for i in range(16)},
]


@pytest.mark.parametrize("backlog", CASES)
@pytest.mark.parametrize("min_fraction", [0.0, 0.25, 1.0])
def test_shares_sum_to_the_total_and_respect_the_floor(backlog, min_fraction) -> None:
    total = 100e6
    out = backlog_shares(total, backlog, min_fraction=min_fraction)
    assert set(out) == set(backlog)
    assert sum(out.values()) == pytest.approx(total)
    equal = total / len(backlog)
    assert all(r >= min_fraction * equal * (1 - 1e-9) for r in out.values())
    # More backlog never gets less rate.
    by_backlog = sorted(backlog, key=lambda c: backlog[c])
    rates = [out[c] for c in by_backlog]
    assert rates == sorted(rates) or max(rates) - min(rates) < 1e-6 * total


def test_equal_backlogs_are_exactly_link_over_n() -> None:
    out = backlog_shares(100e6, {w: 125_000 for w in range(16)})
    assert all(r == pytest.approx(6.25e6) for r in out.values())


def test_a_laggard_gets_rate_in_proportion_to_what_it_still_has() -> None:
    # w0 has 3x the bytes left: it gets 3x the rate and all finish together.
    out = backlog_shares(80e6, {0: 300_000, 1: 100_000, 2: 100_000, 3: 100_000}, min_fraction=0)
    assert out[0] == pytest.approx(40e6)
    assert out[1] == pytest.approx(out[2]) == pytest.approx(out[3]) == pytest.approx(40e6 / 3)
    finish = {c: b / out[c] for c, b in {0: 300_000, 1: 100_000}.items()}
    assert finish[0] == pytest.approx(finish[1])


def test_a_drained_connection_keeps_the_floor() -> None:
    out = backlog_shares(100e6, {0: 0, 1: 500_000}, min_fraction=0.25)
    assert out[0] == pytest.approx(0.25 * 50e6)
    assert out[1] == pytest.approx(100e6 - 12.5e6)


@pytest.mark.parametrize("bad", [
    dict(total_bps=0.0, backlog_bytes={0: 1}),
    dict(total_bps=1e6, backlog_bytes={0: -1}),
    dict(total_bps=1e6, backlog_bytes={0: 1}, min_fraction=1.5),
])
def test_bad_arguments_are_named(bad) -> None:
    with pytest.raises(ValueError, match="total_bps|backlog_bytes\\[0\\]|min_fraction"):
        backlog_shares(**bad)


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        cli = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
    return cli, peer


def _close(ps: ParameterServer, *socks: socket.socket) -> None:
    """Tear down a test's sockets and its in-process PS (listening socket, event log)."""
    for sock in socks:
        sock.close()
    ps.srv.close()
    ps.loop.close()
    ps.log.close()


def test_ps_repaces_its_sockets_by_backlog(tmp_path) -> None:
    run_dir, cfg = make_run_dir(tmp_path, ['shaping.method="tc"', "net.workers=2"])
    ps = ParameterServer(cfg, run_dir, run_dir.name, ps_keys(run_dir), host="127.0.0.1", port=0)
    pairs = [_pair(), _pair()]
    try:
        for w, (cli, _) in enumerate(pairs):
            ps.conns[w] = _Conn(w, cli, f"test:{w}", any_session(run_dir, w))
            ps.active.add(w)
            ps.pacer.pacing_bps[w] = 50e6  # the controller's B_down / N, B_down = 100 Mbit/s
        # w0: 400 KB its peer does not read (what the peer's kernel has not acknowledged
        # stays in SIOCOUTQ) plus 200 KB queued in user space; w1: 200 KB queued.
        pairs[0][0].sendall(b"x" * 400_000)
        in_kernel = ps.conns[0].backlog_bytes()
        assert 300_000 < in_kernel <= 400_000  # the peer's receive buffer acked the rest
        ps.conns[0].queued_bytes = 200_000
        ps.conns[1].queued_bytes = 200_000
        rates = ps.pacer.rebalance(ps.conns, ps.active)
        share0 = 100e6 * (in_kernel + 200_000) / (in_kernel + 400_000)
        assert rates[0] == pytest.approx(share0, rel=0.01)
        assert rates[1] == pytest.approx(100e6 - share0, rel=0.01)
        assert get_max_pacing_rate(pairs[0][0]) == round(rates[0] / 8)
        assert get_max_pacing_rate(pairs[1][0]) == round(rates[1] / 8)
        assert ps.pacer.rebalanced == 2
        # The peer of w0 read everything (w0 has its 200 KB queued left) and w1's event
        # loop wrote its 200 KB into the kernel: about equal again.
        ps.conns[1].written_bytes = 200_000
        pairs[1][0].sendall(b"y" * 200_000)
        got = 0
        while got < 400_000:
            got += len(pairs[0][1].recv(1 << 20))
        left = {w: ps.conns[w].backlog_bytes() for w in (0, 1)}
        assert left[0] == 200_000 and 100_000 < left[1] <= 200_000
        rates = ps.pacer.rebalance(ps.conns, ps.active)
        assert rates[0] == pytest.approx(100e6 * left[0] / (left[0] + left[1]), rel=0.01)
        assert get_max_pacing_rate(pairs[1][0]) == round(rates[1] / 8)
        # A change within 2 % leaves the sockets alone.
        before = ps.pacer.rebalanced
        ps.conns[0].queued_bytes += 1_000
        ps.pacer.rebalance(ps.conns, ps.active)
        assert ps.pacer.rebalanced == before
    finally:
        _close(ps, *(s for pair in pairs for s in pair))


def test_no_rebalance_without_downlink_pacing(tmp_path) -> None:
    run_dir, cfg = make_run_dir(tmp_path, ["net.workers=2"])
    ps = ParameterServer(cfg, run_dir, run_dir.name, ps_keys(run_dir), host="127.0.0.1", port=0)
    a, b = _pair()
    try:
        ps.conns[0] = _Conn(0, a, "test:0", any_session(run_dir, 0))
        ps.conns[1] = _Conn(1, b, "test:1", any_session(run_dir, 1))
        ps.active |= {0, 1}
        assert ps.pacer.rebalance(ps.conns, ps.active) == {}
    finally:
        _close(ps, a, b)


def test_backlog_counts_a_half_written_message_once(tmp_path) -> None:
    """The PS queues a 32 MB message its peer does not read: the kernel takes what fits
    and the rest waits in user space. Every byte not yet in the peer's receive queue is
    then backlog, exactly once: the unsent rest of the message plus the kernel's
    SIOCOUTQ. Once the peer reads, the event loop writes the rest and the backlog is 0."""
    run_dir, cfg = make_run_dir(tmp_path, ["net.workers=1"])
    ps = ParameterServer(cfg, run_dir, run_dir.name, ps_keys(run_dir), host="127.0.0.1", port=0)
    cli, peer = _pair()
    cli.setblocking(False)
    conn = _Conn(0, cli, "test:0", any_session(run_dir, 0))
    try:
        ps._serve_conn(conn)
        payload = torch.ones(8_000_000)  # 32 MB, far more than both socket buffers hold
        total = payload.numel() * 4 + codec.HEADER_SIZE
        ps.loop.write(conn, wire.message_buffers([payload], msg_type=codec.MsgType.WEIGHTS,
                                                 run_tag=ps.tag, worker=0, iteration=0,
                                                 chunk=0, mac=conn.session.down))
        assert conn.queued_bytes == total
        assert 0 < conn.written_bytes < total, "the message should be half written"
        assert conn.writable_wanted  # the loop waits for room to write the rest

        def in_peer() -> int:
            return int(struct.unpack("i", fcntl.ioctl(peer.fileno(), termios.FIONREAD,
                                                      b"\0\0\0\0"))[0])

        last, deadline = -1, time.monotonic() + 10
        while in_peer() != last and time.monotonic() < deadline:
            last = in_peer()
            time.sleep(0.2)  # the kernel has stopped moving bytes (and acked them)
        assert conn.backlog_bytes() + in_peer() == total
        # The peer reads everything while the event loop writes: the backlog drains to 0.
        got = [0]

        def read_all() -> None:
            while got[0] < total:
                got[0] += len(peer.recv(1 << 20))

        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        deadline = time.monotonic() + 10
        while conn.unsent and time.monotonic() < deadline:
            ps._poll(deadline, "the rest of the message to go out")
        reader.join(timeout=10)
        assert got[0] == total and not conn.unsent and not conn.writable_wanted
        while conn.backlog_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)  # the last acknowledgements
        assert conn.backlog_bytes() == 0
    finally:
        _close(ps, cli, peer)
