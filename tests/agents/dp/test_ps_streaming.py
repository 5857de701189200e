"""The PS streams the update chunk by chunk (ps-lite/BytePS push-pull pipelining).

Invariant: chunk c of the new weights comes down as soon as every active worker has sent
chunk c -- not before (it would miss a worker's gradient), and not only once the whole
gradient is in (the downlink would wait for the uplink). And the chunk-wise SGD step with
momentum is the whole-model step, bit for bit.

Loopback run (no root, no Mininet): a real ``agents.dp.ps`` process and two fake workers in
this process that send dense (``none``) gradients of known values one chunk at a time.
"""

from __future__ import annotations

import socket

import pytest
import torch

from agents.net import codec, protocol, wire
from agents.workloads.base import FlatModel, chunk_ranges
from agents.workloads.factory import make_workload
from controller.loopback.dp import connect, make_run_dir, prove, start_ps, welcome

pytestmark = pytest.mark.loopback  # starts real agent processes on 127.0.0.1

LR, MOMENTUM = 0.1, 0.9


def _hello(port: int, run_dir, worker: int
           ) -> tuple[socket.socket, wire.FrameReader, protocol.Dialer]:
    s = connect(port)
    reader, hs = prove(s, run_dir, worker)
    return s, reader, hs


def _welcome(conn: tuple[socket.socket, wire.FrameReader, protocol.Dialer],
             nchunks: int) -> tuple[torch.Tensor, codec.FrameMac]:
    """WELCOME, then the dense weights (returned flat), and the MAC to send with. The PS
    admits the workers once every one of them has proved its key."""
    _, reader, hs = conn
    session = welcome(reader, hs)
    return torch.cat([reader.read_message()[0][1] for _ in range(nchunks)]), session.up


def _nothing_to_read(s: socket.socket, wait_s: float) -> bool:
    s.settimeout(wait_s)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""  # b"" would be EOF: not "nothing"
    except (TimeoutError, BlockingIOError):
        return True
    finally:
        s.settimeout(30.0)


def test_each_chunk_comes_down_once_every_worker_sent_it(tmp_path) -> None:
    run_dir, cfg = make_run_dir(tmp_path, [
        "net.workers=2", "workload.hidden=32", "workload.chunk_bytes=4096",
        "run.iterations=2", "run.eval_every=100", "compress.name=none",
        f"workload.lr={LR}", f"workload.momentum={MOMENTUM}", "run.timeout_s=60"])
    tag = 0  # sealed frames carry their MAC in the tag's place
    model = FlatModel(make_workload(cfg.workload).build_model(cfg.run.seed))
    chunks = chunk_ranges(model.numel, cfg.workload.chunk_bytes)
    assert len(chunks) >= 3, chunks
    ps = start_ps(run_dir)
    try:
        hellos = [_hello(cfg.net.port, run_dir, w) for w in (0, 1)]
        (w0, mac0), (w1, mac1) = (_welcome(c, len(chunks)) for c in hellos)
        conns = [(c[0], c[1]) for c in hellos]
        assert torch.equal(w0, w1)
        gen = torch.Generator().manual_seed(5)
        expect_params, buf = w0.clone(), None
        for it in range(2):
            grads = [torch.randn(model.numel, generator=gen) for _ in range(2)]
            mean = (grads[0] + grads[1]) / 2
            buf = mean.clone() if buf is None else buf.mul_(MOMENTUM).add_(mean)
            expect_params = expect_params - LR * buf
            for c, (s, e) in enumerate(chunks):
                # Worker 0 sends chunk c: nothing may come down yet, to anyone.
                wire.send_message(conns[0][0], [grads[0][s:e].contiguous()],
                                  msg_type=codec.MsgType.GRAD, run_tag=tag, worker=0,
                                  iteration=it, chunk=c, mac=mac0)
                assert _nothing_to_read(conns[0][0], 0.3), f"iter {it} chunk {c} came early"
                wire.send_message(conns[1][0], [grads[1][s:e].contiguous()],
                                  msg_type=codec.MsgType.GRAD, run_tag=tag, worker=1,
                                  iteration=it, chunk=c, mac=mac1)
                # Both sent it: chunk c comes down now, while the later chunks are unsent.
                for _, reader in conns:
                    (h, got), = reader.read_message()
                    assert (h.msg_type, h.iteration, h.chunk) == (codec.MsgType.WEIGHTS, it, c)
                    torch.testing.assert_close(got, expect_params[s:e], rtol=0, atol=1e-6)
        # Both iterations done: the PS says BYE after the last chunk.
        for _, reader in conns:
            h, _ = reader.read_frame()
            assert h.msg_type == codec.MsgType.BYE
        assert ps.wait(timeout=60) == 0
    finally:
        if ps.poll() is None:
            ps.kill()
    final = torch.load(run_dir / "ps_final_weights.pt")
    torch.testing.assert_close(final, expect_params, rtol=0, atol=1e-6)


def test_single_chunk_models_still_step_once_per_iteration(tmp_path) -> None:
    # One chunk: streaming degenerates to step-then-broadcast (the old behaviour).
    run_dir, cfg = make_run_dir(tmp_path, [
        "net.workers=1", "workload.hidden=16", "workload.chunk_bytes=4000000",
        "run.iterations=1", "compress.name=none", f"workload.lr={LR}",
        "workload.momentum=0.0", "run.timeout_s=60"])
    model = FlatModel(make_workload(cfg.workload).build_model(cfg.run.seed))
    assert len(chunk_ranges(model.numel, cfg.workload.chunk_bytes)) == 1
    ps = start_ps(run_dir)
    try:
        conn = _hello(cfg.net.port, run_dir, 0)
        sock, reader = conn[0], conn[1]
        w0, mac = _welcome(conn, 1)
        g = torch.full((model.numel,), 0.5)
        wire.send_message(sock, [g], msg_type=codec.MsgType.GRAD, run_tag=0, worker=0,
                          iteration=0, chunk=0, mac=mac)
        (h, got), = reader.read_message()
        assert (h.iteration, h.chunk) == (0, 0)
        torch.testing.assert_close(got, w0 - LR * g, rtol=0, atol=1e-6)
        assert ps.wait(timeout=60) == 0
    finally:
        if ps.poll() is None:
            ps.kill()
