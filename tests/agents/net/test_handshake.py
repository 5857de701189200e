"""The one handshake driver (agents.net.handshake): every kind of connection of a run goes
through it (real agent processes over loopback, counted by the ``handshake`` events the
driver writes), its deadline is absolute (a peer trickling a byte a second is cut off
when it passes), and a peer that has not proved its key cannot make it read more than
MAX_UNAUTHENTICATED_BYTES."""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import termios
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents.core.events import EventLog
from agents.net import auth, codec, handshake, protocol
from agents.net.control import control_path
from controller.control import ControlServer
from controller.loopback.dp import MASTERS, make_run_dir, start_ps, start_worker
from controller.loopback.pipeline import run_pipeline

RUN = "hs-run"
TAG = codec.run_tag(RUN, codec.PUBLIC_SECRET)
KEY = b"k" * 32


def handshakes(run_dir: Path, node: str) -> list[dict[str, Any]]:
    path = run_dir / "events" / f"{node}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if r["event"] == "handshake"]


def passed(run_dir: Path, node: str, end: str) -> list[tuple[str, int]]:
    """``(peer role, peer index)`` of every handshake ``node`` passed at ``end``, sorted."""
    return sorted((r["peer_role"], r["peer_index"]) for r in handshakes(run_dir, node)
                  if r["end"] == end and r["ok"])


def _wait_all(procs: list[Any], timeout_s: float) -> list[int]:
    try:
        return [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


# -- every kind of connection, in real processes ------------------------------------------

def test_worker_ps_and_control_connections_go_through_the_driver(tmp_path: Path) -> None:
    run_dir, cfg = make_run_dir(tmp_path, ["net.workers=2", "run.iterations=2",
                                           "run.eval_every=1000"])
    master = MASTERS[run_dir]
    reports: list[dict[str, Any]] = []
    ctl_log = EventLog.for_node(run_dir, run_dir.name, "controller")
    srv = ControlServer(control_path(run_dir), reports.append,
                        lambda n: auth.node_key(master, n) if n in ("ps", "w0", "w1") else None,
                        log=ctl_log)
    try:
        ps = start_ps(run_dir)
        workers = [start_worker(run_dir, k, cfg.net.port) for k in range(2)]
        rcs = _wait_all([ps, *workers], 120)
    finally:
        srv.close()
        ctl_log.close()
    assert rcs == [0, 0, 0], (run_dir / "ps.log").read_text()[-2000:]
    # worker -> PS: answered by the PS, dialed by each worker (expecting the PS's WELCOME).
    assert passed(run_dir, "ps", "answer") == [("worker", 0), ("worker", 1)]
    for k in range(2):
        assert ("ps", k) in passed(run_dir, f"w{k}", "dial")
    # agent -> control socket: dialed by every agent, answered by the controller.
    for node in ("ps", "w0", "w1"):
        assert ("controller", 0) in passed(run_dir, node, "dial")
    assert passed(run_dir, "controller", "answer") == [("agent", 0)] * 3
    assert sorted(m["node"] for m in reports if m.get("type") == "hello") == ["ps", "w0", "w1"]


def test_stage_and_stage_ps_connections_go_through_the_driver(tmp_path: Path) -> None:
    # One replica: each kind of pipeline connection once (a second replica adds two
    # processes and the same kinds again).
    run_dir, cfg, rcs = run_pipeline(tmp_path, [
        "pipeline.stages=2", "pipeline.replicas=1", "pipeline.micro_batches=2",
        "pipeline.micro_batch_size=8", "run.iterations=1"], ps=True)
    assert rcs == [0] * 3, rcs
    ps_index = cfg.pipeline.stages  # the pipeline's PS's index, after every stage's
    # stage -> stage: stage 0 dials stage 1, which answers; each stage dials the PS.
    assert passed(run_dir, "s0", "dial") == [("stage", 1), ("stage", ps_index)]
    assert passed(run_dir, "s1", "answer") == [("stage", 0)]
    assert ("stage", ps_index) in passed(run_dir, "s1", "dial")
    assert passed(run_dir, "ps", "answer") == [("stage", i) for i in range(ps_index)]


def test_expert_mesh_connections_go_through_the_driver(tmp_path: Path) -> None:
    from tests.agents.moe.test_moe_transparency import CASES, run_hosts

    overrides = [o if not o.startswith("run.iterations") else "run.iterations=1"
                 for o in CASES["k1-position"]]
    overrides = [o if not o.startswith("moe.hosts") else "moe.hosts=3" for o in overrides]
    overrides = [o if not o.startswith("moe.experts") else "moe.experts=3" for o in overrides]
    run_dir, _ = run_hosts(tmp_path, overrides, dump=False)
    # Host i dials every host below it and answers every host above it.
    assert passed(run_dir, "e0", "answer") == [("expert", 1), ("expert", 2)]
    assert passed(run_dir, "e1", "dial") == [("expert", 0)]
    assert passed(run_dir, "e1", "answer") == [("expert", 2)]
    assert passed(run_dir, "e2", "dial") == [("expert", 0), ("expert", 1)]


# -- the deadline -------------------------------------------------------------------------

def _hello_frame(worker: int = 0) -> bytes:
    d = protocol.Dialer(RUN, "worker", worker, KEY, b"W" * 16)
    hdr, body = codec.frame_for_bytes(d.hello(0), msg_type=codec.MsgType.HELLO, run_tag=TAG,
                                      worker=worker)
    return bytes(hdr) + bytes(body)


def _trickle(sock: socket.socket, data: bytes, period_s: float, stop: threading.Event) -> None:
    """Send the first 6 bytes of ``data`` one every ``period_s``, until refused or ``stop``
    (then stall: a driver with per-read timeouts takes 6 periods and a timeout to give up)."""
    for i in range(6):
        if stop.wait(period_s):
            return
        try:
            sock.send(data[i:i + 1])
        except OSError:
            return


def test_a_trickling_dialer_is_cut_off_at_the_absolute_deadline() -> None:
    """One byte a second restarts any per-read timeout; the driver's deadline is for the
    whole handshake, so the answering end gives up when it passes."""
    a, b = socket.socketpair()
    stop = threading.Event()
    t = threading.Thread(target=_trickle, args=(a, _hello_frame(), 1.0, stop))
    answerer = protocol.Answerer(RUN, "worker", lambda h: KEY, accepts="any")
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(handshake.HandshakeError, match="handshake timed out"):
            handshake.answer(b, answerer, run_tag=TAG, name="trickler", welcome=("ps", 0),
                             timeout_s=2.5)
        took_s = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()
    assert 2.5 <= took_s < 3.5, took_s


def test_a_trickling_answerer_is_cut_off_at_the_absolute_deadline() -> None:
    a, b = socket.socketpair()
    stop = threading.Event()
    challenge_hdr, body = codec.frame_for_bytes(b"C" * 16, msg_type=codec.MsgType.CHALLENGE,
                                                run_tag=TAG, worker=0)
    t = threading.Thread(target=_trickle,
                         args=(b, bytes(challenge_hdr) + bytes(body), 1.0, stop))
    t.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(handshake.HandshakeError, match="handshake timed out"):
            handshake.dial(a, protocol.Dialer(RUN, "worker", 0, KEY), run_tag=TAG,
                           name="dialer", timeout_s=2.5)
        took_s = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
        a.close()
        b.close()
    assert 2.5 <= took_s < 3.5, took_s


def test_the_ps_cuts_off_a_trickling_peer_at_guard_handshake_timeout_s(tmp_path: Path) -> None:
    run_dir, cfg = make_run_dir(tmp_path, ["net.workers=1", "guard.handshake_timeout_s=2"])
    ps = start_ps(run_dir)
    try:
        # The PS's deadline starts when it accepts, which may come before connect() returns
        # here: the clock starts before each try, so the deadline cannot precede it.
        while True:
            t0 = time.monotonic()
            try:
                s = socket.create_connection(("127.0.0.1", cfg.net.port), timeout=30)
                break
            except OSError:
                time.sleep(0.05)
        stop = threading.Event()
        t = threading.Thread(target=_trickle, args=(s, _hello_frame(), 1.0, stop))
        t.start()
        s.settimeout(30)
        try:
            while s.recv(4096):  # the ERROR frame, then EOF
                pass
        except ConnectionResetError:
            pass
        took_s = time.monotonic() - t0
        stop.set()
        t.join()
        s.close()
    finally:
        ps.kill()
        ps.wait()
    assert 2.0 <= took_s < 4.0, took_s
    refused = [json.loads(line) for line in (run_dir / "events" / "ps.jsonl").read_text()
               .splitlines() if '"refused"' in line]
    assert [(e["reason"], e["count"]) for e in refused] == [("handshake timed out", 1)], refused
    assert "handshake timed out" in refused[0]["example"]
    assert handshakes(run_dir, "ps") == []  # a refusal is reported aggregated, not per socket


# -- the cap on an unauthenticated peer ---------------------------------------------------

def _unread_bytes(sock: socket.socket) -> int:
    buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    return int(struct.unpack("i", buf)[0])


def test_an_unauthenticated_flood_is_read_no_further_than_the_cap() -> None:
    """A peer that fills the socket with a HELLO announcing a large payload and a flood
    behind it: the answering end reads a header, refuses, and leaves the rest unread."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    h = codec.FrameHeader(msg_type=codec.MsgType.HELLO, run_tag=TAG, worker=0, iteration=0,
                          chunk=0, dtype=codec.DType.UINT8, numel=1 << 20,
                          payload_len=1 << 20)
    a.setblocking(False)
    sent = 0
    for data in [codec.encode_header(h), *[b"\0" * 65536] * 64]:
        try:
            sent += a.send(data)
        except BlockingIOError:
            break
    assert sent > 2 * handshake.MAX_UNAUTHENTICATED_BYTES  # a flood worth capping
    answerer = protocol.Answerer(RUN, "worker", lambda h: KEY, accepts="any")
    try:
        with pytest.raises(handshake.HandshakeError, match="payload_len"):
            handshake.answer(b, answerer, run_tag=TAG, name="flood", welcome=None,
                             timeout_s=2)
        assert sent - _unread_bytes(b) <= handshake.MAX_UNAUTHENTICATED_BYTES
    finally:
        a.close()
        b.close()
