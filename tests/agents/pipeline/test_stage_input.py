"""Every byte a stage receives is hostile: a message must be one its schedule expects, from
the right neighbour, once, with exactly the boundary's shape (agents/pipeline/stage.py)."""

from __future__ import annotations

import socket

import pandas as pd
import pytest
import torch

from agents.core.schedules import Kind
from agents.net import codec
from agents.pipeline.stage import Stage, StageError, _Peer
from analysis.timeline import host_timeline
from controller.loopback.dp import free_port
from controller.loopback.pipeline import make_run_dir


@pytest.fixture
def stage1(tmp_path):
    run_dir, cfg = make_run_dir(tmp_path, ["pipeline.stages=2", "pipeline.micro_batches=2",
                                           "pipeline.micro_batch_size=4", "run.iterations=1"])
    peers = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    st = Stage(cfg, run_dir, run_dir.name, b"k" * 32, 1, peers)
    a, b = socket.socketpair()
    yield st, _Peer(0, a, "stage 0 (test)")
    st.srv.close()
    a.close()
    b.close()


def _hdr(kind, mb, chunk=0, worker=0, numel=1):
    return codec.FrameHeader(msg_type=kind, run_tag=0, worker=worker, iteration=mb,
                             chunk=chunk, dtype=codec.DType.FLOAT32, numel=numel,
                             payload_len=4 * numel)


def test_accepts_the_expected_activation_once(stage1):
    st, peer = stage1
    numel = int(torch.Size(st.in_shape[0]).numel())
    t = torch.randn(numel)
    st._accept_message(peer, _hdr(codec.MsgType.ACTIVATION, 1, numel=numel), [t])
    assert st.inbox[(Kind.RECV_ACT, 1, 0)].shape == st.in_shape[0]
    with pytest.raises(StageError, match="not a message stage 1's schedule receives"):
        st._accept_message(peer, _hdr(codec.MsgType.ACTIVATION, 1, numel=numel), [t])


@pytest.mark.parametrize("mutate,match", [
    (lambda n: (_hdr(codec.MsgType.ACTIVATION, 7, numel=n), [torch.zeros(n)]),
     "not a message"),  # a micro-batch outside the schedule
    (lambda n: (_hdr(codec.MsgType.GRADIENT_BACK, 0, numel=n), [torch.zeros(n)]),
     "not a message"),  # the last stage receives no gradient
    (lambda n: (_hdr(codec.MsgType.ACTIVATION, 0, numel=n - 1), [torch.zeros(n - 1)]),
     "expected one float32 tensor"),  # wrong size for the boundary
    (lambda n: (_hdr(codec.MsgType.ACTIVATION, 0, worker=5, numel=n), [torch.zeros(n)]),
     "came from stage 5"),  # a header claiming another sender
    (lambda n: (_hdr(codec.MsgType.ACTIVATION, 0, numel=n),
                [torch.full((n,), float("nan"))]), "non-finite"),
    (lambda n: (_hdr(codec.MsgType.WEIGHTS, 0, numel=n), [torch.zeros(n)]), "unexpected"),
])
def test_rejects_hostile_messages(stage1, mutate, match):
    st, peer = stage1
    n = int(torch.Size(st.in_shape[0]).numel())
    h, tensors = mutate(n)
    with pytest.raises(StageError, match=match):
        st._accept_message(peer, h, tensors)


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
