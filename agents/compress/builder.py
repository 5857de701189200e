"""The one builder of what a sender compresses with: the registered compressor (with DGC's
layer-wise selection when asked), its error feedback and its seeded generator.

Every sender (a data-parallel worker, a pipeline stage sending activations or gradients,
the one-process simulation of a data-parallel run) and every receiver that decodes with the
same compressor (the PS) builds through here, so the same config gives the same compressor,
the same residual rule and the same random stream everywhere; GRACE's split, in one place:
the compressor decides what to send, the feedback what to remember, the generator draws.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from agents.compress.base import Compressor, Payload, make
from agents.compress.feedback import ErrorFeedback
from agents.compress.sparse import SparseCompressor

# Sender ``rank``'s generator is seeded with ``seed * SEED_STRIDE + rank``: a prime stride
# keeps the streams of ranks and of nearby run seeds apart.
SEED_STRIDE = 7919


@dataclass(frozen=True)
class CompressionSpec:
    """How one sender compresses. ``params`` go to the compressor's constructor."""

    name: str = "none"                 # a registered compressor (agents/compress/)
    params: Mapping[str, Any] = field(default_factory=dict)
    error_feedback: bool = True        # keep what was not sent and add it next time
    # DGC's momentum correction on the sender (0 = off; the receiver then steps without it).
    momentum: float = 0.0
    masking: bool = True               # with momentum: zero the velocity of what was sent
    per_layer: bool = False            # sparse: select in each layer piece separately
    dense_1d: bool = False             # sparse: send 1-D parameters whole

    @classmethod
    def from_config(cls, cfg: Any) -> CompressionSpec:
        """The data-parallel sender of an experiment config (``[compress]``,
        ``[feedback]``, and ``workload.momentum`` when the momentum moves to the workers)."""
        params = dict(cfg.compress.params)
        if cfg.compress.index_encoding != "int32":
            params.setdefault("index_encoding", cfg.compress.index_encoding)
        fb = cfg.feedback
        return cls(name=cfg.compress.name, params=params,
                   error_feedback=cfg.compress.error_feedback,
                   momentum=cfg.workload.momentum if fb.momentum_correction else 0.0,
                   masking=fb.masking, per_layer=fb.per_layer, dense_1d=fb.dense_1d)


def build_compressor(spec: CompressionSpec) -> Compressor:
    """The registered compressor ``spec.name``, set to select layer by layer when asked."""
    compressor = make(spec.name, **dict(spec.params))
    if spec.per_layer or spec.dense_1d:
        if not isinstance(compressor, SparseCompressor):
            raise ValueError(f"feedback.per_layer / dense_1d: compress.name = {spec.name!r} "
                             "is not a sparse compressor that keeps k elements")
        compressor.select_by_layer(per_layer=spec.per_layer, dense_1d=spec.dense_1d)
    return compressor


def sender_generator(seed: int, rank: int) -> torch.Generator:
    """The generator sender ``rank`` of a run seeded ``seed`` compresses with."""
    return torch.Generator().manual_seed(seed * SEED_STRIDE + rank)


# A chunk's layers as Compressor.set_layers takes them: (key, piece shapes, piece dims).
ChunkLayers = tuple[str, Sequence[tuple[int, ...]], Sequence[int]]


class Sender:
    """One sender's compressor, its error feedback (None when off) and its generator.

    :meth:`compress` is DESIGN 1.2's step: with feedback, ``original = sent + residual``
    and the residual is kept for the next call with the same key; without, the compressor
    alone. The generator advances with every call."""

    def __init__(self, spec: CompressionSpec, seed: int, rank: int,
                 layers: Sequence[ChunkLayers] = ()) -> None:
        self.spec = spec
        self.compressor = build_compressor(spec)
        # Per-layer compressors (PowerSGD, layer-wise sparse) see each chunk's layers; the
        # others ignore them.
        for key, shapes, dims in layers:
            self.compressor.set_layers(key, shapes, dims)
        self.feedback = (ErrorFeedback(self.compressor, momentum=spec.momentum,
                                       masking=spec.masking)
                         if spec.error_feedback else None)
        self.rng = sender_generator(seed, rank)

    def compress(self, grad: torch.Tensor, key: str, ratio: float, *,
                 clip_norm: float | None = None) -> tuple[Payload, dict[str, Any]]:
        """The payload to send for ``grad`` under ``key`` and the ``compress_done`` stats
        (raw_bytes, wire_bytes, residual_norm, and with feedback clipped, norm_before)."""
        if self.feedback is not None:
            return self.feedback.step(grad, key, ratio, self.rng, clip_norm=clip_norm)
        payload = self.compressor.compress(grad, key, ratio, self.rng)
        return payload, {"raw_bytes": grad.numel() * grad.element_size(),
                         "wire_bytes": payload.wire_bytes(), "residual_norm": 0.0}
