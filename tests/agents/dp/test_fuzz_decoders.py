"""Hypothesis fuzzing of every decoder that sees bytes from the network.

Each decoder may only raise its own error (FrameError, ConnectionClosed, PayloadError, the
key bundle's ValueError) on any input, and memory stays bounded: the FrameReader never
allocates past its cap, and the process's peak RSS grows by less than 64 MB over the
whole module.
"""

from __future__ import annotations

import resource
import socket
import threading
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import agents.compress  # noqa: F401  (registers every compressor)
from agents.compress.base import PayloadError, make
from agents.compress.checks import check_gradient
from agents.net import auth, codec, protocol, wire

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
CAP = 1 << 16
START_RSS_KB: list[int] = []


@pytest.fixture(autouse=True, scope="module")
def _peak_rss_at_start() -> None:
    """The process's peak RSS when this module's first test starts (not at collection:
    other modules' tests may run in between)."""
    START_RSS_KB.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def header_bytes(fields: dict[str, int], fix_crc: bool) -> bytes:
    """A 64-byte header from arbitrary field values, with a valid header CRC when asked
    (so the fuzzer gets past the CRC to the field checks)."""
    body = codec._BODY.pack(codec.MAGIC, fields["version"], fields["msg_type"],
                            fields["flags"], fields["tag"], fields["worker"],
                            fields["iteration"], fields["chunk"], fields["part"],
                            fields["nparts"], fields["dtype"], fields["numel"],
                            fields["payload_len"], fields["pcrc"])
    crc = zlib.crc32(body) if fix_crc else fields["pcrc"]
    return body + codec._CRC.pack(crc)


u16 = st.integers(0, 2**16 - 1)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 20)
fields = st.fixed_dictionaries({
    "version": st.one_of(st.just(codec.VERSION), u16), "msg_type": st.one_of(small, u16),
    "flags": st.one_of(st.just(0), st.just(1), u16), "tag": u64, "worker": u32,
    "iteration": u32, "chunk": u32, "part": st.one_of(small, u16),
    "nparts": st.one_of(small, u16), "dtype": st.one_of(small, st.integers(0, 255)),
    "numel": st.one_of(st.integers(0, 5000), u64),
    "payload_len": st.one_of(st.integers(0, 20000), u64), "pcrc": u32})


@SETTINGS
@given(st.binary(min_size=0, max_size=80))
def test_decode_header_raw_bytes(data: bytes) -> None:
    try:
        codec.decode_header(data, max_payload_bytes=CAP)
    except codec.FrameError:
        pass


@SETTINGS
@given(fields, st.booleans())
def test_decode_header_fields(f: dict[str, int], fix_crc: bool) -> None:
    try:
        h = codec.decode_header(header_bytes(f, fix_crc), max_payload_bytes=CAP)
    except codec.FrameError:
        return
    assert h.payload_len <= CAP and h.part < h.nparts


@SETTINGS
@given(st.one_of(st.binary(max_size=5000),
                 st.text(alphabet="[]{}\",:0123456789abcdefnortu\\ ", max_size=4200)
                 .map(str.encode),
                 st.integers(1, 5000).map(lambda n: b"[" * n),
                 st.integers(1, 5000).map(lambda n: b'{"a":' * n)))
def test_parse_hello(data: bytes) -> None:
    try:
        codec.parse_hello(data)
    except codec.FrameError:
        pass


def _feed(data: bytes) -> socket.socket:
    """The reading end of a socketpair whose writer sends ``data`` and closes."""
    a, b = socket.socketpair()
    b.settimeout(5)

    def write() -> None:
        try:
            a.sendall(data)
        except OSError:
            pass
        finally:
            a.close()

    threading.Thread(target=write, daemon=True).start()
    return b


@SETTINGS
@given(st.lists(st.tuples(fields, st.booleans(), st.binary(max_size=300)), max_size=4),
       st.booleans())
def test_frame_reader_over_a_socketpair(frames: list, message: bool) -> None:
    data = b"".join(header_bytes(f, fix) + body for f, fix, body in frames)
    sock = _feed(data)
    reader = wire.FrameReader(sock, max_payload_bytes=CAP)
    try:
        for _ in range(8):
            if message:
                parts = reader.read_message()
                assert sum(t.numel() * t.element_size() for _, t in parts) <= CAP * len(parts)
            else:
                reader.read_frame()
            assert len(reader._buf) <= CAP
    except (codec.FrameError, wire.ConnectionClosed):
        pass
    finally:
        sock.close()


@SETTINGS
@given(st.binary(max_size=600), st.binary(max_size=80))
def test_frame_reader_with_a_mac_refuses_what_is_not_sealed(junk: bytes, hdr: bytes) -> None:
    sock = _feed(hdr + junk)
    reader = wire.FrameReader(sock, max_payload_bytes=CAP, mac=codec.FrameMac(b"k" * 32))
    try:
        reader.read_frame()
        raise AssertionError("an unsealed frame was accepted")
    except (codec.FrameError, wire.ConnectionClosed):
        pass
    finally:
        sock.close()


@SETTINGS
@given(st.sampled_from([m for m in codec.MsgType]), st.binary(max_size=200), u32, u32)
def test_ps_handshake_any_first_frame(msg: codec.MsgType, body: bytes, worker: int,
                                      iteration: int) -> None:
    hs = protocol.Answerer("r", "worker", lambda h: b"k" * 32 if h.worker < 4 else None,
                           b"n" * 16)
    hdr, payload = codec.frame_for_bytes(body, msg_type=msg, run_tag=0, worker=worker,
                                         iteration=iteration)
    h = codec.decode_header(hdr)
    try:
        hs.receive_hello(h, payload)
        hs.receive_proof(h, payload)
    except codec.FrameError:
        assert hs.state is protocol.AnswererState.FAILED or \
            hs.state is protocol.AnswererState.AWAIT_PROOF


@SETTINGS
@given(st.binary(max_size=5000))
def test_key_bundle(data: bytes) -> None:
    try:
        auth.decode_bundle(data)
    except ValueError:
        pass


values = st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=40)
indices = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=40)


@SETTINGS
@given(st.sampled_from(["topk", "randomk", "dgc", "threshold", "none", "fp16", "qsgd",
                        "signsgd"]),
       st.sampled_from(["int32", "delta"]), values, indices, st.binary(max_size=64),
       st.integers(1, 64))
def test_compressor_payload_decoders(name: str, enc: str, vals: list[float], idx: list[int],
                                     raw: bytes, numel: int) -> None:
    """What the PS does with a GRAD's parts: from_parts, decompress(_sparse), the sanity
    check. Only the errors the PS turns into a frame_error may come out."""
    try:
        comp = make(name, index_encoding=enc) if name in ("topk", "randomk", "dgc",
                                                          "threshold") else make(name)
    except (TypeError, ValueError):
        return
    parts = [torch.tensor(vals, dtype=torch.float32),
             torch.tensor(idx, dtype=torch.int32) if enc == "int32"
             else torch.frombuffer(bytearray(raw or b"\0"), dtype=torch.uint8)]
    for n in (1, 2):
        try:
            payload = comp.from_parts(parts[:n], numel, (numel,), torch.float32)
            sparse = comp.decompress_sparse(payload)
            dense = None if sparse is not None else comp.decompress(payload).reshape(-1)
            check_gradient(sparse, dense, numel, who="w", max_abs=1e6, unique_indices=True)
        except (PayloadError, ValueError, RuntimeError, IndexError, TypeError):
            pass  # every one of these is caught by the PS's _accumulate


def test_memory_stayed_bounded() -> None:
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - START_RSS_KB[0]
    assert grown_kb < 64 * 1024, f"peak RSS grew by {grown_kb} KiB"


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_thousand_brackets_is_a_clean_error(depth: int) -> None:
    with pytest.raises(codec.FrameError, match="nested deeper"):
        codec.parse_hello(b"[" * min(depth, codec.MAX_HELLO_BYTES))


@SETTINGS
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=12),
       st.lists(st.integers(-3, 40), min_size=0, max_size=12),
       st.integers(0, 40), st.integers(0, 40), st.integers(0, 40), st.integers(1, 64))
def test_powersgd_layered_payload_decoder(raw_header: list[int], small_header: list[int],
                                          n_p: int, n_q: int, n_dense: int,
                                          numel: int) -> None:
    """PowerSGD's per-layer wire format (an int32 (numel, m, r) header, P, Q, dense): any
    header and part sizes either decode to exactly ``numel`` values or raise PayloadError,
    the one error the PS's _accumulate reports; never another exception. Small headers
    make consistent ones likely, large ones probe overflow."""
    comp = make("powersgd")
    for header in (raw_header, small_header):
        parts = [torch.tensor(header, dtype=torch.int32), torch.ones(n_p), torch.ones(n_q),
                 torch.ones(n_dense)]
        try:
            payload = comp.from_parts(parts, numel, (numel,), torch.float32)
        except PayloadError:
            continue
        assert comp.decompress(payload).shape == (numel,)
