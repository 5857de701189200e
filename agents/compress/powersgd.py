"""PowerSGD: low-rank compression by one step of power iteration with a warm start.

Follows Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (Algorithm 1). A tensor of shape ``(m, ...)`` is
viewed as an ``m x n`` matrix ``M``; with ``Q`` (``n x r``) kept per key from the previous
step (the warm start; first drawn from the generator passed in):
``P = orthogonalize(M Q)``, ``Q = M^T P``; ``P`` and ``Q`` are sent and the receiver
rebuilds ``P Q^T``. It needs error feedback to converge (the paper's, and ours: wrap it in
:class:`agents.compress.feedback.ErrorFeedback`).

Side effect: ``compress`` stores the new ``Q`` under ``key``; :meth:`reset` forgets them.

Rank: fixed ``rank`` by default (the ratio is ignored). With ``rank_from_ratio=True`` the
rank is ``max(1, floor(ratio * m * n / (m + n)))``, so the bytes sent are at most about
``ratio`` of dense. 1-D tensors (biases, norms), and matrices where ``(m + n) r >= m n``, are
sent dense (one part, original dtype), as in the paper. Wire format otherwise: part 0 is
``P`` (m x r) and part 1 is ``Q`` (n x r), row-major float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload, PayloadError, flatten, register


def orthogonalize(p: Tensor) -> Tensor:
    """Orthonormal basis of the columns of ``p`` (reduced QR; the paper uses Gram-Schmidt)."""
    return torch.linalg.qr(p, mode="reduced").Q


@register
class PowerSGDCompressor(Compressor):
    name = "powersgd"

    def __init__(self, rank: int = 4, rank_from_ratio: bool = False) -> None:
        # Higher rank: better approximation, (m + n) * rank * 4 bytes sent.
        if rank < 1:
            raise ValueError(f"powersgd.rank must be >= 1, got {rank}")
        self.rank = rank
        self.rank_from_ratio = rank_from_ratio
        self._q: dict[str, Tensor] = {}

    def reset(self) -> None:
        self._q.clear()

    def _rank(self, m: int, n: int, ratio: float) -> int:
        if self.rank_from_ratio:
            if not ratio > 0.0:
                raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
            r = max(1, math.floor(min(ratio, 1.0) * m * n / (m + n)))
        else:
            r = self.rank
        return min(r, m, n)

    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        shape = tuple(tensor.shape)
        if tensor.dim() >= 2 and tensor.numel() > 0:
            m = shape[0]
            n = tensor.numel() // m
            r = self._rank(m, n, ratio)
            if (m + n) * r < m * n:
                mat = tensor.detach().reshape(m, n).to(torch.float32)
                q = self._q.get(key)
                if q is None or q.shape != (n, r) or q.device != mat.device:
                    q = torch.randn(n, r, generator=rng).to(mat.device)
                p = orthogonalize(mat @ q)
                q = mat.T @ p
                self._q[key] = q
                return Payload(self.name, (p.cpu().reshape(-1).contiguous(),
                                           q.cpu().reshape(-1).contiguous()),
                               tensor.numel(), shape, tensor.dtype)
        flat = flatten(tensor).cpu().clone()
        return Payload(self.name, (flat,), flat.numel(), shape, tensor.dtype)

    def check_parts(self, payload: Payload) -> None:
        parts = payload.tensors
        if len(parts) == 1:
            if parts[0].dtype != payload.dtype or parts[0].numel() != payload.numel:
                raise PayloadError(f"powersgd: dense part is {parts[0].numel()} x "
                                   f"{parts[0].dtype}, expected {payload.numel} x "
                                   f"{payload.dtype}")
            return
        if len(parts) != 2 or len(payload.shape) < 2 or payload.numel == 0:
            raise PayloadError(f"powersgd: {len(parts)} parts for shape {payload.shape}; "
                               "expected 1 (dense) or 2 (P, Q) for a matrix")
        p, q = parts
        m = payload.shape[0]
        n = payload.numel // m
        if p.dtype != torch.float32 or q.dtype != torch.float32:
            raise PayloadError(f"powersgd: P, Q must be float32, got {p.dtype}, {q.dtype}")
        if p.numel() == 0 or p.numel() % m or q.numel() != n * (p.numel() // m):
            raise PayloadError(f"powersgd: P has {p.numel()} and Q {q.numel()} elements, "
                               f"not m*r and n*r for m={m}, n={n}")

    def decompress(self, payload: Payload) -> Tensor:
        if len(payload.tensors) == 1:
            return payload.tensors[0].reshape(payload.shape)
        p, q = payload.tensors
        m = payload.shape[0]
        r = p.numel() // m
        mat = p.view(m, r) @ q.view(-1, r).T
        return mat.to(payload.dtype).reshape(payload.shape)
