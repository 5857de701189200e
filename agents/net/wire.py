"""Blocking socket I/O for gradbed's wire protocol: the edge around :mod:`agents.net.codec`.

Sending hands the kernel the header and the tensor's own memory in one
``sendmsg`` (scatter-gather), advancing memoryviews on partial sends, so the
payload is never copied in user space. Receiving reads the fixed-size header
into a preallocated buffer, validates it, then ``recv_into`` the payload
straight into its final home: a reusable buffer (:meth:`FrameReader.read_frame`),
a caller-supplied one (:meth:`FrameReader.read_frame_into`) or a freshly
allocated tensor that the caller then owns (:meth:`FrameReader.read_message`).
No per-frame concatenation of bytes, no pickle. The only copies are the
kernel's own (user -> socket buffer -> user).

Errors name the peer. A clean EOF between frames raises :class:`ConnectionClosed`;
an EOF inside a frame, or any header error, raises :class:`~agents.net.codec.FrameError`.
After a FrameError the stream may be out of sync: drop the connection (DESIGN.md
section 4: the PS logs a ``frame_error`` event and keeps serving the others).
"""

from __future__ import annotations

import select
import socket
import struct
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING

from agents.net.buffers import ReceivePool
from agents.net.codec import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    FrameError,
    FrameHeader,
    FrameMac,
    MsgType,
    check_payload,
    decode_header,
    frame_for_bytes,
    frame_for_tensor,
    payload_crc32,
    tensor_view,
)
from agents.net.ending import exit_process, run_agent  # noqa: F401  (every agent's end)

# torch is imported where a tensor is made (as in agents.net.codec): the handshake reads and
# writes frames through this module for the controller's control socket too, without torch.
if TYPE_CHECKING:
    import torch


class ConnectionClosed(ConnectionError):
    """The peer closed the connection cleanly, between two frames."""


def peer_name(sock: socket.socket) -> str:
    """Human label of a socket's peer ("10.0.0.2:5000", a Unix path, or "unix:fdN")."""
    try:
        addr = sock.getpeername()
    except OSError:
        addr = None
    if isinstance(addr, tuple) and len(addr) >= 2:
        host, port = addr[0], addr[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    if addr:
        return str(addr)
    return f"unix:fd{sock.fileno()}"


def send_frame(sock: socket.socket, header_bytes: bytes, payload_mv: memoryview | bytes,
               *, peer: str | None = None, progress: Callable[[int], None] | None = None,
               mac: FrameMac | None = None) -> int:
    """Send one frame (header + payload) with scatter-gather ``sendmsg``; returns bytes sent.

    ``mac``: the connection's sending :class:`~agents.net.codec.FrameMac`; the frame (its
    header and payload) is sealed with the next sequence number here, so frames must be
    sent in the order they are sealed (callers hold the connection's send lock around
    both).

    Partial sends (a full socket buffer, a signal) are resumed by slicing the
    memoryviews, which never copies the payload. With ``progress``, every ``sendmsg``
    takes only what fits in the socket buffer now (``MSG_DONTWAIT``, then poll for
    room) and ``progress(n)`` is told the n bytes the kernel just took, so a caller can
    count exactly what is still in user space while a large frame is being written (a
    blocking ``sendmsg`` returns only once the whole frame is in). OSErrors propagate
    with a note naming the peer and how far the frame got.
    """
    return _send_buffers(sock, _sealed(header_bytes, payload_mv, mac), what="a frame",
                         peer=peer, progress=progress)


# sendmsg takes at most this many buffers per call (IOV_MAX on Linux).
IOV_MAX = 1024


def _sealed(header_bytes: bytes, payload_mv: memoryview | bytes,
            mac: FrameMac | None) -> list[memoryview]:
    """One frame's two buffers, its header sealed with the next MAC sequence number when
    ``mac`` is given (so frames must be written in the order they are sealed)."""
    if mac is not None:
        header_bytes = mac.seal(header_bytes, payload_mv)
    return [memoryview(header_bytes).cast("B"), memoryview(payload_mv).cast("B")]


def _send_buffers(sock: socket.socket, bufs: list[memoryview], *, what: str,
                  peer: str | None, progress: Callable[[int], None] | None) -> int:
    """Write ``bufs`` in order with scatter-gather ``sendmsg`` (see :func:`send_frame` for
    partial sends and ``progress``); returns the bytes sent."""
    total = sum(len(b) for b in bufs)
    bufs = [b for b in bufs if len(b)]
    sent = 0
    flags = socket.MSG_DONTWAIT if progress is not None else 0
    room: select.poll | None = None
    try:
        while bufs:
            try:
                n = sock.sendmsg(bufs[:IOV_MAX], (), flags)
            except BlockingIOError as e:
                if not flags and sock.gettimeout() is None:
                    # A blocking socket says EAGAIN only when its SO_SNDTIMEO ran out.
                    raise TimeoutError(f"{peer or peer_name(sock)}: send timed out: no room "
                                       "in the socket buffer within its send timeout "
                                       "(SO_SNDTIMEO)") from e
                if room is None:
                    room = select.poll()
                    room.register(sock, select.POLLOUT)
                room.poll()  # also wakes on an error, which the next sendmsg raises
                continue
            sent += n
            if progress is not None:
                progress(n)
            _consume(bufs, n)
    except OSError as e:
        e.add_note(f"while sending {what} to {peer or peer_name(sock)}: "
                   f"{sent} of {total} bytes sent")
        raise
    return total


def _consume(bufs: list[memoryview], n_bytes: int) -> None:
    """Drop the first ``n_bytes`` of ``bufs`` (in place): what the kernel just took."""
    while n_bytes and bufs:
        if n_bytes >= len(bufs[0]):
            n_bytes -= len(bufs[0])
            bufs.pop(0)
        else:
            bufs[0] = bufs[0][n_bytes:]
            n_bytes = 0


def write_some(sock: socket.socket, bufs: list[memoryview]) -> int:
    """One non-blocking gathered write of ``bufs`` (as many as ``sendmsg`` takes); the
    bytes the kernel took are dropped from ``bufs`` in place and their count returned
    (0 when the socket buffer is full). For an event loop that keeps a connection's
    unsent frames and writes again when the socket is writable. OSErrors propagate."""
    while bufs and not len(bufs[0]):
        bufs.pop(0)
    if not bufs:
        return 0
    try:
        n = sock.sendmsg(bufs[:IOV_MAX], (), socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return 0
    _consume(bufs, n)
    return n


def send_bytes(sock: socket.socket, body: bytes, *, msg_type: MsgType | int, run_tag: int,
               worker: int, iteration: int = 0, peer: str | None = None,
               mac: FrameMac | None = None) -> int:
    """Frame and send one small byte payload (a handshake or control message); returns
    bytes sent (header included). ``mac``: see :func:`send_frame`."""
    return _send_buffers(sock, bytes_buffers(body, msg_type=msg_type, run_tag=run_tag,
                                             worker=worker, iteration=iteration, mac=mac),
                         what="a frame", peer=peer, progress=None)


def send_tensor(sock: socket.socket, tensor: torch.Tensor, *, msg_type: MsgType | int,
                run_tag: int, worker: int, iteration: int, chunk: int, part: int = 0,
                nparts: int = 1, crc: bool = True, peer: str | None = None,
                progress: Callable[[int], None] | None = None,
                mac: FrameMac | None = None) -> int:
    """Frame and send one tensor (flattened); returns bytes sent (header included).
    ``progress``, ``mac``: see :func:`send_frame`."""
    header, payload = frame_for_tensor(tensor, msg_type=msg_type, run_tag=run_tag,
                                       worker=worker, iteration=iteration, chunk=chunk,
                                       part=part, nparts=nparts, crc=crc)
    return send_frame(sock, header, payload, peer=peer, progress=progress, mac=mac)


def send_message(sock: socket.socket, tensors: Sequence[torch.Tensor], *,
                 msg_type: MsgType | int, run_tag: int, worker: int, iteration: int,
                 chunk: int, crc: bool = True, peer: str | None = None,
                 progress: Callable[[int], None] | None = None,
                 mac: FrameMac | None = None) -> int:
    """Send one chunk's message: ``len(tensors)`` frames, parts 0..n-1 in order.

    A compressed chunk is several tensors (values, indices, scales, ...); the
    receiver gets them back together with :meth:`FrameReader.read_message`.
    ``progress``, ``mac``: see :func:`send_frame`.
    """
    # Every frame is sealed in order, then all of them go out in one gathered write: one
    # sendmsg (and one transmit stamp) per chunk rather than one per part.
    bufs = message_buffers(tensors, msg_type=msg_type, run_tag=run_tag, worker=worker,
                           iteration=iteration, chunk=chunk, crc=crc, mac=mac)
    what = "a frame" if len(tensors) == 1 else f"a message of {len(tensors)} frames"
    return _send_buffers(sock, bufs, what=what, peer=peer, progress=progress)


def payload_crcs(tensors: Sequence[torch.Tensor]) -> list[int]:
    """Each tensor's payload CRC-32, for :func:`message_buffers` of one message framed for
    several peers (the PS's downlink): one pass over the bytes instead of one per peer."""
    return [payload_crc32(tensor_view(t)) for t in tensors]


def message_buffers(tensors: Sequence[torch.Tensor], *, msg_type: MsgType | int,
                    run_tag: int, worker: int, iteration: int, chunk: int, crc: bool = True,
                    mac: FrameMac | None = None, crcs: Sequence[int] | None = None
                    ) -> list[memoryview]:
    """One chunk's message as the buffers to write, in order: a header and a payload per
    tensor (views of the tensors' own memory), sealed with ``mac``'s next sequence numbers
    now, so the message must be written before any frame sealed after it. ``crcs``: the
    tensors' :func:`payload_crcs`, when already computed for the same bytes."""
    if not 1 <= len(tensors) <= 0xFFFF:
        raise ValueError(f"tensors: {len(tensors)} parts, must be 1..65535")
    if crcs is not None and len(crcs) != len(tensors):
        raise ValueError(f"crcs: {len(crcs)} given for {len(tensors)} tensors")
    bufs: list[memoryview] = []
    for i, t in enumerate(tensors):
        header, payload = frame_for_tensor(t, msg_type=msg_type, run_tag=run_tag,
                                           worker=worker, iteration=iteration, chunk=chunk,
                                           part=i, nparts=len(tensors), crc=crc,
                                           payload_crc=None if crcs is None else crcs[i])
        bufs += _sealed(header, payload, mac)
    return bufs


def bytes_buffers(body: bytes, *, msg_type: MsgType | int, run_tag: int, worker: int,
                  iteration: int = 0, mac: FrameMac | None = None) -> list[memoryview]:
    """One small byte payload's frame as the buffers to write (see :func:`message_buffers`)."""
    header, payload = frame_for_bytes(body, msg_type=msg_type, run_tag=run_tag,
                                      worker=worker, iteration=iteration)
    return _sealed(header, payload, mac)


class FrameWriter:
    """Sends frames of one run on one blocking socket. Remembers the peer's name while
    the connection is up, so a send that fails after a reset still names it."""

    def __init__(self, sock: socket.socket, *, run_tag: int, worker: int, crc: bool = True,
                 peer: str | None = None) -> None:
        self.sock = sock
        self.peer = peer or peer_name(sock)
        self.run_tag = run_tag
        self.worker = worker
        self.crc = crc
        self.frames_sent = 0
        self.bytes_sent = 0

    def send_bytes_frame(self, header_bytes: bytes, payload_mv: memoryview | bytes) -> int:
        n = send_frame(self.sock, header_bytes, payload_mv, peer=self.peer)
        self.frames_sent += 1
        self.bytes_sent += n
        return n

    def send_message(self, tensors: Sequence[torch.Tensor], *, msg_type: MsgType | int,
                     iteration: int, chunk: int) -> int:
        """One chunk's message (see :func:`send_message`); returns bytes sent."""
        n = send_message(self.sock, tensors, msg_type=msg_type, run_tag=self.run_tag,
                         worker=self.worker, iteration=iteration, chunk=chunk, crc=self.crc,
                         peer=self.peer)
        self.frames_sent += len(tensors)
        self.bytes_sent += n
        return n


class FrameReader:
    """Reads validated frames from one blocking socket. Not thread-safe.

    ``expect_tag`` (per call, or the default given here) rejects frames whose run
    tag differs: frames from another run. Once the connection is authenticated, set
    ``mac`` (the receiving :class:`~agents.net.codec.FrameMac`): the tag is then not
    checked, and every frame's MAC (header and payload) is, as soon as its payload is
    in and before it is returned; until then only the header's own checks and the
    caps below bound what is read.

    ``max_payload_bytes`` caps every payload before anything is allocated for it; a
    receiver that knows what the next message may weigh passes a tighter ``bound``
    to :meth:`read_message` (the chunk's size, the compressor's bound).

    ``deadline_s`` (a ``time.monotonic()`` instant, or None): every receive waits only
    for what is left of it, so a peer trickling one byte at a time cannot stretch a
    read past it (a per-read timeout would restart with every byte). The handshake
    driver (:mod:`agents.net.handshake`) sets it; it changes the socket's timeout.
    """

    def __init__(self, sock: socket.socket, *, expect_tag: int | None = None,
                 peer: str | None = None,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 mac: FrameMac | None = None) -> None:
        self.sock = sock
        self.peer = peer or peer_name(sock)
        self.expect_tag = expect_tag
        self.max_payload_bytes = max_payload_bytes
        self.mac = mac
        self.frames_read = 0
        self.bytes_read = 0
        self.deadline_s: float | None = None
        self._hdr = bytearray(HEADER_SIZE)
        self._hdr_mv = memoryview(self._hdr)
        self._buf = bytearray(0)

    # -- low level -----------------------------------------------------------------------

    def _recv_exact(self, mv: memoryview, what: str, *, boundary: bool = False) -> None:
        """Fill ``mv`` completely. EOF before the first byte of a frame (``boundary``)
        is a clean close; anywhere else it is a truncated frame."""
        want = len(mv)
        got = 0
        try:
            while got < want:
                if self.deadline_s is not None:
                    left_s = self.deadline_s - time.monotonic()
                    if left_s <= 0:
                        raise TimeoutError(f"{self.peer}: deadline passed")
                    self.sock.settimeout(left_s)
                try:
                    n = self.sock.recv_into(mv[got:], want - got)
                except BlockingIOError as e:
                    # A blocking socket says EAGAIN only when its SO_RCVTIMEO ran out
                    # (set_kernel_timeouts); a socket with a Python timeout raises
                    # TimeoutError itself.
                    raise TimeoutError(f"{self.peer}: receive timed out: nothing arrived "
                                       "within the socket's receive timeout "
                                       "(SO_RCVTIMEO)") from e
                if n == 0:
                    if boundary and got == 0:
                        raise ConnectionClosed(f"{self.peer}: connection closed by peer "
                                               f"after {self.frames_read} frames")
                    raise FrameError(f"{self.peer}: truncated frame ({what}): connection "
                                     f"closed after {got} of {want} bytes")
                got += n
        except OSError as e:
            if isinstance(e, ConnectionClosed):
                raise
            e.add_note(f"while reading {what} from {self.peer}: {got} of {want} bytes")
            raise
        self.bytes_read += want

    def read_header(self, expect_tag: int | None = None, *, boundary: bool = True
                    ) -> FrameHeader:
        """Read and validate the next header (the payload is still on the socket).
        ``boundary``: whether a message may end before it (False for a later part of a
        message: EOF there is a truncated frame, not a clean close)."""
        return self._read_header(expect_tag, boundary=boundary)

    def _read_header(self, expect_tag: int | None, *, boundary: bool) -> FrameHeader:
        """``boundary``: EOF before this header is a clean close (not inside a message)."""
        self._recv_exact(self._hdr_mv, "header", boundary=boundary)
        return self._decoded_header(expect_tag)

    def _decoded_header(self, expect_tag: int | None = None) -> FrameHeader:
        """Validate the header bytes just received."""
        tag = self.expect_tag if expect_tag is None else expect_tag
        try:
            h = decode_header(self._hdr_mv, expect_tag=None if self.mac else tag,
                              max_payload_bytes=self.max_payload_bytes)
        except FrameError as e:
            raise FrameError(f"{self.peer}: frame {self.frames_read}: {e}") from e
        return h

    @property
    def last_header(self) -> bytes:
        """The raw bytes of the header read last (for a MAC checked outside the reader)."""
        return bytes(self._hdr)

    def read_payload_into(self, h: FrameHeader, mv: memoryview) -> memoryview:
        """Receive ``h``'s payload into the first ``h.payload_len`` bytes of ``mv``
        and check it (length, CRC when present). Returns the filled slice."""
        mv = memoryview(mv).cast("B")
        if len(mv) < h.payload_len:
            raise FrameError(f"{self.peer}: buffer of {len(mv)} bytes too small for "
                             f"payload_len {h.payload_len} ({h.describe()})")
        dst = mv[:h.payload_len]
        self._recv_exact(dst, f"payload of {h.describe()}")
        return self._verified(h, dst)

    def _verified(self, h: FrameHeader, dst: memoryview) -> memoryview:
        """Check the payload just received into ``dst`` (MAC, length, CRC)."""
        try:
            if self.mac is not None:
                self.mac.verify(self._hdr_mv, dst)
            check_payload(h, dst)
        except FrameError as e:
            raise FrameError(f"{self.peer}: {e}") from e
        self.frames_read += 1
        return dst

    # -- frames --------------------------------------------------------------------------

    def read_frame(self, expect_tag: int | None = None) -> tuple[FrameHeader, memoryview]:
        """Next frame; the payload view points into a reusable buffer and is valid
        only until the next read on this reader."""
        h = self.read_header(expect_tag)
        if len(self._buf) < h.payload_len:
            # A new bytearray rather than a resize: views of the old one may still
            # be alive in the caller, and a bytearray with exports cannot resize.
            self._buf = bytearray(h.payload_len)
        return h, self.read_payload_into(h, memoryview(self._buf))

    def read_frame_into(self, buf: bytearray | memoryview,
                        expect_tag: int | None = None) -> tuple[FrameHeader, memoryview]:
        """Next frame, payload received into the caller's writable ``buf``."""
        h = self.read_header(expect_tag)
        return h, self.read_payload_into(h, memoryview(buf))

    def read_tensor(self, h: FrameHeader, out: torch.Tensor | None = None) -> torch.Tensor:
        """Receive ``h``'s payload directly into a tensor's storage (no copy).

        Without ``out`` a new tensor is allocated: it owns its memory, but a large
        fresh allocation costs page faults on first touch (~40 ms per 100 MB here,
        about as long as the transfer itself). A receiver that reuses per-peer
        buffers passes ``out`` (contiguous, CPU, same dtype, at least ``h.numel``
        elements) and gets back ``out.reshape(-1)[:h.numel]``.
        """
        import torch

        if out is None:
            t = torch.empty(h.numel, dtype=h.dtype.torch_dtype)
        else:
            if (out.dtype != h.dtype.torch_dtype or out.device.type != "cpu"
                    or not out.is_contiguous() or out.numel() < h.numel):
                raise FrameError(f"{self.peer}: out: {out.dtype} tensor of {out.numel()} "
                                 f"elements on {out.device} (contiguous={out.is_contiguous()})"
                                 f" cannot hold {h.numel} {h.dtype.name} ({h.describe()})")
            t = out.reshape(-1)[:h.numel]
        self.read_payload_into(h, tensor_view(t))  # writable view of t's own storage
        return t

    def read_message(self, expect_tag: int | None = None, *,
                     out: Sequence[torch.Tensor] | None = None,
                     bound: Callable[[FrameHeader], None] | None = None,
                     ) -> list[tuple[FrameHeader, torch.Tensor]]:
        """Read one chunk's message: ``nparts`` frames with parts 0..nparts-1 and the
        same msg_type/worker/iteration/chunk. Each payload is received directly into
        its tensor (flat, of the frame's dtype): a new tensor that owns its memory,
        or ``out[part]`` when given (see :meth:`read_tensor`).

        ``bound(header)`` is called for every header before its payload is allocated
        or read, and raises FrameError for a part larger than the receiver expects."""
        first = self.read_header(expect_tag)
        if bound is not None:
            bound(first)
        self._check_first(first)
        if out is not None and len(out) != first.nparts:
            raise FrameError(f"{self.peer}: out: {len(out)} tensors given for a message of "
                             f"{first.nparts} parts ({first.describe()})")

        def dst(i: int) -> torch.Tensor | None:
            return None if out is None else out[i]

        result = [(first, self.read_tensor(first, dst(0)))]
        for i in range(1, first.nparts):
            h = self._read_header(expect_tag, boundary=False)  # EOF here truncates
            self._check_part(first, h, i)
            if bound is not None:
                bound(h)
            result.append((h, self.read_tensor(h, dst(i))))
        return result

    def _check_first(self, first: FrameHeader) -> None:
        if first.part != 0:
            raise FrameError(f"{self.peer}: part: message starts at part {first.part}, "
                             f"expected 0 ({first.describe()})")

    def _check_part(self, first: FrameHeader, h: FrameHeader, i: int) -> None:
        """Part ``i`` of the message that ``first`` began belongs to it."""
        for name in ("msg_type", "worker", "iteration", "chunk", "nparts"):
            if getattr(h, name) != getattr(first, name):
                raise FrameError(f"{self.peer}: {name}: part {i} has "
                                 f"{getattr(h, name)!r}, message started with "
                                 f"{getattr(first, name)!r} ({first.describe()})")
        if h.part != i:
            raise FrameError(f"{self.peer}: part: got {h.part}, expected {i} "
                             f"({first.describe()})")


Message = list[tuple[FrameHeader, "torch.Tensor"]]


class MessageReceiver(FrameReader):
    """Reads chunk messages from one non-blocking socket, for an event loop: each
    :meth:`receive` takes the bytes the socket holds now and returns the messages they
    complete, keeping a message that is still arriving for the next call. The checks
    are :class:`FrameReader`'s own (header, MAC, CRC, parts in order, ``bound`` before
    anything is allocated for a part); each payload is received straight into its own
    new tensor, or one from ``pool`` (:class:`~agents.net.buffers.ReceivePool`), which the
    caller gives back once it has consumed the message.

    An error (a bad frame, EOF, a reset) is raised by the call that meets it, unless
    that call completed messages first: then they are returned and the error is
    raised by the next call, so nothing received before it is lost. A clean EOF
    between messages raises :class:`ConnectionClosed`, anywhere else a FrameError.
    """

    def __init__(self, sock: socket.socket, *, peer: str | None = None,
                 max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
                 mac: FrameMac | None = None, expect_tag: int | None = None,
                 bound: Callable[[FrameHeader], None] | None = None,
                 pool: ReceivePool | None = None) -> None:
        super().__init__(sock, expect_tag=expect_tag, peer=peer,
                         max_payload_bytes=max_payload_bytes, mac=mac)
        self.bound = bound
        self.pool = pool
        self.recv_calls = 0  # recv_into system calls, for the per-chunk profile
        self._complete: list[Message] = []
        self._error: BaseException | None = None
        self._at_boundary = True
        self._steps = self._message_steps()
        self._want = next(self._steps)
        self._got = 0

    def _message_steps(self) -> Generator[memoryview, None, None]:
        """The parse as a generator: yields each buffer to fill, checks it once full."""
        import torch

        while True:
            self._at_boundary = True
            yield self._hdr_mv
            self._at_boundary = False
            first = h = self._decoded_header()
            if self.bound is not None:
                self.bound(first)
            self._check_first(first)
            message: Message = []
            for i in range(first.nparts):
                if i:
                    yield self._hdr_mv
                    h = self._decoded_header()
                    self._check_part(first, h, i)
                    if self.bound is not None:
                        self.bound(h)
                t = torch.empty(h.numel, dtype=h.dtype.torch_dtype) if self.pool is None \
                    else self.pool.take(h.dtype.torch_dtype, h.numel)
                dst = tensor_view(t)
                if len(dst) != h.payload_len:
                    raise FrameError(f"{self.peer}: payload_len {h.payload_len} does not hold "
                                     f"{h.numel} {h.dtype.name} ({h.describe()})")
                yield dst
                self._verified(h, dst)
                message.append((h, t))
            self._complete.append(message)

    def receive(self, max_bytes: int = 1 << 20) -> list[Message]:
        """The messages completed by what the socket holds now (at most ``max_bytes``
        read per call, so one busy peer cannot hold an event loop)."""
        if self._error is not None:
            raise self._error
        budget = max_bytes
        try:
            while budget > 0:
                while self._got == len(self._want):
                    self._want = next(self._steps)
                    self._got = 0
                try:
                    n = self.sock.recv_into(self._want[self._got:],
                                            min(len(self._want) - self._got, budget))
                except (BlockingIOError, InterruptedError):
                    break
                self.recv_calls += 1
                if n == 0:
                    if self._at_boundary and self._got == 0:
                        raise ConnectionClosed(f"{self.peer}: connection closed by peer "
                                               f"after {self.frames_read} frames")
                    raise FrameError(f"{self.peer}: truncated frame: connection closed "
                                     f"{self._got} of {len(self._want)} bytes into a "
                                     f"{'header' if self._want is self._hdr_mv else 'payload'}")
                self._got += n
                self.bytes_read += n
                budget -= n
        except (FrameError, OSError) as e:
            if isinstance(e, OSError) and not isinstance(e, ConnectionClosed):
                e.add_note(f"while reading from {self.peer}")
            self._error = e  # raised again by every later call
            if not self._complete:
                raise
        done, self._complete = self._complete, []
        return done


def read_message(reader: FrameReader, expect_tag: int | None = None, *,
                 out: Sequence[torch.Tensor] | None = None
                 ) -> list[tuple[FrameHeader, torch.Tensor]]:
    """Function form of :meth:`FrameReader.read_message`."""
    return reader.read_message(expect_tag, out=out)


def available_congestion_controls() -> list[str]:
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            return f.read().split()
    except OSError:
        return []


def set_socket_options(sock: socket.socket, *, nodelay: bool = True, sndbuf: int | None = None,
                       rcvbuf: int | None = None, congestion: str | None = None,
                       notsent_lowat: int | None = None) -> None:
    """Apply the per-connection knobs. Set buffers before connect()/listen(): the TCP
    window scale is negotiated at the handshake. ``nodelay`` is ignored on non-TCP
    sockets (Unix socketpairs in tests); ``congestion`` and ``notsent_lowat`` are errors
    there. ``notsent_lowat`` (TCP_NOTSENT_LOWAT, bytes): a blocking send waits while the
    kernel holds this many bytes not yet sent."""
    is_tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
    if nodelay and is_tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for name, value, opt in (("sndbuf", sndbuf, socket.SO_SNDBUF),
                             ("rcvbuf", rcvbuf, socket.SO_RCVBUF)):
        if value is not None:
            if value <= 0:
                raise ValueError(f"{name}: {value} bytes, must be > 0")
            sock.setsockopt(socket.SOL_SOCKET, opt, value)
    if notsent_lowat is not None:
        if not is_tcp or notsent_lowat <= 0:
            raise ValueError(f"notsent_lowat: {notsent_lowat} bytes needs a TCP socket and "
                             f"a value > 0, got {sock!r}")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, notsent_lowat)
    if congestion is not None:
        if not is_tcp:
            raise ValueError(f"congestion: {congestion!r} needs a TCP socket, got {sock!r}")
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        except OSError as e:
            raise ValueError(f"congestion: {congestion!r} rejected by the kernel ({e}); "
                             f"available: {available_congestion_controls()}") from e


_TIMEVAL = struct.Struct("@ll")  # struct timeval: tv_sec, tv_usec


def set_kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Make ``sock`` blocking, with the kernel's own receive and send timeouts
    (``SO_RCVTIMEO``, ``SO_SNDTIMEO``) of ``timeout_s`` in place of Python's.

    With a Python timeout every ``recv`` and ``send`` first ``poll``s the socket, and
    ``poll`` reports POLLERR whenever the socket's error queue holds something: with
    ``SO_TIMESTAMPING`` (agents.net.txstamps) that is every transmit stamp, so a thread
    waiting to receive wakes, finds no data, and polls again until the stamps are read,
    once per stamp and competing for the GIL with the thread that compresses. A blocking
    ``recv`` waits in the kernel, which the error queue does not wake into user space.
    When a timeout runs out, :class:`FrameReader` and the senders here raise
    TimeoutError naming the peer, as with a Python timeout."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s={timeout_s}: must be > 0")
    usec_total = max(1, round(timeout_s * 1e6))  # 0 would mean "never time out"
    tv = _TIMEVAL.pack(*divmod(usec_total, 1_000_000))
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
