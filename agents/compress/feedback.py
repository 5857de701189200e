"""Error feedback with optional local clipping: DESIGN 1.2 (seeds/000) around any compressor.

On a worker, for each key (chunk or layer) at every step:

1. ``G = g + R``: the new gradient plus the residual kept from earlier steps (zero at first).
2. Optional clipping (DGC's local gradient clipping, Lin et al. ICLR 2018): if
   ``||G||_2 > T2`` scale ``G`` by ``T2 / ||G||_2``, with ``T2 = T_global / sqrt(N)``
   (:func:`clip_threshold`).
3. ``payload = inner.compress(G)``.
4. ``R = G - decompress(payload)``: standard error feedback (Seide et al. 2014; Stich et al.
   2018; Karimireddy et al. 2019). The seed's wording adds the previous residual a second
   time; that would count it twice, so it is not done.

Contract, as in PowerSGD's ``Aggregator``: after ``step`` the residual for ``key`` holds the
compression error, so ``G (= g + R_prev, after clipping) == sent + R_new`` exactly up to
the float rounding of one subtraction. For sparse compressors the residual is updated only
at the sent indices (``R[idx] -= values``), which is the same subtraction done without
densifying. Side effect: the wrapper owns one residual tensor per key (as large as the
gradient); ``grad`` itself is never modified.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload


def clip_threshold(t_global: float, n_workers: int) -> float:
    """Per-worker clipping norm ``T2 = T_global / sqrt(N)`` (DESIGN 1.2; DGC section 3.3)."""
    if not t_global > 0.0:
        raise ValueError(f"clip t_global must be > 0, got {t_global!r}")
    if n_workers < 1:
        raise ValueError(f"clip n_workers must be >= 1, got {n_workers!r}")
    return t_global / math.sqrt(n_workers)


class ErrorFeedback:
    """Wraps a :class:`Compressor`; keeps the residual ``R`` per key on the worker."""

    def __init__(self, inner: Compressor) -> None:
        self.inner = inner
        self._residuals: dict[str, Tensor] = {}

    @property
    def name(self) -> str:
        return self.inner.name

    def residual(self, key: str) -> Tensor | None:
        """The residual currently held for ``key`` (None before its first step)."""
        return self._residuals.get(key)

    def reset(self) -> None:
        """Forget every residual (e.g. when the model is re-initialised)."""
        self._residuals.clear()

    def step(self, grad: Tensor, key: str, ratio: float, rng: torch.Generator, *,
             clip_norm: float | None = None) -> tuple[Payload, dict[str, Any]]:
        """One DESIGN 1.2 step for ``key``; returns the payload to send and the stats of the
        ``compress_done`` event: raw_bytes, wire_bytes, residual_norm, clipped,
        norm_before (``||g + R_prev||_2`` before clipping)."""
        prev = self._residuals.get(key)
        g = grad.detach()
        if prev is not None and prev.shape != g.shape:
            raise ValueError(f"error feedback key {key!r}: gradient shape {tuple(g.shape)} "
                             f"differs from residual shape {tuple(prev.shape)}")
        # G is a fresh buffer that becomes the new residual, so `grad` is never touched.
        total = g.add(prev) if prev is not None else g.clone()
        total = total.contiguous()  # the residual is updated through a flat view
        norm_before = float(torch.linalg.vector_norm(total))
        clipped = clip_norm is not None and norm_before > clip_norm
        if clipped:
            assert clip_norm is not None
            total.mul_(clip_norm / norm_before)
        payload = self.inner.compress(total, key, ratio, rng)
        sparse = self.inner.decompress_sparse(payload)
        if sparse is not None:
            idx, values = sparse
            flat = total.view(-1)
            flat.index_add_(0, idx.to(flat.device), values.to(flat.device, flat.dtype),
                            alpha=-1)
        else:
            total.sub_(self.inner.decompress(payload).to(total.device))
        self._residuals[key] = total
        stats = {
            "raw_bytes": g.numel() * g.element_size(),
            "wire_bytes": payload.wire_bytes(),
            "residual_norm": float(torch.linalg.vector_norm(total)),
            "clipped": clipped,
            "norm_before": norm_before,
        }
        return payload, stats
