"""The handshake's two ends and the PS <-> data-parallel worker conversation as sans-I/O
state machines (h11's style).

Nothing here touches a socket: the objects take decoded frames (``FrameHeader`` and
payload bytes from :mod:`agents.net.codec`) and return what to send or what happened, and
raise :class:`ProtocolError` for anything the other side may not do in the current
state. The agents' threads only move bytes (``agents.dp.ps``, ``agents.dp.worker``).

Handshake (challenge-response), drawn for a worker and the PS; every authenticated
connection (stage, expert, control socket) runs the same one, :class:`Dialer` at the end
that opened it and :class:`Answerer` at the end that accepted it::

    worker (dials)                           PS (answers)
    HELLO {role, worker, nonce_w}   ->                       (public run tag)
                                    <-   CHALLENGE nonce_ps  (fresh, 16 bytes)
    PROOF HMAC(k_w, ctx)            ->                       (constant-time compare)
                                    <-   WELCOME + WEIGHTS   (sealed with the down MAC)
    GRAD ... / BYE                  ->                       (sealed with the up MAC)

``k_w`` is worker w's own key (``agents.net.auth``), ``ctx`` binds the run id, the worker
index and both nonces. Both directions then carry a per-frame MAC under keys derived
from ``k_w`` and both nonces (:class:`~agents.net.codec.FrameMac`), so a replayed or
forged frame fails its check, and WELCOME proves to the worker that the PS knows k_w.

After the handshake the PS's main loop runs the :class:`ChunkBarrier` (which
gradients it accepts, when a chunk is complete, when an iteration ends) on typed
events (:data:`PSEvent`), and a worker checks what comes down with :class:`Downlink`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from agents.net import codec
from agents.net.codec import FrameError, FrameHeader, FrameMac, MsgType

PROOF_BYTES = 32
MAX_ERROR_BYTES = 1024


class ProtocolError(FrameError):
    """The peer sent something it may not send in the conversation's current state."""


# -- keys of one connection -------------------------------------------------------------

def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def proof(key: bytes, run_id: str, worker: int, nonce_ps: bytes, nonce_w: bytes) -> bytes:
    """The worker's answer to a challenge: HMAC-SHA256 under its key of the run id, its
    index and both nonces (so it is worth nothing for another run, worker or connection)."""
    return _mac(key, b"gradbed proof", run_id.encode(), str(worker).encode(), nonce_ps, nonce_w)


@dataclass
class Session:
    """An authenticated connection: who it is and its two per-direction MACs."""

    worker: int
    join_at: int
    up: FrameMac  # worker -> PS frames
    down: FrameMac  # PS -> worker frames


def session(key: bytes, worker: int, join_at: int, nonce_ps: bytes, nonce_w: bytes
            ) -> Session:
    return Session(worker, join_at,
                   up=FrameMac(_mac(key, b"gradbed up", nonce_ps, nonce_w)),
                   down=FrameMac(_mac(key, b"gradbed down", nonce_ps, nonce_w)))


# -- the two ends of a handshake -------------------------------------------------------
#
# Named for the ends, not the roles: the end that opened the connection dials, the end
# that accepted it answers. A worker dials the PS; a stage dials the next stage and the
# pipeline's PS; an expert host dials the lower-numbered ones; an agent dials the
# controller's control socket. ``agents.net.handshake`` drives both over a socket.

def new_nonce() -> bytes:
    """A fresh nonce for one end of one handshake (tests pass their own)."""
    return secrets.token_bytes(codec.NONCE_BYTES)


class AnswererState(Enum):
    AWAIT_HELLO = "await hello"
    AWAIT_PROOF = "await proof"
    AUTHENTICATED = "authenticated"
    FAILED = "failed"


# A peer's key by what its HELLO claims; None: not a peer this end accepts.
KeyFor = Callable[[codec.Hello], bytes | None]


def keys_by_index(keys: Mapping[int, bytes]) -> KeyFor:
    """A mesh end's :data:`KeyFor`: the key of the peer whose index the HELLO claims, among
    ``keys`` (the peers that may dial it now)."""
    return lambda hello: keys.get(hello.worker)


@dataclass
class Answerer:
    """The accepting end of one connection, until the peer has proved its key.

    ``role``: what a HELLO must claim to be; ``key_for(hello)``: the claimed peer's key,
    or None when this end accepts no such peer (refused before any challenge, and
    ``accepts`` says whom it does accept, for the error); ``nonce``: this connection's
    fresh challenge (drawn from ``secrets``; tests pass their own). Any error moves to
    FAILED, and a failed handshake accepts nothing more."""

    run_id: str
    role: str
    key_for: KeyFor
    nonce: bytes = field(default_factory=new_nonce)
    accepts: str = ""
    state: AnswererState = AnswererState.AWAIT_HELLO
    hello: codec.Hello | None = None
    join_at: int = 0
    _key: bytes = b""

    def _expect(self, state: AnswererState, h: FrameHeader, msg: MsgType) -> None:
        if self.state is not state:
            self.state = AnswererState.FAILED
            raise ProtocolError(f"handshake: {h.msg_type.name} in state {state.value!r}")
        if h.msg_type != msg:
            self.state = AnswererState.FAILED
            raise ProtocolError(f"handshake: expected {msg.name}, got {h.msg_type.name}")

    def receive_hello(self, h: FrameHeader, body: bytes | memoryview) -> bytes:
        """A HELLO: returns the CHALLENGE body (the nonce) to send back."""
        self._expect(AnswererState.AWAIT_HELLO, h, MsgType.HELLO)
        try:
            hello = codec.parse_hello(body)
            key = self.key_for(hello) if hello.role == self.role else None
            if key is None:
                who = f"{hello.role} {hello.node or hello.worker}"
                raise ProtocolError(f"hello.worker: {who} is not a {self.role} this end "
                                    f"accepts ({self.accepts or 'none'})")
            if hello.worker != h.worker:
                raise ProtocolError(f"hello.worker: {hello.worker}, but its frame says "
                                    f"{h.worker}")
            if len(hello.nonce) != codec.NONCE_BYTES:
                raise ProtocolError(f"hello.nonce: missing (need {codec.NONCE_BYTES} bytes)")
        except FrameError:
            self.state = AnswererState.FAILED
            raise
        self.hello, self.join_at, self._key = hello, h.iteration, key
        self.state = AnswererState.AWAIT_PROOF
        return self.nonce

    def receive_proof(self, h: FrameHeader, body: bytes | memoryview) -> Session:
        """A PROOF: the authenticated :class:`Session`, or ProtocolError."""
        self._expect(AnswererState.AWAIT_PROOF, h, MsgType.PROOF)
        assert self.hello is not None
        w = self.hello.worker
        want = proof(self._key, self.run_id, w, self.nonce, self.hello.nonce)
        if len(body) != PROOF_BYTES or not hmac.compare_digest(bytes(body), want):
            self.state = AnswererState.FAILED
            raise ProtocolError(f"proof: {self.role} {self.hello.node or w} failed the "
                                "challenge (wrong key, or a replayed handshake)")
        self.state = AnswererState.AUTHENTICATED
        return session(self._key, w, self.join_at, self.nonce, self.hello.nonce)


def expected_payload_bytes(state: AnswererState) -> int:
    """The most a handshake frame may carry in ``state``: read before any allocation."""
    return {AnswererState.AWAIT_HELLO: codec.MAX_HELLO_BYTES,
            AnswererState.AWAIT_PROOF: PROOF_BYTES}.get(state, 0)


class DialerState(Enum):
    START = "start"
    AWAIT_CHALLENGE = "await challenge"
    AWAIT_WELCOME = "await welcome"
    JOINED = "joined"
    FAILED = "failed"


class Rejected(ConnectionError):
    """The answering end refused us (an ERROR frame) during the handshake."""


@dataclass
class Dialer:
    """The end that opened the connection: says who it is (``role``, index ``me``, and
    ``node`` where an index does not name it), answers the challenge with its ``key``,
    and checks that WELCOME is sealed under that key, so the answerer holds it too.
    ``welcome_from``: the ``(role, index)`` the WELCOME must name (None: any)."""

    run_id: str
    role: str
    me: int
    key: bytes
    nonce: bytes = field(default_factory=new_nonce)
    welcome_from: tuple[str, int] | None = None
    node: str = ""
    state: DialerState = DialerState.START
    join_at: int = 0
    session: Session | None = None

    def hello(self, join_at: int) -> bytes:
        if self.state is not DialerState.START:
            raise ProtocolError(f"hello: already sent (state {self.state.value!r})")
        self.join_at = join_at
        self.state = DialerState.AWAIT_CHALLENGE
        return codec.hello_payload(self.role, self.me, self.nonce, self.node)

    def _refused(self, h: FrameHeader, body: bytes | memoryview) -> None:
        if h.msg_type == MsgType.ERROR:
            self.state = DialerState.FAILED
            text = bytes(body[:MAX_ERROR_BYTES]).decode("utf-8", "replace")
            raise Rejected(f"refused: {text}")

    def _fail(self, h: FrameHeader, expected: str) -> ProtocolError:
        state = self.state
        self.state = DialerState.FAILED
        return ProtocolError(f"{self.role} {self.node or self.me}: {h.msg_type.name} in "
                             f"state {state.value!r}, expected {expected}")

    def receive_challenge(self, h: FrameHeader, body: bytes | memoryview) -> bytes:
        """The answerer's CHALLENGE: returns the PROOF body."""
        self._refused(h, body)
        if self.state is not DialerState.AWAIT_CHALLENGE or h.msg_type != MsgType.CHALLENGE:
            raise self._fail(h, "CHALLENGE")
        if len(body) != codec.NONCE_BYTES:
            self.state = DialerState.FAILED
            raise ProtocolError(f"{self.role} {self.node or self.me}: challenge of "
                                f"{len(body)} bytes, expected {codec.NONCE_BYTES}")
        nonce_a = bytes(body)
        self.session = session(self.key, self.me, self.join_at, nonce_a, self.nonce)
        self.state = DialerState.AWAIT_WELCOME
        return proof(self.key, self.run_id, self.me, nonce_a, self.nonce)

    def receive_welcome(self, raw_header: bytes | memoryview, h: FrameHeader,
                        body: bytes | memoryview) -> int:
        """WELCOME (its MAC proves the answerer knows our key): the iteration we join at."""
        self._refused(h, body)
        if self.state is not DialerState.AWAIT_WELCOME or h.msg_type != MsgType.WELCOME:
            raise self._fail(h, "WELCOME")
        assert self.session is not None
        try:
            self.session.down.verify(raw_header, body)
            if self.welcome_from is not None:
                hello = codec.parse_hello(body)
                if (hello.role, hello.worker) != self.welcome_from:
                    want = f"{self.welcome_from[0]} {self.welcome_from[1]}"
                    raise ProtocolError(f"WELCOME from {hello.role} {hello.worker}, "
                                        f"expected {want}")
        except FrameError:
            self.state = DialerState.FAILED
            raise
        self.state = DialerState.JOINED
        return h.iteration


# -- after the handshake: what each side accepts ----------------------------------------

def check_uplink(h: FrameHeader, worker: int) -> MsgType:
    """What an authenticated worker's connection may carry: GRAD or BYE, as itself."""
    if h.msg_type not in (MsgType.GRAD, MsgType.BYE):
        raise ProtocolError(f"unexpected {h.msg_type.name} from worker {worker}")
    if h.worker != worker:
        raise ProtocolError(f"worker: frame says {h.worker}, connection is worker {worker}")
    return h.msg_type


# The PS's queue carries these, one class per thing that can happen to a connection.

@dataclass(frozen=True)
class Joined:
    """A worker proved its key and wants to join at iteration ``join_at``."""

    conn: Any
    join_at: int


@dataclass(frozen=True)
class GradReceived:
    conn: Any
    header: FrameHeader
    tensors: list[Any]


@dataclass(frozen=True)
class Left:
    """An orderly BYE."""

    conn: Any
    rejoin_at: int


@dataclass(frozen=True)
class Lost:
    conn: Any
    reason: str


PSEvent = Joined | GradReceived | Left | Lost


@dataclass
class ChunkBarrier:
    """Iteration order and the per-chunk barrier of the PS (DESIGN.md section 2).

    A gradient is accepted only from an active worker, for the current iteration, for
    a chunk in range, once. Chunk c is complete when every active worker has sent it;
    complete chunks are released in order (:meth:`ready`), and the iteration ends when
    the last one has been released (:meth:`end_iteration`). Dropping a worker can
    complete chunks that were waiting only for it."""

    n_chunks: int
    iteration: int = 0
    active: set[int] = field(default_factory=set)
    got: dict[int, set[int]] = field(default_factory=dict)
    next_chunk: int = 0

    def check(self, worker: int, iteration: int, chunk: int) -> None:
        """Raise ProtocolError unless this gradient may be accepted now."""
        if worker not in self.active:
            raise ProtocolError(f"worker {worker}: sent a gradient while not active")
        if iteration != self.iteration:
            raise ProtocolError(f"worker {worker}: iteration {iteration}, PS is at "
                                f"{self.iteration}")
        if not 0 <= chunk < self.n_chunks:
            raise ProtocolError(f"worker {worker}: chunk {chunk} out of range "
                                f"0..{self.n_chunks - 1}")
        if chunk < self.next_chunk or worker in self.got.get(chunk, ()):
            raise ProtocolError(f"worker {worker}: chunk {chunk} sent twice")

    def record(self, worker: int, chunk: int) -> None:
        self.check(worker, self.iteration, chunk)
        self.got.setdefault(chunk, set()).add(worker)

    def ready(self) -> list[int]:
        """Chunks now complete, in order (each is returned once)."""
        out = []
        while (self.active and self.next_chunk < self.n_chunks
               and self.got.get(self.next_chunk, set()) >= self.active):
            out.append(self.next_chunk)
            self.next_chunk += 1
        return out

    def contributors(self, chunk: int) -> int:
        return len(self.got.get(chunk, ()))

    @property
    def iteration_complete(self) -> bool:
        return self.next_chunk == self.n_chunks

    def end_iteration(self) -> None:
        if not self.iteration_complete:
            raise ProtocolError(f"iteration {self.iteration}: chunk {self.next_chunk} of "
                                f"{self.n_chunks} is still open")
        self.iteration += 1
        self.got = {}
        self.next_chunk = 0

    def admit(self, worker: int) -> None:
        """Admission happens at iteration boundaries only."""
        if self.next_chunk or self.got:
            raise ProtocolError(f"admit worker {worker}: iteration {self.iteration} is "
                                "under way")
        self.active.add(worker)

    def drop(self, worker: int) -> None:
        self.active.discard(worker)


@dataclass
class Downlink:
    """What a worker accepts from the PS while receiving one iteration's weights: chunk
    c in order, WEIGHTS of exactly the chunk's size, or UPDATE parts (dense delta, or
    indices + values) no larger than the chunk; BYE ends the run."""

    chunk_sizes: list[int]
    next_chunk: int = 0
    parts_left: int = 0

    def receive(self, h: FrameHeader) -> MsgType:
        if h.msg_type == MsgType.BYE and not self.parts_left:
            return MsgType.BYE
        c = self.next_chunk
        if c >= len(self.chunk_sizes):
            raise ProtocolError(f"downlink: {h.msg_type.name} after the last chunk")
        if h.chunk != c:
            raise ProtocolError(f"downlink: chunk {h.chunk}, expected {c}")
        n = self.chunk_sizes[c]
        if h.msg_type == MsgType.WEIGHTS and not self.parts_left:
            if h.numel != n or h.dtype != codec.DType.FLOAT32 or h.nparts != 1:
                raise ProtocolError(f"downlink: WEIGHTS chunk {c}: {h.numel} {h.dtype.name}"
                                    f" in {h.nparts} parts, expected {n} FLOAT32 in 1")
            self.next_chunk += 1
            return MsgType.WEIGHTS
        if h.msg_type == MsgType.UPDATE:
            if h.nparts not in (1, 2) or h.numel > n:
                raise ProtocolError(f"downlink: UPDATE chunk {c}: {h.numel} elements in "
                                    f"{h.nparts} parts, chunk has {n}")
            if not self.parts_left:
                self.parts_left = h.nparts
            self.parts_left -= 1
            if not self.parts_left:
                self.next_chunk += 1
            return MsgType.UPDATE
        raise ProtocolError(f"downlink: unexpected {h.msg_type.name} at chunk {c}")

    @property
    def complete(self) -> bool:
        return self.next_chunk == len(self.chunk_sizes)
