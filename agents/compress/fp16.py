"""Half-precision casting: every element sent as IEEE float16 (2 bytes).

The simplest quantiser in GRACE's zoo (Xu et al. 2021; used as a baseline there and in
Micikevicius et al., "Mixed Precision Training", ICLR 2018). ``ratio`` is ignored: all
elements are sent. Values beyond float16's range are clamped to +-65504 rather than becoming
inf; under error feedback the clamped excess stays in the residual.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload, PayloadError, flatten, register

_FP16_MAX = 65504.0


@register
class FP16Compressor(Compressor):
    name = "fp16"

    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        flat = flatten(tensor)
        half = flat.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).contiguous()
        return Payload(self.name, (half,), flat.numel(), tuple(tensor.shape), tensor.dtype)

    def expected_parts(self) -> int | None:
        return 1

    def check_parts(self, payload: Payload) -> None:
        (t,) = payload.tensors
        if t.dtype != torch.float16 or t.numel() != payload.numel:
            raise PayloadError(f"fp16: part is {t.numel()} x {t.dtype}, expected "
                               f"{payload.numel} x float16")

    def decompress(self, payload: Payload) -> Tensor:
        return payload.tensors[0].to(payload.dtype).reshape(payload.shape)
