"""Authenticated links between two agents of a mesh: the MoE expert mesh
(:mod:`agents.moe.mesh`) and the pipeline's stage-to-stage and replica-hub connections
(:mod:`agents.pipeline.stage`).

A link runs the PS/worker handshake of :mod:`agents.net.protocol` over one TCP connection,
with the link's pair key (:func:`agents.net.auth.pair_key`, held by its two ends only) in the
worker key's place: the end that dials plays the worker (HELLO with its index and a
nonce, then PROOF, the HMAC of both nonces under the pair key), the end that accepts
plays the PS (CHALLENGE, then WELCOME sealed with the key of its direction, which
proves that it holds the key too). Afterwards every frame in either direction carries
the per-direction MAC with its implicit sequence number (:class:`agents.net.codec.FrameMac`),
so a forged, replayed or reordered frame fails its check on arrival. A peer that claims
an index it holds no key for, or that answers the challenge with a wrong key, is refused
with a :class:`LinkError` naming the connection.

Nothing here blocks longer than ``timeout_s`` before the link is up, and nothing is
allocated for the peer beyond one hello-sized buffer until it has proved its key.
"""

from __future__ import annotations

import secrets
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from agents.net import codec, protocol, wire
from agents.net.codec import FrameError, FrameMac, MsgType


class LinkError(FrameError):
    """A mesh connection failed its handshake; the message names the connection."""


@dataclass
class Link:
    """One authenticated connection: the peer's index, the socket and both MACs.

    ``send_mac``/``recv_mac`` are this end's sending and receiving directions (the dialer
    sends with the session's ``up``, the acceptor with its ``down``). Frames must be
    sealed in the order they are sent: :meth:`send_message` and :meth:`send_frame` hold
    ``send_lock`` around both."""

    peer: int
    sock: socket.socket
    name: str
    send_mac: FrameMac
    recv_mac: FrameMac
    run_tag: int
    send_lock: threading.Lock = field(default_factory=threading.Lock)

    def reader(self, max_payload_bytes: int = codec.DEFAULT_MAX_PAYLOAD_BYTES
               ) -> wire.FrameReader:
        """The reader of this link's incoming frames (every one checked by its MAC)."""
        return wire.FrameReader(self.sock, peer=self.name, mac=self.recv_mac,
                                max_payload_bytes=max_payload_bytes)

    def send_message(self, tensors: Sequence[torch.Tensor], *, msg_type: MsgType | int,
                     worker: int, iteration: int, chunk: int, crc: bool = True) -> int:
        with self.send_lock:
            return wire.send_message(self.sock, tensors, msg_type=msg_type,
                                     run_tag=self.run_tag, worker=worker,
                                     iteration=iteration, chunk=chunk, crc=crc,
                                     peer=self.name, mac=self.send_mac)

    def send_bytes(self, body: bytes, *, msg_type: MsgType | int, worker: int,
                   iteration: int = 0) -> int:
        with self.send_lock:
            return wire.send_bytes(self.sock, body, msg_type=msg_type, run_tag=self.run_tag,
                                   worker=worker, iteration=iteration, peer=self.name,
                                   mac=self.send_mac)


def dial(sock: socket.socket, *, run_id: str, run_tag: int, role: str, me: int, peer: int,
         key: bytes, timeout_s: float, name: str, nonce: bytes | None = None) -> Link:
    """Authenticate a connection this end opened to ``peer`` (see the module docstring).
    Raises LinkError naming ``name`` (wrong key, a peer that is not ``peer``, a timeout)."""
    hs = protocol.WorkerHandshake(run_id, me, key,
                                  nonce or secrets.token_bytes(codec.NONCE_BYTES), role=role)
    reader = wire.FrameReader(sock, expect_tag=run_tag, peer=name,
                              max_payload_bytes=codec.MAX_HELLO_BYTES)
    buf = bytearray(codec.MAX_HELLO_BYTES)
    old = sock.gettimeout()
    try:
        sock.settimeout(timeout_s)
        wire.send_bytes(sock, hs.hello(0), msg_type=MsgType.HELLO, run_tag=run_tag,
                        worker=me, peer=name)
        h, payload = reader.read_frame_into(buf)
        wire.send_bytes(sock, hs.receive_challenge(h, payload), msg_type=MsgType.PROOF,
                        run_tag=run_tag, worker=me, peer=name)
        reader.expect_tag = None  # WELCOME carries a MAC in the tag's place
        h, payload = reader.read_frame_into(buf)
        hs.receive_welcome(reader.last_header, h, payload)
        hello = codec.parse_hello(payload)
        if hello.role != role or hello.worker != peer:
            raise protocol.ProtocolError(f"WELCOME from {hello.role} {hello.worker}, "
                                         f"expected {role} {peer}")
    except (FrameError, protocol.Rejected, OSError) as e:
        why = "handshake timed out" if isinstance(e, TimeoutError) else str(e)
        raise LinkError(f"{name}: {role} {me} -> {peer}: refused: {why}") from e
    finally:
        sock.settimeout(old)
    assert hs.session is not None
    return Link(peer, sock, name, send_mac=hs.session.up, recv_mac=hs.session.down,
                run_tag=run_tag)


def answer(sock: socket.socket, *, run_id: str, run_tag: int, role: str, me: int,
           keys: Mapping[int, bytes], timeout_s: float, name: str,
           accepts: Callable[[int], bool] | None = None,
           nonce: bytes | None = None) -> Link:
    """Authenticate a connection this end accepted. ``keys``: the pair key of every peer
    index that may dial us (``accepts`` may narrow that further, e.g. to peers not yet
    connected). On any failure an ERROR frame tells the peer why, and LinkError names
    the connection."""
    peers = frozenset(i for i in keys if accepts is None or accepts(i))
    hs = protocol.PSHandshake(run_id, max(keys, default=-1) + 1, lambda i: keys[i],
                              nonce or secrets.token_bytes(codec.NONCE_BYTES), role=role,
                              peers=peers)
    reader = wire.FrameReader(sock, expect_tag=run_tag, peer=name,
                              max_payload_bytes=codec.MAX_HELLO_BYTES)
    buf = bytearray(codec.MAX_HELLO_BYTES)
    old = sock.gettimeout()
    try:
        sock.settimeout(timeout_s)
        h, body = reader.read_frame_into(buf)
        challenge = hs.receive_hello(h, body)
        wire.send_bytes(sock, challenge, msg_type=MsgType.CHALLENGE, run_tag=run_tag,
                        worker=me, peer=name)
        reader.max_payload_bytes = protocol.PROOF_BYTES
        h, body = reader.read_frame_into(buf)
        session = hs.receive_proof(h, body)
        wire.send_bytes(sock, codec.hello_payload(role, me), msg_type=MsgType.WELCOME,
                        run_tag=run_tag, worker=me, peer=name, mac=session.down)
    except (FrameError, OSError) as e:
        why = "handshake timed out" if isinstance(e, TimeoutError) else str(e)
        who = f"{role} {hs.hello.worker}" if hs.hello is not None else "an unknown peer"
        _refuse(sock, run_tag, why)
        raise LinkError(f"{name}: {who} -> {role} {me}: refused: {why}") from e
    finally:
        sock.settimeout(old)
    return Link(session.worker, sock, name, send_mac=session.down, recv_mac=session.up,
                run_tag=run_tag)


def _refuse(sock: socket.socket, run_tag: int, why: str) -> None:
    try:
        sock.settimeout(1.0)  # a peer that does not read must not hold us
        wire.send_bytes(sock, why.encode()[:protocol.MAX_ERROR_BYTES],
                        msg_type=MsgType.ERROR, run_tag=run_tag, worker=0)
    except OSError:
        pass
