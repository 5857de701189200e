"""QSGD: stochastic quantisation of each element to one of ``s`` levels of its bucket's norm.

Follows Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017. The flattened tensor is cut into buckets of ``bucket_size``
elements (the paper's bucketing; ``bucket_size=0`` is one bucket for the whole tensor, as in
GRACE). For each bucket with L2 norm ``||v||`` an element becomes
``||v|| * sign(x) * l / s`` where ``l = floor(|x| / ||v|| * s)`` rounded up with probability
equal to the remainder, drawn from the generator passed in, so the estimate is unbiased.

Wire format (no Elias coding; the paper's variable-length code is left out because its
size is data-dependent and it costs a serial pass): part 0 is the bucket norms as float32,
part 1 is ``sign * l`` as one int8 per element (so ``s <= 127``). Wire bytes are
``4 * n_buckets + numel + 2 * header``. The ``ratio`` is ignored: QSGD sends every element.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from agents.compress.base import (
    Compressor,
    Payload,
    PayloadError,
    device_generator,
    flatten,
    register,
)


@register
class QSGDCompressor(Compressor):
    name = "qsgd"

    def __init__(self, levels: int = 127, bucket_size: int = 512) -> None:
        # More levels: less quantisation noise, same bytes (one int8 per element up to 127).
        if not 1 <= levels <= 127:
            raise ValueError(f"qsgd.levels must be in [1, 127] (one int8 each), got {levels}")
        # Smaller buckets: lower variance, one float32 norm per bucket more on the wire.
        if bucket_size < 0:
            raise ValueError(f"qsgd.bucket_size must be >= 0, got {bucket_size}")
        self.levels = levels
        self.bucket_size = bucket_size

    def _bucket(self, numel: int) -> int:
        return numel if self.bucket_size == 0 else min(self.bucket_size, max(numel, 1))

    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        flat = flatten(tensor).to(torch.float32)
        n = flat.numel()
        b = self._bucket(n)
        nb = math.ceil(n / b) if n else 0
        v = torch.nn.functional.pad(flat, (0, nb * b - n)).view(nb, b)
        norms = torch.linalg.vector_norm(v, dim=1)
        scale = self.levels / norms.clamp_min(torch.finfo(torch.float32).tiny)
        scaled = v.abs().mul_(scale[:, None])
        level = torch.floor(scaled)
        frac = scaled.sub_(level)
        level += torch.rand(v.shape, generator=device_generator(rng, v.device),
                            device=v.device) < frac
        level.clamp_(max=self.levels).mul_(torch.sign(v))
        q = level.to(torch.int8).view(-1)[:n].contiguous()
        return Payload(self.name, (norms.contiguous(), q), n, tuple(tensor.shape), tensor.dtype)

    def expected_parts(self) -> int | None:
        return 2

    def check_parts(self, payload: Payload) -> None:
        norms, q = payload.tensors
        n = payload.numel
        b = self._bucket(n)
        nb = math.ceil(n / b) if n else 0
        if norms.dtype != torch.float32 or norms.numel() != nb:
            raise PayloadError(f"qsgd: expected {nb} float32 norms, got {norms.numel()} x "
                               f"{norms.dtype} (bucket_size={self.bucket_size})")
        if q.dtype != torch.int8 or q.numel() != n:
            raise PayloadError(f"qsgd: expected {n} int8 levels, got {q.numel()} x {q.dtype}")

    def decompress(self, payload: Payload) -> Tensor:
        norms, q = payload.tensors
        n = payload.numel
        b = self._bucket(n)
        nb = norms.numel()
        v = torch.nn.functional.pad(q.to(torch.float32), (0, nb * b - n)).view(nb, b)
        v.mul_((norms / self.levels)[:, None])
        return v.view(-1)[:n].to(payload.dtype).reshape(payload.shape)
