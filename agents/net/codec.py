"""Sans-I/O frame codec of gradbed's wire protocol (DESIGN.md sections 2 and 4).

Every message between agents (gradients, weights, activations, MoE counts and
tokens, control) travels as *frames*: a fixed-size binary header followed by one
raw payload buffer holding a flat tensor's bytes. There is no pickle anywhere and
no copy of the payload: the sender hands the kernel a memoryview over the
tensor's own storage, and the receiver builds a tensor over the buffer the
kernel wrote into. This module only turns tensors into (header bytes, payload
view) and header bytes back into a validated :class:`FrameHeader`, in the style
of h11: no sockets here, so every check is testable and fuzzable without I/O.
The socket edge lives in :mod:`agents.net.wire`.

Header layout (little-endian, :data:`HEADER_SIZE` = 64 bytes)::

    off size field        meaning
      0   4  magic        b"GBED"
      4   2  version      VERSION (1)
      6   2  msg_type     MsgType
      8   2  flags        bit 0 = payload CRC present (FLAG_CRC); other bits must be 0
     10   8  run_tag      run_tag(run_id, secret): rejects frames of other runs
     18   4  worker       sender's index (see below)
     22   4  iteration    training iteration (see below)
     26   4  chunk        chunk id in the fixed send order
     30   2  part         index of this tensor within the chunk's message
     32   2  nparts       tensors in the message (values, indices, scales, ...)
     34   1  dtype        DType code
     35   8  numel        element count of the flat payload tensor
     43   8  payload_len  bytes; must equal numel * itemsize
     51   4  payload_crc  CRC-32 (zlib polynomial) of the payload; 0 when FLAG_CRC unset
     55   5  (reserved)   zero; rounds the header to 64 bytes and leaves room
     60   4  header_crc   CRC-32 of bytes 0..59

``worker`` and ``iteration`` name the sender and the step in every protocol's own terms: a
data-parallel worker and its iteration; on a link between pipeline stages the sending stage
and the micro-batch (:attr:`FrameHeader.stage`, :attr:`FrameHeader.micro_batch`); towards the
pipeline's PS ``replica * stages + stage`` and the step; an MoE expert host and its step.

Payloads are flat: a frame carries ``numel`` elements, not a shape. Shapes are
known to both ends (the model, or the compressor's own metadata part).

Authentication (``agents.net.protocol``): the handshake frames (HELLO, CHALLENGE,
PROOF) carry the run's public tag, ``run_tag(run_id, PUBLIC_SECRET)``, which only
keeps frames of another run apart. Once a worker has answered the PS's fresh
challenge with an HMAC under its own key, every later frame of that connection
carries in ``run_tag`` a MAC instead (:class:`FrameMac`): 8 bytes of Poly1305 (a
one-time key per frame) over the header and the payload itself, keyed by an implicit
per-direction sequence number under a key that exists only for this connection. A
captured frame is worth nothing elsewhere: another connection has another key, and
the same connection expects the next sequence number; a payload rewritten in the stream fails the MAC even where its
CRC-32 was fixed up. The receiver checks the MAC once the payload is in, so what it
reads before is bounded by the header checks alone (the chunk's expected size).

The payload CRC is optional per frame (FLAG_CRC). The CRC uses ISA-L's
``isal.isal_zlib.crc32`` when the ``isal`` package is installed (~14 GB/s here,
same polynomial and values as zlib) and falls back to ``zlib.crc32`` (~2.2 GB/s
here, i.e. a sender pass plus a receiver pass caps the codec at ~1.1 GB/s).
:data:`CRC_BACKEND` names the one in use.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from functools import cache
from typing import TYPE_CHECKING, Any

# torch (and numpy) are imported where a tensor is framed or built, not here: the header
# codec and the handshake also serve the controller's control socket, and a controller that
# imported torch would pay seconds of CPU at every run's start for nothing it uses.
if TYPE_CHECKING:
    import torch

MAGIC = b"GBED"
VERSION = 1
FLAG_CRC = 0x0001
_KNOWN_FLAGS = FLAG_CRC
DEFAULT_MAX_PAYLOAD_BYTES = 2**34  # 16 GiB: far above any chunk, far below a corrupt u64

# Everything before header_crc; "5x" = reserved zero bytes.
_BODY = struct.Struct("<4sHHHQIIIHHBQQI5x")
_CRC = struct.Struct("<I")
HEADER_SIZE = _BODY.size + _CRC.size
assert HEADER_SIZE == 64

_U16, _U32, _U64 = 2**16 - 1, 2**32 - 1, 2**64 - 1


class FrameError(ValueError):
    """A frame (header or payload) is malformed, corrupt, or from another run."""


class MsgType(IntEnum):
    """What a frame carries. Codes are stable on the wire; append, never renumber."""

    HELLO = 1  # connect-time handshake: JSON control fields (hello_payload)
    WELCOME = 2  # PS accepts a HELLO
    GRAD = 3  # worker -> PS gradient chunk (dense or compressed parts)
    WEIGHTS = 4  # PS -> worker full weights
    UPDATE = 5  # PS -> worker aggregated (sparse) update
    BYE = 6  # orderly leave
    ERROR = 7  # peer reports an error (UTF-8 text payload)
    ACTIVATION = 8  # pipeline: forward activations downstream
    GRADIENT_BACK = 9  # pipeline: gradients upstream
    COUNTS = 10  # MoE: per-expert token counts in a round of their own (now part 0 of TOKENS)
    TOKENS = 11  # MoE dispatch phase 2: token payloads
    CONTROL = 12  # small JSON control message
    CHALLENGE = 13  # PS -> worker: a fresh nonce the worker must MAC (agents.net.protocol)
    PROOF = 14  # worker -> PS: HMAC of the challenge under the worker's key
    # Pipeline (agents/pipeline/stage.py, agents/pipeline/stage_ps.py). Codes 20-29.
    SLICE_WEIGHTS = 20  # pipeline: a stage's slice weights to the PS, which evaluates them
    # MoE (agents/moe/exchange.py). Codes from 40 up, away from other appenders.
    EXPERT_OUT = 40  # MoE: expert outputs back to the tokens' hosts, in dispatch order
    EXPERT_OUT_GRAD = 41  # MoE backward: gradients of the expert outputs, to the experts
    TOKENS_GRAD = 42  # MoE backward: gradients of the dispatched tokens, to their hosts
    REDUCE_SCATTER = 43  # ZeRO: one shard of a shared class's gradients
    ALL_GATHER = 44  # ZeRO: one host's shard of a shared class's parameters
    # MoE, later: codes from 50 up.
    DISPATCH_DONE = 50  # MoE: the sender holds every token row of a dispatch (int32: the
    #                     rows it got from the receiver), so the combine may start


class DType(IntEnum):
    """Payload element types. Codes are stable on the wire; append, never renumber."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT64 = 4
    INT8 = 5
    UINT8 = 6
    INT16 = 7
    INT32 = 8
    INT64 = 9
    BOOL = 10

    @property
    def torch_dtype(self) -> torch.dtype:
        return _torch_of()[self]

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE_OF[self]

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> DType:
        code_of = _code_of()
        try:
            return code_of[dtype]
        except KeyError:
            allowed = ", ".join(str(d) for d in code_of)
            raise FrameError(f"dtype: {dtype} cannot be sent; allowed: {allowed}") from None


@cache
def _torch_of() -> dict[DType, torch.dtype]:
    import torch

    return {
        DType.FLOAT32: torch.float32,
        DType.FLOAT16: torch.float16,
        DType.BFLOAT16: torch.bfloat16,
        DType.FLOAT64: torch.float64,
        DType.INT8: torch.int8,
        DType.UINT8: torch.uint8,
        DType.INT16: torch.int16,
        DType.INT32: torch.int32,
        DType.INT64: torch.int64,
        DType.BOOL: torch.bool,
    }


@cache
def _code_of() -> dict[torch.dtype, DType]:
    return {v: k for k, v in _torch_of().items()}


# Written out rather than read from torch, so that a header is checked without torch; a
# test holds it equal to torch's own itemsizes.
_ITEMSIZE_OF: dict[DType, int] = {
    DType.FLOAT32: 4, DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT64: 8, DType.INT8: 1,
    DType.UINT8: 1, DType.INT16: 2, DType.INT32: 4, DType.INT64: 8, DType.BOOL: 1,
}
_MSG_TYPES = frozenset(int(m) for m in MsgType)
_DTYPES = frozenset(int(d) for d in DType)


def _pick_crc32() -> tuple[Callable[..., int], str]:
    # ISA-L computes the same CRC-32 as zlib (gzip polynomial), with PCLMULQDQ
    # folding, ~6x faster than Debian's zlib here. Optional dependency.
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.crc32, "zlib"
    return isal_zlib.crc32, "isal"


payload_crc32, CRC_BACKEND = _pick_crc32()


@dataclass(frozen=True)
class FrameHeader:
    """One frame's header. ``payload_crc`` is 0 when ``flags & FLAG_CRC`` is unset."""

    msg_type: MsgType
    run_tag: int
    worker: int
    iteration: int
    chunk: int
    dtype: DType
    numel: int
    payload_len: int
    part: int = 0
    nparts: int = 1
    flags: int = 0
    payload_crc: int = 0
    version: int = VERSION

    @property
    def has_crc(self) -> bool:
        return bool(self.flags & FLAG_CRC)

    @property
    def stage(self) -> int:
        """On a link between pipeline stages: the sending stage (the ``worker`` field)."""
        return self.worker

    @property
    def micro_batch(self) -> int:
        """On a link between pipeline stages: the micro-batch (the ``iteration`` field)."""
        return self.iteration

    def describe(self) -> str:
        """Short label for error messages and logs."""
        return (f"{self.msg_type.name} worker={self.worker} iter={self.iteration} "
                f"chunk={self.chunk} part={self.part}/{self.nparts}")


# The handshake's tag is public: it names the run, it proves nothing.
PUBLIC_SECRET = b"gradbed public run tag"


def run_tag(run_id: str, secret: bytes) -> int:
    """The u64 every frame of a run carries: first 8 bytes of HMAC-SHA256(secret, run_id)."""
    if not isinstance(secret, bytes | bytearray) or len(secret) == 0:
        raise ValueError("secret: must be non-empty bytes")
    digest = hmac.new(bytes(secret), run_id.encode("utf-8"), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "little")


def _check_range(name: str, value: int, hi: int, lo: int = 0) -> None:
    if not isinstance(value, int) or not lo <= value <= hi:
        raise FrameError(f"{name}: {value!r} out of range [{lo}, {hi}]")


def encode_header(h: FrameHeader) -> bytes:
    """Pack a header into HEADER_SIZE bytes (validating every field's range)."""
    _check_range("version", h.version, _U16)
    _check_range("msg_type", int(h.msg_type), _U16)
    _check_range("flags", h.flags, _U16)
    _check_range("run_tag", h.run_tag, _U64)
    _check_range("worker", h.worker, _U32)
    _check_range("iteration", h.iteration, _U32)
    _check_range("chunk", h.chunk, _U32)
    _check_range("nparts", h.nparts, _U16, lo=1)
    _check_range("part", h.part, h.nparts - 1)
    _check_range("numel", h.numel, _U64)
    _check_range("payload_len", h.payload_len, _U64)
    _check_range("payload_crc", h.payload_crc, _U32)
    if h.payload_len != h.numel * DType(h.dtype).itemsize:
        raise FrameError(f"payload_len: {h.payload_len} != numel {h.numel} * itemsize "
                         f"{DType(h.dtype).itemsize} ({DType(h.dtype).name})")
    body = _BODY.pack(MAGIC, h.version, int(h.msg_type), h.flags, h.run_tag, h.worker,
                      h.iteration, h.chunk, h.part, h.nparts, int(h.dtype), h.numel,
                      h.payload_len, h.payload_crc)
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(buf: bytes | bytearray | memoryview, *, expect_tag: int | None = None,
                  max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> FrameHeader:
    """Parse and validate HEADER_SIZE bytes. Raises FrameError naming the bad field.

    Order of checks: length, magic, version (so a peer speaking something else gets
    a precise message), header CRC (so no later field is trusted before it), then
    the fields themselves, then the run tag.
    """
    if len(buf) < HEADER_SIZE:
        raise FrameError(f"header: truncated, {len(buf)} of {HEADER_SIZE} bytes")
    mv = memoryview(buf)[:HEADER_SIZE]
    (magic, version, msg_type, flags, tag, worker, iteration, chunk, part, nparts, dtype,
     numel, payload_len, pcrc) = _BODY.unpack_from(mv)
    if magic != MAGIC:
        raise FrameError(f"magic: got {bytes(magic)!r}, expected {MAGIC!r} "
                         "(not a gradbed frame, or the stream lost sync)")
    if version != VERSION:
        raise FrameError(f"version: got {version}, expected {VERSION}")
    (hcrc,) = _CRC.unpack_from(mv, _BODY.size)
    actual = zlib.crc32(mv[:_BODY.size])
    if hcrc != actual:
        raise FrameError(f"header_crc: mismatch (header says {hcrc:#010x}, "
                         f"computed {actual:#010x}): corrupt header")
    if msg_type not in _MSG_TYPES:
        raise FrameError(f"msg_type: unknown code {msg_type}")
    if dtype not in _DTYPES:
        raise FrameError(f"dtype: unknown code {dtype}")
    if flags & ~_KNOWN_FLAGS:
        raise FrameError(f"flags: unknown bits {flags & ~_KNOWN_FLAGS:#06x}")
    if nparts < 1 or part >= nparts:
        raise FrameError(f"part: {part} not in [0, nparts={nparts})")
    itemsize = _ITEMSIZE_OF[DType(dtype)]
    if payload_len != numel * itemsize:
        raise FrameError(f"payload_len: {payload_len} != numel {numel} * itemsize {itemsize} "
                         f"({DType(dtype).name})")
    if payload_len > max_payload_bytes:
        raise FrameError(f"payload_len: {payload_len} bytes is too large "
                         f"(limit {max_payload_bytes})")
    if expect_tag is not None and tag != expect_tag:
        raise FrameError(f"run_tag: {tag:#018x} != expected {expect_tag:#018x}: "
                         "frame from another run or wrong secret")
    return FrameHeader(msg_type=MsgType(msg_type), run_tag=tag, worker=worker,
                       iteration=iteration, chunk=chunk, dtype=DType(dtype), numel=numel,
                       payload_len=payload_len, part=part, nparts=nparts, flags=flags,
                       payload_crc=pcrc, version=version)


def check_payload(h: FrameHeader, payload: bytes | bytearray | memoryview) -> None:
    """Raise FrameError if the payload's length (or CRC, when the frame has one) is wrong."""
    if len(payload) != h.payload_len:
        raise FrameError(f"payload_len: got {len(payload)} bytes, header says "
                         f"{h.payload_len} ({h.describe()})")
    if h.has_crc:
        actual = payload_crc32(payload)
        if actual != h.payload_crc:
            raise FrameError(f"payload_crc: mismatch (header says {h.payload_crc:#010x}, "
                             f"computed {actual:#010x}): corrupt payload ({h.describe()})")


_TAG = slice(10, 18)  # run_tag's bytes in the header


class _HashMac:
    """A keyed hashlib-style MAC, keyed once; each frame starts from a copy with its
    sequence number (no per-frame key schedule)."""

    def __init__(self, base: Any) -> None:
        self._base = base

    def start(self, seq: int) -> Any:
        m = self._base.copy()
        m.update(seq.to_bytes(8, "little"))
        return m


class _Poly1305Mac:
    """Poly1305 (RFC 8439) under a one-time key per frame, ``HMAC-SHA256(key, seq)``:
    never reused, since every connection direction has its own key and ``seq`` only
    grows. OpenSSL's vectorised Poly1305 through ``cryptography``."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def start(self, seq: int) -> Any:
        return _Poly1305Frame(_Poly1305(hmac.digest(self._key, seq.to_bytes(8, "little"),
                                                    "sha256")))


class _Poly1305Frame:
    __slots__ = ("_p",)

    def __init__(self, p: Any) -> None:
        self._p = p

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._p.update(data)

    def digest(self) -> bytes:
        return bytes(self._p.finalize())


#: Keyed MACs a connection can seal its frames with, by name. Poly1305 with a one-time
#: key per frame is the default where ``cryptography`` is installed (about 10 GB/s here);
#: HMAC-SHA256 runs on the CPU's SHA extensions (about 1.4-1.8 GB/s here) and is the
#: fallback; keyed BLAKE2b is pure software (0.6-0.9 GB/s here). ``benchmarks/codec.py``
#: measures each side by side. Both ends of a connection run on one machine, with one
#: environment, so they pick the same.
MAC_ALGORITHMS: dict[str, Callable[[bytes], Any]] = {
    "hmac-sha256": lambda key: _HashMac(hmac.new(key, digestmod=hashlib.sha256)),
    "blake2b": lambda key: _HashMac(hashlib.blake2b(digest_size=8, key=key[:64])),
}
try:
    from cryptography.hazmat.primitives.poly1305 import Poly1305 as _Poly1305
except ImportError:  # pragma: no cover - cryptography is a dependency
    MAC_ALGORITHM = "hmac-sha256"
else:
    MAC_ALGORITHMS["poly1305"] = _Poly1305Mac
    MAC_ALGORITHM = "poly1305"


class FrameMac:
    """One direction of one authenticated connection: seals or verifies frames in order.

    ``tag = MAC_seq(key, header[0:10] || header[18:60] || payload)``, first 8 bytes:
    every header field except the tag itself, the payload bytes themselves, under
    ``seq``, the number of frames this direction carried before (never on the wire: TCP
    delivers in order, so both ends count). The MAC is :data:`MAC_ALGORITHM` (Poly1305
    with a one-time key per frame). :meth:`seal` writes the tag and recomputes the
    header CRC; :meth:`verify` raises FrameError on a forged, replayed, reordered,
    rewritten or foreign frame. Cost: one pass over the payload on each side (about
    10 GB/s here) and a few microseconds per frame.
    """

    __slots__ = ("_base", "seq")

    def __init__(self, key: bytes, algorithm: str = MAC_ALGORITHM) -> None:
        if len(key) < 16:
            raise ValueError(f"FrameMac key: {len(key)} bytes, need at least 16")
        if algorithm not in MAC_ALGORITHMS:
            raise ValueError(f"FrameMac algorithm: {algorithm!r} not one of "
                             f"{sorted(MAC_ALGORITHMS)}")
        # Keyed once; each frame's MAC starts from a copy (no per-frame key schedule).
        self._base = MAC_ALGORITHMS[algorithm](bytes(key))
        self.seq = 0

    def _tag(self, hdr: bytes | bytearray | memoryview,
             payload: bytes | bytearray | memoryview) -> bytes:
        m = self._base.start(self.seq)
        m.update(hdr[:10])
        m.update(hdr[18:_BODY.size])
        m.update(payload)
        return bytes(m.digest()[:8])

    def seal(self, header: bytes | bytearray, payload: bytes | bytearray | memoryview = b""
             ) -> bytes:
        """The header with the MAC of header and ``payload`` for the next sequence number
        (consumes it)."""
        body = bytearray(header[:_BODY.size])
        body[_TAG] = self._tag(body, memoryview(payload).cast("B"))
        self.seq += 1
        return bytes(body) + _CRC.pack(zlib.crc32(body))

    def verify(self, header: bytes | bytearray | memoryview,
               payload: bytes | bytearray | memoryview = b"") -> None:
        """Check a frame's MAC (its header and payload) for the next sequence number
        (consumes it)."""
        mv = memoryview(header)
        if not hmac.compare_digest(bytes(mv[_TAG]), self._tag(mv, memoryview(payload).cast("B"))):
            raise FrameError(f"mac: frame {self.seq} of this connection fails its MAC "
                             "(forged, replayed, reordered, rewritten, or from another "
                             "connection)")
        self.seq += 1


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """A byte memoryview over a tensor's storage, without copying.

    A non-contiguous or non-CPU tensor is first made contiguous / moved to the CPU
    once (that is a copy; the memoryview then keeps the copy alive). Autograd
    history is dropped (detach). The view's exporter is a numpy uint8 array whose
    data pointer equals the (possibly copied) tensor's ``data_ptr()``.
    """
    import torch

    DType.from_torch(tensor.dtype)  # reject unsupported dtypes with a named error
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    # view(uint8) reinterprets bytes in place; numpy lacks bfloat16 so never go
    # through numpy with the original dtype.
    u8 = t.reshape(-1).view(torch.uint8)
    return u8.numpy().data  # ndarray.data: the array's buffer as a memoryview


def _frame(payload: memoryview, dtype: DType, numel: int, *, msg_type: MsgType | int,
           run_tag: int, worker: int, iteration: int, chunk: int, part: int, nparts: int,
           crc: bool, payload_crc: int | None = None) -> bytes:
    if not crc:
        payload_crc = 0
    elif payload_crc is None:
        payload_crc = payload_crc32(payload)
    h = FrameHeader(msg_type=MsgType(msg_type), run_tag=run_tag, worker=worker,
                    iteration=iteration, chunk=chunk, dtype=dtype, numel=numel,
                    payload_len=len(payload), part=part, nparts=nparts,
                    flags=FLAG_CRC if crc else 0, payload_crc=payload_crc)
    return encode_header(h)


def frame_for_tensor(tensor: torch.Tensor, *, msg_type: MsgType | int, run_tag: int,
                     worker: int, iteration: int, chunk: int, part: int = 0, nparts: int = 1,
                     crc: bool = True, payload_crc: int | None = None
                     ) -> tuple[bytes, memoryview]:
    """Frame a tensor: (header bytes, zero-copy byte view of its data), flattened.

    See :func:`tensor_view` for the one case that copies (non-contiguous or non-CPU
    input). The caller must not modify the tensor until the payload is sent.
    ``payload_crc``: the payload's :func:`payload_crc32` when the caller has it already
    (the same tensor framed for several peers); computed here otherwise.
    """
    payload = tensor_view(tensor)
    header = _frame(payload, DType.from_torch(tensor.dtype), tensor.numel(),
                    msg_type=msg_type, run_tag=run_tag, worker=worker, iteration=iteration,
                    chunk=chunk, part=part, nparts=nparts, crc=crc, payload_crc=payload_crc)
    return header, payload


def frame_for_bytes(data: bytes | bytearray | memoryview, *, msg_type: MsgType | int,
                    run_tag: int, worker: int, iteration: int = 0, chunk: int = 0,
                    crc: bool = True) -> tuple[bytes, memoryview]:
    """Frame raw bytes (HELLO/CONTROL/ERROR bodies) as a one-part UINT8 payload."""
    payload = memoryview(data).cast("B")
    header = _frame(payload, DType.UINT8, len(payload), msg_type=msg_type, run_tag=run_tag,
                    worker=worker, iteration=iteration, chunk=chunk, part=0, nparts=1, crc=crc)
    return header, payload


def tensor_from_buffer(h: FrameHeader, buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A flat tensor of ``h.numel`` elements of ``h.dtype`` over ``buf``, without copying.

    The tensor aliases ``buf``: it is valid only as long as the buffer is not reused.
    A read-only buffer (bytes) gives a tensor that must not be written to.
    """
    import torch

    if len(buf) != h.payload_len:
        raise FrameError(f"payload_len: buffer has {len(buf)} bytes, header says "
                         f"{h.payload_len} ({h.describe()})")
    dtype = h.dtype.torch_dtype
    if h.numel == 0:
        return torch.empty(0, dtype=dtype)  # torch.frombuffer rejects empty buffers
    mv = memoryview(buf)
    with warnings.catch_warnings():
        # torch warns once per read-only buffer; the contract above covers it.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mv, dtype=dtype, count=h.numel)


def buffer_address(mv: memoryview) -> int:
    """Address of a buffer's first byte (used to verify zero-copy in tests/benchmarks)."""
    import numpy as np

    if len(mv) == 0:
        return 0
    arr: Any = np.frombuffer(mv, dtype=np.uint8)
    return int(arr.ctypes.data)


# --- HELLO handshake (control fields only: small JSON, never tensors) -------------------

# "agent": any agent proving its node's key on the control socket (its ``node`` names it).
_ROLES = frozenset({"worker", "ps", "stage", "expert", "controller", "agent"})
MAX_HELLO_BYTES = 4096
MAX_NODE_CHARS = 64
MAX_HELLO_DEPTH = 4  # a hello is a flat object; nesting is refused before json sees it
NONCE_BYTES = 16


@dataclass(frozen=True)
class Hello:
    """Control fields of a HELLO/WELCOME payload. ``nonce``: the sender's fresh
    NONCE_BYTES, mixed into the connection's keys (empty in a WELCOME). ``node``: the
    sender's node name, where an index does not name it (the control socket); else empty."""

    role: str
    worker: int
    version: int = VERSION
    nonce: bytes = b""
    node: str = ""


def _node_ok(node: object) -> bool:
    return (isinstance(node, str) and len(node) <= MAX_NODE_CHARS
            and all(c.isascii() and (c.isalnum() or c in "_-") for c in node))


def hello_payload(role: str, worker: int, nonce: bytes = b"", node: str = "") -> bytes:
    """JSON body of a HELLO (or WELCOME) frame; send it with :func:`frame_for_bytes`."""
    if role not in _ROLES:
        raise ValueError(f"role: {role!r} not one of {sorted(_ROLES)}")
    _check_range("worker", worker, _U32)
    if not _node_ok(node):
        raise ValueError(f"node: {node!r} is not up to {MAX_NODE_CHARS} ASCII letters, "
                         "digits, '_' or '-'")
    obj: dict[str, Any] = {"role": role, "worker": worker, "version": VERSION}
    if nonce:
        obj["nonce"] = nonce.hex()
    if node:
        obj["node"] = node
    return json.dumps(obj, separators=(",", ":")).encode("utf-8")


def json_depth(data: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in JSON text, strings skipped (a linear scan, so
    a hostile body costs no recursion)."""
    depth = deepest = 0
    in_str = escaped = False
    for b in data:
        if in_str:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif b in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse_hello(payload: bytes | bytearray | memoryview) -> Hello:
    """Validate a HELLO/WELCOME body; raises FrameError naming the bad field."""
    if len(payload) > MAX_HELLO_BYTES:
        raise FrameError(f"hello: {len(payload)} bytes exceeds {MAX_HELLO_BYTES}")
    data = bytes(payload)
    if json_depth(data) > MAX_HELLO_DEPTH:
        raise FrameError(f"hello: JSON nested deeper than {MAX_HELLO_DEPTH} levels")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise FrameError(f"hello: not UTF-8 JSON: {e}") from e
    if not isinstance(obj, dict):
        raise FrameError(f"hello: expected a JSON object, got {type(obj).__name__}")
    role, worker, version = obj.get("role"), obj.get("worker"), obj.get("version")
    if role not in _ROLES:
        raise FrameError(f"hello.role: {role!r} not one of {sorted(_ROLES)}")
    if not isinstance(worker, int) or isinstance(worker, bool) or not 0 <= worker <= _U32:
        raise FrameError(f"hello.worker: {worker!r} is not a u32")
    if version != VERSION:
        raise FrameError(f"hello.version: got {version!r}, expected {VERSION}")
    nonce_hex = obj.get("nonce", "")
    if not isinstance(nonce_hex, str) or len(nonce_hex) not in (0, 2 * NONCE_BYTES):
        raise FrameError(f"hello.nonce: must be {2 * NONCE_BYTES} hex digits")
    try:
        nonce = bytes.fromhex(nonce_hex)
    except ValueError as e:
        raise FrameError(f"hello.nonce: not hex: {e}") from e
    node = obj.get("node", "")
    if not _node_ok(node):
        raise FrameError(f"hello.node: {node!r} is not up to {MAX_NODE_CHARS} ASCII "
                         "letters, digits, '_' or '-'")
    return Hello(role=role, worker=worker, version=version, nonce=nonce, node=node)
