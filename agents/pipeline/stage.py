"""A pipeline stage: one process per stage, running its schedule on its layer slices.

Run inside a stage host as ``python -m agents.pipeline.stage --run-dir RUN --stage S [--replica R]
--peers H0:P0,H1:P1,...`` (the addresses of this replica's stages, in order). It:

1. builds the workload's model (an ``nn.Sequential``), cuts it into ``stages * chunks``
   pieces by ``pipeline.balance`` (or evenly by parameter count) and keeps its own: piece
   ``chunk * p + stage`` for each chunk (one chunk; two for the two-group schedule);
2. connects to its downstream neighbour and accepts its upstream one (a ring for the
   two-group schedule), each an authenticated :class:`agents.net.link.Link` under the key
   only the link's two ends hold (from the controller through stdin), with a MAC and a
   sequence number on every frame;
3. runs its schedule (:mod:`agents.core.schedules`, validated first) action by action:
   forwards and backwards of micro-batches, recomputation, optimizer steps. Activations
   go downstream (``ACTIVATION``) and gradients upstream (``GRADIENT_BACK``) through the
   frame codec, the frame's ``iteration`` field carrying the micro-batch id and ``chunk``
   the receiving chunk. Sends are handed to one sender thread per connection (a send
   never blocks compute, as the schedule's validator assumes); one reader thread per
   connection receives.

Every received byte is hostile: a message must be one this stage's schedule expects (kind,
micro-batch, chunk, from the right neighbour, not seen before) and decode to exactly the
activation shape the model gives at that boundary; otherwise the stage stops with a
``frame_error`` naming the peer.

Compression (``pipeline.act_compress`` / ``grad_compress``: fp16 or top-k) applies per
message; gradients may keep an error-feedback residual per boundary (``R = G - sent``).
With ``pipeline.recompute`` a forward runs without autograd and keeps only its input; the
schedule's ``R`` action re-runs it with autograd just before the stage waits for the
downstream gradient. Activation bytes held are counted exactly: every tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``) plus the stashed inputs.

With ``--ps HOST:PORT`` the stage also talks to the pipeline's PS (:mod:`agents.pipeline.stage_ps`)
over one more connection: with ``pipeline.replicas = d > 1`` every optimizer step sends the
chunk's slice gradient (``GRAD``) and waits for the mean over the d replicas (``UPDATE``);
replica 0 sends its slice weights (``SLICE_WEIGHTS``) after the steps the PS evaluates at
(``run.eval_every``, and the last), so the PS can measure held-out accuracy. ``d > 1``
needs the PS.
"""

from __future__ import annotations

import argparse
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import agents.compress  # noqa: F401  (registers every compressor)
from agents.compress.base import Compressor, PayloadError
from agents.compress.builder import CompressionSpec, Sender
from agents.core import config as cfgmod
from agents.core.events import EventLog, now_ns
from agents.core.lr_schedule import lr_at
from agents.core.nodes import PS_NODE, stage_links, stage_node
from agents.core.schedules import Action, Kind, Schedule, validate
from agents.core.schedules import make as make_schedule
from agents.net import auth, codec, handshake, link, protocol, wire
from agents.net.control import liveness_client
from agents.net.pacing import set_max_pacing_rate
from agents.pipeline.partition import balance_by_params, boundary_shapes, split
from agents.workloads.base import Batch, FlatModel, sgd_step_
from agents.workloads.factory import make_workload

ACT, GRAD = codec.MsgType.ACTIVATION, codec.MsgType.GRADIENT_BACK
CONNECT_TIMEOUT_S = 60.0


def ps_node_id(stage: int, replica: int, stages: int) -> int:
    """The id a stage gives the PS in its HELLO and frames: ``replica * p + stage``."""
    return replica * stages + stage


def ps_index(stages: int, replicas: int) -> int:
    """The pipeline PS's index in its links' handshakes: after every stage's."""
    return stages * replicas


def is_eval_step(run: Any, step: int) -> bool:
    """Whether the PS evaluates after step ``step``: every ``run.eval_every`` steps and
    after the last (the data-parallel PS's cadence)."""
    return (step + 1) % run.eval_every == 0 or step + 1 == run.iterations


class StageError(RuntimeError):
    """A neighbour sent something the schedule does not allow, or vanished."""


def build_schedule(pc: Any, steps: int) -> Schedule:
    return validate(make_schedule(pc.schedule, pc.stages, pc.micro_batches, steps=steps,
                                  recompute=pc.recompute))


def micro_batch(workload: Any, pc: Any, mb: int, replica: int) -> Batch:
    """Micro-batch ``mb`` (global id) of replica ``replica``: step ``k``'s global batch of
    ``d * m * b`` samples is the workload's batch of iteration ``k``; replica ``r`` takes
    slice ``r`` and cuts it into ``m`` micro-batches of ``b``."""
    m, b = pc.micro_batches, pc.micro_batch_size
    k, i = divmod(mb, m)
    full = workload.batch(k, replica, pc.replicas, m * b)
    return Batch(full.x[i * b:(i + 1) * b], full.y[i * b:(i + 1) * b])


def pipeline_sender(name: str, error_feedback: bool, seed: int, stage: int) -> Sender | None:
    """The sender of one direction of a stage's links; None for ``none``, whose tensors go
    out as they are, without a compressor's framing."""
    if name == "none":
        return None
    return Sender(CompressionSpec(name, error_feedback=error_feedback), seed, stage)


def _compressor(sender: Sender | None) -> Compressor | None:
    return None if sender is None else sender.compressor


class _LockedLog:
    """The stage's event log, shared by its main and sender threads (EventLog is not)."""

    def __init__(self, log: EventLog) -> None:
        self._log = log
        self._lock = threading.Lock()
        self.path = log.path

    def emit(self, event: str, iter: int = -1, **fields: Any) -> None:
        with self._lock:
            self._log.emit(event, iter, **fields)

    def close(self) -> None:
        with self._lock:
            self._log.close()


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a forward. Weights are not
    activations: a saved tensor living in a weight buffer (a parameter, or a view of one
    such as ``weight.t()`` that ``addmm`` saves) is not counted."""

    def __init__(self, weight_storages: set[int]) -> None:
        self.bytes = 0
        self.weights = weight_storages

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.weights:
            self.bytes += t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


@dataclass
class _Held:
    """What a forward left for its backward."""

    x: torch.Tensor  # the piece's input (always kept: the recompute needs it)
    out: torch.Tensor | None = None  # output with autograd history (None until recomputed)
    saved_bytes: int = 0


@dataclass
class _PSLink:
    """The connection to the pipeline's PS. Sends go through ``outbox`` to one sender
    thread, in order; the averaged gradient is read back on the main thread."""

    sock: socket.socket
    reader: wire.FrameReader
    conn: link.Link  # authenticated under the stage's key shared with the PS only
    outbox: queue.Queue[tuple[codec.MsgType, int, int, torch.Tensor] | None] = field(
        default_factory=queue.Queue)
    thread: threading.Thread | None = None
    error: str | None = None


@dataclass
class _Peer:
    """One TCP connection to a neighbour stage."""

    stage: int
    sock: socket.socket
    peer: str
    outbox: queue.Queue[tuple[codec.MsgType, int, int, list[torch.Tensor]] | None] = field(
        default_factory=queue.Queue)
    bytes_sent: int = 0
    threads: list[threading.Thread] = field(default_factory=list)
    conn: link.Link | None = None  # the authenticated link (None only in unit tests)

    @property
    def link(self) -> link.Link:
        if self.conn is None:
            raise StageError(f"{self.peer}: not connected")
        return self.conn


class Stage:
    def __init__(self, cfg: cfgmod.ExperimentConfig, run_dir: Path, run_id: str,
                 secret: bytes, stage: int, peers: list[tuple[str, int]], replica: int = 0,
                 ps: tuple[str, int] | None = None, keys: auth.KeyBundle | None = None
                 ) -> None:
        """``secret`` names the run (the frames' tag); ``keys``: this stage's bundle with
        the key of every link it is an end of (without it, derived from ``secret`` as
        ``--auth file`` does: tests and runs by hand)."""
        pc = cfg.pipeline
        self.cfg, self.pc = cfg, pc
        self.s, self.p, self.replica = stage, pc.stages, replica
        self.node = stage_node(replica, stage, pc.replicas)
        self.run_id = run_id
        self.keys = keys or auth.file_bundle(secret, self.node,
                                             stage_links(replica, stage, pc.stages,
                                                         pc.replicas))
        self.log = _LockedLog(EventLog.for_node(run_dir, run_id, self.node))
        self.tag = codec.run_tag(run_id, secret)
        self.peers_addr, self.ps_addr = peers, ps
        if len(peers) != self.p:
            raise ValueError(f"--peers: {len(peers)} addresses for {self.p} stages")
        if pc.replicas > 1 and ps is None:
            raise ValueError(f"--ps: pipeline.replicas = {pc.replicas} averages the stage "
                             "gradients through the PS; give its HOST:PORT")
        self.schedule = build_schedule(pc, cfg.run.iterations)
        self.actions = self.schedule.actions[stage]
        self.workload = make_workload(cfg.workload, cfg.vision)
        model = self.workload.build_model(cfg.run.seed)
        pieces_n = self.schedule.positions
        balance = list(pc.balance) or balance_by_params(model, pieces_n)
        pieces = split(model, balance)
        self.workload.prepare(model, stage, cfg.run.seed)
        sample = micro_batch(self.workload, pc, 0, replica).x
        self.shapes = boundary_shapes(pieces, sample)  # output shape of every piece
        self.in_shape = {c: (sample.shape if self.schedule.position(stage, c) == 0
                             else self.shapes[self.schedule.position(stage, c) - 1])
                         for c in range(self.schedule.chunks)}
        # One FlatModel per chunk; a chunk in stale_chunks keeps two versions (2BW).
        self.versions: dict[int, list[FlatModel]] = {}
        for c in range(self.schedule.chunks):
            piece = pieces[self.schedule.position(stage, c)]
            flat = FlatModel(piece)
            if c in self.schedule.stale_chunks:
                twin = FlatModel(_clone_module(piece))
                twin.flat_params.copy_(flat.flat_params)
                self.versions[c] = [flat, twin]
            else:
                self.versions[c] = [flat]
        self._weight_storages = {fm.flat_params.untyped_storage().data_ptr()
                                 for vs in self.versions.values() for fm in vs}
        self.momentum: dict[int, torch.Tensor] = {}
        self.opt_count: dict[int, int] = {}
        # Activations downstream never keep a residual (each micro-batch's is new data).
        self.act_send = pipeline_sender(pc.act_compress, False, cfg.run.seed, stage)
        self.grad_send = pipeline_sender(pc.grad_compress, pc.error_feedback, cfg.run.seed,
                                         stage)
        self.held: dict[tuple[int, int], _Held] = {}
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.losses: dict[int, float] = {}
        # Incoming messages: (kind, mb, chunk) -> dense tensor; the schedule says which.
        self.expected = {(a.kind, a.mb, a.chunk) for a in self.actions
                         if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)}
        self.inbox: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self.inbox_cv = threading.Condition()
        self.failure: str | None = None
        self.down: _Peer | None = None
        self.up: _Peer | None = None
        self.ps_link: _PSLink | None = None
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wire.set_socket_options(self.srv, nodelay=True, congestion=cfg.net.congestion)
        self.srv.bind(("0.0.0.0" if peers[stage][0] != "127.0.0.1" else "127.0.0.1",
                       peers[stage][1]))
        self.srv.listen(16)

    # -- wiring --------------------------------------------------------------------------

    def _needs(self) -> tuple[int | None, int | None]:
        """(downstream stage, upstream stage) this stage talks to, None where none."""
        sch = self.schedule
        downs = {sch.downstream(self.s, c) for c in range(sch.chunks)} - {None}
        ups = {sch.upstream(self.s, c) for c in range(sch.chunks)} - {None}
        dn = {d[0] for d in downs if d is not None}
        up = {u[0] for u in ups if u is not None}
        assert len(dn) <= 1 and len(up) <= 1
        return (dn.pop() if dn else None), (up.pop() if up else None)

    def _rank(self, replica: int, stage: int) -> int:
        """A stage's index in the handshake: unique over every replica's stages."""
        return replica * self.p + stage

    def _link_key(self, replica: int, stage: int) -> bytes:
        return self.keys.link_key("stage", self.node,
                                  stage_node(replica, stage, self.pc.replicas))

    def _dial_link(self, addr: tuple[str, int], peer: int, key: bytes, what: str
                   ) -> link.Link:
        """Dial ``addr`` and authenticate as this stage to handshake index ``peer`` (a
        stage, or the pipeline's PS) under ``key``."""
        sock = _dial(addr)
        name = f"stage {self.node} -> {what} ({wire.peer_name(sock)})"
        try:
            dialer = protocol.Dialer(self.run_id, "stage", self._rank(self.replica, self.s),
                                     key, welcome_from=("stage", peer))
            session, _ = handshake.dial(sock, dialer, run_tag=self.tag, name=name,
                                        timeout_s=self.cfg.guard.handshake_timeout_s,
                                        log=self.log)
        except BaseException:
            sock.close()
            raise
        return link.Link.dialed(sock, session, peer=peer, name=name, run_tag=self.tag)

    def connect(self) -> None:
        dn, up = self._needs()
        accepted: dict[str, Any] = {}
        # Who may dial us, by handshake index: the upstream stage only.
        keys = {}
        if up is not None:
            keys[self._rank(self.replica, up)] = self._link_key(self.replica, up)

        def accept_all() -> None:
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            try:
                while "up" not in accepted and keys:
                    self.srv.settimeout(max(0.1, deadline - time.monotonic()))
                    sock, addr = self.srv.accept()
                    name = f"stage {self.node} <- {addr[0]}:{addr[1]}"
                    answerer = protocol.Answerer(self.run_id, "stage",
                                                 protocol.keys_by_index(keys),
                                                 accepts=f"stages {sorted(keys)}")
                    try:
                        session = handshake.answer(
                            sock, answerer, run_tag=self.tag, name=name,
                            welcome=("stage", self._rank(self.replica, self.s)),
                            timeout_s=self.cfg.guard.handshake_timeout_s,
                            log=self.log)
                    except handshake.HandshakeError as e:
                        # A stranger, or a stage claiming to be another: refuse it and
                        # keep waiting for the real neighbour.
                        self.log.emit("frame_error", peer=f"{addr[0]}:{addr[1]}",
                                      error=str(e))
                        print(f"{self.node}: {e}", file=sys.stderr, flush=True)
                        sock.close()
                        continue
                    accepted["up"] = link.Link.answered(sock, session, name=name,
                                                        run_tag=self.tag)
            except OSError as e:
                accepted["error"] = e

        t = threading.Thread(target=accept_all, daemon=True)
        t.start()
        if dn is not None:
            lk = self._dial_link(self.peers_addr[dn], self._rank(self.replica, dn),
                                 self._link_key(self.replica, dn), f"stage {dn}")
            wire.set_socket_options(lk.sock, nodelay=True, congestion=self.cfg.net.congestion)
            self.down = _Peer(dn, lk.sock, lk.name, conn=lk)
        t.join(CONNECT_TIMEOUT_S + 5)
        if "error" in accepted:
            raise StageError(f"stage {self.s}: accepting neighbours: {accepted['error']}")
        if up is not None:
            if "up" not in accepted:
                raise StageError(f"stage {self.s}: upstream stage {up} never connected")
            lk = accepted["up"]
            self.up = _Peer(up, lk.sock, lk.name, conn=lk)
        for peer in (self.down, self.up):
            if peer is None:
                continue
            if self.pc.pace_mbps > 0:  # the pacing shaping method, per stage-to-stage link
                set_max_pacing_rate(peer.sock, self.pc.pace_mbps * 1e6)
            reader = peer.link.reader()
            for target, name in ((self._read_loop, "read"), (self._send_loop, "send")):
                args = (peer, reader) if name == "read" else (peer,)
                th = threading.Thread(target=target, args=args, daemon=True,
                                      name=f"{name}-s{peer.stage}")
                th.start()
                peer.threads.append(th)
        self.log.emit("stage_ready", stage=self.s, replica=self.replica,
                      chunks=self.schedule.chunks, schedule=self.pc.schedule,
                      params=sum(v[0].numel for v in self.versions.values()),
                      actions=len(self.actions))

    def connect_ps(self) -> None:
        """Dial the PS (``--ps``): an authenticated link (:mod:`agents.net.link`) as ``stage``
        ``replica * p + s``, under the key only this stage and the PS hold."""
        if self.ps_addr is None:
            return
        lk = self._dial_link(self.ps_addr, ps_index(self.p, self.pc.replicas),
                             self.keys.link_key("stage", self.node, PS_NODE), "ps")
        sock = lk.sock
        wire.set_socket_options(sock, nodelay=True, congestion=self.cfg.net.congestion)
        peer = f"ps ({wire.peer_name(sock)})"
        ps_link = _PSLink(sock, lk.reader(), lk)
        ps_link.thread = threading.Thread(target=self._ps_send_loop, args=(ps_link, peer),
                                          daemon=True, name="send-ps")
        ps_link.thread.start()
        self.ps_link = ps_link

    def _ps_send_loop(self, link: _PSLink, peer: str) -> None:
        me = ps_node_id(self.s, self.replica, self.p)
        while True:
            item = link.outbox.get()
            if item is None:
                return
            msg_type, step, chunk, t = item
            t0 = now_ns()
            try:
                n = link.conn.send_message([t], msg_type=msg_type, worker=me,
                                           iteration=step, chunk=chunk)
            except OSError as e:
                link.error = f"{peer}: send failed: {e}"
                self._fail(link.error)
                return
            self.log.emit("pp_ps_send", iter=step, chunk=chunk, bytes=n, start_ns=t0,
                          end_ns=now_ns(),
                          kind="G" if msg_type == codec.MsgType.GRAD else "W")

    # -- receiving (reader threads) -------------------------------------------------------

    def _read_loop(self, peer: _Peer, reader: wire.FrameReader) -> None:
        try:
            while True:
                parts = reader.read_message()
                h = parts[0][0]
                if h.msg_type == codec.MsgType.BYE:
                    return
                self._accept_message(peer, h, [t for _, t in parts])
        except wire.ConnectionClosed:
            return
        except (codec.FrameError, PayloadError, StageError, OSError, ValueError) as e:
            self._fail(f"{peer.peer}: {e}")

    def _accept_message(self, peer: _Peer, h: codec.FrameHeader,
                        tensors: list[torch.Tensor]) -> None:
        if h.msg_type == ACT:
            kind, comp = Kind.RECV_ACT, _compressor(self.act_send)
        elif h.msg_type == GRAD:
            kind, comp = Kind.RECV_GRAD, _compressor(self.grad_send)
        else:
            raise StageError(f"unexpected {h.msg_type.name}")
        key = (kind, h.micro_batch, h.chunk)
        if key not in self.expected:
            raise StageError(f"{h.describe()}: not a message stage {self.s}'s schedule "
                             f"receives (or received already)")
        src = self.schedule.upstream(self.s, h.chunk) if kind is Kind.RECV_ACT \
            else self.schedule.downstream(self.s, h.chunk)
        if src is None or src[0] != peer.stage or h.stage != peer.stage:
            raise StageError(f"{h.describe()}: came from stage {h.stage} on the connection "
                             f"of stage {peer.stage}, expected stage {src}")
        shape = (self.in_shape[h.chunk] if kind is Kind.RECV_ACT
                 else self.shapes[self.schedule.position(self.s, h.chunk)])
        numel = int(torch.Size(shape).numel())
        if comp is None:
            if len(tensors) != 1 or tensors[0].dtype != torch.float32 \
                    or tensors[0].numel() != numel:
                raise StageError(f"{h.describe()}: expected one float32 tensor of {numel} "
                                 f"elements {tuple(shape)}, got "
                                 f"{[(t.dtype, t.numel()) for t in tensors]}")
            dense = tensors[0].reshape(shape)
        else:
            payload = comp.from_parts(tensors, numel, tuple(shape), torch.float32)
            dense = comp.decompress(payload).reshape(shape)
        if not torch.isfinite(dense).all():
            raise StageError(f"{h.describe()}: non-finite values")
        with self.inbox_cv:
            self.expected.discard(key)
            self.inbox[key] = dense
            self.inbox_cv.notify_all()

    def _fail(self, why: str) -> None:
        with self.inbox_cv:
            if self.failure is None:
                self.failure = why
                self.log.emit("frame_error", peer=why.split(":")[0], error=why)
            self.inbox_cv.notify_all()

    def _take(self, kind: Kind, mb: int, chunk: int) -> torch.Tensor:
        key = (kind, mb, chunk)
        deadline = time.monotonic() + self.cfg.run.timeout_s
        with self.inbox_cv:
            while key not in self.inbox:
                if self.failure is not None:
                    raise StageError(self.failure)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageError(f"stage {self.s}: timed out waiting for "
                                     f"{Action(kind, mb, chunk)}")
                self.inbox_cv.wait(left)
            return self.inbox.pop(key)

    # -- sending (sender threads) ----------------------------------------------------------

    def _send_loop(self, peer: _Peer) -> None:
        while True:
            item = peer.outbox.get()
            if item is None:
                return
            msg_type, mb, chunk, tensors = item
            t0 = now_ns()
            try:
                n = peer.link.send_message(tensors, msg_type=msg_type, worker=self.s,
                                           iteration=mb, chunk=chunk)
            except OSError as e:
                self._fail(f"{peer.peer}: send failed: {e}")
                return
            peer.bytes_sent += n
            self.log.emit("pp_send", iter=mb // self.pc.micro_batches,
                          kind="SA" if msg_type == ACT else "SG", mb=mb, chunk=chunk,
                          to=peer.stage, bytes=n, start_ns=t0, end_ns=now_ns())

    def _send(self, kind: Kind, mb: int, chunk: int, t: torch.Tensor) -> int:
        sch = self.schedule
        if kind is Kind.SEND_ACT:
            dst = sch.downstream(self.s, chunk)
            peer, msg, sender = self.down, ACT, self.act_send
        else:
            dst = sch.upstream(self.s, chunk)
            peer, msg, sender = self.up, GRAD, self.grad_send
        assert dst is not None and peer is not None and peer.stage == dst[0]
        t = t.detach().contiguous()
        if sender is None:
            tensors = [t.reshape(-1)]
        else:
            tensors = list(sender.compress(t, f"c{chunk}", self.cfg.compress.ratio)[0].tensors)
        peer.outbox.put((msg, mb, dst[1], tensors))
        return sum(x.numel() * x.element_size() + codec.HEADER_SIZE for x in tensors)

    # -- compute -------------------------------------------------------------------------

    def _model(self, chunk: int, mb: int) -> FlatModel:
        """The weights micro-batch ``mb`` uses through ``chunk``: a stale (2BW) chunk
        alternates two versions by step parity (version ``V_k`` serves step ``k``)."""
        vs = self.versions[chunk]
        return vs[(mb // self.pc.micro_batches) % len(vs)]

    def _pad(self, t0: float) -> None:
        """Sleep out the rest of ``compute_pad_ms`` (per stage share of the layers: a
        stage with two chunks pads each action to half of it, so every schedule does the
        same work per stage and step)."""
        want_s = self.pc.compute_pad_ms / 1000.0 / self.schedule.chunks
        pad = want_s - (time.perf_counter() - t0)
        if pad > 0:
            time.sleep(pad)

    def _forward(self, mb: int, chunk: int, x: torch.Tensor, grad: bool) -> None:
        t0 = time.perf_counter()
        pos = self.schedule.position(self.s, chunk)
        last = pos == self.schedule.positions - 1
        module = self._model(chunk, mb).module
        x = x.detach()
        if pos > 0:
            x.requires_grad_(True)
        held = _Held(x=x)
        self.held_bytes += x.numel() * x.element_size()
        if grad:
            counter = _SavedBytes(self._weight_storages)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                out = module(x)
                if last:
                    y = micro_batch(self.workload, self.pc, mb, self.replica).y
                    out = nn.functional.cross_entropy(out, y) / self.pc.micro_batches
            held.out, held.saved_bytes = out, counter.bytes
            self.held_bytes += counter.bytes
        else:
            with torch.no_grad():
                out = module(x)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self.held[(mb, chunk)] = held
        if last and held.out is not None:
            self.losses[mb] = float(held.out.detach()) * self.pc.micro_batches
        self._last_out = out
        self._pad(t0)

    def _recompute(self, mb: int, chunk: int) -> None:
        held = self.held[(mb, chunk)]
        self.held_bytes -= held.x.numel() * held.x.element_size()  # _forward re-adds it
        del self.held[(mb, chunk)]
        self._forward(mb, chunk, held.x, grad=True)

    def _backward(self, mb: int, chunk: int, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        t0 = time.perf_counter()
        held = self.held.pop((mb, chunk))
        assert held.out is not None, f"B{mb}.{chunk} without a forward's autograd graph"
        if grad_out is None:
            held.out.backward()
        else:
            held.out.backward(grad_out)
        self.held_bytes -= held.saved_bytes + held.x.numel() * held.x.element_size()
        self._pad(t0)
        return held.x.grad

    def _optimizer(self, step: int, chunk: int) -> None:
        """SGD on this stage's slice. Synchronous chunk: the step's gradient (averaged over
        replicas) updates the weights the next step uses. Stale chunk (2BW): the weights of
        step ``k`` (``vs[k % 2]``) had ``g(k)``; they become ``V_{k+2} = V_{k+1} - lr g(k)``."""
        vs = self.versions[chunk]
        fm = vs[step % len(vs)]
        self._average_replicas(step, chunk, fm.flat_grad)
        first = self.opt_count.get(chunk, 0) == 0
        self.opt_count[chunk] = self.opt_count.get(chunk, 0) + 1
        mom = self.cfg.workload.momentum
        buf = None
        if mom > 0:
            buf = self.momentum.setdefault(chunk, torch.zeros_like(fm.flat_params))
        if len(vs) == 2:
            fm.flat_params.copy_(vs[(step + 1) % 2].flat_params)
        wl = self.cfg.workload
        lr = lr_at(wl.lr, step, self.cfg.run.iterations, wl.lr_schedule, wl.lr_decay_at,
                   wl.lr_decay_factor)
        sgd_step_(fm.flat_params, fm.flat_grad, buf, lr=lr, momentum=mom, first=first)
        fm.zero_grad()

    def final_params(self, chunk: int) -> torch.Tensor:
        """The weights after the run: for a stale chunk, ``V_{S+1}`` (the last gradient
        applied once more, the flush at the end of training)."""
        vs = self.versions[chunk]
        return vs[(self.cfg.run.iterations + 1) % len(vs)].flat_params \
            if len(vs) == 2 else vs[0].flat_params

    # -- data-parallel replicas ------------------------------------------------------------

    def _average_replicas(self, step: int, chunk: int, grad: torch.Tensor) -> None:
        """Replace ``grad`` by its mean over the d replicas: send it to the PS and wait for
        the mean (the PS answers only when all d are in, so ``grad`` is not touched while
        the sender thread still writes it)."""
        if self.pc.replicas == 1:
            return
        link = self.ps_link
        assert link is not None
        link.outbox.put((codec.MsgType.GRAD, step, chunk, grad))
        try:
            parts = link.reader.read_message()
        except wire.ConnectionClosed as e:
            raise StageError(f"{link.reader.peer}: closed while stage {self.s} waited for "
                             f"the mean gradient of step {step} chunk {chunk} ({e})") from None
        h, t = parts[0]
        if (h.msg_type != codec.MsgType.UPDATE or h.iteration != step or h.chunk != chunk
                or len(parts) != 1 or t.numel() != grad.numel() or t.dtype != torch.float32
                or not bool(torch.isfinite(t).all())):
            raise StageError(f"{link.reader.peer}: expected the mean gradient of step {step} "
                             f"chunk {chunk} ({grad.numel()} float32), got {h.describe()} "
                             f"with {[(x.dtype, x.numel()) for _, x in parts]}")
        grad.copy_(t.reshape(-1))

    def _send_weights(self, step: int) -> None:
        """Replica 0, after an evaluated step: every chunk's freshest weights to the PS (a
        stale chunk's just-updated version, what ``final_params`` gives after the last)."""
        if self.ps_link is None or self.replica != 0 or not is_eval_step(self.cfg.run, step):
            return
        for c, vs in self.versions.items():
            self.ps_link.outbox.put((codec.MsgType.SLICE_WEIGHTS, step, c,
                                     vs[step % len(vs)].flat_params.clone()))

    # -- the schedule --------------------------------------------------------------------

    def run(self) -> int:
        self.connect()
        self.connect_ps()
        m = self.pc.micro_batches
        step_start = now_ns()
        outputs: dict[tuple[int, int], torch.Tensor] = {}
        grads_in: dict[tuple[int, int], torch.Tensor] = {}
        acts_in: dict[tuple[int, int], torch.Tensor] = {}
        in_grads: dict[tuple[int, int], torch.Tensor] = {}
        for a in self.actions:
            if self.failure is not None:
                raise StageError(self.failure)
            t0 = now_ns()
            nbytes = 0
            key = (a.mb, a.chunk)
            k = a.kind
            if k is Kind.RECV_ACT:
                acts_in[key] = self._take(k, a.mb, a.chunk)
            elif k is Kind.RECV_GRAD:
                grads_in[key] = self._take(k, a.mb, a.chunk)
            elif k is Kind.FORWARD:
                pos = self.schedule.position(self.s, a.chunk)
                x = (micro_batch(self.workload, self.pc, a.mb, self.replica).x if pos == 0
                     else acts_in.pop(key))
                recomputes = self.pc.recompute and Action(Kind.RECOMPUTE, a.mb, a.chunk) \
                    in self._recomputed
                self._forward(a.mb, a.chunk, x, grad=not recomputes)
                outputs[key] = self._last_out
            elif k is Kind.RECOMPUTE:
                self._recompute(a.mb, a.chunk)
            elif k is Kind.SEND_ACT:
                nbytes = self._send(k, a.mb, a.chunk, outputs.pop(key))
            elif k is Kind.BACKWARD:
                outputs.pop(key, None)
                g_in = self._backward(a.mb, a.chunk, grads_in.pop(key, None))
                if g_in is not None:
                    in_grads[key] = g_in
            elif k is Kind.SEND_GRAD:
                nbytes = self._send(k, a.mb, a.chunk, in_grads.pop(key))
            elif k is Kind.OPTIMIZER:
                self._optimizer(a.mb, a.chunk)
            self.log.emit("pp_action", iter=(a.mb if k is Kind.OPTIMIZER else a.mb // m),
                          kind=k.value, mb=a.mb, chunk=a.chunk, start_ns=t0, end_ns=now_ns(),
                          bytes=nbytes, held_bytes=self.held_bytes)
            if k is Kind.OPTIMIZER and a.chunk == self._last_opt_chunk(a.mb):
                losses = [self.losses[i] for i in range(a.mb * m, (a.mb + 1) * m)
                          if i in self.losses]
                self.log.emit("pp_step_done", iter=a.mb, step_s=(now_ns() - step_start) / 1e9,
                              loss=(sum(losses) / len(losses)) if losses else None,
                              peak_held_bytes=self.peak_held_bytes,
                              bytes_down=self.down.bytes_sent if self.down else 0,
                              bytes_up=self.up.bytes_sent if self.up else 0)
                self._send_weights(a.mb)
                step_start = now_ns()
        self._finish()
        return 0

    @property
    def _recomputed(self) -> set[Action]:
        cached: set[Action] | None = getattr(self, "_recomputed_cache", None)
        if cached is None:
            cached = {a for a in self.actions if a.kind is Kind.RECOMPUTE}
            self._recomputed_cache = cached
        return cached

    def _last_opt_chunk(self, step: int) -> int:
        opts = [a.chunk for a in self.actions if a.kind is Kind.OPTIMIZER and a.mb == step]
        return opts[-1]

    def _finish(self) -> None:
        for peer in (self.down, self.up):
            if peer is not None:
                peer.outbox.put(None)
                peer.threads[1].join(self.cfg.run.timeout_s)
        # Tell the neighbours we are done sending; wait until they are done too, so no
        # socket closes under a message still in flight.
        for peer in (self.down, self.up):
            if peer is None:
                continue
            try:
                peer.link.send_bytes(b"done", msg_type=codec.MsgType.BYE, worker=self.s)
            except OSError:
                pass
        for peer in (self.down, self.up):
            if peer is not None:
                peer.threads[0].join(self.cfg.run.timeout_s)
        if self.ps_link is not None:
            self._close_ps(self.ps_link)
        if self.failure is not None:
            raise StageError(self.failure)
        out = {c: self.final_params(c).clone() for c in self.versions}
        run_dir = self.log.path.parent.parent
        torch.save(out, run_dir / f"{self.node}_final_weights.pt")
        self.log.emit("pp_done", stage=self.s, replica=self.replica,
                      peak_held_bytes=self.peak_held_bytes,
                      bytes_down=self.down.bytes_sent if self.down else 0,
                      bytes_up=self.up.bytes_sent if self.up else 0)
        for peer in (self.down, self.up):
            if peer is not None:
                peer.sock.close()
        self.srv.close()


    def _close_ps(self, link: _PSLink) -> None:
        """Everything queued for the PS goes out, then BYE (nothing more comes back: every
        mean was read before the last optimizer step ended)."""
        link.outbox.put(None)
        if link.thread is not None:
            link.thread.join(self.cfg.run.timeout_s)
        me = ps_node_id(self.s, self.replica, self.p)
        try:
            link.conn.send_bytes(b"done", msg_type=codec.MsgType.BYE, worker=me)
        except OSError as e:
            self._fail(f"{link.reader.peer}: BYE failed: {e}")
        link.sock.close()


def _clone_module(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def _dial(addr: tuple[str, int]) -> socket.socket:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection(addr, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def parse_peers(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--peers: {item!r} is not HOST:PORT")
        out.append((host, int(port)))
    return out


def main(argv: list[str] | None = None, on_error: Callable[[str], None] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.pipeline.stage",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--stage", required=True, type=int)
    ap.add_argument("--replica", type=int, default=0)
    ap.add_argument("--peers", required=True, help="HOST:PORT of every stage of this replica")
    ap.add_argument("--ps", default=None, help="HOST:PORT of the pipeline's PS (averages "
                    "the replicas' stage gradients, evaluates; needed with d > 1)")
    auth.add_auth_argument(ap)
    args = ap.parse_args(argv)
    cfg = cfgmod.load(args.run_dir / "config.toml")
    # With --auth stdin the bundle holds this agent's control key and the key of each link
    # it is an end of (agents.net.link), which only the link's two ends hold.
    keys, secret = auth.agent_keys(args.auth, args.run_dir, codec.PUBLIC_SECRET)
    # Heartbeats on the control channel: a hung agent is declared lost by the controller.
    liveness_client(args.run_dir, keys, timeout_s=cfg.guard.handshake_timeout_s)
    torch.set_num_threads(1)
    ps = parse_peers(args.ps)[0] if args.ps else None
    st = Stage(cfg, args.run_dir, args.run_dir.name, secret, args.stage,
               parse_peers(args.peers), args.replica, ps, keys)
    return wire.run_agent(st.run, name=lambda: st.node,
                          errors=(StageError, ConnectionError, codec.FrameError, OSError),
                          code=2, on_error=lambda e: st.log.emit("stage_error", error=e),
                          close=st.log.close)


if __name__ == "__main__":
    wire.exit_process(main())
