"""The controller's end of the control plane (see ``agents/net/control.py``).

One thread serves ``RUN_DIR/control.sock`` on the event loop every server of the run uses
(:class:`agents.net.loop.EventLoop`): it accepts, runs each handshake as a feed of bytes
(:class:`agents.net.answering.AnswerFeed`), reads the JSON-line reports (at most 64 KiB a
line) of the agents that passed it and hands each to a callback, and writes the commands
``send(node, ...)`` queues. However many peers connect, the control plane costs one
thread: a thread per connection let 20,000 keyless connections take 20,000 threads and
every descriptor. The callback runs on that thread, so it must be quick.

A connection counts only once its peer has proved it knows its node's key
(``key_for(node)``), through the run's one handshake (the controller answering); its
reports then always carry that node's name, whatever they claim. The peer's pid and uid
(``SO_PEERCRED``) go into the hello the callback sees. Until then it is held to ``[guard]``'s
admission limits (:class:`agents.net.admission.Admission`: per peer process, in all, new
ones a second, one slot kept for each expected source), to 64 KiB of input and to the
handshake's absolute deadline (``guard.handshake_timeout_s``); a peer that fails any of
them is refused and closed. Refusals are reported as ``control_refused`` aggregated, one
per (source, reason) per ``guard.refusal_report_interval_s`` with a ``count``. Each node
holds at most one connection (a newer one that proved the same key replaces it), so
authenticated connections are bounded by the run's agents; what waits to be written to
one is bounded too (:data:`MAX_UNSENT_BYTES`). A connection that ends after its hello is
reported as ``control_closed`` (the run's liveness watch reads it).
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from agents.core.guard_config import GuardConfig
from agents.net import admission, answering, handshake, loop, protocol
from agents.net.control import (
    CONTROL_RUN_ID,
    CONTROL_TAG,
    CONTROLLER_END,
    MAX_LINE_BYTES,
)
from agents.net.wire import ConnectionClosed

Handler = Callable[[dict[str, Any]], None]
KeyFor = Callable[[str], bytes | None]

#: How often the loop wakes when nothing happens: the resolution of the handshake deadline.
TICK_S = 0.1
#: Connections accepted per wake-up before the others get a turn.
ACCEPT_BATCH = 256
#: What one read takes from one connection before the others get a turn.
READ_BYTES = 65536
#: Commands waiting for an agent that does not read them: more are not queued.
MAX_UNSENT_BYTES = 1 << 20
#: The listening socket's backlog; the kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 4096


def peer_source(conn: socket.socket) -> str:
    """A control-socket peer's source for admission: its process (``SO_PEERCRED``).
    Every Mininet host runs as root, so the uid tells no host from another; one process
    flooding is held to ``guard.max_handshakes_per_source``, many to ``max_handshakes``."""
    pid, uid, _gid = peer_cred(conn)
    return pid_source(pid, uid)


def pid_source(pid: int, uid: int = 0) -> str:
    """The admission source of a peer process (what :func:`peer_source` says of it)."""
    return f"pid {pid} uid {uid}"


def peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


def split_lines(buf: bytearray, data: bytes) -> list[dict[str, Any]]:
    """The JSON objects that ``data`` completes after what ``buf`` holds (which keeps the
    unfinished rest); a line that is not a JSON object is skipped (a peer's bytes are not
    trusted to be either). Raises ConnectionError once a line passes MAX_LINE_BYTES."""
    buf += data
    out = []
    while True:
        end = buf.find(b"\n")
        if end < 0:
            break
        line = bytes(buf[:end])
        del buf[:end + 1]
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(msg, dict):
            out.append(msg)
    if len(buf) > MAX_LINE_BYTES:
        raise ConnectionError(f"control: line longer than {MAX_LINE_BYTES} bytes")
    return out


class _BytesReceiver:
    """A control connection's reader (:class:`agents.net.loop.Receiver`): what one
    non-blocking read brings, as one item."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer

    def receive(self) -> list[bytes]:
        try:
            data = self.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        if not data:
            raise ConnectionClosed(f"{self.peer}: connection closed")
        return [data]


class _Conn(loop.Transport[_BytesReceiver]):
    """One control connection: its handshake (``feed``, the admission ``ticket`` it holds
    and its ``deadline_s``) until ``node`` is set, its unfinished line after."""

    def __init__(self, sock: socket.socket, pid: int, uid: int,
                 ticket: admission.Ticket, feed: answering.AnswerFeed,
                 deadline_s: float) -> None:
        super().__init__(sock, f"controller <- pid {pid} uid {uid}")
        self.pid, self.uid = pid, uid
        self.ticket = ticket
        self.feed = feed
        self.started_s = time.monotonic()
        self.deadline_s = deadline_s
        self.node: str | None = None
        self.line = bytearray()


class ControlServer:
    def __init__(self, path: str | os.PathLike[str], handler: Handler, key_for: KeyFor, *,
                 guard: GuardConfig | None = None,
                 log: handshake.EventSink | None = None,
                 expected: Collection[str] = ()) -> None:
        """``guard``: the handshake's deadline and the admission limits (``[guard]``'s
        defaults when None); ``log``: where each handshake is reported (an event log,
        written from the loop's thread); ``expected``: sources (:func:`pid_source`) that
        keep a slot of their own (more with :meth:`expect`)."""
        self.path = Path(path)
        self.handler = handler
        self.key_for = key_for
        self.guard = guard or GuardConfig()
        self.log = log
        limits = admission.AdmissionLimits.from_guard(self.guard)
        self._admission = admission.Admission(limits, expected)
        self._refusals = admission.RefusalLog(limits.report_interval_s)
        self._pending: set[_Conn] = set()  # admitted, handshake not done
        self._conns: dict[str, _Conn] = {}  # node -> its authenticated connection
        self._outbox: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()  # _conns, _outbox and the admission's expected set
        self._stopped = threading.Event()
        self._accept_pause_s = handshake.ACCEPT_BACKOFF_S[0]
        self._accept_again_s: float | None = None  # accepting paused until then (EMFILE)
        if self.path.exists():
            self.path.unlink()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(os.fspath(self.path))
        self._srv.listen(LISTEN_BACKLOG)
        self._loop = loop.EventLoop(self)
        self._loop.add_reader(self._srv, self._accept)
        self._thread = threading.Thread(target=self._run, name="control-loop", daemon=True)
        self._thread.start()

    # -- the public side (any thread) ------------------------------------------------------

    def expect(self, source: str) -> None:
        """Keep a slot of its own for ``source`` (an agent's process, :func:`pid_source`)."""
        with self._lock:
            self._admission.expect(source)

    def send(self, node: str, type_: str, **fields: Any) -> bool:
        """Queue a command to ``node``; False when it has no connection."""
        data = (json.dumps({"type": type_, **fields}) + "\n").encode()
        with self._lock:
            if node not in self._conns:
                return False
            self._outbox.append((node, data))
        self._loop.wake()
        return True

    def nodes(self) -> list[str]:
        with self._lock:
            return list(self._conns)

    @property
    def threads(self) -> int:
        """Threads the control plane runs on: one, whatever the number of connections."""
        return 1 if self._thread.is_alive() else 0

    def close(self) -> None:
        """Stop serving; the refusals still being counted are reported before this
        returns."""
        self._stopped.set()
        self._loop.wake()
        self._thread.join(timeout=2 * self.guard.refusal_report_interval_s + 1)
        if self.path.exists():
            self.path.unlink()

    # -- the loop's thread -----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                self._loop.run_once(TICK_S)
                now = time.monotonic()
                self._deliver()
                self._expire(now)
                self._resume_accepting(now)
                self._flush_refusals(self._refusals.due(now))
        finally:
            self._flush_refusals(self._refusals.due(time.monotonic(), everything=True))
            for t in list(self._pending) + list(self._conns.values()):
                t.sock.close()
            self._loop.remove_reader(self._srv)
            self._srv.close()
            self._loop.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _addr = self._srv.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EBADF, errno.EINVAL):
                    return  # our own socket was closed
                self._refused("accept", "accept failed",
                              f"{e}; retrying in {self._accept_pause_s:.2f} s")
                self._loop.remove_reader(self._srv)  # out of descriptors: pause, retry
                self._accept_again_s = time.monotonic() + self._accept_pause_s
                self._accept_pause_s = min(self._accept_pause_s * 2,
                                           handshake.ACCEPT_BACKOFF_S[1])
                return
            self._accept_pause_s = handshake.ACCEPT_BACKOFF_S[0]
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        try:
            pid, uid, _gid = peer_cred(sock)
        except OSError:
            sock.close()
            return
        src, now = pid_source(pid, uid), time.monotonic()
        with self._lock:
            ticket = self._admission.admit(src, now)
        if isinstance(ticket, str):
            sock.close()
            self._refused(src, ticket, f"pid {pid} uid {uid}: not admitted: {ticket}")
            return
        answerer = protocol.Answerer(
            CONTROL_RUN_ID, "agent", lambda h: self.key_for(h.node) if h.node else None,
            accepts="this run's agents")
        feed = answering.AnswerFeed(answerer, run_tag=CONTROL_TAG, welcome=CONTROLLER_END)
        t = _Conn(sock, pid, uid, ticket, feed, now + self.guard.handshake_timeout_s)
        self._pending.add(t)
        self._loop.serve(t, _BytesReceiver(sock, t.peer))

    def _resume_accepting(self, now: float) -> None:
        if self._accept_again_s is not None and now >= self._accept_again_s:
            self._accept_again_s = None
            self._loop.add_reader(self._srv, self._accept)

    def _expire(self, now: float) -> None:
        for t in [t for t in self._pending if now >= t.deadline_s]:
            self._refuse(t, "handshake timed out")

    def _deliver(self) -> None:
        with self._lock:
            out, self._outbox = self._outbox, []
            targets = [(self._conns.get(node), data) for node, data in out]
        for t, data in targets:
            if t is not None and not (t.failed or t.closed) \
                    and t.queued_bytes - t.written_bytes + len(data) <= MAX_UNSENT_BYTES:
                self._loop.write(t, [memoryview(data)])

    # -- the loop's Handler ----------------------------------------------------------------

    def data_received(self, t: _Conn, messages: list[bytes]) -> None:
        for data in messages:
            if t.failed or t.closed:
                return
            if t.node is not None:
                self._reports(t, data)
                continue
            try:
                reply = t.feed.receive(data)
            except answering.FrameError as e:
                self._refuse(t, str(e))
                return
            if reply:
                self._loop.write(t, [memoryview(reply)])
            if t.feed.done and not (t.failed or t.closed):
                self._authenticated(t)
                if t.feed.rest:
                    self._reports(t, t.feed.rest)

    def connection_lost(self, t: _Conn, error: Exception, during: str) -> None:
        if t.node is None:
            self._refuse(t, str(error))
            return
        t.sock.close()
        with self._lock:
            if self._conns.get(t.node) is t:
                del self._conns[t.node]
        self._report({"type": "control_closed", "node": t.node})

    def _authenticated(self, t: _Conn) -> None:
        hello = t.feed.answerer.hello
        assert hello is not None
        self._pending.discard(t)
        with self._lock:
            self._admission.release(t.ticket)
            t.node = hello.node
            old = self._conns.get(t.node)
            self._conns[t.node] = t
        handshake.report_handshake(self.log, "answer", t.peer, (hello.role, hello.worker),
                                   t.started_s, "")
        if old is not None:  # the newer connection that proved the same key replaces it
            self._loop.lose(old, ConnectionError("replaced by a newer connection"), "read")
        self._report({"type": "hello", "node": t.node, "pid": t.pid, "uid": t.uid})

    def _reports(self, t: _Conn, data: bytes) -> None:
        try:
            msgs = split_lines(t.line, data)
        except ConnectionError as e:
            self._loop.lose(t, e, "read")
            return
        for msg in msgs:
            msg["node"] = t.node  # an authenticated peer speaks only for itself
            try:
                self.handler(msg)
            except Exception as e:  # a bad report must not kill the control plane
                self._report({"type": "handler_error", "node": t.node, "error": repr(e)})

    def _refuse(self, t: _Conn, why: str) -> None:
        """End a handshake that failed: tell the peer why (as far as its socket takes it
        now: a peer that does not read must not hold the loop), count the refusal, close."""
        if t not in self._pending:
            return
        self._pending.discard(t)
        self._loop.unwatch(t)
        t.closed = True
        try:
            t.sock.send(t.feed.refusal(why), socket.MSG_DONTWAIT)
        except OSError:
            pass
        t.sock.close()
        with self._lock:
            self._admission.release(t.ticket)
        self._refused(t.ticket.source, handshake.reason_class(why),
                      f"{t.peer}: {answering.claimed(t.feed)}: refused: {why}")

    def _refused(self, source: str, reason: str, example: str) -> None:
        self._flush_refusals(self._refusals.note(source, reason, example, time.monotonic()))

    def _flush_refusals(self, due: list[admission.RefusalReport]) -> None:
        for r in due:
            self._report({"type": "control_refused", "source": r.source,
                          "reason": r.reason, "count": r.count, "error": r.example})

    def _report(self, msg: dict[str, Any]) -> None:
        try:
            self.handler(msg)
        except Exception:  # noqa: BLE001  (the control plane outlives a bad handler)
            pass
