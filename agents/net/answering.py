"""The answering end of the run's handshake as a feed of bytes (h11's ``Connection`` is
the model): what an event loop drives (the controller's control server) and what the
blocking :func:`agents.net.handshake.answer` drives, one implementation for both.

A server on :mod:`agents.net.loop` cannot block in ``answer`` for a peer that trickles a
byte a second: one such peer would hold every other connection. :class:`AnswerFeed`
takes whatever bytes arrived (``receive``), splits them into frames, hands each to the
:class:`agents.net.protocol.Answerer` state machine, and returns the bytes to write back
(the CHALLENGE, then the WELCOME sealed under the new session). It does no I/O and reads
no clock: the loop that drives it enforces the handshake's absolute deadline.

The limits of the blocking driver hold here too: at most
:data:`agents.net.handshake.MAX_UNAUTHENTICATED_BYTES` from a peer that has not proved its
key, headers included, and each frame held to what its state allows before any of its
payload is kept. Anything after the PROOF is not the handshake's: it is kept in
:attr:`AnswerFeed.rest` for whatever the connection carries next.
"""

from __future__ import annotations

from agents.net import codec, protocol
from agents.net.codec import HEADER_SIZE, FrameError, MsgType

#: What a peer that has not proved its key may make this end buffer, all frames together
#: (the blocking driver's own cap, :data:`agents.net.handshake.MAX_UNAUTHENTICATED_BYTES`).
MAX_UNAUTHENTICATED_BYTES = 64 * 1024


def sealed_frame(body: bytes, msg_type: MsgType, *, run_tag: int, worker: int,
                 mac: codec.FrameMac | None = None) -> bytes:
    """One small frame's bytes (a CHALLENGE, a WELCOME, an ERROR), its header sealed by
    ``mac`` when given."""
    header, payload = codec.frame_for_bytes(body, msg_type=msg_type, run_tag=run_tag,
                                            worker=worker)
    if mac is not None:
        header = mac.seal(header, payload)
    return bytes(header) + bytes(payload)


class AnswerFeed:
    """One accepted connection's handshake, fed with the bytes it sends.

    ``welcome``: this end's ``(role, index)``, said in the WELCOME sealed under the session
    (proving this end holds the key too); None when the caller welcomes later itself (the
    data-parallel PS admits a worker at an iteration boundary, with the weights). :meth:`receive` raises FrameError (a
    :class:`agents.net.protocol.ProtocolError` for a refusal by the state machine) naming
    what was wrong; the caller then refuses the peer (:meth:`refusal`) and closes it."""

    def __init__(self, answerer: protocol.Answerer, *, run_tag: int,
                 welcome: tuple[str, int] | None) -> None:
        self.answerer = answerer
        self.run_tag = run_tag
        self.welcome = welcome
        self.session: protocol.Session | None = None
        self.bytes_read = 0
        self.rest = b""  # what came after the PROOF (the connection's next protocol)
        self._buf = bytearray()

    @property
    def done(self) -> bool:
        """The peer proved its key (and the WELCOME, if any, is what :meth:`receive`
        returned last)."""
        return self.session is not None

    def want(self) -> int:
        """How many more bytes complete the next frame (its header first): what a blocking
        reader asks for, so that it reads nothing past the handshake. Raises FrameError
        for a header already in that is refused."""
        if self.done:
            return 0
        if len(self._buf) < HEADER_SIZE:
            return HEADER_SIZE - len(self._buf)
        h = self._header()
        return HEADER_SIZE + h.payload_len - len(self._buf)

    def _header(self) -> codec.FrameHeader:
        most = protocol.expected_payload_bytes(self.answerer.state)
        return codec.decode_header(self._buf, expect_tag=self.run_tag, max_payload_bytes=most)

    def receive(self, data: bytes) -> bytes:
        """Take ``data`` (what the socket gave now); returns the bytes to write back."""
        if self.done:
            self.rest += data
            return b""
        self.bytes_read += len(data)
        if self.bytes_read > MAX_UNAUTHENTICATED_BYTES:
            raise protocol.ProtocolError(f"handshake: more than {MAX_UNAUTHENTICATED_BYTES} "
                                         "bytes before the peer proved its key")
        self._buf += data
        out = b""
        while not self.done:
            frame = self._next_frame()
            if frame is None:
                break
            out += self._answer(*frame)
        if self.done:
            self.rest, self._buf = bytes(self._buf), bytearray()
        return out

    def _next_frame(self) -> tuple[codec.FrameHeader, bytes] | None:
        """The next complete frame in the buffer, checked, or None while one is arriving."""
        if len(self._buf) < HEADER_SIZE:
            return None
        h = self._header()
        end = HEADER_SIZE + h.payload_len
        if len(self._buf) < end:
            return None
        body = bytes(self._buf[HEADER_SIZE:end])
        codec.check_payload(h, body)
        del self._buf[:end]
        return h, body

    def _answer(self, h: codec.FrameHeader, body: bytes) -> bytes:
        me = self.welcome[1] if self.welcome is not None else 0
        if self.answerer.state is protocol.AnswererState.AWAIT_HELLO:
            challenge = self.answerer.receive_hello(h, body)
            return sealed_frame(challenge, MsgType.CHALLENGE, run_tag=self.run_tag, worker=me)
        session = self.answerer.receive_proof(h, body)
        self.session = session
        if self.welcome is None:
            return b""
        return sealed_frame(codec.hello_payload(*self.welcome), MsgType.WELCOME,
                            run_tag=self.run_tag, worker=me, mac=session.down)

    def refusal(self, why: str) -> bytes:
        """The ERROR frame that tells a refused peer why."""
        return sealed_frame(why.encode()[:protocol.MAX_ERROR_BYTES], MsgType.ERROR,
                            run_tag=self.run_tag, worker=0)


def claimed(feed: AnswerFeed) -> str:
    """Who the peer said it was (its HELLO), for a refusal's message."""
    hello = feed.answerer.hello
    return f"{hello.role} {hello.node or hello.worker}" if hello is not None \
        else "an unknown peer"


__all__ = ["AnswerFeed", "FrameError", "MAX_UNAUTHENTICATED_BYTES", "claimed",
           "sealed_frame"]
