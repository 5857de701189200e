"""Authenticated links between two agents of a mesh: the MoE expert mesh
(:mod:`agents.moe.mesh`) and the pipeline's stage-to-stage and stage-to-PS connections
(:mod:`agents.pipeline.stage`, :mod:`agents.pipeline.stage_ps`).

A link is one TCP connection after the handshake of :mod:`agents.net.handshake`, run
under the link's pair key (:func:`agents.net.auth.pair_key`, held by its two ends only):
the end that opened it dialed, the end that accepted it answered. Afterwards every frame
in either direction carries the per-direction MAC with its implicit sequence number
(:class:`agents.net.codec.FrameMac`), so a forged, replayed or reordered frame fails its
check on arrival.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agents.net import codec, protocol, wire
from agents.net.codec import FrameMac, MsgType


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

    @classmethod
    def dialed(cls, sock: socket.socket, session: protocol.Session, *, peer: int, name: str,
               run_tag: int) -> Link:
        """The link this end opened (``agents.net.handshake.dial`` made ``session``)."""
        return cls(peer, sock, name, send_mac=session.up, recv_mac=session.down,
                   run_tag=run_tag)

    @classmethod
    def answered(cls, sock: socket.socket, session: protocol.Session, *, name: str,
                 run_tag: int) -> Link:
        """The link this end accepted (``agents.net.handshake.answer`` made ``session``)."""
        return cls(session.worker, sock, name, send_mac=session.down, recv_mac=session.up,
                   run_tag=run_tag)

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
