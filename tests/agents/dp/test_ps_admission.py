"""The PS keeps reading while it welcomes joiners.

Admission seals every joiner's copy of the model under that joiner's MAC and hands it to
the kernel, one joiner after the other. On a loaded host that takes seconds for a large
model, and the joiner welcomed first has its weights long before the last one is in: it
computes and uploads. If the PS read nothing meanwhile, that upload would fill the PS's
receive window and stall, and the up link would idle until the whole membership was
welcomed (docs/performance.md, the moves' acceptance).

In-process PS over loopback socket pairs (no root, no agent processes). A slow host is
stood for by sealing the last joiner's welcome only once the first joiner's gradient has
arrived in the PS's socket: the PS must have read it, as a ``GradReceived`` event, by
the time admission returns.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
import time
from typing import Any

import torch

from agents.dp.ps import ParameterServer, _Conn
from agents.net import codec, protocol, wire
from agents.net.protocol import GradReceived, Joined
from controller.loopback.dp import any_session, make_run_dir, ps_keys

WORKERS = 3


def _pair() -> tuple[socket.socket, socket.socket]:
    """(the PS's end, the worker's end) of one loopback TCP connection. The PS's send
    buffer holds a whole welcome of this small model, so the kernel takes it at once and
    the joiner reads it without the PS's loop."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        worker_end = socket.create_connection(srv.getsockname())
        ps_end, _ = srv.accept()
    ps_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    return ps_end, worker_end


def _readable_bytes(sock: socket.socket) -> int:
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD,
                                              b"\0\0\0\0"))[0])


class Joiner(threading.Thread):
    """A worker's end: reads WELCOME and the weights (every MAC and CRC checked), then,
    when ``upload`` is set, sends chunk 0 of a gradient as a worker does."""

    def __init__(self, sock: socket.socket, session: protocol.Session, worker: int,
                 nchunks: int, tag: int, upload: bool) -> None:
        super().__init__(daemon=True)
        self.sock, self.session, self.worker = sock, session, worker
        self.nchunks, self.tag, self.upload = nchunks, tag, upload
        self.weights: list[torch.Tensor] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            reader = wire.FrameReader(self.sock, mac=self.session.down)
            h, _ = reader.read_frame()
            assert h.msg_type == codec.MsgType.WELCOME, h.describe()
            for c in range(self.nchunks):
                parts = reader.read_message()
                assert parts[0][0].msg_type == codec.MsgType.WEIGHTS and parts[0][0].chunk == c
                self.weights.append(parts[0][1])
            if self.upload:
                wire.send_message(self.sock, [torch.ones_like(self.weights[0])],
                                  msg_type=codec.MsgType.GRAD, run_tag=self.tag,
                                  worker=self.worker, iteration=0, chunk=0,
                                  mac=self.session.up)
        except BaseException as e:  # reported by the test, not lost in the thread
            self.error = e


def test_a_joiner_welcomed_first_is_read_while_the_others_are_welcomed(
        tmp_path, monkeypatch) -> None:
    run_dir, cfg = make_run_dir(tmp_path, [f"net.workers={WORKERS}", "workload.hidden=64",
                                           "workload.chunk_bytes=8192"])  # 36 KB, 5 chunks
    ps = ParameterServer(cfg, run_dir, run_dir.name, ps_keys(run_dir), host="127.0.0.1", port=0)
    pairs = [_pair() for _ in range(WORKERS)]
    nchunks = len(ps.chunks)
    assert nchunks >= 3
    grad_bytes = codec.HEADER_SIZE + (ps.chunks[0][1] - ps.chunks[0][0]) * 4
    joiners = [Joiner(pairs[w][1], any_session(run_dir, w), w, nchunks, ps.tag, w == 0)
               for w in range(WORKERS)]
    sealing = wire.message_buffers
    waited: dict[str, Any] = {}

    def arrived() -> int:
        """Bytes of worker 0's upload in the PS's socket or already read from it."""
        receiver = ps.conns[0].receiver
        assert receiver is not None
        return _readable_bytes(pairs[0][0]) + receiver.bytes_read

    def slow_host_sealing(*args: Any, **kw: Any) -> list[memoryview]:
        if kw["worker"] == WORKERS - 1 and kw["chunk"] == 0 and "s" not in waited:
            t0 = time.monotonic()
            while arrived() < grad_bytes and time.monotonic() - t0 < 10:
                time.sleep(0.002)
            waited["s"] = time.monotonic() - t0
            waited["arrived"] = arrived()
        return sealing(*args, **kw)

    monkeypatch.setattr(wire, "message_buffers", slow_host_sealing)
    try:
        for w in range(WORKERS):  # HELLO in worker order: worker 0 is welcomed first
            ps._handle(Joined(_Conn(w, pairs[w][0], f"test:{w}", any_session(run_dir, w)), 0))
        for j in joiners:
            j.start()
        ps._admit()
        assert waited.get("arrived", 0) >= grad_bytes, \
            f"worker 0's gradient never reached the PS's socket: {waited}, {joiners[0].error!r}"
        read = [ev for ev in ps.events if isinstance(ev, GradReceived)]
        assert [(ev.conn.worker, ev.header.chunk) for ev in read] == [(0, 0)], \
            "the PS read nothing while it welcomed the later joiners"
        assert torch.equal(read[0].tensors[0], torch.ones_like(read[0].tensors[0]))
        # Every joiner gets the same weights, checked by MAC and by the CRC shared
        # between them.
        deadline = time.monotonic() + 10
        while any(j.is_alive() for j in joiners) and time.monotonic() < deadline:
            ps.loop.run_once(0.05)
        for j in joiners:
            j.join(timeout=1)
            assert j.error is None and not j.is_alive(), f"worker {j.worker}: {j.error!r}"
            assert torch.equal(torch.cat(j.weights), ps.model.flat_params)
        assert ps.active == set(range(WORKERS))
    finally:
        for ps_end, worker_end in pairs:
            ps_end.close()
            worker_end.close()
        ps.srv.close()
        ps.loop.close()
        ps.log.close()
