"""The identity compressor: the dense baseline every other compressor is compared with.

No paper; it is the ``none`` of GRACE (Xu et al. 2021). ``ratio`` is ignored: everything is
sent, as one part in the original dtype, so wire bytes are ``numel * element_size + header``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload, PayloadError, flatten, register


@register
class NoneCompressor(Compressor):
    name = "none"

    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        # A copy, not a view: the caller may overwrite its gradient buffer while the payload
        # is still queued for the socket.
        flat = flatten(tensor).clone()  # stays on the tensor's device
        return Payload(self.name, (flat,), flat.numel(), tuple(tensor.shape), tensor.dtype)

    def expected_parts(self) -> int | None:
        return 1

    def check_parts(self, payload: Payload) -> None:
        (t,) = payload.tensors
        if t.dtype != payload.dtype or t.numel() != payload.numel:
            raise PayloadError(f"none: part is {t.numel()} x {t.dtype}, expected "
                               f"{payload.numel} x {payload.dtype}")

    def decompress(self, payload: Payload) -> Tensor:
        return payload.tensors[0].reshape(payload.shape)
