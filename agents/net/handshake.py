"""The one handshake driver: :func:`dial` at the end that opened a connection, :func:`answer`
at the end that accepted it. Every authenticated connection of a run goes through here:
worker -> PS, stage -> stage, stage -> the pipeline's PS, expert host <-> expert host,
and an agent -> the controller's control socket.

The conversation itself (HELLO, CHALLENGE, PROOF, WELCOME, and what each end may send
when) is the pair of sans-I/O state machines :class:`agents.net.protocol.Dialer` and
:class:`agents.net.protocol.Answerer`; this module only moves their bytes, under two
limits that hold whoever the peer is:

- **an absolute deadline** for the whole handshake (``timeout_s``, 5 s unless the caller
  passes ``guard.handshake_timeout_s``): every read and write waits only for what is
  left of it, so a peer that trickles one byte a second is cut off when the deadline
  passes, not after a per-read timeout that restarts with every byte;
- **a cap on what an unauthenticated peer may make us buffer**
  (:data:`MAX_UNAUTHENTICATED_BYTES`, over the whole handshake, headers included; each
  frame is also held to what its state allows, a hello or a proof).

A listening socket accepts through :func:`accept_forever`: a handshake thread per
connection, but only for connections that the admission limits of ``[guard]`` let in (per
source address, in all, new ones a second, a slot kept for each expected agent:
:mod:`agents.net.admission`); refusals are reported aggregated, one report per (source,
reason) per interval with a count, so a flood neither holds the real peers out nor fills
the disk with events.

A dialer that must wait for admission after proving itself (a data-parallel worker waits
for an iteration boundary) passes ``welcome_timeout_s`` for that last wait.

Each handshake that passes, and each that fails at the dialing end, is reported once to
``log`` (the agent's event log) as a ``handshake`` event, so a run's logs show every
connection it made and how long each took to authenticate. A listener's failed
handshakes are a flood's, one per connection: :func:`answer` leaves them out of ``log``
unless asked, and :func:`accept_forever` counts them in its aggregated refusals.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from agents.net import admission, answering, codec, protocol, wire
from agents.net.answering import MAX_UNAUTHENTICATED_BYTES
from agents.net.codec import FrameError, MsgType

#: The whole handshake's deadline unless the caller passes another (guard.handshake_timeout_s).
DEFAULT_TIMEOUT_S = 5.0
#: accept() errors that pass (descriptors or memory run out, a peer gave up): back off.
ACCEPT_BACKOFF_S = (0.01, 1.0)
#: How long a refusal (an ERROR frame) may take to write: a peer that does not read
#: must not hold the answering end.
REFUSE_TIMEOUT_S = 1.0
#: The listen backlog of every socket that accepts through :func:`accept_forever`. A
#: flood's connections wait there until the accept loop refuses them; past the backlog
#: the kernel drops SYNs, a real peer's with them, and its connect retries only after
#: 1 s, then 3 s, 7 s...
LISTEN_BACKLOG = 256

class EventSink(Protocol):
    """Where handshakes are reported: an agent's event log (``agents.core.events.EventLog``)."""

    def emit(self, event: str, iter: int = -1, **fields: Any) -> None: ...


class HandshakeError(FrameError):
    """A handshake failed or was refused; the message names the connection and why,
    ``why`` is the reason alone (``handshake timed out`` when the deadline passed)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


def dial(sock: socket.socket, dialer: protocol.Dialer, *, run_tag: int, name: str,
         timeout_s: float = DEFAULT_TIMEOUT_S, join_at: int = 0,
         welcome_timeout_s: float | None = None,
         log: EventSink | None = None) -> tuple[protocol.Session, int]:
    """Authenticate a connection this end opened, as ``dialer`` says it is. Returns the
    session (``up`` seals what we send, ``down`` checks what we receive) and the iteration
    the WELCOME names. Raises HandshakeError naming ``name`` (refused, wrong key, a peer
    that is not the one expected, the deadline). The socket's timeout is restored."""
    start_s = time.monotonic()
    deadline_s = start_s + timeout_s
    reader = _reader(sock, run_tag, name)
    buf = bytearray(codec.MAX_HELLO_BYTES)
    old = sock.gettimeout()
    try:
        _send(sock, deadline_s, dialer.hello(join_at), MsgType.HELLO, run_tag, dialer.me,
              join_at, name)
        h, body = _read(reader, buf, deadline_s, codec.MAX_HELLO_BYTES)
        _send(sock, deadline_s, dialer.receive_challenge(h, body), MsgType.PROOF, run_tag,
              dialer.me, join_at, name)
        if welcome_timeout_s is not None:
            deadline_s = time.monotonic() + welcome_timeout_s
        reader.expect_tag = None  # WELCOME carries a MAC in the tag's place
        h, body = _read(reader, buf, deadline_s, codec.MAX_HELLO_BYTES)
        iteration = dialer.receive_welcome(reader.last_header, h, body)
    except (FrameError, protocol.Rejected, OSError) as e:
        why = _why(e)
        report_handshake(log, "dial", name, dialer.welcome_from, start_s, why)
        raise HandshakeError(f"{name}: {dialer.role} {dialer.node or dialer.me}: {why}",
                             why) from e
    finally:
        sock.settimeout(old)
    report_handshake(log, "dial", name, dialer.welcome_from, start_s, "")
    assert dialer.session is not None
    return dialer.session, iteration


def answer(sock: socket.socket, answerer: protocol.Answerer, *, run_tag: int, name: str,
           welcome: tuple[str, int] | None, timeout_s: float = DEFAULT_TIMEOUT_S,
           log: EventSink | None = None, log_refusal: bool = False) -> protocol.Session:
    """Authenticate a connection this end accepted. ``welcome``: this end's ``(role,
    index)``, said in a WELCOME sealed under the session (which proves we hold the key
    too); None when the caller welcomes later itself (the PS admits a worker at an
    iteration boundary, with the weights). On any failure an ERROR frame tells the peer
    why, and HandshakeError names the connection; the caller closes the socket. The
    socket's timeout is restored. A failure is not reported to ``log`` unless
    ``log_refusal``: under :func:`accept_forever`, where every answering end runs, each
    would be a flood's line, and the refusals are reported aggregated there."""
    start_s = time.monotonic()
    deadline_s = start_s + timeout_s
    # The same feed an event loop drives (controller.control), here fed exactly the bytes
    # of the next frame, so nothing after the PROOF is read from a socket handed on.
    feed = answering.AnswerFeed(answerer, run_tag=run_tag, welcome=welcome)
    old = sock.gettimeout()
    try:
        while not feed.done:
            reply = feed.receive(_recv(sock, feed.want(), deadline_s, name))
            if reply:
                _settimeout_left(sock, deadline_s, name)
                sock.sendall(reply)
    except (FrameError, OSError) as e:
        why = _why(e)
        report_handshake(log if log_refusal else None, "answer", name,
                         _claimed(answerer.hello), start_s, why)
        _refuse(sock, feed.refusal(why))
        raise HandshakeError(f"{name}: {answering.claimed(feed)}: refused: {why}", why) from e
    finally:
        sock.settimeout(old)
    report_handshake(log, "answer", name, _claimed(answerer.hello), start_s, "")
    assert feed.session is not None
    return feed.session


def _settimeout_left(sock: socket.socket, deadline_s: float, name: str) -> None:
    left_s = deadline_s - time.monotonic()
    if left_s <= 0:
        raise TimeoutError(f"{name}: deadline passed")
    sock.settimeout(left_s)


def _recv(sock: socket.socket, n: int, deadline_s: float, name: str) -> bytes:
    """Up to ``n`` bytes (at least one) before ``deadline_s``."""
    _settimeout_left(sock, deadline_s, name)
    data = sock.recv(n)
    if not data:
        raise wire.ConnectionClosed(f"{name}: connection closed by peer")
    return data


def _reader(sock: socket.socket, run_tag: int, name: str) -> wire.FrameReader:
    return wire.FrameReader(sock, expect_tag=run_tag, peer=name,
                            max_payload_bytes=codec.MAX_HELLO_BYTES)


def _read(reader: wire.FrameReader, buf: bytearray, deadline_s: float, most_bytes: int
          ) -> tuple[codec.FrameHeader, memoryview]:
    """One frame of at most ``most_bytes`` payload, and never past the handshake's total
    cap, before ``deadline_s``."""
    left = MAX_UNAUTHENTICATED_BYTES - reader.bytes_read - codec.HEADER_SIZE
    if left < 0:
        raise protocol.ProtocolError(f"handshake: more than {MAX_UNAUTHENTICATED_BYTES} "
                                     "bytes before the peer proved its key")
    reader.max_payload_bytes = min(most_bytes, left)
    reader.deadline_s = deadline_s
    return reader.read_frame_into(buf)


def _send(sock: socket.socket, deadline_s: float, body: bytes, msg_type: MsgType,
          run_tag: int, worker: int, iteration: int, name: str,
          mac: codec.FrameMac | None = None) -> None:
    left_s = deadline_s - time.monotonic()
    if left_s <= 0:
        raise TimeoutError(f"{name}: deadline passed")
    sock.settimeout(left_s)
    wire.send_bytes(sock, body, msg_type=msg_type, run_tag=run_tag, worker=worker,
                    iteration=iteration, peer=name, mac=mac)


def _why(e: BaseException) -> str:
    return "handshake timed out" if isinstance(e, TimeoutError) else str(e)


def _claimed(hello: codec.Hello | None) -> tuple[str, int] | None:
    return None if hello is None else (hello.role, hello.worker)


def report_handshake(log: EventSink | None, end: str, name: str,
                     peer: tuple[str, int] | None, start_s: float, error: str) -> None:
    """One ``handshake`` event for ``log`` (none when None): which end, which link, who the
    peer said it was, how long it took, and the error (empty when it passed)."""
    if log is None:
        return
    role, index = peer if peer is not None else (None, None)
    log.emit("handshake", end=end, link=name, peer_role=role, peer_index=index,
             ok=not error, elapsed_ms=round((time.monotonic() - start_s) * 1e3, 3),
             error=error)


def _refuse(sock: socket.socket, error_frame: bytes) -> None:
    try:
        sock.settimeout(REFUSE_TIMEOUT_S)
        sock.sendall(error_frame)
    except OSError:
        pass


def ip_source(sock: socket.socket, addr: Any) -> str:
    """A TCP peer's source for admission: its address without the port."""
    return str(addr[0]) if isinstance(addr, tuple) and addr else wire.peer_name(sock)


def reason_class(why: str) -> str:
    """The reason a refused handshake is counted under: a few fixed words, so that a
    peer cannot make every refusal a new (source, reason) pair by varying what it sends."""
    return "handshake timed out" if why == "handshake timed out" else "handshake failed"


class _Gate:
    """:class:`agents.net.admission.Admission` and :class:`~agents.net.admission.RefusalLog`
    under one lock, for the accepting thread and the handshake threads together."""

    def __init__(self, limits: admission.AdmissionLimits, expected: Collection[str],
                 report: Callable[[admission.RefusalReport], None]) -> None:
        self.admission = admission.Admission(limits, expected)
        self.refusals = admission.RefusalLog(limits.report_interval_s)
        self.report = report
        self.lock = threading.Lock()

    def admit(self, source: str) -> admission.Ticket | str:
        with self.lock:
            return self.admission.admit(source, time.monotonic())

    def release(self, ticket: admission.Ticket) -> None:
        with self.lock:
            self.admission.release(ticket)

    def refused(self, source: str, reason: str, example: str) -> None:
        with self.lock:
            due = self.refusals.note(source, reason, example, time.monotonic())
        for r in due:
            self.report(r)

    def flush(self, everything: bool = False) -> None:
        with self.lock:
            due = self.refusals.due(time.monotonic(), everything=everything)
        for r in due:
            self.report(r)


def accept_forever(srv: socket.socket, on_connection: Callable[[socket.socket, str], None],
                   *, stopped: threading.Event,
                   report: Callable[[admission.RefusalReport], None],
                   limits: admission.AdmissionLimits,
                   expected: Collection[str] = (),
                   source: Callable[[socket.socket, Any], str] = ip_source) -> None:
    """Accept on ``srv`` until ``stopped`` is set or ``srv`` is closed, and run
    ``on_connection(sock, peer)`` (the answering handshake, then handing the connection
    over; on HandshakeError the socket is closed here) on a thread of its own for each
    connection that :class:`agents.net.admission.Admission` admits (``expected``: the
    sources of the agents this end waits for, each with a slot of its own); any other is
    closed unread.

    Refusals (a connection not admitted, or an ``on_connection`` that raised
    HandshakeError) go to ``report`` aggregated (:class:`agents.net.admission.RefusalLog`),
    at most one report per (source, reason) per ``limits.report_interval_s``, from
    whichever thread notes one; pending counts are reported when the interval passes and
    when accepting ends. An accept error that passes (EMFILE, ENFILE, ENOBUFS, ENOMEM, a
    peer that reset before accept) is counted the same way, and retried after a growing
    pause."""
    gate = _Gate(limits, expected, report)

    def run(sock: socket.socket, peer: str, ticket: admission.Ticket) -> None:
        try:
            on_connection(sock, peer)
        except HandshakeError as e:
            gate.refused(ticket.source, reason_class(e.why), str(e))
            sock.close()  # after the report: a peer that sees EOF finds it written
        finally:
            gate.release(ticket)

    srv.settimeout(limits.report_interval_s)  # wakes to report what a quiet flood left
    pause = ACCEPT_BACKOFF_S[0]
    try:
        while not stopped.is_set():
            try:
                sock, addr = srv.accept()
            except TimeoutError:
                gate.flush()
                continue
            except OSError as e:
                if stopped.is_set() or e.errno in (errno.EBADF, errno.EINVAL):
                    return  # our own socket was closed: the run is over
                gate.refused("accept", "accept failed", f"{e}; retrying in {pause:.2f} s")
                time.sleep(pause)
                pause = min(pause * 2, ACCEPT_BACKOFF_S[1])
                continue
            pause = ACCEPT_BACKOFF_S[0]
            src = source(sock, addr)
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else src
            ticket = gate.admit(src)
            if isinstance(ticket, str):
                sock.close()
                gate.refused(src, ticket, f"{peer}: not admitted: {ticket}")
                continue
            try:
                threading.Thread(target=run, args=(sock, peer, ticket), daemon=True).start()
            except RuntimeError as e:  # no thread to be had: like EMFILE, it passes
                gate.release(ticket)
                sock.close()
                gate.refused(src, "no handshake thread", str(e))
    finally:
        gate.flush(everything=True)
