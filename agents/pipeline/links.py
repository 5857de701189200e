"""A stage's links: the connections to its neighbour stages and to the pipeline's PS, the
messages on them, and nothing of the model.

- **Connecting.** A stage dials its downstream neighbour and answers its upstream one
  (a ring for the two-group schedule), each through the one handshake driver
  (:mod:`agents.net.handshake`: ``dial``, and ``accept_forever`` + ``answer`` on the
  listening side) under the key only the link's two ends hold; a stranger, or a stage
  claiming to be another, is refused (``frame_error``) and the stage keeps waiting for
  its real neighbour. With ``--ps`` it also dials the pipeline's PS.
- **Sending.** Every link has one :class:`LinkSender`: a thread writing its queued
  messages in order, so a send never blocks compute (as the schedule's validator
  assumes). Compression (``pipeline.act_compress`` / ``grad_compress``) is applied on the
  caller's thread before the message is queued.
- **Receiving.** One reader thread per neighbour checks each message's header against
  the connection's :class:`~agents.pipeline.conversation.Conversation` (the exact
  messages that neighbour's schedule sends, then BYE), decodes it to exactly the
  boundary's shape, refuses non-finite values, and files it for :meth:`StageLinks.take`.
  The first failure on any thread is kept and raised on the runtime's next call.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agents.compress.base import Compressor, PayloadError
from agents.compress.builder import CompressionSpec, Sender
from agents.core import config as cfgmod
from agents.core.events import now_ns
from agents.core.nodes import PS_NODE, stage_node
from agents.core.schedules import Action, Kind, Schedule
from agents.net import admission, auth, codec, handshake, link, protocol, wire
from agents.net.admission import AdmissionLimits
from agents.net.pacing import set_max_pacing_rate
from agents.pipeline import conversation
from agents.pipeline.common import (
    CONNECT_TIMEOUT_S,
    LockedLog,
    StageError,
    ps_index,
    ps_node_id,
)

ACT, GRAD = codec.MsgType.ACTIVATION, codec.MsgType.GRADIENT_BACK


def pipeline_sender(name: str, error_feedback: bool, seed: int, stage: int) -> Sender | None:
    """The sender of one direction of a stage's links; None for ``none``, whose tensors go
    out as they are, without a compressor's framing."""
    if name == "none":
        return None
    return Sender(CompressionSpec(name, error_feedback=error_feedback), seed, stage)


@dataclass(frozen=True)
class Outgoing:
    """One message queued on a link: frame kind, ``iteration`` and ``chunk`` fields."""

    msg_type: codec.MsgType
    iteration: int
    chunk: int
    tensors: tuple[torch.Tensor, ...]


#: ``sent(message, bytes on the wire, start_ns)``, after the kernel took it.
OnSent = Callable[[Outgoing, int, int], None]


class LinkSender:
    """One thread writing one link's messages in the order they were queued, each sealed
    under the link's MAC and signed as ``worker``. A failed write is reported once through
    ``fail`` and ends the thread."""

    def __init__(self, lk: link.Link, *, worker: int, sent: OnSent,
                 fail: Callable[[str], None], name: str) -> None:
        self.link, self.worker = lk, worker
        self._sent, self._fail = sent, fail
        self.outbox: queue.Queue[Outgoing | None] = queue.Queue()
        self.bytes_sent = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name=name)
        self.thread.start()

    def put(self, msg: Outgoing) -> None:
        self.outbox.put(msg)

    def close(self, timeout_s: float) -> None:
        """Write out everything queued, then stop."""
        self.outbox.put(None)
        self.thread.join(timeout_s)

    def _loop(self) -> None:
        while (msg := self.outbox.get()) is not None:
            t0 = now_ns()
            try:
                n = self.link.send_message(msg.tensors, msg_type=msg.msg_type,
                                           worker=self.worker, iteration=msg.iteration,
                                           chunk=msg.chunk)
            except OSError as e:
                self._fail(f"{self.link.name}: send failed: {e}")
                return
            self.bytes_sent += n
            self._sent(msg, n, t0)


class Inbox:
    """What the reader threads received, by ``(kind, mb, chunk)``, and the first failure of
    any thread; :meth:`take` waits for one message or that failure."""

    def __init__(self, timeout_s: float, log: LockedLog) -> None:
        self.timeout_s = timeout_s
        self.log = log
        self.items: dict[tuple[Kind, int, int], torch.Tensor] = {}
        self.failure: str | None = None
        self._cv = threading.Condition()

    def put(self, key: tuple[Kind, int, int], t: torch.Tensor) -> None:
        with self._cv:
            self.items[key] = t
            self._cv.notify_all()

    def fail(self, why: str) -> None:
        """Keep the first failure (reported as ``frame_error``) and wake the runtime."""
        with self._cv:
            if self.failure is None:
                self.failure = why
                self.log.emit("frame_error", peer=why.split(":")[0], error=why)
            self._cv.notify_all()

    def check(self) -> None:
        if self.failure is not None:
            raise StageError(self.failure)

    def take(self, key: tuple[Kind, int, int], who: str) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        with self._cv:
            while key not in self.items:
                self.check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageError(f"{who}: timed out waiting for {Action(*key)}")
                self._cv.wait(left)
            return self.items.pop(key)


@dataclass
class Neighbour:
    """One connection to a neighbour stage: ``upstream`` when that stage feeds this one
    (its activations come in, this stage's gradients go out)."""

    stage: int
    link: link.Link
    upstream: bool
    talk: conversation.Conversation
    sender: LinkSender | None = None
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return self.sender.bytes_sent if self.sender is not None else 0


def _dial(addr: tuple[str, int], source: str) -> socket.socket:
    """Connect to ``addr`` from ``source`` (this stage's own address, the one its peers
    keep an admission slot for), retrying until ``CONNECT_TIMEOUT_S`` (the peer may not
    listen yet: every stage starts at once)."""
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while True:
        try:
            return socket.create_connection(addr, timeout=CONNECT_TIMEOUT_S,
                                            source_address=(source, 0))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class StageLinks:
    """Stage ``stage`` of replica ``replica``: its listening socket, its neighbours, its
    link to the pipeline's PS. ``in_shape[c]`` / ``out_shape[c]``: the shapes chunk ``c``
    receives activations and gradients in."""

    def __init__(self, cfg: cfgmod.ExperimentConfig, schedule: Schedule, *, stage: int,
                 replica: int, run_id: str, tag: int, keys: auth.KeyBundle,
                 peers: list[tuple[str, int]], ps: tuple[str, int] | None, log: LockedLog,
                 in_shape: dict[int, torch.Size], out_shape: dict[int, torch.Size]) -> None:
        self.cfg, self.pc, self.schedule = cfg, cfg.pipeline, schedule
        self.s, self.replica, self.p = stage, replica, cfg.pipeline.stages
        self.node = stage_node(replica, stage, self.pc.replicas)
        self.run_id, self.tag, self.keys, self.log = run_id, tag, keys, log
        self.peers_addr, self.ps_addr = peers, ps
        self.in_shape, self.out_shape = in_shape, out_shape
        # Activations downstream never keep a residual (each micro-batch's is new data).
        seed = cfg.run.seed
        self.act_send = pipeline_sender(self.pc.act_compress, False, seed, stage)
        self.grad_send = pipeline_sender(self.pc.grad_compress, self.pc.error_feedback,
                                         seed, stage)
        self.inbox = Inbox(cfg.run.timeout_s, log)
        self.down: Neighbour | None = None
        self.up: Neighbour | None = None
        self.ps: LinkSender | None = None
        self.ps_reader: wire.FrameReader | None = None
        self.ps_talk = conversation.Conversation(
            conversation.from_stage_ps(schedule, stage, self.pc.replicas), "ps")
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wire.set_socket_options(self.srv, nodelay=True, congestion=cfg.net.congestion)
        self.srv.bind(("0.0.0.0" if peers[stage][0] != "127.0.0.1" else "127.0.0.1",
                       peers[stage][1]))
        self.srv.listen(handshake.LISTEN_BACKLOG)

    @property
    def neighbours(self) -> list[Neighbour]:
        return [nb for nb in (self.down, self.up) if nb is not None]

    # -- connecting ------------------------------------------------------------------------

    def _needs(self) -> tuple[int | None, int | None]:
        """(downstream stage, upstream stage) this stage talks to, None where none."""
        sch = self.schedule
        dn = {d[0] for c in range(sch.chunks) if (d := sch.downstream(self.s, c)) is not None}
        up = {u[0] for c in range(sch.chunks) if (u := sch.upstream(self.s, c)) is not None}
        assert len(dn) <= 1 and len(up) <= 1
        return (dn.pop() if dn else None), (up.pop() if up else None)

    def _rank(self, stage: int) -> int:
        """A stage's index in the handshake: unique over every replica's stages."""
        return self.replica * self.p + stage

    def _link_key(self, stage: int) -> bytes:
        return self.keys.link_key("stage", self.node,
                                  stage_node(self.replica, stage, self.pc.replicas))

    def _dial_link(self, addr: tuple[str, int], peer: int, key: bytes, what: str
                   ) -> link.Link:
        """Dial ``addr`` and authenticate as this stage to handshake index ``peer`` (a
        stage, or the pipeline's PS) under ``key``."""
        sock = _dial(addr, self.peers_addr[self.s][0])
        name = f"stage {self.node} -> {what} ({wire.peer_name(sock)})"
        try:
            dialer = protocol.Dialer(self.run_id, "stage", self._rank(self.s), key,
                                     welcome_from=("stage", peer))
            session, _ = handshake.dial(sock, dialer, run_tag=self.tag, name=name,
                                        timeout_s=self.cfg.guard.handshake_timeout_s,
                                        log=self.log)
        except BaseException:
            sock.close()
            raise
        wire.set_socket_options(sock, nodelay=True, congestion=self.cfg.net.congestion)
        return link.Link.dialed(sock, session, peer=peer, name=name, run_tag=self.tag)

    def _start_accepting(self, up: int) -> queue.Queue[link.Link]:
        """Answer connections (``handshake.accept_forever``, under the admission limits of
        ``[guard]``, the upstream stage's address keeping a slot of its own) until the
        upstream stage has proved itself; its link arrives on the returned queue. Anyone
        else is refused."""
        got: queue.Queue[link.Link] = queue.Queue()
        done = threading.Event()
        keys = {self._rank(up): self._link_key(up)}
        lock = threading.Lock()

        def on_connection(sock: socket.socket, peer: str) -> None:
            name = f"stage {self.node} <- {peer}"
            answerer = protocol.Answerer(self.run_id, "stage", protocol.keys_by_index(keys),
                                         accepts=f"stages {sorted(keys)}")
            session = handshake.answer(
                sock, answerer, run_tag=self.tag, name=name,
                welcome=("stage", self._rank(self.s)),
                timeout_s=self.cfg.guard.handshake_timeout_s, log=self.log)
            with lock:  # only the neighbour holds the key; it is let in once
                if done.is_set():
                    raise handshake.HandshakeError(f"{name}: already connected",
                                                   "already connected")
                done.set()
            got.put(link.Link.answered(sock, session, name=name, run_tag=self.tag))

        threading.Thread(target=handshake.accept_forever, name="accept", daemon=True,
                         args=(self.srv, on_connection),
                         kwargs=dict(stopped=done, report=self._refused,
                                     limits=AdmissionLimits.from_guard(self.cfg.guard),
                                     expected=(self.peers_addr[up][0],))
                         ).start()
        return got

    def _refused(self, r: admission.RefusalReport) -> None:
        """Strangers, or a stage claiming to be another (aggregated by the driver)."""
        self.log.emit("refused", source=r.source, reason=r.reason, count=r.count,
                      example=r.example)
        self.log.emit("frame_error", peer=r.source, error=r.example)
        print(f"{self.node}: {r.example}", file=sys.stderr, flush=True)

    def connect(self) -> None:
        """Dial the downstream neighbour, answer the upstream one, and start each link's
        reader and sender."""
        dn, up = self._needs()
        accepted = self._start_accepting(up) if up is not None else None
        if dn is not None:
            lk = self._dial_link(self.peers_addr[dn], self._rank(dn), self._link_key(dn),
                                 f"stage {dn}")
            self.down = self._neighbour(dn, lk, upstream=False)
        if up is not None and accepted is not None:
            try:
                lk = accepted.get(timeout=CONNECT_TIMEOUT_S)
            except queue.Empty:
                raise StageError(f"stage {self.s}: upstream stage {up} never connected "
                                 f"within {CONNECT_TIMEOUT_S:g} s") from None
            self.up = self._neighbour(up, lk, upstream=True)
        for nb in self.neighbours:
            self._start(nb)

    def _neighbour(self, stage: int, lk: link.Link, *, upstream: bool) -> Neighbour:
        script = conversation.from_neighbour(self.schedule, self.s, stage, upstream=upstream)
        return Neighbour(stage, lk, upstream, conversation.Conversation(script, lk.name))

    def _start(self, nb: Neighbour) -> None:
        if self.pc.pace_mbps > 0:  # the pacing shaping method, per stage-to-stage link
            set_max_pacing_rate(nb.link.sock, self.pc.pace_mbps * 1e6)
        reader = threading.Thread(target=self._read_loop, args=(nb, nb.link.reader()),
                                  daemon=True, name=f"read-s{nb.stage}")
        reader.start()
        nb.threads.append(reader)
        nb.sender = LinkSender(nb.link, worker=self.s, fail=self.inbox.fail,
                               sent=lambda msg, n, t0: self._sent(nb, msg, n, t0),
                               name=f"send-s{nb.stage}")

    def connect_ps(self) -> None:
        """Dial the PS (``--ps``): an authenticated link as ``stage`` ``replica * p + s``,
        under the key only this stage and the PS hold."""
        if self.ps_addr is None:
            return
        lk = self._dial_link(self.ps_addr, ps_index(self.p, self.pc.replicas),
                             self.keys.link_key("stage", self.node, PS_NODE), "ps")
        self.ps_talk.peer = lk.name
        self.ps_reader = lk.reader()
        self.ps = LinkSender(lk, worker=ps_node_id(self.s, self.replica, self.p),
                             sent=self._sent_ps, fail=self.inbox.fail, name="send-ps")

    # -- sending ---------------------------------------------------------------------------

    def send(self, kind: Kind, mb: int, chunk: int, t: torch.Tensor) -> int:
        """Queue ``SA`` (to the downstream neighbour) or ``SG`` (upstream) of micro-batch
        ``mb`` from ``chunk``, compressed; returns its bytes on the wire."""
        act = kind is Kind.SEND_ACT
        nb, sender = (self.down, self.act_send) if act else (self.up, self.grad_send)
        dst = (self.schedule.downstream if act else self.schedule.upstream)(self.s, chunk)
        assert dst is not None and nb is not None and nb.sender is not None \
            and nb.stage == dst[0]
        t = t.detach().contiguous()
        tensors = ((t.reshape(-1),) if sender is None else
                   tuple(sender.compress(t, f"c{chunk}", self.cfg.compress.ratio)[0].tensors))
        nb.sender.put(Outgoing(ACT if act else GRAD, mb, dst[1], tensors))
        return sum(x.numel() * x.element_size() + codec.HEADER_SIZE for x in tensors)

    def _sent(self, nb: Neighbour, msg: Outgoing, n: int, t0: int) -> None:
        self.log.emit("pp_send", iter=msg.iteration // self.pc.micro_batches,
                      kind="SA" if msg.msg_type == ACT else "SG", mb=msg.iteration,
                      chunk=msg.chunk, to=nb.stage, bytes=n, start_ns=t0, end_ns=now_ns())

    def _sent_ps(self, msg: Outgoing, n: int, t0: int) -> None:
        self.log.emit("pp_ps_send", iter=msg.iteration, chunk=msg.chunk, bytes=n,
                      start_ns=t0, end_ns=now_ns(),
                      kind="G" if msg.msg_type == codec.MsgType.GRAD else "W")

    def send_weights(self, step: int, weights: dict[int, torch.Tensor]) -> None:
        """Every chunk's weights after step ``step``, to the PS (which evaluates them)."""
        assert self.ps is not None
        for c, w in weights.items():
            self.ps.put(Outgoing(codec.MsgType.SLICE_WEIGHTS, step, c, (w.clone(),)))

    # -- receiving -------------------------------------------------------------------------

    def _read_loop(self, nb: Neighbour, reader: wire.FrameReader) -> None:
        try:
            while not nb.talk.finished:
                parts = reader.read_message()
                arrived_ns = now_ns()  # before decoding: when the network was done with it
                want = nb.talk.receive(parts[0][0])
                if want.kind != codec.MsgType.BYE:
                    self.log.emit("pp_recv", iter=want.iteration // self.pc.micro_batches,
                                  kind="RA" if want.kind == ACT else "RG",
                                  mb=want.iteration, chunk=want.chunk, from_stage=nb.stage,
                                  arrived_ns=arrived_ns)
                    self._file(nb, want, [t for _, t in parts])
        except wire.ConnectionClosed as e:
            owed = nb.talk.next
            assert owed is not None
            self.inbox.fail(f"{nb.link.name}: closed before {owed.describe()} ({e})")
        except (codec.FrameError, PayloadError, StageError, OSError, ValueError) as e:
            self.inbox.fail(f"{nb.link.name}: {e}")

    def _file(self, nb: Neighbour, want: conversation.Expected,
              tensors: list[torch.Tensor]) -> None:
        """Decode an accepted message to its boundary's dense tensor and file it."""
        act = want.kind == ACT
        shape = self.in_shape[want.chunk] if act else self.out_shape[want.chunk]
        sender = self.act_send if act else self.grad_send
        what = f"{want.kind.name} iter={want.iteration} chunk={want.chunk}"
        dense = _dense(_compressor(sender), tensors, shape, what)
        self.inbox.put((Kind.RECV_ACT if act else Kind.RECV_GRAD, want.iteration,
                        want.chunk), dense)

    def take(self, kind: Kind, mb: int, chunk: int) -> torch.Tensor:
        """The received tensor of ``RA``/``RG`` (mb, chunk), waiting up to
        ``run.timeout_s``; StageError on any link's failure."""
        return self.inbox.take((kind, mb, chunk), f"stage {self.s}")

    def average(self, step: int, chunk: int, grad: torch.Tensor) -> None:
        """Replace ``grad`` by its mean over the d replicas: send it to the PS and wait for
        the mean (the PS answers only when all d are in, so ``grad`` is not touched while
        the sender thread still writes it)."""
        assert self.ps is not None and self.ps_reader is not None
        self.ps.put(Outgoing(codec.MsgType.GRAD, step, chunk, (grad,)))
        try:
            parts = self.ps_reader.read_message()
            want = self.ps_talk.receive(parts[0][0])
        except wire.ConnectionClosed as e:
            raise StageError(f"{self.ps.link.name}: closed while stage {self.s} waited for "
                             f"the mean gradient of step {step} chunk {chunk} ({e})") from None
        assert (want.iteration, want.chunk) == (step, chunk), (want, step, chunk)
        what = f"the mean gradient of step {step} chunk {chunk}"
        grad.copy_(_dense(None, [t for _, t in parts], grad.shape, what))

    # -- closing ---------------------------------------------------------------------------

    def finish(self) -> None:
        """Write out everything queued, say BYE to each neighbour and wait for theirs, so
        no socket closes under a message still in flight; then BYE to the PS (nothing more
        comes back from it: every mean was read before the last optimizer step ended)."""
        timeout_s = self.cfg.run.timeout_s
        for nb in self.neighbours:
            if nb.sender is not None:
                nb.sender.close(timeout_s)
        for nb in self.neighbours:
            try:
                nb.link.send_bytes(b"done", msg_type=codec.MsgType.BYE, worker=self.s)
            except OSError:
                pass
        for nb in self.neighbours:
            for th in nb.threads:
                th.join(timeout_s)
        if self.ps is not None:
            self.ps.close(timeout_s)
            try:
                self.ps.link.send_bytes(b"done", msg_type=codec.MsgType.BYE,
                                        worker=self.ps.worker)
            except OSError as e:
                self.inbox.fail(f"{self.ps.link.name}: BYE failed: {e}")
        self.inbox.check()

    def close(self) -> None:
        """Close every socket; the listening one is shut down first, which wakes the
        accepting thread."""
        for lk in [nb.link for nb in self.neighbours] + (
                [self.ps.link] if self.ps is not None else []):
            lk.sock.close()
        try:
            self.srv.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.srv.close()


def _compressor(sender: Sender | None) -> Compressor | None:
    return None if sender is None else sender.compressor


def _dense(comp: Compressor | None, tensors: list[torch.Tensor], shape: Any, what: str
           ) -> torch.Tensor:
    """A received message as a dense float32 tensor of exactly ``shape``, finite; without
    a compressor, exactly one float32 tensor of that many elements."""
    numel = int(torch.Size(shape).numel())
    if comp is None:
        if len(tensors) != 1 or tensors[0].dtype != torch.float32 \
                or tensors[0].numel() != numel:
            raise StageError(f"{what}: expected one float32 tensor of {numel} elements "
                             f"{tuple(shape)}, got {[(t.dtype, t.numel()) for t in tensors]}")
        dense = tensors[0].reshape(shape)
    else:
        dense = comp.decompress(comp.from_parts(tensors, numel, tuple(shape),
                                                torch.float32)).reshape(shape)
    if not bool(torch.isfinite(dense).all()):
        raise StageError(f"{what}: non-finite values")
    return dense
