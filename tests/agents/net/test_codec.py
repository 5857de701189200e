"""Property tests of the sans-I/O frame codec (agents/net/codec.py): round trips of every
dtype bit-exactly, zero-copy, and a named FrameError for every kind of bad header."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.net.codec import (
    FLAG_CRC,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    DType,
    FrameError,
    FrameHeader,
    MsgType,
    buffer_address,
    check_payload,
    decode_header,
    encode_header,
    frame_for_bytes,
    frame_for_tensor,
    hello_payload,
    parse_hello,
    payload_crc32,
    run_tag,
    tensor_from_buffer,
)

TAG = run_tag("run-test", b"secret-1")

# The layout written out independently of the module, so a silent change of the wire
# format fails here.
RAW = struct.Struct("<4sHHHQIIIHHBQQI5x")


def raw_header(*, magic: bytes = MAGIC, version: int = VERSION, msg_type: int = 3,
               flags: int = 0, tag: int = TAG, worker: int = 1, iteration: int = 2,
               chunk: int = 3, part: int = 0, nparts: int = 1, dtype: int = 1,
               numel: int = 4, payload_len: int = 16, pcrc: int = 0) -> bytes:
    body = RAW.pack(magic, version, msg_type, flags, tag, worker, iteration, chunk, part,
                    nparts, dtype, numel, payload_len, pcrc)
    return body + struct.pack("<I", zlib.crc32(body))


def random_tensor(dtype: DType, n: int, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    if dtype is DType.BOOL:
        return torch.from_numpy(g.integers(0, 2, n).astype(np.bool_))
    # Random bit patterns, so NaN payloads, infinities and denormals are covered too.
    raw = bytearray(g.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).tobytes())
    if n == 0:
        return torch.empty(0, dtype=dtype.torch_dtype)
    return torch.frombuffer(raw, dtype=dtype.torch_dtype)


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def test_header_layout() -> None:
    assert HEADER_SIZE == 64 == RAW.size + 4
    h = decode_header(raw_header(), expect_tag=TAG)
    assert (h.msg_type, h.worker, h.iteration, h.chunk, h.dtype, h.numel) == (
        MsgType.GRAD, 1, 2, 3, DType.FLOAT32, 4)


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(list(DType)), n=st.integers(0, 300), seed=st.integers(0, 2**32),
       worker=st.integers(0, 2**32 - 1), iteration=st.integers(0, 2**32 - 1),
       chunk=st.integers(0, 2**32 - 1), nparts=st.integers(1, 2**16 - 1),
       msg_type=st.sampled_from(list(MsgType)), crc=st.booleans(), data=st.data())
def test_round_trip_every_dtype(dtype: DType, n: int, seed: int, worker: int, iteration: int,
                                chunk: int, nparts: int, msg_type: MsgType, crc: bool,
                                data: st.DataObject) -> None:
    part = data.draw(st.integers(0, nparts - 1))
    t = random_tensor(dtype, n, seed)
    hb, mv = frame_for_tensor(t, msg_type=msg_type, run_tag=TAG, worker=worker,
                              iteration=iteration, chunk=chunk, part=part, nparts=nparts,
                              crc=crc)
    assert len(hb) == HEADER_SIZE and len(mv) == n * dtype.itemsize
    h = decode_header(hb, expect_tag=TAG)
    assert h == FrameHeader(msg_type=msg_type, run_tag=TAG, worker=worker, iteration=iteration,
                            chunk=chunk, dtype=dtype, numel=n, payload_len=n * dtype.itemsize,
                            part=part, nparts=nparts, flags=FLAG_CRC if crc else 0,
                            payload_crc=zlib.crc32(mv) if crc else 0)
    assert encode_header(h) == hb
    received = bytearray(mv)  # what the kernel would hand the receiver
    check_payload(h, received)
    out = tensor_from_buffer(h, received)
    assert out.dtype == t.dtype and out.shape == (n,)
    assert bits(out) == bits(t)
    if n:
        # Zero copy on both sides: the payload view is the tensor's memory, and the
        # decoded tensor is the receive buffer's memory.
        assert buffer_address(mv) == t.data_ptr()
        assert out.data_ptr() == buffer_address(memoryview(received))


def test_non_contiguous_and_shaped_tensors_are_flattened() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for src in (t, t.t(), t[:, ::2], torch.tensor(3.5), t[1]):
        hb, mv = frame_for_tensor(src, msg_type=MsgType.WEIGHTS, run_tag=TAG, worker=0,
                                  iteration=0, chunk=0)
        h = decode_header(hb)
        assert torch.equal(tensor_from_buffer(h, bytearray(mv)), src.reshape(-1))


def test_grad_tracking_tensor_is_detached() -> None:
    w = torch.ones(5, requires_grad=True)
    hb, mv = frame_for_tensor(w * 2, msg_type=MsgType.GRAD, run_tag=TAG, worker=0,
                              iteration=0, chunk=0)
    assert torch.equal(tensor_from_buffer(decode_header(hb), bytearray(mv)), torch.full((5,), 2.0))


def test_unsupported_dtype_names_field() -> None:
    with pytest.raises(FrameError, match="dtype"):
        frame_for_tensor(torch.zeros(3, dtype=torch.complex64), msg_type=MsgType.GRAD,
                         run_tag=TAG, worker=0, iteration=0, chunk=0)


@pytest.mark.parametrize("dtype", list(DType))
def test_every_wire_dtype_has_torch_itemsize_and_round_trips_its_code(dtype: DType) -> None:
    # The header's payload_len check reads a written-out table (no torch there).
    assert dtype.itemsize == dtype.torch_dtype.itemsize
    assert DType.from_torch(dtype.torch_dtype) is dtype


def _good_frame() -> tuple[bytes, memoryview]:
    t = torch.linspace(-1, 1, 33)
    return frame_for_tensor(t, msg_type=MsgType.GRAD, run_tag=TAG, worker=7, iteration=9,
                            chunk=2, part=1, nparts=3)


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, HEADER_SIZE - 1), xor=st.integers(1, 255))
def test_any_single_byte_header_corruption_is_rejected(pos: int, xor: int) -> None:
    hb, _ = _good_frame()
    bad = bytearray(hb)
    bad[pos] ^= xor
    with pytest.raises(FrameError, match="magic|version|header_crc"):
        decode_header(bytes(bad), expect_tag=TAG)


@settings(max_examples=100, deadline=None)
@given(pos=st.integers(0, 33 * 4 - 1), xor=st.integers(1, 255))
def test_payload_corruption_detected_with_crc(pos: int, xor: int) -> None:
    hb, mv = _good_frame()
    h = decode_header(hb, expect_tag=TAG)
    bad = bytearray(mv)
    bad[pos] ^= xor
    with pytest.raises(FrameError, match="payload_crc.*GRAD worker=7 iter=9 chunk=2"):
        check_payload(h, bad)


def test_payload_corruption_undetected_without_crc() -> None:
    # The documented trade-off of crc=False: only the length is checked.
    t = torch.ones(8)
    hb, mv = frame_for_tensor(t, msg_type=MsgType.GRAD, run_tag=TAG, worker=0, iteration=0,
                              chunk=0, crc=False)
    h = decode_header(hb)
    assert not h.has_crc and h.payload_crc == 0
    bad = bytearray(mv)
    bad[0] ^= 1
    check_payload(h, bad)
    with pytest.raises(FrameError, match="payload_len: got 31 bytes, header says 32"):
        check_payload(h, bad[:-1])


@pytest.mark.parametrize("n", range(HEADER_SIZE))
def test_truncated_header(n: int) -> None:
    hb, _ = _good_frame()
    with pytest.raises(FrameError, match=f"header: truncated, {n} of {HEADER_SIZE} bytes"):
        decode_header(hb[:n])


def test_longer_buffer_decodes_first_header() -> None:
    hb, mv = _good_frame()
    assert decode_header(hb + bytes(mv)).numel == 33


def test_wrong_version() -> None:
    with pytest.raises(FrameError, match="version: got 2, expected 1"):
        decode_header(raw_header(version=2))


def test_wrong_magic_shows_bytes() -> None:
    with pytest.raises(FrameError, match=r"magic: got b'HTTP'"):
        decode_header(raw_header(magic=b"HTTP"))


def test_wrong_secret_and_wrong_run_are_rejected() -> None:
    hb, _ = _good_frame()
    for other in (run_tag("run-test", b"secret-2"), run_tag("run-other", b"secret-1")):
        assert other != TAG
        with pytest.raises(FrameError, match="run_tag.*another run or wrong secret"):
            decode_header(hb, expect_tag=other)
    assert decode_header(hb).run_tag == TAG  # no expectation: accepted, tag reported


def test_run_tag_properties() -> None:
    assert run_tag("a", b"k") == run_tag("a", b"k")
    assert 0 <= run_tag("a", b"k") < 2**64
    assert len({run_tag(r, s) for r in ("a", "b") for s in (b"k", b"l")}) == 4
    with pytest.raises(ValueError, match="secret"):
        run_tag("a", b"")


def test_payload_len_mismatch() -> None:
    with pytest.raises(FrameError, match=r"payload_len: 15 != numel 4 \* itemsize 4 \(FLOAT32\)"):
        decode_header(raw_header(numel=4, payload_len=15))
    with pytest.raises(FrameError, match="payload_len"):
        encode_header(FrameHeader(msg_type=MsgType.GRAD, run_tag=TAG, worker=0, iteration=0,
                                  chunk=0, dtype=DType.INT64, numel=2, payload_len=8))


def test_payload_too_large() -> None:
    with pytest.raises(FrameError, match="payload_len: 4000 bytes is too large"):
        decode_header(raw_header(numel=1000, payload_len=4000), max_payload_bytes=3999)
    n = 2**61  # a corrupt-but-CRC-valid u64 must not make the receiver allocate it
    with pytest.raises(FrameError, match="too large"):
        decode_header(raw_header(numel=n, payload_len=n, dtype=int(DType.UINT8)))


def test_unknown_codes_and_bad_fields() -> None:
    with pytest.raises(FrameError, match="msg_type: unknown code 999"):
        decode_header(raw_header(msg_type=999))
    with pytest.raises(FrameError, match="dtype: unknown code 0"):
        decode_header(raw_header(dtype=0))
    with pytest.raises(FrameError, match="flags: unknown bits 0x0004"):
        decode_header(raw_header(flags=4))
    with pytest.raises(FrameError, match="part: 3 not in"):
        decode_header(raw_header(part=3, nparts=3))
    with pytest.raises(FrameError, match="part: 0 not in"):
        decode_header(raw_header(part=0, nparts=0))


def test_encode_rejects_out_of_range_fields() -> None:
    base = dict(msg_type=MsgType.GRAD, run_tag=TAG, worker=0, iteration=0, chunk=0,
                dtype=DType.UINT8, numel=0, payload_len=0)
    for field, value in (("worker", -1), ("iteration", 2**32), ("chunk", 2**32),
                         ("run_tag", 2**64), ("nparts", 0), ("part", 5)):
        with pytest.raises(FrameError, match=field):
            encode_header(FrameHeader(**{**base, field: value}))  # type: ignore[arg-type]


def test_crc_backend_matches_zlib() -> None:
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    assert payload_crc32(data.data) == zlib.crc32(data.tobytes())


def test_tensor_from_buffer_length_check() -> None:
    hb, mv = _good_frame()
    with pytest.raises(FrameError, match="payload_len: buffer has 4 bytes"):
        tensor_from_buffer(decode_header(hb), bytearray(4))


def test_hello_round_trip() -> None:
    body = hello_payload("worker", 5)
    hb, mv = frame_for_bytes(body, msg_type=MsgType.HELLO, run_tag=TAG, worker=5)
    h = decode_header(hb, expect_tag=TAG)
    check_payload(h, mv)
    assert h.msg_type is MsgType.HELLO and h.dtype is DType.UINT8
    hello = parse_hello(bytes(mv))
    assert (hello.role, hello.worker, hello.version) == ("worker", 5, VERSION)


@pytest.mark.parametrize("body,field", [
    (b"\xff", "hello: not UTF-8"), (b"[1]", "hello: expected a JSON object"),
    (b'{"role":"x","worker":1,"version":1}', "hello.role"),
    (b'{"role":"ps","worker":-1,"version":1}', "hello.worker"),
    (b'{"role":"ps","worker":true,"version":1}', "hello.worker"),
    (b'{"role":"ps","worker":0,"version":9}', "hello.version"),
    (b" " * 5000, "exceeds"),
])
def test_bad_hello(body: bytes, field: str) -> None:
    with pytest.raises(FrameError, match=field):
        parse_hello(body)
    with pytest.raises(ValueError, match="role"):
        hello_payload("admin", 0)


def test_crc_falls_back_to_zlib_without_isal(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from agents.net import codec
    monkeypatch.setitem(sys.modules, "isal", None)  # makes `import isal` fail
    fn, name = codec._pick_crc32()
    assert name == "zlib" and fn is zlib.crc32
