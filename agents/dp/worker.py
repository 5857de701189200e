"""A data-parallel worker: trains on its shard and ships compressed gradients to the PS.

Run inside a worker host as ``python -m agents.dp.worker --run-dir RUN --worker K
--ps 10.0.0.1``. Per iteration it:

1. computes the gradient of its share of the global batch (or, for the replay
   workload, sleeps the configured compute time and uses a synthetic gradient of
   a real model's layer sizes);
2. walks the gradient chunk by chunk in a fixed order (see ``chunk_ranges``); for
   each chunk the ratio policy picks a keep ratio, the compressor (wrapped in
   error feedback: ``R = G - sent``) turns it into a payload, and the codec sends
   it as frames whose payloads are views of the tensors (no copy);
3. samples ``TCP_INFO`` from the kernel while the transfer runs (the sending rate
   is the growth of ``tcpi_bytes_acked``, not the timing of our own writes) and
   feeds it to the ratio policy;
4. receives the new weights straight into the model's flat parameter buffer, on a
   receiver thread that starts with the upload: the PS sends chunk c back as soon
   as every worker has sent it, so the downlink of early chunks overlaps the
   upload of later ones (and the socket's receive window never stalls the PS).

Commands from the controller (Unix control socket) set the socket's pacing rate
(``SO_MAX_PACING_RATE``) for link/N shaping, and tell the oracle policy the
bandwidth. Leaving and rejoining follow ``membership.schedule``.
"""

from __future__ import annotations

import argparse
import math
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import agents.compress  # noqa: F401  (registers every compressor)
from agents.compress.base import Compressor
from agents.compress.builder import CompressionSpec, Sender
from agents.compress.staging import PayloadStager
from agents.core import config as cfgmod
from agents.core.drain import WAIT_MIN_NS, queued_departure_rate_bps
from agents.core.ethernet import GSO_SEGS_MAX, TCP_GOODPUT_FRACTION, TCP_MSS_BYTES
from agents.core.events import EventLog, now_ns
from agents.core.nodes import worker_node
from agents.core.policies import RatioContext, ratio_policy_class, ratio_policy_from_config
from agents.core.policies.adaptive import ack_clock_rate_bps
from agents.dp.upload import Compressed, Upload
from agents.net import auth, codec, handshake, protocol, wire
from agents.net.control import ControlClient, control_path
from agents.net.pacing import clear_max_pacing_rate, set_max_pacing_rate
from agents.net.tcpinfo import read_tcp_info
from agents.net.txstamps import TxStampReader
from agents.workloads.base import FlatModel, chunk_layer_specs, chunk_ranges
from agents.workloads.device import make_deterministic, memory_stats, pick_device
from agents.workloads.factory import make_workload
from agents.workloads.replay import Replay


def notsent_lowat(a: cfgmod.AdaptiveConfig) -> int | None:
    """TCP_NOTSENT_LOWAT for the worker's socket: bounded where keep ratios are decided
    during the transfer (``decides_in_flight``: adaptive, oracle), the kernel's default (no
    bound) otherwise."""
    return a.notsent_lowat_bytes if ratio_policy_class(a.policy).decides_in_flight else None


class PSClosed(Exception):
    """The PS ended the run (BYE) or went away."""


def _said_bye(receiving: Future[tuple[int, int]], wait_s: float) -> bool:
    """Whether the weights' receiver ended with the PS's BYE (within ``wait_s``)."""
    try:
        receiving.result(timeout=wait_s)
    except PSClosed:
        return True
    except Exception:  # noqa: BLE001 - any other end: the send's error is the one to report
        return False
    return False


class RateSampler(threading.Thread):
    """Samples TCP_INFO every ``period_s`` while a transfer is in flight; logs each
    sample and hands the rate from ``bytes_acked`` deltas to ``on_rate``."""

    def __init__(self, worker: Worker, period_s: float) -> None:
        super().__init__(name="tcp-info", daemon=True)
        self.w = worker
        self.period_s = period_s
        self.active = threading.Event()
        self.stopped = False
        self.last: tuple[int, int] | None = None

    def run(self) -> None:
        while not self.stopped:
            self.active.wait(0.5)
            if not self.active.is_set() or self.w.sock is None:
                self.last = None
                continue
            try:
                info = read_tcp_info(self.w.sock)
            except OSError:
                self.last = None
                continue
            ts = now_ns()
            acked = int(info.bytes_acked or 0)
            rate_bps = None
            if self.last is not None and ts > self.last[0]:
                rate_bps = (acked - self.last[1]) * 8e9 / (ts - self.last[0])
            self.last = (ts, acked)
            self.w.log.emit("tcp_info", iter=self.w.iteration, bytes_acked=acked,
                            delivery_rate_bps=(info.delivery_rate_bytes_per_s or 0) * 8,
                            rtt_us=info.rtt_us, cwnd=info.snd_cwnd_pkts,
                            pacing_rate_bps=(info.pacing_rate_bytes_per_s or 0) * 8,
                            total_retrans=info.total_retrans, rate_bps=rate_bps)
            # rate_source "drain" feeds the policy only its per-upload rate (time_drain).
            if (rate_bps is not None and rate_bps > 0
                    and self.w.cfg.adaptive.rate_source != "drain"):
                self.w.observe_rate(rate_bps, ts)
            time.sleep(self.period_s)


class Worker:
    def __init__(self, cfg: cfgmod.ExperimentConfig, run_dir: Path, run_id: str, key: bytes,
                 worker: int, ps_host: str, ps_port: int, device: torch.device,
                 gso_segs: int = 1) -> None:
        self.cfg = cfg
        self.rank = worker
        self.run_dir = run_dir
        self.run_id = run_id
        self.key = key
        self.ps_addr = (ps_host, ps_port)
        self.tag = codec.run_tag(run_id, codec.PUBLIC_SECRET)
        self.session: protocol.Session | None = None
        self.node = worker_node(worker)
        self.log = EventLog.for_node(run_dir, run_id, self.node)
        self.ctl = ControlClient(control_path(run_dir), self.node, key,
                                 timeout_s=cfg.guard.handshake_timeout_s, log=self.log)
        self.device = device
        self.workload = make_workload(cfg.workload, cfg.vision)
        self.model = FlatModel(self.workload.build_model(cfg.run.seed), device)
        self.workload.prepare(self.model.module, worker, cfg.run.seed)
        # Weights arrive into host memory; on a GPU they are copied up chunk by chunk, from
        # pinned memory so the copy is asynchronous.
        self.host_params = (self.model.flat_params if device.type == "cpu"
                            else torch.empty(self.model.numel, dtype=torch.float32,
                                             pin_memory=device.type == "cuda"))
        # Payloads go to the socket through pinned host buffers on CUDA (a no-op on the CPU).
        self.stager = PayloadStager(device)
        self.chunks = chunk_ranges(self.model.numel, cfg.workload.chunk_bytes)
        self.sender = Sender(CompressionSpec.from_config(cfg), cfg.run.seed, worker,
                             chunk_layer_specs(self.model.shapes, self.chunks))
        self.compressor: Compressor = self.sender.compressor
        self.planned_bps = (cfg.net.bottleneck_mbps * 1e6 / cfg.net.workers
                            * TCP_GOODPUT_FRACTION)
        self.policy: Any = self._make_policy()
        self.policy_lock = threading.Lock()
        self.sock: socket.socket | None = None
        # rate_source "drain": the kernel's transmit stamps of this connection's writes,
        # each packet at most gso_segs segments (the host's interface, topo.spec).
        self.stamps: TxStampReader | None = None
        self.packet_bytes = gso_segs * TCP_MSS_BYTES
        self.reader: wire.FrameReader | None = None
        # One thread receives the new weights while this one uploads (see run()).
        self.receiver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recv")
        self.iteration = 0
        self.pacing_bps: float | None = None
        self.sampler = RateSampler(self, cfg.adaptive.sample_ms / 1000.0)
        self.sampler.start()
        self.clip = (cfg.compress.clip_global / math.sqrt(cfg.net.workers)
                     if cfg.compress.clip_global > 0 else None)

    def _make_policy(self, trace_start_ns: int = 0, workers: int | None = None) -> Any:
        """The configured ratio policy (agents/core/policies/, built by its registered name)."""
        ctx = RatioContext(gradient_bytes=self.model.numel * 4, planned_bps=self.planned_bps,
                           workers=workers or self.cfg.net.workers,
                           trace_start_ns=trace_start_ns, worker=self.rank)
        return ratio_policy_from_config(self.cfg, ctx)

    # -- connection -----------------------------------------------------------------

    def connect(self, join_at: int) -> int:
        """Connect (retrying while the PS starts), say HELLO, wait for WELCOME and the
        weights. Returns the iteration the PS admitted us at."""
        deadline = time.monotonic() + 60
        while True:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            wire.set_socket_options(s, nodelay=True, congestion=self.cfg.net.congestion,
                                    notsent_lowat=notsent_lowat(self.cfg.adaptive))
            try:
                s.connect(self.ps_addr)
                break
            except OSError as e:
                s.close()
                if time.monotonic() > deadline:
                    raise ConnectionError(f"{self.node}: cannot reach PS at "
                                          f"{self.ps_addr[0]}:{self.ps_addr[1]}: {e}") from e
                time.sleep(0.2)
        self.sock = s
        self._drop_stamps()
        if self.pacing_bps:
            set_max_pacing_rate(s, self.pacing_bps)
        # Challenge-response (agents.net.handshake): WELCOME's MAC proves the PS knows our
        # key, and the wait for it lasts until the PS admits us at an iteration boundary.
        dialer = protocol.Dialer(self.run_id, "worker", self.rank, self.key,
                                 welcome_from=("ps", self.rank))
        self.session, joined_at = handshake.dial(
            s, dialer, run_tag=self.tag, name=f"{self.node} -> ps ({wire.peer_name(s)})",
            timeout_s=self.cfg.guard.handshake_timeout_s, join_at=join_at,
            welcome_timeout_s=self.cfg.run.timeout_s, log=self.log)
        # From here on the kernel times the socket out (no poll before each recv/send).
        wire.set_kernel_timeouts(s, self.cfg.run.timeout_s)
        self.reader = wire.FrameReader(s, mac=self.session.down,
                                       max_payload_bytes=self.max_down_bytes)
        if self.device.type != "cpu":
            self.host_params.copy_(self.model.flat_params)
        self.recv_weights()
        self.log.emit("joined", iter=joined_at)
        return joined_at

    @property
    def max_down_bytes(self) -> int:
        """The largest payload the PS may send us: one dense chunk."""
        return max(e - s for s, e in self.chunks) * 4

    def leave(self, rejoin_at: int) -> None:
        assert self.sock is not None and self.session is not None
        # The header's iteration is unsigned: "never rejoins" (-1) travels as 0, which the
        # PS ignores.
        wire.send_bytes(self.sock, b"bye", msg_type=codec.MsgType.BYE, run_tag=self.tag,
                        worker=self.rank, iteration=max(rejoin_at, 0), mac=self.session.up)
        self._drop_stamps()
        self.sock.close()
        self.sock = None
        self.log.emit("left", iter=self.iteration, rejoin_at=rejoin_at)

    # -- commands and rates ---------------------------------------------------------

    def apply_commands(self) -> None:
        for cmd in self.ctl.poll():
            kind = cmd.get("type")
            if kind == "pace":
                rate = cmd.get("rate_bps")
                self.pacing_bps = float(rate) if rate else None
                if self.sock is not None:
                    if self.pacing_bps:
                        set_max_pacing_rate(self.sock, self.pacing_bps)
                    else:
                        clear_max_pacing_rate(self.sock)
                self.log.emit("paced", iter=self.iteration, rate_bps=self.pacing_bps or 0)
            elif kind == "bandwidth" and self.policy.follows_bandwidth:
                with self.policy_lock:
                    self.policy = self._make_policy(int(cmd.get("trace_start_ns", 0)),
                                                    int(cmd.get("workers", 1)))

    def observe_rate(self, rate_bps: float, ts_ns: int) -> None:
        with self.policy_lock:
            self.policy.observe(rate_bps, ts_ns)

    # -- one iteration --------------------------------------------------------------

    def compute(self) -> float:
        t0 = time.perf_counter()
        self.model.zero_grad()
        if isinstance(self.workload, Replay):
            self.workload.fill_grad(self.model.module, self.rank, self.cfg.run.seed)
            loss = float("nan")
        else:
            b = self.workload.batch(self.iteration, self.rank, self.cfg.net.workers,
                                    self.cfg.workload.batch_size)
            out = self.workload.loss(self.model.module, type(b)(b.x.to(self.device),
                                                               b.y.to(self.device)))
            out.backward()
            loss = float(out.detach())
        self.log.emit("compute_done", iter=self.iteration, compute_s=time.perf_counter() - t0,
                      loss=loss)
        return loss

    def element_ratio(self, keep: float) -> float:
        """The compressor ratio that spends ``keep`` of the chunk's dense bytes.

        With ``adaptive.budget = "bytes"`` and a sparse compressor, each kept element
        costs its value and its index (int32: 8 bytes where dense pays 4), so a byte
        budget below 1 buys ``keep * value / (value + index)`` of the elements; at 1 the
        chunk goes dense (the sparse compressors fall back to dense there). The fixed
        policy's ratio is always an element ratio, as configured (``budgets_bytes`` False)."""
        if (not self.policy.budgets_bytes or self.cfg.adaptive.budget == "elements"
                or keep >= 1.0 or not getattr(self.compressor, "sparse", False)):
            return keep
        index_bytes = 4.0 if self.cfg.compress.index_encoding == "int32" else 1.5
        return max(self.cfg.adaptive.keep_min, keep * 4.0 / (4.0 + index_bytes))

    def time_upload(self, poll_s: float = 0.0005, limit_s: float = 2.0) -> None:
        """One rate sample for the upload just written (``adaptive.rate_source =
        "upload"``): read ``bytes_acked`` every ``poll_s`` until nothing written is left
        unacknowledged, and hand ``ack_clock_rate_bps`` of the readings to the policy.
        The PS answers only after the whole gradient arrived, so this ends before the
        reply would be read; ``limit_s`` bounds it if the ACKs stall."""
        assert self.sock is not None
        samples: list[tuple[int, int]] = []
        deadline = time.monotonic() + limit_s
        info = read_tcp_info(self.sock)
        while True:
            samples.append((now_ns(), int(info.bytes_acked or 0)))
            if (info.unacked_pkts == 0 and not info.notsent_bytes) or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
            info = read_tcp_info(self.sock)
        rate_bps = ack_clock_rate_bps(samples)
        ts = samples[-1][0]
        self.log.emit("tcp_info", iter=self.iteration, bytes_acked=samples[-1][1],
                      delivery_rate_bps=(info.delivery_rate_bytes_per_s or 0) * 8,
                      rtt_us=info.rtt_us, cwnd=info.snd_cwnd_pkts,
                      pacing_rate_bps=(info.pacing_rate_bytes_per_s or 0) * 8,
                      total_retrans=info.total_retrans, rate_bps=rate_bps)
        if rate_bps is not None and rate_bps > 0:
            self.observe_rate(rate_bps, ts)

    def time_drain(self) -> None:
        """One rate sample for the upload just written (``adaptive.rate_source = "drain"``,
        agents.core.drain): the kernel's stamps of its writes entering and leaving the
        interface's shaper (agents.net.txstamps), timed by ``queued_departure_rate_bps``. It
        waits until the last write has left the shaper, which the PS's reply needs anyway."""
        assert self.stamps is not None
        stamps = self.stamps.collect()
        rate_bps = queued_departure_rate_bps(stamps, self.stamps.writes,
                                             packet_bytes=self.packet_bytes)
        self.log.emit("drain", iter=self.iteration, stamps=len(stamps),
                      waited=sum(1 for x in stamps if x.wait_ns >= WAIT_MIN_NS),
                      rate_bps=rate_bps)
        if rate_bps is not None and rate_bps > 0:
            self.observe_rate(rate_bps, now_ns())

    def send_gradient(self) -> tuple[float, float, int]:
        """Upload this iteration's gradient chunk by chunk (:mod:`agents.dp.upload`), then
        take the upload's rate sample. Returns (compress s, send s, wire bytes)."""
        upload = Upload(self, self._start_upload())
        t0 = time.perf_counter()
        # On CUDA chunk c's payload is copied to pinned host memory while chunk c+1 is
        # compressed (one chunk of look-ahead); on the CPU each chunk is sent before the next
        # is compressed, so the ratio policy sees every byte sent before it decides.
        lookahead = 1 if self.stager.asynchronous else 0
        ready: deque[Compressed] = deque()
        try:
            for c in range(len(self.chunks)):
                ready.append(upload.compress(c))
                while len(ready) > lookahead:
                    upload.send(ready.popleft())
            while ready:
                upload.send(ready.popleft())
        finally:
            self.sampler.active.clear()
        send_s = time.perf_counter() - t0 - upload.compress_s
        if self.cfg.adaptive.rate_source == "upload" and self.policy.decides_in_flight:
            self.time_upload()
        if upload.stamps is not None:
            self.time_drain()
        self.log.emit("send_done", iter=self.iteration, bytes=upload.wire_bytes,
                      send_s=send_s, start_ns=upload.start_ns)
        return upload.compress_s, send_s, upload.wire_bytes

    def _start_upload(self) -> TxStampReader | None:
        """Start the ratio policy's upload from its first rate estimate and wake the rate
        sampler; the kernel's stamp reader for this upload when the policy times the upload
        by it (``adaptive.rate_source = "drain"``, agents.net.txstamps)."""
        assert self.sock is not None
        if self.cfg.adaptive.r0 == "planned":
            r0: float | None = self.planned_bps
        else:
            info = read_tcp_info(self.sock)
            r0 = (info.delivery_rate_bytes_per_s or 0) * 8 or None
        with self.policy_lock:
            self.policy.start(self.model.numel * 4, r0, now_ns())
        self.sampler.last = None
        self.sampler.active.set()
        if self.cfg.adaptive.rate_source != "drain" or not self.policy.decides_in_flight:
            return None
        if self.stamps is None:
            self.stamps = TxStampReader(self.sock)
        self.stamps.start_upload()
        return self.stamps

    def recv_weights(self) -> tuple[int, int]:
        """Receive every chunk of the new weights (or the sparse delta) into the model.
        Returns the wire bytes and when the first chunk's header arrived (CLOCK_MONOTONIC
        ns): before it the worker waited on the PS, after it the weights were arriving."""
        assert self.reader is not None
        total = 0
        first_ns = 0
        flat = self.host_params
        down = protocol.Downlink([e - s for s, e in self.chunks])
        for c, (s, e) in enumerate(self.chunks):
            h = self.reader.read_header()
            if c == 0:
                first_ns = now_ns()
            kind = down.receive(h)  # order, type and size: before anything is read
            if kind == codec.MsgType.BYE:
                raise PSClosed("PS said BYE")
            if kind == codec.MsgType.WEIGHTS:
                # Zero copy: the payload lands in the parameters themselves.
                self.reader.read_payload_into(h, codec.tensor_view(flat[s:e]))
            else:
                parts = [(h, self.reader.read_tensor(h))]
                for _ in range(1, h.nparts):
                    h2 = self.reader.read_header()
                    down.receive(h2)
                    parts.append((h2, self.reader.read_tensor(h2)))
                if len(parts) == 2:
                    idx = parts[0][1].to(torch.int64)
                    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= e - s):
                        raise protocol.ProtocolError(f"{self.node}: UPDATE chunk {c}: "
                                                     "index out of range")
                    flat[s:e].index_add_(0, idx, parts[1][1])
                else:
                    flat[s:e].add_(parts[0][1])
            if flat is not self.model.flat_params:
                self.model.flat_params[s:e].copy_(flat[s:e], non_blocking=True)
            total += h.payload_len + codec.HEADER_SIZE
        return total, first_ns

    def run(self) -> int:
        schedule = {w: (leave, rejoin) for w, leave, rejoin in self.cfg.membership.schedule}
        leave_at, rejoin_at = schedule.get(self.rank, (-1, -1))
        self.iteration = self.connect(join_at=0)
        n_iter = self.cfg.run.iterations
        while self.iteration < n_iter:
            if self.iteration == leave_at:
                self.leave(rejoin_at)
                if rejoin_at < 0 or rejoin_at >= n_iter:
                    return 0
                self.iteration = self.connect(join_at=rejoin_at)
                leave_at = -1
                continue
            self.apply_commands()
            t0, start_ns = time.perf_counter(), now_ns()
            loss = self.compute()
            compute_s = time.perf_counter() - t0
            # Compute is done with the parameters: the new ones may land while we send.
            receiving = self.receiver.submit(self.recv_weights)
            try:
                compress_s, send_s, up = self.send_gradient()
            except ConnectionError:
                if _said_bye(receiving, self.cfg.run.stall_timeout_s):
                    break  # the PS ended the run (its target reached) while we sent
                raise
            tw = time.perf_counter()
            try:
                down, first_ns = receiving.result()
            except PSClosed:
                break
            wait_s = time.perf_counter() - tw
            iter_s = time.perf_counter() - t0
            self.log.emit("recv_done", iter=self.iteration, bytes=down, wait_s=wait_s,
                          first_ns=first_ns)
            self.log.emit("iter_done", iter=self.iteration, iter_s=iter_s, compute_s=compute_s,
                          compress_s=compress_s, send_s=send_s, wait_s=wait_s, bytes_up=up,
                          bytes_down=down, loss=loss, start_ns=start_ns)
            self.ctl.send("iter_done", iter=self.iteration, iter_s=iter_s, bytes_up=up)
            self.iteration += 1
        if self.device.type == "cuda":
            self.log.emit("device_memory", iter=self.iteration, **memory_stats(self.device))
        return 0

    def _drop_stamps(self) -> None:
        if self.stamps is not None:
            self.stamps.close()
            self.stamps = None

    def close(self) -> None:
        self.sampler.stopped = True
        self._drop_stamps()
        if self.sock is not None:
            self.sock.close()
        self.receiver.shutdown(wait=False, cancel_futures=True)
        self.log.close()
        self.ctl.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.dp.worker",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--worker", required=True, type=int)
    ap.add_argument("--ps", required=True, help="PS address (IP inside the emulated network)")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--device", default=None, help="auto, cpu or cuda (default: run.device)")
    ap.add_argument("--gso-segs", type=int, default=1,
                    help="segments per packet this host's interface sends (topo.spec)")
    args = ap.parse_args(argv)
    if not 1 <= args.gso_segs <= GSO_SEGS_MAX:
        ap.error(f"--gso-segs {args.gso_segs}: must be in [1, {GSO_SEGS_MAX}]")
    cfg = cfgmod.load(args.run_dir / "config.toml")
    keys = auth.read_bundle()  # from the controller, on our stdin: never a file
    auth.exit_with_controller()
    torch.set_num_threads(1)
    make_deterministic(cfg.run.deterministic)
    w = Worker(cfg, args.run_dir, args.run_dir.name, keys.key,
               args.worker, args.ps, args.port or cfg.net.port,
               pick_device(args.device or cfg.run.device), args.gso_segs)
    return wire.run_agent(w.run, name=lambda: w.node,
                          errors=(ConnectionError, codec.FrameError, wire.ConnectionClosed),
                          code=2, on_error=lambda e: w.log.emit("worker_error",
                                                                iter=w.iteration, error=e),
                          close=w.close)


if __name__ == "__main__":
    wire.exit_process(main())
