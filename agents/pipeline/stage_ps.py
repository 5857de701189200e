"""The pipeline's PS: averages the stage gradients of d pipeline replicas once per step and
evaluates the model the stages hold (DESIGN.md 1.3, data parallel across pipelines: the
planner's layout (t = 1, p, d), seeds/003).

Run on its own host as ``python -m agents.pipeline.stage_ps --run-dir RUN --port P`` (the stage
role places it on the fabric's host ``p * d``). Every stage ``s`` of every replica ``r``
dials it and says HELLO as stage ``r * p + s``.

What each connection carries is fixed by the stage's schedule, so the PS knows the one
message that may come next on each: for every optimizer action (step ``k``, chunk ``c``) of
stage ``s``'s schedule, with ``d > 1``, a ``GRAD`` holding that chunk's slice gradient;
after step ``k``'s last optimizer action, from replica 0 and at an evaluated step
(:func:`agents.pipeline.common.is_eval_step`), one ``SLICE_WEIGHTS`` per chunk; then ``BYE``. A frame
out of that order, of the wrong size, or a gradient failing the PS's checks
(:func:`agents.compress.checks.check_gradient`: finite, within ``guard.max_abs_grad``) ends the
run with a ``frame_error`` naming the peer, and the PS closes every connection, so no stage
waits for a mean that will not come.

Every stage connection is served by one event loop on the main thread
(:mod:`agents.net.loop`, the data-parallel PS's loop): it reads what has arrived, checks
each complete message and writes each connection's queued means as its socket takes
them, so the PS runs the same threads whatever the number of stages.

Averaging: once the d gradients of ``(k, s, c)`` are in, ``mean = (g_0 + ... + g_{d-1}) /
d``, summed in replica order, is queued as ``UPDATE`` to every replica's connection; each replica applies the same SGD step to the same mean, so
the replicas stay identical (``tests/agents/pipeline/test_pipeline_transparency.py``). Per step the link of
stage ``s`` of each replica carries its slice gradient up and the mean down
(:func:`analysis.planner.pipeline_dp_link_bytes`).

Evaluation: once every stage's weights of step ``k`` are in, they are copied into the
whole model (the pieces share its parameter tensors) and a thread of its own evaluates it
on the workload's held-out set (``eval``; after the last step also ``final_eval``), so the
averaging never waits for an evaluation. These are the data-parallel PS's events, from node
``ps``, so time to accuracy and final accuracy come out of the same code
(:func:`analysis.metrics.time_to_accuracy`).
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time
from pathlib import Path

import torch

from agents.compress.base import PayloadError
from agents.compress.checks import check_gradient
from agents.core import config as cfgmod
from agents.core.events import EventLog
from agents.core.nodes import PS_NODE, stage_node, stage_ps_links
from agents.net import admission, auth, codec, handshake, link, loop, protocol, wire
from agents.net.admission import AdmissionLimits
from agents.net.control import liveness_client
from agents.pipeline import conversation
from agents.pipeline.common import CONNECT_TIMEOUT_S, LockedLog, build_schedule, ps_index
from agents.pipeline.partition import balance_by_params, split
from agents.workloads.base import FlatModel
from agents.workloads.factory import make_workload

GRAD, UPDATE = codec.MsgType.GRAD, codec.MsgType.UPDATE
# The event loop looks for a silent run at least this often.
POLL_S = 0.5
WEIGHTS, BYE = codec.MsgType.SLICE_WEIGHTS, codec.MsgType.BYE


class StagePSError(RuntimeError):
    """A stage sent what its schedule does not allow, or vanished."""


class _StageConn(loop.Transport):
    """Stage ``stage`` of replica ``replica`` on the PS's event loop: the transport, its
    link's MACs, and what it may send next (:mod:`agents.pipeline.conversation`)."""

    def __init__(self, replica: int, stage: int, lk: link.Link,
                 talk: conversation.Conversation) -> None:
        super().__init__(lk.sock, lk.name)
        self.replica = replica
        self.stage = stage
        self.link = lk
        self.talk = talk
        self.said_bye = False

    @property
    def node(self) -> str:
        return f"r{self.replica}s{self.stage}"


class StagePS:
    def __init__(self, cfg: cfgmod.ExperimentConfig, run_dir: Path, run_id: str,
                 secret: bytes, *, host: str = "0.0.0.0", port: int = 6000,
                 keys: auth.KeyBundle | None = None, expected: tuple[str, ...] = ()) -> None:
        """``keys``: the PS's bundle, with the key of its link to every stage (without it,
        derived from ``secret`` as ``--auth file`` does). ``expected``: the stages' source
        addresses, each with an admission slot of its own while strangers flood
        (``agents.net.admission``)."""
        self.expected = expected
        pc = cfg.pipeline
        self.cfg, self.pc = cfg, pc
        self.p, self.d = pc.stages, pc.replicas
        self.run_id = run_id
        bundle = keys or auth.file_bundle(secret, PS_NODE, stage_ps_links(self.p, self.d))
        self.link_keys = {r * self.p + s: bundle.link_key("stage", PS_NODE,
                                                          stage_node(r, s, self.d))
                          for r in range(self.d) for s in range(self.p)}
        self.log = LockedLog(EventLog.for_node(run_dir, run_id, PS_NODE))
        self.tag = codec.run_tag(run_id, secret)
        self.schedule = build_schedule(pc, cfg.run.iterations)
        self.workload = make_workload(cfg.workload, cfg.vision)
        self.model = self.workload.build_model(cfg.run.seed)
        positions = self.schedule.positions
        balance = list(pc.balance) or balance_by_params(self.model, positions)
        # One flat view per piece, in pipeline-position order; the pieces share the
        # model's parameters, so copying a stage's weights in updates the whole model.
        self.pieces = [FlatModel(piece) for piece in split(self.model, balance)]
        self.workload.prepare(self.model, -1, cfg.run.seed)
        self.max_payload_bytes = max(f.numel for f in self.pieces) * 4
        self.conns: dict[tuple[int, int], _StageConn] = {}
        self.joined: set[tuple[int, int]] = set()  # (replica, stage) authenticated
        self.loop = loop.EventLoop(self)
        self.open_conns = 0  # connections that have not said BYE
        self.grads: dict[tuple[int, int, int], dict[int, torch.Tensor]] = {}
        self.weights: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self.evals: queue.Queue[tuple[int, list[torch.Tensor]] | None] = queue.Queue()
        self.srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        wire.set_socket_options(self.srv, nodelay=True, congestion=cfg.net.congestion)
        self.srv.bind((host, port))
        self.srv.listen(max(handshake.LISTEN_BACKLOG, self.p * self.d))
        self.log.emit("ps_ready", numel=sum(f.numel for f in self.pieces),
                      chunks=len(self.pieces), compressor="none")

    def numel(self, stage: int, chunk: int) -> int:
        return self.pieces[self.schedule.position(stage, chunk)].numel

    # -- connections -----------------------------------------------------------------------

    def accept(self) -> None:
        """Every stage of every replica, each once, within ``CONNECT_TIMEOUT_S``. The
        handshakes run on threads under the admission limits of ``[guard]``
        (``agents.net.handshake.accept_forever``), so a stranger that trickles its hello
        holds one slot, not the stages' way in."""
        joined: queue.SimpleQueue[link.Link] = queue.SimpleQueue()
        stopped = threading.Event()
        limits = AdmissionLimits.from_guard(self.cfg.guard)
        acceptor = threading.Thread(
            target=handshake.accept_forever, name="accept", daemon=True,
            args=(self.srv, lambda sock, peer: joined.put(self._handshake(sock, peer))),
            kwargs=dict(stopped=stopped, report=self._report_refused, limits=limits,
                        expected=self.expected))
        acceptor.start()
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        try:
            while len(self.conns) < self.p * self.d:
                try:
                    lk = joined.get(timeout=max(0.001, deadline - time.monotonic()))
                except queue.Empty:
                    missing = sorted(f"r{r}s{s}" for r in range(self.d) for s in range(self.p)
                                     if (r, s) not in self.conns)
                    raise StagePSError(f"ps: stages {', '.join(missing)} never connected "
                                       f"within {CONNECT_TIMEOUT_S:g} s") from None
                self._add(lk)
        finally:
            stopped.set()
        # Once every stage is in, nothing else may connect, and the run's threads are the
        # same however many stages there are: the acceptor ends within its interval.
        acceptor.join(2 * limits.report_interval_s)

    def _report_refused(self, r: admission.RefusalReport) -> None:
        self.log.emit("refused", source=r.source, reason=r.reason, count=r.count,
                      example=r.example)

    def _handshake(self, sock: socket.socket, peer: str) -> link.Link:
        """Challenge-response under the key this PS shares with that stage only: a stage
        cannot pass for another, nor can anyone else (on an accept thread)."""
        waiting = {i: k for i, k in self.link_keys.items()
                   if divmod(i, self.p) not in self.joined}
        answerer = protocol.Answerer(self.run_id, "stage", protocol.keys_by_index(waiting),
                                     accepts=f"stages {sorted(waiting)}")
        name = f"ps <- {peer}"
        session = handshake.answer(sock, answerer, run_tag=self.tag, name=name,
                                   welcome=("stage", ps_index(self.p, self.d)),
                                   timeout_s=self.cfg.guard.handshake_timeout_s,
                                   log=self.log)
        sock.settimeout(None)
        lk = link.Link.answered(sock, session, name=name, run_tag=self.tag)
        r, s = divmod(lk.peer, self.p)
        self.joined.add((r, s))  # set.add is atomic: a second try for it is refused
        lk.name = f"{conn_name(r, s)} ({peer})"
        return lk

    def _add(self, lk: link.Link) -> None:
        """An authenticated stage's link, served by the event loop from here."""
        r, s = divmod(lk.peer, self.p)
        if (r, s) in self.conns:  # two handshakes for one stage raced: the first holds
            self.log.emit("frame_error", peer=lk.name, error="a second connection refused")
            lk.sock.close()
            return
        script = conversation.to_stage_ps(self.schedule, s, r, self.d, self.cfg.run)
        conn = _StageConn(r, s, lk, conversation.Conversation(script, lk.name))
        self.conns[(r, s)] = conn
        self.loop.serve(conn, wire.MessageReceiver(lk.sock, peer=lk.name, mac=lk.recv_mac,
                                                   max_payload_bytes=self.max_payload_bytes))

    def data_received(self, conn: _StageConn, messages: list[wire.Message]) -> None:
        """A stage's complete messages (the loop's handler); nothing is read after BYE."""
        for parts in messages:
            if self._handle(conn, parts[0][0], [t for _, t in parts]):
                conn.said_bye = True
                conn.receiver = None
                self.open_conns -= 1
                return

    def connection_lost(self, conn: _StageConn, error: Exception, during: str) -> None:
        """A stage's connection failed (the loop's handler): the run cannot go on, unless
        the stage had said BYE and only a last write to it failed."""
        if conn.said_bye and during == "write":
            return
        if isinstance(error, wire.ConnectionClosed):
            raise StagePSError(f"{conn.peer}: closed before BYE ({error})")
        what = "send failed: " if during == "write" else ""
        raise StagePSError(f"{conn.peer}: {what}{error}")

    # -- the conversation ------------------------------------------------------------------

    def serve(self) -> int:
        evaluator = threading.Thread(target=self._eval_loop, daemon=True, name="eval")
        evaluator.start()
        try:
            self.accept()
            self.log.emit("ps_connected", stages=len(self.conns),
                          threads=threading.active_count())
            self.open_conns = len(self.conns)
            limit_s = self.cfg.run.timeout_s
            while self.open_conns:
                self.loop.run_once(POLL_S)
                heard_s = max(c.heard_s for c in self.conns.values())
                if time.monotonic() - heard_s > limit_s:
                    raise StagePSError(f"ps: nothing from any stage for {limit_s:g} s")
        finally:
            self.evals.put(None)
        evaluator.join()
        self._close()
        self.log.emit("ps_done", iter=self.cfg.run.iterations, reason="completed")
        return 0

    def _handle(self, conn: _StageConn, h: codec.FrameHeader, tensors: list[torch.Tensor]) -> bool:
        """One message from ``conn``; True when it was its BYE."""
        try:
            conn.talk.receive(h)
        except codec.FrameError as e:
            raise StagePSError(str(e)) from None
        if h.msg_type == BYE:
            return True
        numel = self.numel(conn.stage, h.chunk)
        if len(tensors) != 1 or tensors[0].dtype != torch.float32 \
                or tensors[0].numel() != numel:
            raise StagePSError(f"{conn.peer}: {h.describe()}: expected one float32 tensor of "
                               f"{numel} elements, got {[(t.dtype, t.numel()) for t in tensors]}")
        t = tensors[0].reshape(-1)
        who = f"{conn.node} step {h.iteration} chunk {h.chunk}"
        try:
            if h.msg_type == GRAD:
                check_gradient(None, t, numel, who=who, max_abs=self.cfg.guard.max_abs_grad,
                               unique_indices=False)
            elif not bool(torch.isfinite(t).all()):
                raise PayloadError(f"{who}: non-finite weights")
        except PayloadError as e:
            raise StagePSError(f"{conn.peer}: {e}") from None
        if h.msg_type == GRAD:
            self._add_grad(conn, h.iteration, h.chunk, t)
        else:
            self._add_weights(conn, h.iteration, h.chunk, t)
        return False

    def _add_grad(self, conn: _StageConn, step: int, chunk: int, g: torch.Tensor) -> None:
        key = (step, conn.stage, chunk)
        got = self.grads.setdefault(key, {})
        got[conn.replica] = g
        if len(got) < self.d:
            return
        del self.grads[key]
        mean = got[0].clone()
        for r in range(1, self.d):
            mean += got[r]
        mean /= self.d
        n = mean.numel() * mean.element_size() + codec.HEADER_SIZE
        for r in range(self.d):
            to = self.conns[(r, conn.stage)]
            bufs = wire.message_buffers([mean], msg_type=UPDATE, run_tag=self.tag, worker=0,
                                        iteration=step, chunk=chunk, mac=to.link.send_mac)
            self.loop.write(to, bufs)
            self.log.emit("ps_slice_sent", iter=step, to=to.node, chunk=chunk,
                          bytes=sum(len(b) for b in bufs))
        self.log.emit("ps_slice_mean", iter=step, stage=conn.stage, chunk=chunk,
                      replicas=self.d, bytes=n)

    def _add_weights(self, conn: _StageConn, step: int, chunk: int, w: torch.Tensor) -> None:
        got = self.weights.setdefault(step, {})
        got[(conn.stage, chunk)] = w
        if len(got) < len(self.pieces):
            return
        del self.weights[step]
        flat: list[torch.Tensor] = [torch.empty(0)] * len(self.pieces)
        for (s, c), t in got.items():
            flat[self.schedule.position(s, c)] = t
        self.evals.put((step, flat))

    def _eval_loop(self) -> None:
        while True:
            item = self.evals.get()
            if item is None:
                return
            step, flat = item
            for piece, t in zip(self.pieces, flat, strict=True):
                piece.flat_params.copy_(t)
            metrics = self.workload.evaluate(self.model)
            if metrics is None:
                continue
            self.log.emit("eval", iter=step, **metrics)
            if step + 1 == self.cfg.run.iterations:
                # The weights after the last step are the final ones (a stale chunk's too:
                # the stage sent the version it saves as final).
                self.log.emit("final_eval", iter=step, **metrics)

    def _close(self) -> None:
        """Write out the means still queued (a stage reads them before its BYE's answer
        could matter), then close every connection."""
        self.loop.flush_all(list(self.conns.values()), self.cfg.run.timeout_s)
        for conn in self.conns.values():
            conn.sock.close()
        self.srv.close()
        self.loop.close()

    def abort(self, why: str) -> None:
        """Close every connection at once: each stage's next read fails, none hangs."""
        self.log.emit("frame_error", peer=why.split(":")[0], error=why)
        self.log.emit("ps_done", reason=why)
        for conn in self.conns.values():
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.sock.close()
        self.srv.close()


def conn_name(replica: int, stage: int) -> str:
    return f"stage {stage} of replica {replica}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.pipeline.stage_ps",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", required=True, type=int)
    ap.add_argument("--expect", action="append", default=[], metavar="ADDR",
                    help="a stage's host address, which keeps an admission slot of its own "
                         "(repeat for each)")
    auth.add_auth_argument(ap)
    args = ap.parse_args(argv)
    cfg = cfgmod.load(args.run_dir / "config.toml")
    # With --auth stdin the bundle holds this agent's control key and the key of each link
    # it is an end of (agents.net.link), which only the link's two ends hold.
    keys, secret = auth.agent_keys(args.auth, args.run_dir, codec.PUBLIC_SECRET)
    # Heartbeats on the control channel: a hung agent is declared lost by the controller.
    liveness_client(args.run_dir, keys, timeout_s=cfg.guard.handshake_timeout_s)
    torch.set_num_threads(1)
    ps = StagePS(cfg, args.run_dir, args.run_dir.name, secret, host=args.host, port=args.port,
                 keys=keys, expected=tuple(args.expect))
    return wire.run_agent(ps.serve, name=lambda: "ps",
                          errors=(StagePSError, OSError, codec.FrameError), code=2,
                          on_error=ps.abort, close=ps.log.close)


if __name__ == "__main__":
    wire.exit_process(main())
