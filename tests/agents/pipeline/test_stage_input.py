"""Every byte a stage receives is hostile (agents/pipeline/links.py): on a real socket, a
message must be the next one its neighbour's schedule sends on that connection, with
exactly the boundary's shape and finite values; anything else stops the stage with an
error naming the connection and the message."""

from __future__ import annotations

import re
import socket

import pandas as pd
import pytest
import torch

from agents.core.schedules import Kind
from agents.net import codec, link
from agents.net.codec import FrameMac
from agents.pipeline.stage import Stage
from analysis.timeline import host_timeline
from controller.loopback.dp import free_port
from controller.loopback.pipeline import make_run_dir

ACT, GRAD, BYE = codec.MsgType.ACTIVATION, codec.MsgType.GRADIENT_BACK, codec.MsgType.BYE
UP, DOWN = b"u" * 32, b"d" * 32  # the MAC keys of the test link's two directions


@pytest.fixture
def stage1(tmp_path):
    """Stage 1 of 2 (GPipe, 2 micro-batches), its upstream link a socketpair: stage 0
    owes it ACTIVATION 0, ACTIVATION 1, then BYE."""
    run_dir, cfg = make_run_dir(tmp_path, ["pipeline.stages=2", "pipeline.micro_batches=2",
                                           "pipeline.micro_batch_size=4", "run.iterations=1"])
    peers = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    st = Stage(cfg, run_dir, run_dir.name, b"k" * 32, 1, peers)
    a, b = socket.socketpair()
    mine = link.Link(0, a, "stage 0 (test)", send_mac=FrameMac(DOWN), recv_mac=FrameMac(UP),
                     run_tag=0)
    theirs = link.Link(1, b, "stage 1 (test)", send_mac=FrameMac(UP), recv_mac=FrameMac(DOWN),
                       run_tag=0)
    yield st, st.links._neighbour(0, mine, upstream=True), theirs
    st.links.close()
    st.log.close()
    a.close()
    b.close()


def _feed(st, nb, theirs, messages):
    """Write ``messages`` (kind, mb, worker, tensor) from stage 0's end, close it, and run
    stage 1's reader on what arrived; returns the stage's failure (None when none)."""
    for kind, mb, worker, t in messages:
        if kind == BYE:
            theirs.send_bytes(b"done", msg_type=BYE, worker=worker)
        else:
            theirs.send_message([t], msg_type=kind, worker=worker, iteration=mb, chunk=0)
    theirs.sock.shutdown(socket.SHUT_WR)
    st.links._read_loop(nb, nb.link.reader())
    return st.links.inbox.failure


def test_accepts_what_the_upstream_schedule_sends(stage1):
    st, nb, theirs = stage1
    shape = st.compute.in_shape[0]
    x0, x1 = torch.randn(shape), torch.randn(shape)
    assert _feed(st, nb, theirs, [(ACT, 0, 0, x0.reshape(-1)), (ACT, 1, 0, x1.reshape(-1)),
                                  (BYE, -1, 0, None)]) is None
    assert torch.equal(st.links.take(Kind.RECV_ACT, 0, 0), x0)
    assert torch.equal(st.links.take(Kind.RECV_ACT, 1, 0), x1)


@pytest.mark.parametrize("make,match", [
    (lambda n: [(ACT, 1, 0, torch.zeros(n))],  # out of the schedule's order
     "sent ACTIVATION worker=0 iter=1 .*expected ACTIVATION iter=0 chunk=0 from 0"),
    (lambda n: [(ACT, 0, 0, torch.zeros(n)), (ACT, 0, 0, torch.zeros(n))],  # twice
     "sent ACTIVATION worker=0 iter=0 .*expected ACTIVATION iter=1 chunk=0 from 0"),
    (lambda n: [(GRAD, 0, 0, torch.zeros(n))],  # stage 1 is last: no gradient comes in
     "sent GRADIENT_BACK .*expected ACTIVATION iter=0"),
    (lambda n: [(codec.MsgType.WEIGHTS, 0, 0, torch.zeros(n))], "sent WEIGHTS"),
    (lambda n: [(ACT, 0, 5, torch.zeros(n))],  # a header claiming another sender
     "sent ACTIVATION worker=5 .*from 0"),
    (lambda n: [(BYE, -1, 0, None)], "sent BYE .*expected ACTIVATION iter=0"),  # leaves early
    (lambda n: [(ACT, 0, 0, torch.zeros(n)), (BYE, -1, 0, None), (ACT, 1, 0, torch.zeros(n))],
     "sent BYE .*expected ACTIVATION iter=1"),
    (lambda n: [(ACT, 0, 0, torch.zeros(n))],  # hangs up still owing a message
     "closed before ACTIVATION iter=1 chunk=0 from 0"),
    (lambda n: [(ACT, 0, 0, torch.zeros(n - 1))], "expected one float32 tensor"),  # size
    (lambda n: [(ACT, 0, 0, torch.full((n,), float("nan")))], "non-finite"),
])
def test_rejects_hostile_messages(stage1, make, match):
    st, nb, theirs = stage1
    failure = _feed(st, nb, theirs, make(int(torch.Size(st.compute.in_shape[0]).numel())))
    assert failure is not None
    assert failure.startswith("stage 0 (test): ")  # names the connection
    assert re.search(match, failure), failure


def test_worker_timeline_from_data_parallel_events():
    ev = pd.DataFrame([
        {"ts_ns": 2_000_000_000, "node": "w0", "iter": 0, "event": "compute_done",
         "compute_s": 0.5},
        {"ts_ns": 2_600_000_000, "node": "w0", "iter": 0, "event": "send_done",
         "start_ns": 2_000_000_000},
        {"ts_ns": 3_000_000_000, "node": "w0", "iter": 0, "event": "recv_done",
         "wait_s": 0.4},
    ])
    tl = host_timeline(ev)
    assert list(zip(tl["category"], tl["start_s"], tl["end_s"], strict=True)) == [
        ("compute", 0.0, 0.5), ("send", 0.5, 1.1), ("wait", 1.1, 1.5)]
