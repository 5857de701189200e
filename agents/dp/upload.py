"""One iteration's upload of a worker's gradient, chunk by chunk.

Each chunk goes through GRACE's ``send_step`` in order: the ratio policy picks the keep
(what the bytes already sent say about the link), error feedback compensates and
compresses (the compressor builder's :class:`~agents.compress.builder.Sender` keeps what
was not sent), the payload is staged for the wire, and the codec sends it. The worker
decides how far compression may run ahead of sending (:meth:`Worker.send_gradient`); this
module keeps the upload's tallies, which the ratio policy, the events and the summary read.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from agents.compress.builder import Sender
from agents.compress.staging import PayloadStager, Staged
from agents.core import config as cfgmod
from agents.core.events import EventLog, now_ns
from agents.core.feedback_config import warmup_keep
from agents.core.policies.base import RatioPolicy
from agents.net import codec, protocol, wire
from agents.net.txstamps import TxStampReader
from agents.workloads.base import FlatModel


class Uploader(Protocol):
    """What an upload reads of its worker (:class:`agents.dp.worker.Worker`)."""
    cfg: cfgmod.ExperimentConfig
    log: EventLog
    iteration: int
    rank: int
    tag: int  # the run tag every frame carries (agents.net.codec.run_tag)
    sock: socket.socket | None
    session: protocol.Session | None
    model: FlatModel
    chunks: list[tuple[int, int]]
    policy: RatioPolicy
    policy_lock: threading.Lock
    sender: Sender
    stager: PayloadStager
    clip: float | None

    def element_ratio(self, keep: float) -> float: ...


@dataclass(frozen=True)
class Compressed:
    """Chunk ``chunk`` compressed and staged, waiting for the wire."""
    chunk: int
    staged: Staged
    stats: dict[str, Any]
    ratio: float  # the compressor's element ratio
    keep: float  # the policy's keep, after the sparsity warm-up
    compress_s: float


class Upload:
    """The tallies of one upload: raw bytes sent so far (the ratio policy decides on them),
    wire bytes, compression time, and the kernel's stamps of the writes when the policy
    times the upload by them (``adaptive.rate_source = "drain"``)."""

    def __init__(self, worker: Uploader, stamps: TxStampReader | None) -> None:
        self.w = worker
        self.stamps = stamps
        self.start_ns = now_ns()
        self.sent_raw_bytes = 0
        self.wire_bytes = 0
        self.compress_s = 0.0

    def compress(self, c: int) -> Compressed:
        """Decide chunk ``c``'s keep, compress it with error feedback and stage it."""
        w = self.w
        with w.policy_lock:
            d = w.policy.keep_for_next_chunk(self.sent_raw_bytes)
        if d.reason != "fixed":
            w.log.emit("decision", iter=w.iteration, chunk=c, **d.as_event())
        t0 = time.perf_counter()
        s, e = w.chunks[c]
        # DGC's sparsity warm-up loosens the keep over the first iterations.
        keep = warmup_keep(w.iteration, d.keep, w.cfg.feedback.warmup_iterations)
        ratio = w.element_ratio(keep)
        payload, stats = w.sender.compress(w.model.flat_grad[s:e], f"c{c}", ratio,
                                           clip_norm=w.clip)
        staged = w.stager.stage(c, payload)
        dt = time.perf_counter() - t0
        self.compress_s += dt
        return Compressed(c, staged, stats, ratio, keep, dt)

    def send(self, x: Compressed) -> None:
        """Send one compressed chunk as GRAD frames, MAC'd with the session's upload key."""
        w = self.w
        assert w.sock is not None and w.session is not None
        s, e = w.chunks[x.chunk]
        begun_ns = time.time_ns()  # the stamps' clock (agents.net.txstamps)
        n = wire.send_message(w.sock, list(x.staged.host_tensors()),
                              msg_type=codec.MsgType.GRAD, run_tag=w.tag, worker=w.rank,
                              iteration=w.iteration, chunk=x.chunk, mac=w.session.up)
        self.wire_bytes += n
        self.sent_raw_bytes += (e - s) * 4
        if self.stamps is not None:
            self.stamps.wrote(n, begun_ns)
        w.log.emit("compress_done", iter=w.iteration, key=f"c{x.chunk}", ratio=x.ratio,
                   keep=x.keep, raw_bytes=x.stats.get("raw_bytes", (e - s) * 4),
                   wire_bytes=n, residual_norm=float(x.stats.get("residual_norm", 0.0)),
                   compress_s=x.compress_s)
