"""The PS/worker conversation as sans-I/O state machines (agents.net.protocol): no sockets.

Both handshake sides are driven against each other with frames encoded and decoded by
the real codec; every illegal transition raises ProtocolError (or Rejected) and leaves
the machine failed. (One test also reads a forged frame through a FrameReader over a
socketpair.)
"""

from __future__ import annotations

import dataclasses
import socket
import zlib

import pytest

from agents.net import auth, codec, protocol, wire
from agents.net.codec import FrameError, FrameMac, MsgType
from agents.net.protocol import (
    Answerer,
    AnswererState,
    ChunkBarrier,
    Dialer,
    Downlink,
    ProtocolError,
    Rejected,
)

RUN = "run-x"
MASTER = b"m" * 32
ROOT = auth.workers_root(MASTER)
TAG = codec.run_tag(RUN, codec.PUBLIC_SECRET)


def frame(body: bytes, msg: MsgType, worker: int = 0, iteration: int = 0,
          mac: FrameMac | None = None) -> tuple[bytes, codec.FrameHeader, bytes]:
    """(raw header, decoded header, body) as the receiver would see them."""
    hdr, payload = codec.frame_for_bytes(body, msg_type=msg, run_tag=TAG, worker=worker,
                                         iteration=iteration)
    if mac is not None:
        hdr = mac.seal(hdr, payload)
    return hdr, codec.decode_header(hdr), bytes(payload)


def ps_end(nonce: bytes = b"P" * 16) -> Answerer:
    """The PS's end: workers 0..3, each under its own key."""
    return Answerer(RUN, "worker",
                    lambda h: auth.worker_key(ROOT, h.worker) if h.worker < 4 else None,
                    nonce, accepts="0..3")


def pair(worker: int = 1, key: bytes | None = None) -> tuple[Answerer, Dialer]:
    wk = Dialer(RUN, "worker", worker, key or auth.node_key(MASTER, f"w{worker}"), b"W" * 16)
    return ps_end(), wk


def run_handshake(ps: Answerer, wk: Dialer, join_at: int = 0
                  ) -> protocol.Session:
    _, h, body = frame(wk.hello(join_at), MsgType.HELLO, wk.me, join_at)
    challenge = ps.receive_hello(h, body)
    _, h, body = frame(challenge, MsgType.CHALLENGE)
    answer = wk.receive_challenge(h, body)
    _, h, body = frame(answer, MsgType.PROOF, wk.me)
    return ps.receive_proof(h, body)


def test_handshake_authenticates_and_both_sides_agree_on_the_keys() -> None:
    ps, wk = pair(worker=2)
    s = run_handshake(ps, wk, join_at=5)
    assert ps.state is AnswererState.AUTHENTICATED
    assert (s.worker, s.join_at) == (2, 5)
    raw, h, body = frame(codec.hello_payload("ps", 2), MsgType.WELCOME, 2, 5, mac=s.down)
    assert wk.receive_welcome(raw, h, body) == 5
    assert wk.state is protocol.DialerState.JOINED
    assert wk.session is not None
    # Worker -> PS frames sealed by the worker verify at the PS, in order only.
    h1 = wk.session.up.seal(frame(b"x", MsgType.GRAD, 2)[0], b"x")
    h2 = wk.session.up.seal(frame(b"y", MsgType.GRAD, 2)[0], b"y")
    with pytest.raises(FrameError, match="mac"):
        s.up.verify(h2, b"y")  # out of order
    s.up.seq = 0
    s.up.verify(h1, b"x")
    s.up.verify(h2, b"y")
    with pytest.raises(FrameError, match="mac"):
        s.up.verify(h2, b"y")  # replayed


@pytest.mark.parametrize("algorithm", sorted(codec.MAC_ALGORITHMS))
def test_the_mac_covers_the_payload_itself(algorithm: str) -> None:
    """One payload byte flipped and the payload CRC fixed up to match (what an attacker
    rewriting bytes inside the TCP stream can do) fails the MAC, sans-I/O and through a
    FrameReader over a socketpair."""
    up_w, up_ps = FrameMac(b"u" * 32, algorithm), FrameMac(b"u" * 32, algorithm)
    body = bytes(range(256)) * 4
    hdr, payload = codec.frame_for_bytes(body, msg_type=MsgType.GRAD, run_tag=TAG, worker=1)
    sealed = up_w.seal(hdr, payload)
    forged_body = bytearray(body)
    forged_body[100] ^= 0x01
    h = codec.decode_header(sealed)
    forged = codec.encode_header(dataclasses.replace(
        h, payload_crc=codec.payload_crc32(forged_body)))
    forged = sealed[:18] + forged[18:60]  # keep the sealed tag; the header CRC re-done:
    forged += zlib.crc32(forged).to_bytes(4, "little")
    fh = codec.decode_header(forged)  # a well-formed header whose CRC matches the payload
    codec.check_payload(fh, forged_body)
    with pytest.raises(FrameError, match="fails its MAC"):
        up_ps.verify(forged, forged_body)
    up_ps.verify(sealed, body)  # the real frame still verifies (the failed one consumed
    # nothing) ...
    a, b = socket.socketpair()
    try:
        reader = wire.FrameReader(b, mac=FrameMac(b"v" * 32, algorithm))
        tx = FrameMac(b"v" * 32, algorithm)
        hdr2 = tx.seal(hdr, payload)
        h2 = codec.decode_header(hdr2)
        fixed = codec.encode_header(dataclasses.replace(
            h2, payload_crc=codec.payload_crc32(forged_body)))
        a.sendall(hdr2[:18] + fixed[18:60]
                  + zlib.crc32(hdr2[:18] + fixed[18:60]).to_bytes(4, "little")
                  + bytes(forged_body))
        with pytest.raises(FrameError, match="fails its MAC"):
            reader.read_frame()
    finally:
        a.close()
        b.close()


def test_wrong_key_fails_the_challenge_and_the_handshake_is_over() -> None:
    ps, wk = pair(worker=1, key=b"k" * 32)
    with pytest.raises(ProtocolError, match="failed the challenge"):
        run_handshake(ps, wk)
    assert ps.state is AnswererState.FAILED
    _, h, body = frame(b"\0" * 32, MsgType.PROOF, 1)
    with pytest.raises(ProtocolError):
        ps.receive_proof(h, body)


def test_a_replayed_handshake_fails_under_a_fresh_challenge() -> None:
    """A captured HELLO and PROOF of a real handshake, replayed against a new
    connection: the PS's new nonce makes the old proof worthless."""
    ps, wk = pair(worker=1)
    _, hello_h, hello_body = frame(wk.hello(0), MsgType.HELLO, 1)
    _, ch, cb = frame(ps.receive_hello(hello_h, hello_body), MsgType.CHALLENGE)
    _, proof_h, proof_body = frame(wk.receive_challenge(ch, cb), MsgType.PROOF, 1)
    ps.receive_proof(proof_h, proof_body)
    ps2 = ps_end(b"Q" * 16)
    ps2.receive_hello(hello_h, hello_body)
    with pytest.raises(ProtocolError, match="failed the challenge"):
        ps2.receive_proof(proof_h, proof_body)


@pytest.mark.parametrize("first", [MsgType.PROOF, MsgType.GRAD, MsgType.WELCOME, MsgType.BYE])
def test_ps_refuses_anything_but_hello_first(first: MsgType) -> None:
    ps, _ = pair()
    _, h, body = frame(b"\0" * 32, first)
    with pytest.raises(ProtocolError, match="expected HELLO"):
        ps.receive_hello(h, body)
    assert ps.state is AnswererState.FAILED


def test_ps_refuses_a_second_hello_and_hello_without_nonce_or_out_of_range() -> None:
    ps, wk = pair()
    _, h, body = frame(wk.hello(0), MsgType.HELLO, 1)
    ps.receive_hello(h, body)
    with pytest.raises(ProtocolError, match="in state"):
        ps.receive_hello(h, body)
    ps, _ = pair()
    _, h, body = frame(codec.hello_payload("worker", 1), MsgType.HELLO, 1)
    with pytest.raises(ProtocolError, match="nonce"):
        ps.receive_hello(h, body)
    ps, _ = pair()
    _, h, body = frame(codec.hello_payload("worker", 4, b"n" * 16), MsgType.HELLO, 4)
    with pytest.raises(ProtocolError, match="not a worker"):
        ps.receive_hello(h, body)


def test_worker_illegal_transitions() -> None:
    _, wk = pair()
    _, h, body = frame(b"P" * 16, MsgType.CHALLENGE)
    with pytest.raises(ProtocolError):
        wk.receive_challenge(h, body)  # before HELLO
    _, wk = pair()
    wk.hello(0)
    with pytest.raises(ProtocolError, match="already sent"):
        wk.hello(0)
    _, h, body = frame(b"short", MsgType.CHALLENGE)
    with pytest.raises(ProtocolError, match="challenge of 5 bytes"):
        wk.receive_challenge(h, body)
    _, wk = pair()
    wk.hello(0)
    _, h, body = frame(b"no such worker", MsgType.ERROR)
    with pytest.raises(Rejected, match="no such worker"):
        wk.receive_challenge(h, body)


def test_welcome_without_the_ps_mac_is_refused() -> None:
    """A fake PS (one that does not know our key) cannot welcome us."""
    ps, wk = pair()
    run_handshake(ps, wk)
    raw, h, body = frame(codec.hello_payload("ps", 1), MsgType.WELCOME, 1,
                         mac=FrameMac(b"z" * 32))
    with pytest.raises(FrameError, match="mac"):
        wk.receive_welcome(raw, h, body)
    assert wk.state is protocol.DialerState.FAILED


def test_uplink_allows_grad_and_bye_as_itself_only() -> None:
    assert protocol.check_uplink(frame(b"", MsgType.GRAD, 3)[1], 3) == MsgType.GRAD
    assert protocol.check_uplink(frame(b"", MsgType.BYE, 3)[1], 3) == MsgType.BYE
    with pytest.raises(ProtocolError, match="frame says 2"):
        protocol.check_uplink(frame(b"", MsgType.GRAD, 2)[1], 3)
    with pytest.raises(ProtocolError, match="unexpected HELLO"):
        protocol.check_uplink(frame(b"", MsgType.HELLO, 3)[1], 3)


def test_chunk_barrier_releases_chunks_in_order_when_every_active_worker_sent_them() -> None:
    b = ChunkBarrier(3)
    b.admit(0)
    b.admit(1)
    b.record(0, 1)
    b.record(1, 1)
    assert b.ready() == []  # chunk 0 still open: chunks go down in order
    b.record(0, 0)
    assert b.ready() == []
    b.record(1, 0)
    assert b.ready() == [0, 1]
    b.record(0, 2)
    b.drop(1)  # the worker chunk 2 waited for is gone
    assert b.ready() == [2] and b.iteration_complete
    b.end_iteration()
    assert (b.iteration, b.next_chunk, b.got) == (1, 0, {})


def test_chunk_barrier_illegal_gradients() -> None:
    b = ChunkBarrier(2)
    b.admit(0)
    with pytest.raises(ProtocolError, match="not active"):
        b.record(5, 0)
    with pytest.raises(ProtocolError, match="iteration 1, PS is at 0"):
        b.check(0, 1, 0)
    with pytest.raises(ProtocolError, match="out of range"):
        b.record(0, 2)
    b.record(0, 0)
    with pytest.raises(ProtocolError, match="sent twice"):
        b.record(0, 0)
    assert b.ready() == [0]
    with pytest.raises(ProtocolError, match="sent twice"):
        b.record(0, 0)  # already released
    with pytest.raises(ProtocolError, match="still open"):
        b.end_iteration()
    with pytest.raises(ProtocolError, match="under way"):
        b.admit(1)  # admission only at iteration boundaries


def _down(msg: MsgType, chunk: int, numel: int, nparts: int = 1, part: int = 0,
          dtype: codec.DType = codec.DType.FLOAT32) -> codec.FrameHeader:
    return codec.FrameHeader(msg_type=msg, run_tag=0, worker=0, iteration=0, chunk=chunk,
                             dtype=dtype, numel=numel, payload_len=numel * dtype.itemsize,
                             part=part, nparts=nparts)


def test_downlink_order_sizes_and_bye() -> None:
    d = Downlink([10, 4])
    assert d.receive(_down(MsgType.WEIGHTS, 0, 10)) == MsgType.WEIGHTS
    with pytest.raises(ProtocolError, match="chunk 0, expected 1"):
        d.receive(_down(MsgType.WEIGHTS, 0, 10))
    with pytest.raises(ProtocolError, match="expected 4 FLOAT32"):
        d.receive(_down(MsgType.WEIGHTS, 1, 5))
    assert d.receive(_down(MsgType.UPDATE, 1, 2, nparts=2, dtype=codec.DType.INT32)) \
        == MsgType.UPDATE
    assert not d.complete
    with pytest.raises(ProtocolError, match="UPDATE chunk 1: 9 elements"):
        d.receive(_down(MsgType.UPDATE, 1, 9, nparts=2, part=1))
    assert d.receive(_down(MsgType.UPDATE, 1, 2, nparts=2, part=1)) == MsgType.UPDATE
    assert d.complete
    with pytest.raises(ProtocolError, match="after the last chunk"):
        d.receive(_down(MsgType.WEIGHTS, 2, 1))
    assert Downlink([3]).receive(_down(MsgType.BYE, 0, 0)) == MsgType.BYE
    with pytest.raises(ProtocolError, match="unexpected GRAD"):
        Downlink([3]).receive(_down(MsgType.GRAD, 0, 3))


def test_hello_parser_bounds_depth_and_size() -> None:
    with pytest.raises(FrameError, match="nested deeper"):
        codec.parse_hello(b"[" * 1000)
    with pytest.raises(FrameError, match="exceeds"):
        codec.parse_hello(b" " * (codec.MAX_HELLO_BYTES + 1))
    # Brackets inside strings are not nesting.
    h = codec.parse_hello(b'{"role":"worker","worker":1,"version":1,"x":"[[[[[[[["}')
    assert h.worker == 1


def test_key_bundles_give_each_agent_only_its_own_key() -> None:
    w0, w1, ps = (auth.bundle_for(MASTER, n) for n in ("w0", "w1", "ps"))
    assert w0.key != w1.key and not w0.workers_root and not w1.workers_root
    assert auth.worker_key(ps.workers_root, 1) == w1.key
    assert auth.decode_bundle(w1.encode()) == w1
    with pytest.raises(ValueError, match="malformed"):
        auth.decode_bundle(b"[" * 3000)
