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

Per layer (the paper's setting): the testbed's workers send gradients as flat 1-D chunks
(several layers concatenated, like DDP buckets). The worker tells the compressor each
chunk's layer pieces (:meth:`set_layers`, from ``agents.workloads.base.chunk_layers``); then
every piece of two or more dimensions is its own ``m x n`` matrix with its own rank and warm
start (``Q`` kept per key and piece), and 1-D pieces (biases, norms, partial rows at a chunk
cut) are sent uncompressed. Error feedback on the chunk is then error feedback per layer:
the residual is element-wise, so the chunk's residual is the layers' residuals side by side.
Wire format of a layered chunk, four parts: a header of int32 triples ``(numel, m, r)`` per
piece (``r = 0``: sent dense; consecutive dense pieces share one triple), all ``P`` (m x r,
row-major float32) concatenated, all ``Q`` (n x r) concatenated, all dense pieces
concatenated. The receiver needs no layout: the header says how to rebuild, and every triple
is checked against the part sizes.

Why per layer: with the whole model in one flat bucket (the flat fallback below) the
85 k-parameter digits MLP became one 291 x 291 matrix whose rank-4 approximation carried a
small part of each step; most of the gradient waited in the residual and left in delayed
bursts, which the PS's momentum 0.9 amplified until training diverged (docs/workloads.md).

Flat fallback, for a key with no layers set: a 1-D tensor of at least ``MIN_FLAT_NUMEL``
elements is viewed as a near-square matrix -- ``m = floor(sqrt(numel))`` rows,
``n = ceil(numel / m)`` columns, zero-padded at the end -- a shape both ends derive from
``numel`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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

        self._layers: dict[str, tuple[tuple[int, ...], ...]] = {}

    def reset(self) -> None:
        self._q.clear()

    def set_layers(self, key: str, shapes: Sequence[tuple[int, ...]],
                   param_dims: Sequence[int] | None = None) -> None:
        """Compress the flat tensor sent under ``key`` layer by layer: ``shapes`` are its
        consecutive pieces (module docstring); ``param_dims`` is not needed here."""
        self._layers[key] = tuple(tuple(int(d) for d in shape) for shape in shapes)

    def _rank(self, m: int, n: int, ratio: float) -> int:
        if self.rank_from_ratio:
            if not ratio > 0.0:
                raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
            r = max(1, math.floor(min(ratio, 1.0) * m * n / (m + n)))
        else:
            r = self.rank
        return min(r, m, n)

    def _low_rank(self, mat: Tensor, key: str, r: int,
                  rng: torch.Generator) -> tuple[Tensor, Tensor]:
        """One power-iteration step on ``mat`` with the warm-start ``Q`` kept under ``key``:
        ``P = orthogonalize(M Q)``, ``Q = M^T P``."""
        n = mat.shape[1]
        q = self._q.get(key)
        if q is None or q.shape != (n, r) or q.device != mat.device:
            q = torch.randn(n, r, generator=device_generator(rng, mat.device),
                            device=mat.device)
        p = orthogonalize(mat @ q)
        q = mat.T @ p
        self._q[key] = q
        return p, q

    def _compress_layers(self, tensor: Tensor, key: str, ratio: float, rng: torch.Generator,
                         shapes: tuple[tuple[int, ...], ...]) -> Payload:
        """The layered format: one matrix per piece of >= 2 dimensions, 1-D pieces dense."""
        flat = tensor.detach().reshape(-1).to(torch.float32)
        if sum(math.prod(s) for s in shapes) != flat.numel():
            raise ValueError(f"powersgd key {key!r}: layers {shapes} hold "
                             f"{sum(math.prod(s) for s in shapes)} elements, the tensor "
                             f"{flat.numel()}")
        header: list[list[int]] = []
        ps: list[Tensor] = []
        qs: list[Tensor] = []
        dense: list[Tensor] = []
        offset = 0
        for j, shape in enumerate(shapes):
            numel = math.prod(shape)
            piece = flat[offset:offset + numel]
            offset += numel
            r = 0
            if len(shape) >= 2 and numel > 0:
                m, n = shape[0], numel // shape[0]
                r = self._rank(m, n, ratio)
                if (m + n) * r >= m * n:
                    r = 0  # low rank would not save bytes: dense, as the paper does
            if r == 0:
                if header and header[-1][2] == 0:
                    header[-1][0] += numel
                else:
                    header.append([numel, 1, 0])
                dense.append(piece)
                continue
            p, q = self._low_rank(piece.view(m, n), f"{key}/{j}", r, rng)
            header.append([numel, m, r])
            ps.append(p.reshape(-1))
            qs.append(q.reshape(-1))
        if not ps:  # nothing low-rank: the plain dense format
            return Payload(self.name, (flatten(tensor).clone(),), tensor.numel(),
                           tuple(tensor.shape), tensor.dtype)
        empty = flat.new_empty(0)
        parts = (torch.tensor(header, dtype=torch.int32, device=flat.device).reshape(-1),
                 torch.cat(ps), torch.cat(qs), torch.cat(dense) if dense else empty)
        return Payload(self.name, parts, tensor.numel(), tuple(tensor.shape), tensor.dtype)

    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        layers = self._layers.get(key)
        if layers is not None:
            return self._compress_layers(tensor, key, ratio, rng, layers)
        shape = tuple(tensor.shape)
        mn = matrix_shape(shape, tensor.numel())
        if mn is not None:
            m, n = mn
            r = self._rank(m, n, ratio)
            if (m + n) * r < m * n:
                flat = tensor.detach().reshape(-1).to(torch.float32)
                if m * n != flat.numel():
                    flat = torch.nn.functional.pad(flat, (0, m * n - flat.numel()))
                p, q = self._low_rank(flat.reshape(m, n), key, r, rng)
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
        if len(parts) == 4:
            self._layered_triples(payload)
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

    def _layered_triples(self, payload: Payload) -> list[tuple[int, int, int]]:
        """The header's ``(numel, m, r)`` triples of a layered payload, each checked against
        the payload's numel and the sizes of the P, Q and dense parts; raises
        :class:`PayloadError` naming the first one that does not fit."""
        header, p, q, dense = payload.tensors
        if header.dtype != torch.int32 or header.numel() == 0 or header.numel() % 3:
            raise PayloadError(f"powersgd: layer header is {header.numel()} x {header.dtype}, "
                               "expected int32 triples (numel, m, r)")
        for name, t in (("P", p), ("Q", q), ("dense", dense)):
            if t.dtype != torch.float32:
                raise PayloadError(f"powersgd: {name} part must be float32, got {t.dtype}")
        values = header.tolist()
        triples = [(values[i], values[i + 1], values[i + 2]) for i in range(0, len(values), 3)]
        total = p_numel = q_numel = dense_numel = 0
        for j, (numel, m, r) in enumerate(triples):
            if numel < 1 or r < 0 or m < 1 or (r > 0 and (numel % m
                                                          or r > min(m, numel // m))):
                raise PayloadError(f"powersgd: layer {j} header (numel {numel}, m {m}, r {r}) "
                                   "is not a piece of m whole rows at a rank <= min(m, n)")
            total += numel
            if r == 0:
                dense_numel += numel
            else:
                p_numel += m * r
                q_numel += numel // m * r
        if (total, p_numel, q_numel, dense_numel) != (payload.numel, p.numel(), q.numel(),
                                                       dense.numel()):
            raise PayloadError(f"powersgd: layer headers give {total} elements, P {p_numel}, "
                               f"Q {q_numel}, dense {dense_numel}; the payload has "
                               f"{payload.numel}, P {p.numel()}, Q {q.numel()}, dense "
                               f"{dense.numel()}")
        return triples

    def decompress(self, payload: Payload) -> Tensor:
        if len(payload.tensors) == 1:
            return payload.tensors[0].reshape(payload.shape)
        if len(payload.tensors) == 4:
            _, p_all, q_all, dense = payload.tensors
            out = torch.empty(payload.numel, dtype=torch.float32, device=p_all.device)
            offset = p_at = q_at = dense_at = 0
            for numel, m, r in self._layered_triples(payload):
                if r == 0:
                    out[offset:offset + numel] = dense[dense_at:dense_at + numel]
                    dense_at += numel
                else:
                    n = numel // m
                    p = p_all[p_at:p_at + m * r].view(m, r)
                    q = q_all[q_at:q_at + n * r].view(n, r)
                    out[offset:offset + numel] = (p @ q.T).reshape(-1)
                    p_at += m * r
                    q_at += n * r
                offset += numel
            return out.to(payload.dtype).reshape(payload.shape)
        p, q = payload.tensors
        mn = matrix_shape(tuple(payload.shape), payload.numel)
        assert mn is not None, "check_parts rejects P, Q for a tensor sent dense"
        m = mn[0]
        r = p.numel() // m
        mat = p.view(m, r) @ q.view(-1, r).T
        return mat.reshape(-1)[:payload.numel].to(payload.dtype).reshape(payload.shape)
