"""A selector event loop for framed connections, as a library: it knows nothing of the
role that uses it (asyncio's ``selector_events.py`` is the model).

- :class:`Transport` is one non-blocking connection: the socket, the reader of its
  incoming messages (:class:`agents.net.wire.MessageReceiver`, which keeps what a
  partial read left), and its write buffer (sealed frames waiting for the kernel), with
  ``write`` / ``_write_ready`` as in asyncio's ``_SelectorSocketTransport``.
- :class:`EventLoop` waits on every transport at once (``selectors``) and on a wake-up
  pair (the self-pipe: another thread hands something over and wakes it with
  :meth:`EventLoop.wake`); :meth:`EventLoop.run_once` is asyncio's ``_process_events``:
  read what arrived, hand each complete message to the :class:`Handler`, and write what
  each socket takes now, so a slow receiver never blocks the others.

One thread runs the loop and its handler: reader and sender threads per connection
handed every message over through a queue, and on a busy 2-core host those hand-overs,
not the network, set an iteration's pace (docs/fidelity.md). The data-parallel PS
(``agents.dp.ps``), the pipeline's PS (``agents.pipeline.stage_ps``) and the controller's
control server (``controller.control``) run on it.
"""

from __future__ import annotations

import fcntl
import select
import selectors
import socket
import struct
import termios
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from agents.net import wire
from agents.net.codec import FrameError


class Receiver(Protocol):
    """What reads a served transport's socket (non-blocking): the messages the bytes there
    now complete. :class:`agents.net.wire.MessageReceiver` reads framed messages; a
    control connection reads bytes (``controller.control``). It raises FrameError or an
    OSError (:class:`agents.net.wire.ConnectionClosed` for an orderly close)."""

    def receive(self) -> list[Any]: ...


R = TypeVar("R", bound=Receiver)


class Transport(Generic[R]):
    """One connection served by an :class:`EventLoop` (``R``: what reads it). Frames are sealed when written
    (so in order, under the connection's MAC) and wait in ``unsent`` until the kernel
    takes them. ``receiver`` is None until the loop serves it, and again after the last
    message the role wants (a BYE): nothing more is read."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.receiver: R | None = None
        self.unsent: list[memoryview] = []
        self.closed = False  # the role dropped it
        self.failed = False  # reading or writing failed: the handler was told
        self.writable_wanted = False  # registered for EVENT_WRITE (something is unsent)
        # Bytes queued and taken by the kernel (a message half written counts half).
        self.queued_bytes = 0
        self.written_bytes = 0
        now = time.monotonic()
        self.heard_s = now  # bytes last received
        self.moved_s = now  # the kernel last took bytes

    def queue(self, bufs: list[memoryview]) -> None:
        """Queue sealed frames behind what is already waiting."""
        if not self.unsent:
            self.moved_s = time.monotonic()  # a stall is counted from here
        self.unsent += bufs
        self.queued_bytes += sum(len(b) for b in bufs)

    def flush(self) -> bool:
        """Hand the kernel what it takes now, without waiting; True when nothing is left.
        OSErrors propagate."""
        n = wire.write_some(self.sock, self.unsent)
        while n:
            self.written_bytes += n
            self.moved_s = time.monotonic()
            n = wire.write_some(self.sock, self.unsent)
        return not self.unsent

    def dead(self) -> bool:
        """True when the peer provably went away: the socket reports a hang-up or an
        error, or the role already dropped it."""
        if self.closed:
            return True
        p = select.poll()
        p.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
        try:
            return bool(p.poll(0))
        except (OSError, ValueError):
            return True

    def backlog_bytes(self) -> int:
        """Bytes written but not yet delivered: still in user space (queued, or the unsent
        rest of a message), plus what the kernel holds (unsent or unacknowledged,
        ``SIOCOUTQ``). Every byte counts in exactly one of the two."""
        try:
            buf = fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
            in_kernel = int(struct.unpack("i", buf)[0])
        except (OSError, ValueError):
            in_kernel = 0  # closed under us: the event loop reports it
        return max(0, self.queued_bytes - self.written_bytes) + in_kernel


class Handler(Protocol):
    """What a role does with what its transports bring (called on the loop's thread)."""

    def data_received(self, t: Any, messages: list[Any]) -> None:
        """Complete messages (what ``t.receiver`` returns), in order. To stop reading (after a BYE) set
        ``t.receiver = None``; to drop the connection, :meth:`EventLoop.lose` it."""

    def connection_lost(self, t: Any, error: Exception, during: str) -> None:
        """``t`` failed and is no longer watched: ``during`` is ``read`` (``error`` is
        :class:`agents.net.wire.ConnectionClosed` for an orderly close, a FrameError or
        an OSError otherwise), ``write`` (an OSError) or ``stall`` (a TimeoutError
        saying what stalled)."""


class EventLoop:
    """Serves transports on the calling thread; see the module docstring."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self.selector.register(self._wake_r, selectors.EVENT_READ, None)

    def wake(self) -> None:
        """Wake :meth:`run_once` from another thread (the self-pipe)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # a wake-up already pending (a full pipe), or the loop is closed

    def serve(self, t: Transport[R], receiver: R) -> None:
        """Start reading ``t``'s messages with ``receiver`` (the socket goes non-blocking)."""
        t.sock.setblocking(False)
        t.receiver = receiver
        t.heard_s = time.monotonic()
        self.selector.register(t.sock, selectors.EVENT_READ, t)

    def add_reader(self, sock: socket.socket, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the loop's thread whenever ``sock`` is readable (a
        listening socket: its callback accepts), as asyncio's ``add_reader``."""
        sock.setblocking(False)
        self.selector.register(sock, selectors.EVENT_READ, callback)

    def remove_reader(self, sock: socket.socket) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass  # never watched, or already let go

    def unwatch(self, t: Transport) -> None:
        try:
            self.selector.unregister(t.sock)
        except (KeyError, ValueError):
            pass  # never served, or already let go

    def lose(self, t: Transport, error: Exception, during: str) -> None:
        """Stop serving ``t`` and tell the handler (once)."""
        if t.failed or t.closed:
            return
        t.failed = True
        self.unwatch(t)
        self.handler.connection_lost(t, error, during)

    def write(self, t: Transport, bufs: list[memoryview]) -> None:
        """Queue sealed frames to ``t`` and write what the kernel takes now; the rest goes
        as the socket makes room."""
        t.queue(bufs)
        self._write_ready(t)

    def run_once(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for something to happen and process it."""
        for key, mask in self.selector.select(timeout_s):
            t = key.data
            if t is None:
                self._wake_r.recv(4096)
                continue
            if not isinstance(t, Transport):
                t()  # a reader's callback (add_reader)
                continue
            if mask & selectors.EVENT_WRITE:
                self._write_ready(t)
            if mask & selectors.EVENT_READ:
                self._read_ready(t)

    def _read_ready(self, t: Transport) -> None:
        if t.failed or t.closed or t.receiver is None:
            return
        try:
            messages = t.receiver.receive()
        except (FrameError, OSError) as e:  # ConnectionClosed is an OSError
            self.lose(t, e, "read")
            return
        t.heard_s = time.monotonic()
        if messages:
            self.handler.data_received(t, messages)

    def _write_ready(self, t: Transport) -> None:
        if t.failed or t.closed:
            return
        try:
            done = t.flush()
        except OSError as e:
            self.lose(t, e, "write")
            return
        if done == t.writable_wanted:  # watch for room exactly while bytes wait
            t.writable_wanted = not done
            self.selector.modify(t.sock, selectors.EVENT_READ | (
                selectors.EVENT_WRITE if t.writable_wanted else 0), t)

    def check_stalls(self, transports: Iterable[Transport], limit_s: float) -> None:
        """Lose every transport that has received nothing, or whose written bytes have
        not moved, for ``limit_s``."""
        now = time.monotonic()
        for t in list(transports):
            if t.failed or t.closed:
                continue
            if t.receiver is not None and now - t.heard_s > limit_s:
                why = f"nothing received for {now - t.heard_s:.1f} s"
            elif t.unsent and now - t.moved_s > limit_s:
                why = (f"downlink stalled for {now - t.moved_s:.1f} s with "
                       f"{sum(len(b) for b in t.unsent)} bytes unsent")
            else:
                continue
            self.lose(t, TimeoutError(why), "stall")

    @staticmethod
    def drain_until_closed(transports: list[Transport], seconds: float) -> None:
        """Read and throw away what each of ``transports`` still sends until its peer
        closes, for up to ``seconds``: a run that ends before its peers expected (the
        target accuracy reached) lets their last uploads finish instead of resetting them
        mid-write. Nothing read is parsed; a failure only stops that transport."""
        end = time.monotonic() + seconds
        open_ = [t for t in transports if not t.failed]
        scratch = bytearray(1 << 20)
        while open_ and (remaining := end - time.monotonic()) > 0:
            readable = select.poll()
            for t in open_:
                readable.register(t.sock, select.POLLIN)
            ready = {fd for fd, _ in readable.poll(remaining * 1000)}
            for t in [t for t in open_ if t.sock.fileno() in ready]:
                try:
                    n = t.sock.recv_into(scratch)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    n = 0
                if n == 0:
                    open_.remove(t)

    @staticmethod
    def flush_all(transports: list[Transport], seconds: float) -> None:
        """Write every queued frame of ``transports`` out, waiting up to ``seconds`` for
        room (the end of a run, a refusal); a failure only stops that transport."""
        end = time.monotonic() + seconds
        waiting = transports
        while True:
            left = []
            for t in waiting:
                try:
                    if not t.failed and not t.flush():
                        left.append(t)
                except OSError:
                    t.failed = True
            waiting = left
            remaining = end - time.monotonic()
            if not waiting or remaining <= 0:
                return
            room = select.poll()
            for t in waiting:
                room.register(t.sock, select.POLLOUT)
            room.poll(remaining * 1000)

    def close(self) -> None:
        self.selector.close()
        self._wake_r.close()
        self._wake_w.close()
