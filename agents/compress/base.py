"""Compressor interface, payload type, registry and the one definition of k.

The split follows GRACE (Xu et al., "GRACE: A Compressed Communication Framework for
Distributed Machine Learning", ICDCS 2021): a ``Compressor`` decides what to send, error
feedback (:mod:`agents.compress.feedback`) decides what to remember, and the codec moves the
bytes. Like BytePS (``byteps/common/compressor/``) each algorithm lives in its own file and
registers itself by name; there is no central ``if/elif``. Unlike GRACE the keep ratio is an
argument of every ``compress`` call, so a controller can change it chunk by chunk, and
randomness comes from a ``torch.Generator`` the caller passes in.

A :class:`Payload` is what goes on the wire: a tuple of contiguous 1-D tensors plus the
metadata needed to rebuild the original (numel, shape, dtype). Its :meth:`Payload.wire_bytes`
is exact: the raw buffer bytes plus one frame header per part.

Device: ``compress`` keeps the payload on the device of the tensor it was given
(compression stays on the GPU, nothing in it calls ``.cpu()``); only the payload is copied to
host memory, by :mod:`agents.compress.staging`, when the worker sends it. Payloads read off
the wire are CPU tensors, and ``decompress`` returns a tensor on the payload's device.
Randomness on another device comes from :func:`device_generator`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeVar

import torch
from torch import Tensor

from agents.core.registry import COMPRESSOR, Registry

# Framing overhead the wire codec adds per tensor part (bytes). The lead aligns this with the
# codec's HEADER_SIZE; wire_bytes() uses it so reported sizes match what crosses the link.
FRAME_HEADER_BYTES = 64  # == agents.net.codec.HEADER_SIZE (asserted in tests/agents/compress/test_codec_compress.py)


class PayloadError(ValueError):
    """A payload (usually one received off the wire) is malformed: wrong number of parts,
    wrong dtypes, lengths that disagree, or indices out of range. The message names the
    sender and the field so the PS can log it and keep serving the other workers."""


@dataclass(frozen=True)
class Payload:
    """One compressed tensor, ready for the codec.

    ``tensors`` are contiguous 1-D tensors sent as-is (e.g. float32 values + int32
    indices), on the compressed tensor's device until staged for the socket;
    ``numel``/``shape``/``dtype`` describe the original dense tensor."""

    compressor: str
    tensors: tuple[Tensor, ...]
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    header_bytes: int = FRAME_HEADER_BYTES  # framing overhead per part on the wire

    def buffer_bytes(self) -> int:
        """Bytes of the raw tensor buffers, without framing."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def wire_bytes(self) -> int:
        """Exact bytes this payload occupies on the wire: buffers plus one header per part."""
        return self.buffer_bytes() + len(self.tensors) * self.header_bytes

    def raw_bytes(self) -> int:
        """Bytes of the original dense tensor (what 'none' would have sent without framing)."""
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def k_for(numel: int, ratio: float) -> int:
    """THE definition of how many elements a sparse compressor keeps.

    ``ratio`` is the fraction of elements kept and is clamped to (0, 1]:
    ``k = numel`` when ``ratio >= 1``, else ``k = max(1, ceil(ratio * numel))``; an empty
    tensor keeps 0. A ratio that is NaN or <= 0 is an error (a keep ratio of zero would
    silently send nothing; the controller's ``keep_min`` exists to prevent that)."""
    if not (ratio > 0.0):  # also catches NaN
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    if numel <= 0:
        return 0
    if ratio >= 1.0:
        return numel
    return min(numel, max(1, math.ceil(ratio * numel)))


def device_generator(rng: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` for a compressor's random draws: ``rng`` itself when it is
    already there (CPU), else a fresh one on ``device`` seeded by one draw from ``rng``, so a
    seeded run stays reproducible and no random numbers cross the bus."""
    if torch.device(rng.device).type == device.type:
        return rng
    seed = int(torch.randint(0, 2**62, (1,), generator=rng))
    return torch.Generator(device=device).manual_seed(seed)


def flatten(tensor: Tensor) -> Tensor:
    """A contiguous 1-D view (or copy, if needed) of ``tensor``; stays on its device."""
    return tensor.detach().reshape(-1).contiguous()


class Compressor(ABC):
    """Turns one tensor into a :class:`Payload` and back.

    Implementations are stateless except where the algorithm needs state across steps
    (PowerSGD's warm-start Q, kept per ``key``). ``ratio`` is the fraction of elements kept
    (1.0 = everything); compressors for which a ratio has no meaning document how they use
    or ignore it."""

    name: ClassVar[str]

    @abstractmethod
    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        """Compress ``tensor`` (any shape) for the chunk/layer called ``key``."""

    @abstractmethod
    def decompress(self, payload: Payload) -> Tensor:
        """Dense tensor with the original shape and dtype, on the payload's device."""

    def set_layers(self, key: str, shapes: Sequence[tuple[int, ...]],
                   param_dims: Sequence[int] | None = None) -> None:
        """Tell the compressor how the flat tensor it will get under ``key`` splits into
        layers: the shapes of its consecutive pieces, in flat order (numels summing to the
        tensor's; :func:`agents.workloads.base.chunk_layers`), and optionally the number of
        dimensions of the parameter each piece belongs to
        (:func:`agents.workloads.base.chunk_layer_dims`; None: each piece's own). Compressors
        that work per layer (PowerSGD: one matrix per layer; the sparse compressors with
        ``per_layer`` or ``dense_1d``) use it; the default ignores it, since the others work
        element by element or on the whole tensor."""
        return None

    def expected_parts(self) -> int | None:
        """Number of tensor parts a payload of this compressor carries (None: variable)."""
        return None

    def from_parts(self, tensors: Sequence[Tensor], numel: int, shape: Sequence[int],
                   dtype: torch.dtype) -> Payload:
        """Rebuild a payload from tensors received off the wire (PS side). Checks the
        number of parts and that ``shape`` matches ``numel``; compressor-specific checks
        happen in :meth:`check_parts`."""
        shape_t = tuple(int(s) for s in shape)
        if math.prod(shape_t) != numel:
            raise PayloadError(f"{self.name}: shape {shape_t} has {math.prod(shape_t)} "
                               f"elements but numel={numel}")
        parts = tuple(tensors)
        n = self.expected_parts()
        if n is not None and len(parts) != n:
            raise PayloadError(f"{self.name}: expected {n} tensor parts, got {len(parts)}")
        for i, t in enumerate(parts):
            if t.dim() != 1:
                raise PayloadError(f"{self.name}: part {i} must be 1-D, got shape "
                                   f"{tuple(t.shape)}")
        payload = Payload(self.name, parts, int(numel), shape_t, dtype)
        self.check_parts(payload)
        return payload

    def check_parts(self, payload: Payload) -> None:
        """Compressor-specific validation of a payload built from wire parts; raises
        :class:`PayloadError`. Default: nothing beyond :meth:`from_parts`."""
        return None

    def decompress_sparse(self, payload: Payload) -> tuple[Tensor, Tensor] | None:
        """``(indices, values)`` into the flattened tensor, for compressors whose output is
        sparse, so the PS can aggregate without densifying; None otherwise. Indices are an
        integer tensor (int32 as they came off the wire, or int64)."""
        return None


C = TypeVar("C", bound=type[Compressor])

# Every compressor, one file each in agents/compress/ (agents.core.registry.COMPRESSOR).
COMPRESSORS: Registry[type[Compressor]] = Registry(COMPRESSOR)


def register(cls: C) -> C:
    """Class decorator: make ``cls`` available as ``make(cls.name)``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} must set a non-empty class attribute 'name'")
    COMPRESSORS.add(name, cls)
    return cls


def names() -> list[str]:
    """Registered compressor names, sorted."""
    return list(COMPRESSORS.names())


def make(name: str, **params: object) -> Compressor:
    """Build the compressor registered as ``name`` with constructor ``params``.

    Unknown names and unknown/invalid parameters raise ValueError naming what is allowed."""
    factory: Callable[..., Compressor] = COMPRESSORS.get(name, "compress.name")
    try:
        return factory(**params)
    except TypeError as exc:  # unexpected keyword: say which compressor rejected it
        raise ValueError(f"compressor {name!r}: bad parameters {params}: {exc}") from exc
