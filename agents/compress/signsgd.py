"""Scaled sign compression: one bit per element plus one scale.

Follows Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML
2018, with the scale of Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
Compression Schemes", ICML 2019 (EF-SignSGD): the tensor is sent as
``mean(|x|) * sign(x)``, which is only convergent with error feedback, so wrap it in
:class:`agents.compress.feedback.ErrorFeedback`. ``sign(0)`` is sent as +1.

Wire format: part 0 is the scale as one float32; part 1 is the signs packed 8 per uint8,
most significant bit first (bit set = non-negative). Wire bytes are
``4 + ceil(numel / 8) + 2 * header``. The ``ratio`` is ignored.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload, PayloadError, flatten, register

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
_SHIFTS = torch.arange(7, -1, -1, dtype=torch.uint8)


def pack_bits(bits: Tensor) -> Tensor:
    """Pack a bool tensor into uint8, MSB first; the last byte is zero-padded."""
    n = bits.numel()
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, math.ceil(n / 8) * 8 - n))
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits as bool."""
    return ((packed[:, None] >> _SHIFTS.to(packed.device)) & 1).view(-1)[:n].bool()


@register
class SignSGDCompressor(Compressor):
    name = "signsgd"

    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        flat = flatten(tensor)
        scale = flat.abs().mean(dtype=torch.float32).reshape(1) if flat.numel() else \
            torch.zeros(1, device=flat.device)
        packed = pack_bits(flat >= 0)
        return Payload(self.name, (scale.to(torch.float32).contiguous(), packed),
                       flat.numel(), tuple(tensor.shape), tensor.dtype)

    def expected_parts(self) -> int | None:
        return 2

    def check_parts(self, payload: Payload) -> None:
        scale, packed = payload.tensors
        nbytes = math.ceil(payload.numel / 8)
        if scale.dtype != torch.float32 or scale.numel() != 1:
            raise PayloadError(f"signsgd: scale must be one float32, got {scale.numel()} x "
                               f"{scale.dtype}")
        if packed.dtype != torch.uint8 or packed.numel() != nbytes:
            raise PayloadError(f"signsgd: expected {nbytes} uint8 sign bytes, got "
                               f"{packed.numel()} x {packed.dtype}")

    def decompress(self, payload: Payload) -> Tensor:
        scale, packed = payload.tensors
        bits = unpack_bits(packed, payload.numel)
        signs = bits.to(torch.float32).mul_(2).sub_(1)
        return signs.mul_(scale).to(payload.dtype).reshape(payload.shape)
