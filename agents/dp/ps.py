"""The parameter server: aggregates workers' (compressed) gradients and steps the model.

Run inside the PS host as ``python -m agents.dp.ps --run-dir RUN --port 5000``. It
reads the resolved ``RUN/config.toml``, listens for workers, and for every
iteration:

1. receives each active worker's gradient chunk by chunk (``GRAD`` messages,
   one frame per payload tensor), validates it and accumulates it -- sparse
   payloads with a sorted ``index_add_`` when that is cheaper than densifying;
2. as soon as every active worker has sent chunk c (chunks complete in order),
   takes that chunk's mean and applies SGD to it (the same elementwise update as
   ``torch.optim.SGD``, so stepping chunk by chunk equals one whole step);
3. sends chunk c of the new weights (``WEIGHTS``, dense) or of the sparse weight
   delta (``UPDATE``) back to every worker at once, through the same bottleneck,
   while later chunks are still coming up -- the per-partition push/pull pipelining
   of ps-lite and BytePS. Every worker socket is non-blocking and served by one
   event loop on the main thread (:mod:`agents.net.loop`): it reads whatever bytes have
   arrived, adds the messages they complete, and writes each connection's queued
   downlink as its socket takes it, so the downlink of chunk c overlaps the uplink
   of chunk c+1 and a slow receiver never blocks the loop. The arithmetic of steps 1-3
   (decoding, the gradient checks, the add, the mean, the SGD step) runs on a thread of
   its own (:mod:`agents.dp.chunk_work`), in arrival order, so the loop reads chunk c+1
   while chunk c is added and stepped. When every chunk is out,
   the PS evaluates held-out accuracy every ``run.eval_every`` iterations. Each
   worker's weight send is logged as its own span (``weights_sent``, from the first
   chunk queued to the kernel taking the last byte: :mod:`agents.dp.weight_sends`).

How much the pipelining buys depends on how evenly the workers' uploads progress:
chunk c is complete only when the slowest worker has sent it. Under link/N every
worker delivers chunk c at the same moment, so the downlink runs one chunk behind
the uplink; under unfair TCP the slowest worker's chunks arrive late and the
downlink is pushed back towards the end of the upload.

Workers authenticate at connect time by challenge-response under their own keys, and
every later frame carries a per-connection MAC (``agents.net.protocol``, ``agents.net.auth``);
the conversation's rules (handshake, chunk barrier, iteration order, BYE) are the
sans-I/O state machines of ``agents.net.protocol``, and the code here only moves bytes.
Accepting and the handshake (:mod:`agents.net.handshake`) run on threads, each under
one absolute deadline and the admission limits of ``[guard]`` (per source address, in
all, a slot kept for each worker's host: :mod:`agents.net.admission`); an authenticated
connection is handed to the event loop. Refused connections are reported aggregated, one
``refused`` event per source and reason per second with a count.
Nothing is allocated for a peer before it has proved its key, and then no more than
the message it may send weighs. A malformed frame or an insane gradient (non-finite,
above ``guard.max_abs_grad``, duplicate indices) ends that one connection with a
logged ``frame_error``; the PS keeps serving the others (or stops, as
``run.on_worker_death`` says). A model that becomes non-finite stops the run.

Aggregation is streamed: each payload is added in the order it arrived, so the order of the
floating-point additions follows arrival order, and two runs that differ only in
timing can differ in the last bits of the weights (then more, for chaotic training).
Dense SGD is exact to float tolerance (``tests/agents/dp/test_transparency.py``). A worker that
disconnects is dropped from the active set, the controller is told (it
re-shapes to B/(N-1)) and the run goes on, or stops if ``run.on_worker_death``
says so.
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import torch

import agents.compress  # noqa: F401  (registers every compressor)
from agents.compress.builder import CompressionSpec, build_compressor
from agents.core import config as cfgmod
from agents.core.events import EventLog, now_ns
from agents.core.lr_schedule import lr_at
from agents.dp.aggregate import max_message_bytes, uplink_bound
from agents.dp.chunk_work import Added, AddJob, ChunkWork, Outcome, StepJob, Stepped
from agents.dp.downlink import REBALANCE_S, DownlinkPacer
from agents.dp.weight_sends import WeightSends
from agents.net import admission, auth, codec, handshake, loop, protocol, wire
from agents.net.admission import AdmissionLimits
from agents.net.buffers import ReceivePool
from agents.net.control import ControlClient, control_path
from agents.net.protocol import GradReceived, Joined, Left, Lost, PSEvent
from agents.workloads.base import FlatModel, chunk_ranges
from agents.workloads.factory import make_workload

# The event loop looks for stalled connections at least this often.
POLL_S = 0.5
# How long a PS that stopped at its target accuracy reads (and discards) the uploads its
# workers had begun before BYE reached them, waiting for each to close.
DRAIN_S = 60.0


def _reached_target(run: cfgmod.RunConfig, metrics: dict[str, float]) -> bool:
    """Whether an evaluation ends the run (``run.stop_at_target``)."""
    return run.stop_at_target and float(metrics.get("accuracy", 0.0)) >= run.target_accuracy


def _wire_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes one message of ``tensors`` takes on the wire: a header and a payload each."""
    return sum(t.numel() * t.element_size() + codec.HEADER_SIZE for t in tensors)


def receive_counts(conns: Iterable[loop.Transport], pool: ReceivePool) -> dict[str, int]:
    """An iteration's receive-side counts (the per-chunk profile, docs/linerate.md): new
    and reused receive buffers, ``recv_into`` calls; then zeroed."""
    calls = 0
    for conn in conns:
        if conn.receiver is not None:
            calls += conn.receiver.recv_calls
            conn.receiver.recv_calls = 0
    out = {"rx_buffers_new": pool.allocated, "rx_buffers_reused": pool.reused,
           "recv_calls": calls}
    pool.allocated = pool.reused = 0
    return out


class _Conn(loop.Transport):
    """One worker's connection on the PS's event loop: the transport, and who it is."""

    def __init__(self, worker: int, sock: socket.socket, peer: str,
                 session: protocol.Session) -> None:
        super().__init__(sock, peer)
        self.worker = worker
        self.session = session


def _max_grad_bytes(cfg: cfgmod.ExperimentConfig, chunks: list[tuple[int, int]]) -> int:
    """The most one GRAD message of the largest chunk may weigh (the reader's cap)."""
    return max(max_message_bytes(cfg.compress.name, e - s) for s, e in chunks)


def _lr(cfg: cfgmod.ExperimentConfig, iteration: int) -> float:
    """The PS's learning rate at ``iteration`` (``workload.lr_schedule``)."""
    wl = cfg.workload
    return lr_at(wl.lr, iteration, cfg.run.iterations, wl.lr_schedule, wl.lr_decay_at,
                 wl.lr_decay_factor)


def _listening_socket(host: str, port: int, congestion: str) -> socket.socket:
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    wire.set_socket_options(srv, nodelay=True, congestion=congestion)
    srv.bind((host, port))
    srv.listen(handshake.LISTEN_BACKLOG)
    return srv


def _log_sends(log: EventLog, sends: WeightSends, conns: dict[int, _Conn]) -> None:
    """A ``weights_sent`` event for every weight send the kernel has now taken."""
    for s in sends.finished({w: c.written_bytes for w, c in conns.items()}, now_ns()):
        log.emit("weights_sent", iter=s.iteration, worker=s.worker, start_ns=s.start_ns,
                 end_ns=s.end_ns, bytes=s.bytes)


def _welcome(lp: loop.EventLoop, conn: _Conn, weights: torch.Tensor,
             chunks: list[tuple[int, int]], crcs: list[list[int]], *, tag: int,
             iteration: int) -> None:
    """Queue WELCOME and the whole model to a joiner. ``crcs``: each chunk's payload CRC,
    filled by the first joiner and reused by the others (the bytes are the same).

    Sealing every joiner's copy of the model (a MAC over each byte, per connection) and
    pushing it into the kernel takes seconds on a loaded host (3.7 s for four copies of
    102 MB at load 7-11, docs/performance.md). The joiner welcomed first has its weights
    by then and is uploading, so the loop reads and writes between chunks: unread, that
    upload's receive window closes and the up link idles until the last joiner is in."""
    w = conn.worker
    lp.write(conn, wire.bytes_buffers(codec.hello_payload("ps", w),
                                      msg_type=codec.MsgType.WELCOME, run_tag=tag, worker=w,
                                      iteration=iteration, mac=conn.session.down))
    for c, (s, e) in enumerate(chunks):
        if c == len(crcs):
            crcs.append(wire.payload_crcs([weights[s:e]]))
        lp.write(conn, wire.message_buffers(
            [weights[s:e]], msg_type=codec.MsgType.WEIGHTS, run_tag=tag, worker=w,
            iteration=iteration, chunk=c, mac=conn.session.down, crcs=crcs[c]))
        lp.run_once(0)  # what arrived meanwhile becomes events, handled after admission


def _close_listening(srv: socket.socket) -> None:
    """Shut down first: that wakes the accepting thread's accept() at once (a close alone
    does not), which ``serve`` then joins; it otherwise slept out its report interval
    (1 s), and every run's end waited for it."""
    try:
        srv.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    srv.close()


def _accept_in_background(ps: ParameterServer) -> threading.Thread:
    """The PS's accept loop (``handshake.accept_forever``) on a thread of its own."""
    t = threading.Thread(target=handshake.accept_forever, name="accept", daemon=True,
                         args=(ps.srv, ps._handshake),
                         kwargs=dict(stopped=ps.done, report=ps._report_refused,
                                     limits=AdmissionLimits.from_guard(ps.cfg.guard),
                                     expected=ps.expected))
    t.start()
    return t


class ParameterServer:
    def __init__(self, cfg: cfgmod.ExperimentConfig, run_dir: Path, run_id: str,
                 keys: auth.KeyBundle, *, host: str = "0.0.0.0", port: int = 5000,
                 expected: tuple[str, ...] = ()) -> None:
        """``expected``: the workers' source addresses, each with an admission slot of its
        own while strangers flood (``agents.net.admission``)."""
        self.cfg = cfg
        self.expected = expected
        self.run_dir = run_dir
        self.run_id = run_id
        if not keys.workers_root:
            raise ValueError("PS key bundle: no workers_root (is this the PS's bundle?)")
        self.workers_root = keys.workers_root
        self.tag = codec.run_tag(run_id, codec.PUBLIC_SECRET)
        self.log = EventLog.for_node(run_dir, run_id, "ps")
        self.ctl = ControlClient(control_path(run_dir), "ps", keys.key,
                                 timeout_s=cfg.guard.handshake_timeout_s, log=self.log)
        self.workload = make_workload(cfg.workload, cfg.vision)
        self.model = FlatModel(self.workload.build_model(cfg.run.seed))
        self.workload.prepare(self.model.module, -1, cfg.run.seed)  # -1: the PS
        self.chunks = chunk_ranges(self.model.numel, cfg.workload.chunk_bytes)
        # The accumulators and the optimizer, worked on by a thread of their own while
        # the event loop reads (agents.dp.chunk_work). With DGC's momentum correction the
        # workers applied the momentum before compressing. ``shadow``: what the workers
        # hold, for the sparse-delta downlink (bit-identical to theirs).
        self.work = ChunkWork(
            self.model, self.chunks, build_compressor(CompressionSpec.from_config(cfg)),
            momentum=0.0 if cfg.feedback.momentum_correction else cfg.workload.momentum,
            shadow=self.model.flat_params.clone() if cfg.compress.downlink == "update"
            else None, max_abs_grad=cfg.guard.max_abs_grad,
            rank_order=cfg.run.sum_order == "rank")
        # What happened, in order, for the main loop: filled by the event loop (``_poll``)
        # on this thread; handshake threads hand over ``joins``, the chunk work its outcomes.
        self.events: deque[PSEvent | Outcome] = deque()
        self.joins: queue.SimpleQueue[Joined] = queue.SimpleQueue()
        self.loop = loop.EventLoop(self)
        # Dense chunks are received into tensors used again once added (agents.net.buffers).
        self.rx_pool = ReceivePool(max_free=2 * cfg.net.workers)
        self.next_rebalance_s = 0.0
        self.conns: dict[int, _Conn] = {}
        self.barrier = protocol.ChunkBarrier(len(self.chunks))
        self.active = self.barrier.active  # the same set: the barrier's is the truth
        self.pending: dict[int, int] = {}  # worker -> iteration it wants to join at
        self.pacer = DownlinkPacer(self.log)
        self.sends = WeightSends()
        self.done = threading.Event()
        self.iteration = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.agg_s = 0.0
        self.nonfinite = False  # a stepped chunk has a NaN or an infinity: the run stops
        self.in_work: set[tuple[int, int]] = set()  # (worker, chunk) adds not back yet
        self.outstanding = 0  # jobs handed to the chunk work whose outcome is not handled
        self.srv = _listening_socket(host, port, cfg.net.congestion)
        self.stop_reason = ""
        self.at_target = False  # run.stop_at_target: an evaluation reached the target

    # -- connections: accepted and authenticated on threads, then served by the loop -----

    def _report_refused(self, r: admission.RefusalReport) -> None:
        """Refused connections, aggregated per (source, reason) (``accept_forever``)."""
        self.log.emit("refused", iter=self.iteration, source=r.source, reason=r.reason,
                      count=r.count, example=r.example)

    def _handshake(self, sock: socket.socket, peer: str) -> None:
        """Challenge-response through the handshake driver, under the absolute deadline
        ``guard.handshake_timeout_s``; WELCOME waits for admission (:meth:`_admit`). A
        failure raises HandshakeError: ``accept_forever`` counts it and closes the socket."""
        workers = self.cfg.net.workers
        answerer = protocol.Answerer(
            self.run_id, "worker",
            lambda h: auth.worker_key(self.workers_root, h.worker) if h.worker < workers
            else None, accepts=f"0..{workers - 1}")
        session = handshake.answer(sock, answerer, run_tag=self.tag, name=peer, welcome=None,
                                   timeout_s=self.cfg.guard.handshake_timeout_s,
                                   log=self.log)
        # Authenticated: from here the main thread's event loop serves the socket.
        sock.setblocking(False)
        self.joins.put(Joined(_Conn(session.worker, sock, peer, session), session.join_at))
        self.loop.wake()

    # -- the event loop (agents.net.loop): every worker socket on this one thread -----

    def _serve_conn(self, conn: _Conn) -> None:
        """Start reading an authenticated connection's messages."""
        self.loop.serve(conn, wire.MessageReceiver(
            conn.sock, peer=conn.peer, mac=conn.session.up,
            max_payload_bytes=_max_grad_bytes(self.cfg, self.chunks),
            bound=uplink_bound(self.cfg.compress.name, self.chunks), pool=self.rx_pool))

    def _poll(self, deadline: float, what: str) -> None:
        """Wait until something happens (at most until ``deadline``) and turn it into
        events: messages received, connections joined, lost or stalled."""
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"PS: timed out waiting for {what}")
        wait = min(deadline - now, POLL_S)
        if self.cfg.shaping.downlink == "backlog":
            wait = min(wait, max(0.0, self.next_rebalance_s - now))
        self.loop.run_once(wait)
        _log_sends(self.log, self.sends, self.conns)
        while True:
            try:
                self.events.append(self.joins.get_nowait())
            except queue.Empty:
                break
        self.events.extend(self.work.outcomes())
        now = time.monotonic()
        if self.cfg.shaping.downlink == "backlog" and now >= self.next_rebalance_s:
            self.pacer.rebalance(self.conns, self.active)
            self.next_rebalance_s = now + REBALANCE_S
        self.loop.check_stalls(self.conns.values(), self.cfg.run.timeout_s)

    def data_received(self, conn: _Conn, messages: list[wire.Message]) -> None:
        """A worker's complete messages (the loop's handler): GRADs become events, a BYE
        ends what is read from it."""
        for parts in messages:
            h = parts[0][0]
            try:
                kind = protocol.check_uplink(h, conn.worker)
            except codec.FrameError as e:
                self.loop.lose(conn, e, "read")
                return
            if kind == codec.MsgType.BYE:
                conn.receiver = None  # nothing after a BYE is read
                self.events.append(Left(conn, h.iteration))
                return
            self.events.append(GradReceived(conn, h, [t for _, t in parts]))

    def connection_lost(self, conn: _Conn, error: Exception, during: str) -> None:
        """A worker's connection failed (the loop's handler); the main loop drops it when
        it meets the Lost event, after the messages received before the failure."""
        if isinstance(error, wire.ConnectionClosed):
            reason = "connection closed"
        elif during == "write":
            reason = f"send failed: {error}"
        elif self.done.is_set() and isinstance(error, OSError) and during == "read":
            return  # the run is over: a worker tearing down after BYE may reset: no news
        else:
            why = f"{error} (run.timeout_s)" if during == "stall" else str(error)
            self.log.emit("frame_error", iter=self.iteration, peer=conn.peer,
                          worker=conn.worker, error=why)
            reason = f"timed out: {why}" if during == "stall" else f"frame error: {error}"
        self.events.append(Lost(conn, reason))

    def _refuse(self, conn: _Conn, why: str) -> None:
        """Tell an authenticated worker why it is being dropped, after what is queued
        to it (the MAC's order), waiting at most a second for a peer that does not read."""
        conn.queue(wire.bytes_buffers(why.encode()[:protocol.MAX_ERROR_BYTES],
                                      msg_type=codec.MsgType.ERROR, run_tag=self.tag,
                                      worker=0, mac=conn.session.down))
        self.loop.flush_all([conn], 1.0)

    # -- the iteration loop ------------------------------------------------------------

    def serve(self) -> int:
        accepter = _accept_in_background(self)
        self.ctl.send("ready", port=self.srv.getsockname()[1])
        self.log.emit("ps_ready", numel=self.model.numel, chunks=len(self.chunks),
                      compressor=self.cfg.compress.name)
        n = self.cfg.net.workers
        deadline = time.monotonic() + 120
        # Start when every worker has said hello (a missing one is a failed run).
        while len(self.pending) < n:
            ev = self._next_event(deadline, "all workers to connect")
            assert not isinstance(ev, Added | Stepped)  # no chunk work before the start
            self._handle(ev)
        self._admit()
        start_ns = now_ns()
        self.work.start(self.loop.wake)
        try:
            self._iterate(start_ns)
        finally:
            self.work.stop()
        self._finish()
        # Its last turn reports the refusals still counted, before the event log closes.
        accepter.join(timeout=self.cfg.guard.refusal_report_interval_s + 1)
        return 0

    def _iterate(self, start_ns: int) -> None:
        """Every iteration: hand each chunk received to the chunk work, release the chunks
        every active worker has sent, write each stepped chunk down."""
        while self.iteration < self.cfg.run.iterations and not self.at_target:
            if not self.active:
                if self.cfg.run.on_worker_death == "stop" or not self.pending:
                    self.stop_reason = "no active workers"
                    break
            ev = self._next_event(time.monotonic() + self.cfg.run.timeout_s,
                                  f"gradients of iteration {self.iteration}")
            if isinstance(ev, GradReceived):
                self._submit(ev)
            elif isinstance(ev, Added):
                self._added(ev)
            elif isinstance(ev, Stepped):
                self._send_chunk(ev)
            else:
                self._handle(ev)
            if self.stop_reason:
                break
            # Chunks are stepped in order, each as soon as every active worker's is added --
            # also when the event just dropped the last worker a chunk was waiting for.
            for c in self.barrier.ready():
                self._step_chunk(c)
            if self.barrier.iteration_complete and not self.outstanding:
                self._end_iteration(start_ns)
                if self.stop_reason:
                    break

    def _next_event(self, deadline: float, what: str) -> PSEvent | Outcome:
        while not self.events:
            self._poll(deadline, what)
        return self.events.popleft()

    def _handle(self, ev: PSEvent) -> None:
        conn: _Conn = ev.conn
        if isinstance(ev, Joined):
            old = self.conns.get(conn.worker)
            if old is not None and not old.dead():
                # A second HELLO for a live worker: whoever it is, it does not take the
                # slot over. The live connection keeps it.
                why = (f"worker {conn.worker}: refused a second connection from {conn.peer}"
                       f" while {old.peer} is alive")
                self.log.emit("frame_error", iter=self.iteration, peer=conn.peer,
                              worker=conn.worker, error=why)
                self._refuse(conn, why)
                conn.closed = True
                conn.sock.close()
                return
            if old is not None:
                self._handle(Lost(old, "connection dead (replaced by a new one)"))
            self.conns[conn.worker] = conn
            self.pending[conn.worker] = ev.join_at
            self._serve_conn(conn)
            self.log.emit("worker_hello", iter=self.iteration, worker=conn.worker,
                          peer=conn.peer, join_at=ev.join_at)
            return
        if self.conns.get(conn.worker) is not conn:
            return  # an old (or refused) connection of a worker
        was_active = conn.worker in self.active
        self.barrier.drop(conn.worker)
        self.pending.pop(conn.worker, None)
        del self.conns[conn.worker]
        self.sends.forget(conn.worker)
        self.loop.unwatch(conn)
        conn.closed = True
        conn.sock.close()
        reason = ev.reason if isinstance(ev, Lost) else "left (BYE)"
        self.log.emit("worker_lost" if isinstance(ev, Lost) else "worker_left",
                      iter=self.iteration, worker=conn.worker, reason=reason)
        if was_active:
            self._report_membership()
        if isinstance(ev, Lost) and self.cfg.run.on_worker_death == "stop":
            self.stop_reason = f"worker {conn.worker} died: {reason}"

    def _submit(self, ev: GradReceived) -> None:
        """Hand one worker's chunk to the chunk work, once the barrier allows it (this
        iteration, a chunk in range, not sent before). A refusal drops that worker."""
        conn: _Conn = ev.conn
        h = ev.header
        w = conn.worker
        if self.conns.get(w) is not conn:
            return  # queued before its connection was dropped
        try:
            self.barrier.check(w, h.iteration, h.chunk)
            if (w, h.chunk) in self.in_work:
                raise protocol.ProtocolError(f"worker {w}: chunk {h.chunk} sent twice")
        except protocol.ProtocolError as err:
            self._drop_for(conn, str(err))
            return
        self.in_work.add((w, h.chunk))
        self.outstanding += 1
        self.work.submit(AddJob(conn, w, h, ev.tensors, len(self.active)))

    def _added(self, out: Added) -> None:
        """A chunk's add came back: the barrier counts it, or its worker is dropped."""
        self.outstanding -= 1
        job, conn, w = out.job, out.job.conn, out.job.worker
        assert isinstance(conn, _Conn)
        self.in_work.discard((w, job.header.chunk))
        if out.dense:
            # Added (copied) into the accumulator: the received tensors are free again.
            # Sparse parts are not: the accumulator keeps their indices.
            self.rx_pool.give(job.tensors)
        if out.skipped or self.conns.get(w) is not conn or w not in self.active:
            return  # its connection was dropped meanwhile; the step counts what was added
        if out.error is not None:
            return self._drop_for(conn, out.error)
        self.barrier.record(w, job.header.chunk)
        self.bytes_in += _wire_bytes(job.tensors)

    def _drop_for(self, conn: _Conn, msg: str) -> None:
        """A bad message from ``conn``: log it, tell the worker why, drop it."""
        self.log.emit("frame_error", iter=self.iteration, peer=conn.peer, worker=conn.worker,
                      error=msg)
        self._refuse(conn, msg)
        self._handle(Lost(conn, f"bad payload: {msg}"))

    def _step_chunk(self, c: int) -> None:
        """Every active worker's chunk ``c`` is added: the chunk work steps it next."""
        if c == 0:
            self.pacer.apply_commands(self.ctl.poll(), self.conns, self.iteration)  # downlink pacing changes land at iteration boundaries
        if c == len(self.chunks) - 1:
            # The last byte of this iteration's gradients is in: the end of the upload window.
            self.log.emit("grads_in", iter=self.iteration, workers=len(self.active))
        self.outstanding += 1
        self.work.submit(StepJob(c, self.iteration, _lr(self.cfg, self.iteration)))

    def _send_chunk(self, out: Stepped) -> None:
        """Chunk ``c`` is stepped: its new weights (or the delta) go down to every active
        worker, each frame sealed under that worker's MAC."""
        self.outstanding -= 1
        c = out.job.chunk
        self.agg_s += out.agg_s
        self.nonfinite = self.nonfinite or not out.finite
        size = _wire_bytes(out.tensors)
        for w in sorted(self.active):
            conn = self.conns[w]
            queued_ns = now_ns()
            self.loop.write(conn, wire.message_buffers(
                out.tensors, msg_type=out.msg_type, run_tag=self.tag, worker=w,
                iteration=self.iteration, chunk=c, mac=conn.session.down, crcs=out.crcs))
            self.sends.queued(w, self.iteration, size, conn.queued_bytes,
                              c == len(self.chunks) - 1, queued_ns)
        self.bytes_out += len(self.active) * size
        _log_sends(self.log, self.sends, self.conns)

    def _end_iteration(self, start_ns: int) -> None:
        """Every chunk is stepped and queued: evaluate, admit joiners, report."""
        i = self.iteration
        metrics = None
        if (i + 1) % self.cfg.run.eval_every == 0 or i + 1 == self.cfg.run.iterations:
            metrics = self.workload.evaluate(self.model.module)
            if metrics is not None:
                self.log.emit("eval", iter=i, **metrics)
                self.at_target = _reached_target(self.cfg.run, metrics)
        self.log.emit("ps_iter_done", iter=i, agg_s=self.agg_s, bytes_in=self.bytes_in,
                      bytes_out=self.bytes_out, rebalanced=self.pacer.rebalanced,
                      workers=len(self.active), elapsed_s=(now_ns() - start_ns) / 1e9,
                      **receive_counts(self.conns.values(), self.rx_pool))
        self.barrier.end_iteration()
        self.iteration += 1
        if self.nonfinite:
            # Every gradient passed the checks, and yet: nothing sane can follow.
            self.stop_reason = f"model became non-finite at iteration {i}"
            self.log.emit("frame_error", iter=i, peer="ps", error=self.stop_reason)
            return
        self._admit()
        self.ctl.send("iter_done", iter=i, workers=len(self.active),
                      **({"accuracy": metrics.get("accuracy"), "loss": metrics.get("loss")}
                         if metrics else {}))
        self.bytes_in = self.bytes_out = 0
        self.agg_s = 0.0
        self.pacer.rebalanced = 0

    def _admit(self) -> None:
        """Workers waiting to (re)join come in at an iteration boundary, with the weights.
        Every joiner's welcome is queued at once and written by the event loop as each
        socket takes it, in parallel: with link/N pacing on the downlink a sequential
        welcome would cost N transfer times (measured: 39 s for 16 workers)."""
        joined = [w for w, at in self.pending.items() if at <= self.iteration]
        if not joined:
            return
        self.pacer.apply_commands(self.ctl.poll(), self.conns, self.iteration)
        weights = self.model.flat_params.clone()  # what they get, whatever steps next
        crcs: list[list[int]] = []  # each chunk's payload CRC, the same for every joiner
        for w in joined:
            del self.pending[w]
            if w in self.pacer.pacing_bps:
                self.pacer.pace(w, self.conns.get(w), self.iteration)
            _welcome(self.loop, self.conns[w], weights, self.chunks, crcs, tag=self.tag,
                     iteration=self.iteration)
            self.barrier.admit(w)
            self.log.emit("worker_joined", iter=self.iteration, worker=w)
        self._report_membership()

    def _report_membership(self) -> None:
        self.ctl.send("membership", iter=self.iteration, active=sorted(self.active))

    def _finish(self) -> None:
        if self.work.shadow is not None:
            # Workers hold the shadow; report the model they actually have.
            self.model.flat_params.copy_(self.work.shadow)
        final = self.workload.evaluate(self.model.module)
        if final is not None:
            self.log.emit("final_eval", iter=self.iteration, **final)
        torch.save(self.model.flat_params.clone(), self.run_dir / "ps_final_weights.pt")
        self.done.set()
        conns = [c for c in self.conns.values() if not c.failed]
        for conn in conns:  # the last chunks go out before BYE
            conn.queue(wire.bytes_buffers(b"done", msg_type=codec.MsgType.BYE, run_tag=self.tag,
                                          worker=conn.worker, iteration=self.iteration,
                                          mac=conn.session.down))
        self.loop.flush_all(list(conns), self.cfg.run.timeout_s)
        # Stopped at the target: the workers' next uploads, begun before BYE, finish.
        self.loop.drain_until_closed(list(conns), DRAIN_S if self.at_target else 0.0)
        self.log.emit("ps_done", iter=self.iteration, reason=self.stop_reason or "completed",
                      at_target=self.at_target)
        self.ctl.send("done", iter=self.iteration, reason=self.stop_reason or "completed")
        _close_listening(self.srv)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.dp.ps", description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--expect", action="append", default=[], metavar="ADDR",
                    help="a worker's source address (repeatable): it keeps an admission "
                         "slot of its own while strangers flood")
    args = ap.parse_args(argv)
    cfg = cfgmod.load(args.run_dir / "config.toml")
    keys = auth.read_bundle()  # from the controller, on our stdin: never a file
    auth.exit_with_controller()
    run_id = args.run_dir.name
    torch.set_num_threads(1)
    ps = ParameterServer(cfg, args.run_dir, run_id, keys, host=args.host,
                         port=args.port or cfg.net.port, expected=tuple(args.expect))
    return wire.run_agent(ps.serve, name=lambda: "ps", errors=(TimeoutError,), code=3,
                          on_error=lambda e: ps.log.emit("ps_done", iter=ps.iteration, reason=e),
                          close=ps.log.close)


if __name__ == "__main__":
    wire.exit_process(main())
