"""Every byte the pipeline's PS receives is hostile (agents/pipeline/stage_ps.py): on each stage's
connection only the one message its schedule sends next is accepted, with exactly its
slice's size and a sane gradient; the mean goes back only once all d replicas are in."""

from __future__ import annotations

import socket

import pytest
import torch

from agents.net import codec, link, wire
from agents.net.codec import FrameMac
from agents.pipeline import conversation
from agents.pipeline.common import build_schedule
from agents.pipeline.stage_ps import StagePS, StagePSError, _StageConn
from controller.loopback.dp import free_port
from controller.loopback.pipeline import make_run_dir

GRAD, W, BYE = codec.MsgType.GRAD, codec.MsgType.SLICE_WEIGHTS, codec.MsgType.BYE
SEND_KEY = b"s" * 32  # what the PS seals the means with, on every test connection


@pytest.fixture
def ps(tmp_path):
    run_dir, cfg = make_run_dir(tmp_path, [
        "pipeline.stages=2", "pipeline.replicas=2", "pipeline.schedule='1f1b'",
        "pipeline.micro_batches=2", "pipeline.micro_batch_size=4", "run.iterations=2",
        "run.eval_every=1000"])
    server = StagePS(cfg, run_dir, run_dir.name, b"k" * 32, host="127.0.0.1",
                     port=free_port())
    pairs = []
    server.peers = {}  # the stage's end of each connection
    for r in range(2):
        for s in range(2):
            a, b = socket.socketpair()
            pairs += [a, b]
            lk = link.Link(r * 2 + s, a, f"stage {s} of replica {r} (test)",
                           send_mac=FrameMac(SEND_KEY), recv_mac=FrameMac(b"r" * 32),
                           run_tag=0)
            script = conversation.to_stage_ps(server.schedule, s, r, 2, cfg.run)
            server.conns[(r, s)] = _StageConn(r, s, lk,
                                              conversation.Conversation(script, lk.name))
            server.peers[(r, s)] = b
    yield server
    server.srv.close()
    server.loop.close()
    for x in pairs:
        x.close()


def _hdr(kind, step, chunk=0, worker=0, numel=1):
    return codec.FrameHeader(msg_type=kind, run_tag=0, worker=worker, iteration=step,
                             chunk=chunk, dtype=codec.DType.FLOAT32, numel=numel,
                             payload_len=4 * numel)


def test_each_connection_owes_its_schedule_order():
    """1F1B, 2 steps, d = 2, evaluated only after the last step: a gradient per step,
    then (replica 0 only) the weights after the last, then BYE."""
    class Run:
        iterations, eval_every = 2, 1000

    class PC:
        schedule, stages, micro_batches, recompute = "1f1b", 2, 2, False

    sch = build_schedule(PC, 2)

    def script(stage, replica, replicas):
        return [(e.kind, e.iteration, e.chunk, e.sender) for e in
                conversation.to_stage_ps(sch, stage, replica, replicas, Run)]

    assert script(0, 0, 2) == [(GRAD, 0, 0, 0), (GRAD, 1, 0, 0), (W, 1, 0, 0), (BYE, -1, -1, 0)]
    assert script(1, 1, 2) == [(GRAD, 0, 0, 3), (GRAD, 1, 0, 3), (BYE, -1, -1, 3)]
    assert script(1, 0, 1) == [(W, 1, 0, 1), (BYE, -1, -1, 1)]


def test_the_mean_goes_back_once_every_replica_sent(ps):
    n = ps.numel(1, 0)
    g0, g1 = torch.randn(n), torch.randn(n)
    ps._handle(ps.conns[(0, 1)], _hdr(GRAD, 0, worker=1, numel=n), [g0])
    assert ps.conns[(0, 1)].queued_bytes == 0  # replica 1 still owes its gradient
    ps._handle(ps.conns[(1, 1)], _hdr(GRAD, 0, worker=3, numel=n), [g1])
    for r in range(2):
        # The event loop wrote the mean to the stage's socket, sealed under its link.
        reader = wire.FrameReader(ps.peers[(r, 1)], mac=FrameMac(SEND_KEY))
        ((h, mean),) = reader.read_message()
        assert (h.msg_type, h.iteration, h.chunk) == (codec.MsgType.UPDATE, 0, 0)
        torch.testing.assert_close(mean, (g0 + g1) / 2, rtol=0, atol=0)


@pytest.mark.parametrize("make,match", [
    (lambda n: (_hdr(GRAD, 1, numel=n), [torch.zeros(n)]),
     "expected GRAD iter=0 chunk=0 from 0"),  # a step ahead of the schedule
    (lambda n: (_hdr(W, 0, numel=n), [torch.zeros(n)]), "expected GRAD"),  # wrong kind
    (lambda n: (_hdr(BYE, 0, numel=n), [torch.zeros(n)]), "expected GRAD"),  # leaves early
    (lambda n: (_hdr(GRAD, 0, numel=n - 1), [torch.zeros(n - 1)]),
     "expected one float32 tensor"),  # not the slice's size
    (lambda n: (_hdr(GRAD, 0, worker=3, numel=n), [torch.zeros(n)]),
     "sent GRAD worker=3 .*expected GRAD iter=0 chunk=0 from 0"),  # claims another stage
    (lambda n: (_hdr(GRAD, 0, numel=n), [torch.full((n,), float("nan"))]), "non-finite"),
])
def test_rejects_hostile_messages(ps, make, match):
    n = ps.numel(0, 0)
    h, tensors = make(n)
    with pytest.raises(StagePSError, match=match) as e:
        ps._handle(ps.conns[(0, 0)], h, tensors)
    assert "stage 0 of replica 0 (test)" in str(e.value)
