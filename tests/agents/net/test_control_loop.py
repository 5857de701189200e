"""The controller's control server on the one event loop (controller.control, with the
answering handshake as a feed of bytes, agents.net.answering): the feed alone, sans I/O,
then the real server on a Unix socket under floods of slow keyless connections from other
processes (controller.loopback.flood), with a real agent beside them."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from agents.core.guard_config import GuardConfig
from agents.net import answering, auth, codec, protocol
from agents.net.codec import HEADER_SIZE, MsgType
from agents.net.control import CONTROL_RUN_ID, CONTROL_TAG, CONTROLLER_END, ControlClient
from controller.control import ControlServer, pid_source
from controller.loopback.flood import unix_flood

MASTER = auth.new_master()


def key_for(node: str) -> bytes | None:
    return auth.node_key(MASTER, node) if node in ("ps", "w0") else None


def _frames(data: bytes) -> list[tuple[codec.FrameHeader, bytes, bytes]]:
    out = []
    while data:
        h = codec.decode_header(data)
        out.append((h, data[:HEADER_SIZE], data[HEADER_SIZE:HEADER_SIZE + h.payload_len]))
        data = data[HEADER_SIZE + h.payload_len:]
    return out


def _feed(node: str, key: bytes) -> tuple[protocol.Dialer, answering.AnswerFeed]:
    dialer = protocol.Dialer(CONTROL_RUN_ID, "agent", 0, key, node=node,
                             welcome_from=CONTROLLER_END)
    answerer = protocol.Answerer(CONTROL_RUN_ID, "agent",
                                 lambda h: key_for(h.node) if h.node else None)
    return dialer, answering.AnswerFeed(answerer, run_tag=CONTROL_TAG, welcome=CONTROLLER_END)


# -- the feed, without sockets ---------------------------------------------------------

def test_the_feed_authenticates_a_dialer_whose_bytes_arrive_one_at_a_time() -> None:
    dialer, feed = _feed("w0", auth.node_key(MASTER, "w0"))
    hello = answering.sealed_frame(dialer.hello(0), MsgType.HELLO, run_tag=CONTROL_TAG,
                                   worker=0)
    replies = b"".join(feed.receive(hello[i:i + 1]) for i in range(len(hello)))
    [(h, _, body)] = _frames(replies)
    proof = answering.sealed_frame(dialer.receive_challenge(h, body), MsgType.PROOF,
                                   run_tag=CONTROL_TAG, worker=0)
    replies = b"".join(feed.receive(proof[i:i + 1]) for i in range(len(proof) - 1))
    assert replies == b"" and not feed.done  # the last byte of the PROOF is missing
    replies = feed.receive(proof[-1:] + b'{"type": "ready"}\n')
    [(h, raw, body)] = _frames(replies)
    dialer.receive_welcome(raw, h, body)  # sealed under the session: we hold the key too
    assert feed.done and feed.answerer.hello is not None
    assert feed.answerer.hello.node == "w0"
    assert feed.rest == b'{"type": "ready"}\n'  # the next protocol's, kept for it


def test_the_feed_refuses_a_wrong_key_and_more_than_the_unauthenticated_cap() -> None:
    dialer, feed = _feed("w0", b"not the key".ljust(32))
    hello = answering.sealed_frame(dialer.hello(0), MsgType.HELLO, run_tag=CONTROL_TAG,
                                   worker=0)
    [(h, _, body)] = _frames(feed.receive(hello))
    proof = answering.sealed_frame(dialer.receive_challenge(h, body), MsgType.PROOF,
                                   run_tag=CONTROL_TAG, worker=0)
    with pytest.raises(protocol.ProtocolError, match="w0 failed the challenge"):
        feed.receive(proof)
    _, feed = _feed("w0", auth.node_key(MASTER, "w0"))
    with pytest.raises(protocol.ProtocolError, match="more than 65536 bytes"):
        feed.receive(b"\0" * (answering.MAX_UNAUTHENTICATED_BYTES + 1))
    _, feed = _feed("intruder", b"k" * 32)
    with pytest.raises(codec.FrameError, match="magic"):
        feed.receive(b"x" * HEADER_SIZE)


# -- the server, under floods of slow connections from other processes --------------------

def _wait(cond: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_one_thread_serves_thousands_of_slow_connections_and_an_agent_gets_through(
        tmp_path: Path) -> None:
    """Six processes hold 2,400 slow connections (a byte a second); the server stays one
    thread and a bounded number of descriptors, cuts the admitted ones off at the
    handshake's absolute deadline, reports refusals aggregated, and a real agent connects,
    reports and is commanded in the middle of it. With a thread per connection, the 48
    admitted handshakes (8 per flooding process) were 48 threads."""
    got: list[dict[str, Any]] = []
    path = tmp_path / "control.sock"
    # Threads are compared by identity: a thread another test left behind may end meanwhile.
    threads_before, fds_before = set(threading.enumerate()), _fds()
    srv = ControlServer(path, got.append, key_for,
                        guard=GuardConfig(handshake_timeout_s=1.0))
    try:
        with unix_flood(path, processes=6, per_process=400) as flood:
            _wait(lambda: sum(m.get("count", 0) for m in got
                              if m.get("type") == "control_refused") >= 2000,
                  f"the flood was refused: {got[-3:]}")
            threads, fds = set(threading.enumerate()) - threads_before, _fds()
            t0 = time.monotonic()
            agent = ControlClient(path, "w0", auth.node_key(MASTER, "w0"), heartbeat_s=None)
            connect_s = time.monotonic() - t0
            agent.send("iter_done", iter=3)
            _wait(lambda: any(m.get("type") == "iter_done" for m in got), "the report")
            assert srv.send("w0", "pace", rate_bps=5)
            _wait(lambda: agent.poll() == [{"type": "pace", "rate_bps": 5}], "the command")
            # Held past the deadline: the admitted ones were cut off, not held.
            time.sleep(1.5)
            agent.close()
    finally:
        srv.close()
    assert len(threads) == 1, ("the control plane is one thread", threads)
    # Admitted handshakes (8 per flooder), a pipe from each flooder, and a few of our own
    # (the listening socket, the selector, the wake-up pair).
    assert fds - fds_before <= 6 * 8 + len(flood.pids) + 6, (fds, fds_before)
    assert connect_s < 2.0, connect_s
    refused = [m for m in got if m.get("type") == "control_refused"]
    by_reason: dict[str, int] = {}
    for m in refused:
        by_reason[m["reason"]] = by_reason.get(m["reason"], 0) + m["count"]
    assert by_reason.get("handshake timed out", 0) >= len(flood.pids) * 8, by_reason
    # The rest are closed unread: over the per-process bound, or over its connects a second.
    assert (by_reason.get("8 unauthenticated connections already", 0)
            + by_reason.get("more than 64 connections a second", 0)) >= 2000, by_reason
    # Aggregated: a handful of reports per (source, reason) per second, not one each.
    assert len(refused) < sum(by_reason.values()) / 20, (len(refused), by_reason)
    assert {m["source"] for m in refused} <= {pid_source(p) for p in flood.pids}
    assert flood.opened >= 2400, flood.opened
    assert [m["node"] for m in got if m.get("type") == "hello"] == ["w0"]


def test_an_expected_agent_gets_its_own_slot_while_floods_hold_every_shared_one(
        tmp_path: Path) -> None:
    got: list[dict[str, Any]] = []
    path = tmp_path / "control.sock"
    guard = GuardConfig(max_handshakes=4, max_handshakes_per_source=2,
                        handshake_timeout_s=30.0)
    srv = ControlServer(path, got.append, key_for, guard=guard)
    try:
        with unix_flood(path, processes=3, per_process=20, trickle_s=5.0):
            _wait(lambda: any(m.get("reason") == "4 unauthenticated connections at once"
                              for m in got), "every slot taken")
            with pytest.raises(ConnectionError, match="closed|reset|refused|Broken"):
                ControlClient(path, "w0", auth.node_key(MASTER, "w0"), timeout_s=2.0)
            srv.expect(pid_source(os.getpid()))
            agent = ControlClient(path, "w0", auth.node_key(MASTER, "w0"), timeout_s=5.0,
                                  heartbeat_s=None)
            agent.close()
    finally:
        srv.close()
    assert [m["node"] for m in got if m.get("type") == "hello"] == ["w0"]


# What ``ssh -R`` is to a cluster's control plane: one process that accepts on the server's
# socket and opens a connection to the controller's for each (controller/remote.py).
FORWARDER = """
import os, socket, sys, threading
def pump(a, b):
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    for s in (a, b):
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
srv = socket.socket(socket.AF_UNIX)
srv.bind(sys.argv[1])
srv.listen(4096)
print("ready", flush=True)
while True:
    a, _ = srv.accept()
    b = socket.socket(socket.AF_UNIX)
    try:
        b.connect(sys.argv[2])
    except OSError:
        a.close()
        continue
    for x, y in ((a, b), (b, a)):
        threading.Thread(target=pump, args=(x, y), daemon=True).start()
"""


def test_connections_forwarded_by_one_process_are_admitted_as_that_process(
        tmp_path: Path) -> None:
    """Admission holds behind a forwarder: every forwarded connection is the forwarder's
    (SO_PEERCRED), so a flood behind it is held to one source's slots, and a real agent
    behind it still authenticates end to end once a slot is free."""
    import subprocess
    import sys

    got: list[dict[str, Any]] = []
    local, remote = tmp_path / "control.sock", tmp_path / "remote.sock"
    srv = ControlServer(local, got.append, key_for,
                        guard=GuardConfig(max_handshakes_per_source=2, handshake_timeout_s=1.0))
    fwd = subprocess.Popen([sys.executable, "-c", FORWARDER, str(remote), str(local)],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert fwd.stdout is not None and fwd.stdout.readline().strip() == "ready"
        with unix_flood(remote, processes=2, per_process=50, trickle_s=5.0, seconds=3.0):
            _wait(lambda: sum(m.get("count", 0) for m in got
                              if m.get("type") == "control_refused") >= 50, f"{got[-3:]}")
        time.sleep(1.5)  # the flood is over and its admitted handshakes timed out
        agent = ControlClient(remote, "w0", auth.node_key(MASTER, "w0"), heartbeat_s=None)
        agent.send("iter_done", iter=1)
        _wait(lambda: any(m.get("type") == "iter_done" for m in got), "the report")
        agent.close()
    finally:
        fwd.kill()
        fwd.wait()
        srv.close()
    refused = [m for m in got if m.get("type") == "control_refused"]
    assert {m["source"] for m in refused} == {pid_source(fwd.pid)}, refused
    reasons = {m["reason"] for m in refused}
    assert "2 unauthenticated connections already" in reasons, reasons
    assert [m["node"] for m in got if m.get("type") == "hello"] == ["w0"]
