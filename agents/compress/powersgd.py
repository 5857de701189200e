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

Flat buckets: the testbed's workers send gradients as flat 1-D chunks (several layers
concatenated, like DDP buckets). A 1-D tensor of at least ``MIN_FLAT_NUMEL`` elements is
viewed as a near-square matrix -- ``m = floor(sqrt(numel))`` rows, ``n = ceil(numel / m)``
columns, zero-padded at the end -- a shape both ends derive from ``numel`` alone. This is
the same move PowerSGD makes for conv kernels (reshape, then low-rank); on a bucket that
spans layers the low-rank fit is looser than per layer, and error feedback carries the rest.
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

MIN_FLAT_NUMEL = 4096


def matrix_shape(shape: tuple[int, ...], numel: int) -> tuple[int, int] | None:
    """The (m, n) matrix a tensor is compressed as, or None when it is sent dense."""
    if numel == 0:
        return None
    if len(shape) >= 2:
        return shape[0], numel // shape[0]
    if numel >= MIN_FLAT_NUMEL:
        m = math.isqrt(numel)
        return m, -(-numel // m)
    return None


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
        mn = matrix_shape(shape, tensor.numel())
        if mn is not None:
            m, n = mn
            r = self._rank(m, n, ratio)
            if (m + n) * r < m * n:
                flat = tensor.detach().reshape(-1).to(torch.float32)
                if m * n != flat.numel():
                    flat = torch.nn.functional.pad(flat, (0, m * n - flat.numel()))
                mat = flat.reshape(m, n)
                q = self._q.get(key)
                if q is None or q.shape != (n, r) or q.device != mat.device:
                    q = torch.randn(n, r, generator=device_generator(rng, mat.device),
                                    device=mat.device)
                p = orthogonalize(mat @ q)
                q = mat.T @ p
                self._q[key] = q
                return Payload(self.name, (p.reshape(-1).contiguous(),
                                           q.reshape(-1).contiguous()),
                               tensor.numel(), shape, tensor.dtype)
        flat = flatten(tensor).clone()
        return Payload(self.name, (flat,), flat.numel(), shape, tensor.dtype)

    def check_parts(self, payload: Payload) -> None:
        parts = payload.tensors
        if len(parts) == 1:
            if parts[0].dtype != payload.dtype or parts[0].numel() != payload.numel:
                raise PayloadError(f"powersgd: dense part is {parts[0].numel()} x "
                                   f"{parts[0].dtype}, expected {payload.numel} x "
                                   f"{payload.dtype}")
            return
        mn = matrix_shape(tuple(payload.shape), payload.numel)
        if len(parts) != 2 or mn is None:
            raise PayloadError(f"powersgd: {len(parts)} parts for shape {payload.shape}; "
                               "expected 1 (dense) or 2 (P, Q) for a matrix")
        p, q = parts
        m, n = mn
        if p.dtype != torch.float32 or q.dtype != torch.float32:
            raise PayloadError(f"powersgd: P, Q must be float32, got {p.dtype}, {q.dtype}")
        if p.numel() == 0 or p.numel() % m or q.numel() != n * (p.numel() // m):
            raise PayloadError(f"powersgd: P has {p.numel()} and Q {q.numel()} elements, "
                               f"not m*r and n*r for m={m}, n={n}")

    def decompress(self, payload: Payload) -> Tensor:
        if len(payload.tensors) == 1:
            return payload.tensors[0].reshape(payload.shape)
        p, q = payload.tensors
        mn = matrix_shape(tuple(payload.shape), payload.numel)
        assert mn is not None, "check_parts rejects P, Q for a tensor sent dense"
        m = mn[0]
        r = p.numel() // m
        mat = p.view(m, r) @ q.view(-1, r).T
        return mat.reshape(-1)[:payload.numel].to(payload.dtype).reshape(payload.shape)
