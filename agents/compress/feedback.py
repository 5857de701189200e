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

**Momentum correction and momentum factor masking** (Lin et al., "Deep Gradient
Compression", ICLR 2018, section 3.2, options ``momentum`` > 0 and ``masking``). With SGD
momentum applied after aggregation, what a worker leaves in its residual misses the momentum
it would have had, and a coordinate sent after T steps arrives as a plain sum instead of a
discounted one; DGC moves the momentum onto the worker, before compression:

    u = m u + g          (local momentum, "velocity"; clipping, when on, applies to g first)
    v = v + u            (the residual accumulates velocities, not gradients)
    sent = C(v);  v = v - sent
    masking: u = 0 where sent    (sparse compressors: the sent indices; dense fallback: all)

and the PS applies plain SGD (no momentum) to the mean of what was sent: with nothing
compressed away and no masking this is exactly SGD with momentum m (tested). Masking stops a
coordinate's stale velocity from pushing it again after it was sent. It needs a set of sent
coordinates, so it applies to the sparse compressors only (topk, dgc, threshold, randomk);
for the others (powersgd, qsgd, signsgd, fp16, none) the velocity is kept whole. The
velocity is one more tensor per key. Coordinates the compressor sends whole every step
(``dense_1d``, :meth:`agents.compress.sparse.SparseCompressor.whole_indices`) are never
masked: for them the local momentum is exactly momentum SGD, as DGC applies it to the
tensors it does not compress.
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
    """Wraps a :class:`Compressor`; keeps the residual ``R`` per key on the worker, and with
    ``momentum`` > 0 the velocity ``u`` of DGC's momentum correction (module docstring)."""

    def __init__(self, inner: Compressor, *, momentum: float = 0.0,
                 masking: bool = True) -> None:
        # momentum: 0 = plain error feedback (the PS applies any momentum); m in (0, 1) =
        # DGC's momentum correction at m (then the PS must step without momentum).
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"error feedback momentum must be in [0, 1), got {momentum!r}")
        self.inner = inner
        self.momentum = momentum
        self.masking = masking
        self._residuals: dict[str, Tensor] = {}
        self._velocity: dict[str, Tensor] = {}

    def velocity(self, key: str) -> Tensor | None:
        """DGC's local momentum ``u`` for ``key`` (None before its first step or without
        momentum correction)."""
        return self._velocity.get(key)

    @property
    def name(self) -> str:
        return self.inner.name

    def residual(self, key: str) -> Tensor | None:
        """The residual currently held for ``key`` (None before its first step)."""
        return self._residuals.get(key)

    def reset(self) -> None:
        """Forget every residual (e.g. when the model is re-initialised)."""
        self._residuals.clear()
        self._velocity.clear()

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
        if self.momentum > 0:
            total, norm_before, clipped = self._momentum_step(g, prev, key, clip_norm)
        else:
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
        u = self._velocity.get(key)
        # Coordinates a sparse compressor sends whole every step (dense_1d: DGC's 1-D
        # parameters) keep their momentum: DGC masks only the sparsified tensors, and masking
        # a coordinate sent every step would turn its momentum SGD into plain SGD.
        whole, kept = None, None
        whole_indices = getattr(self.inner, "whole_indices", None)
        if u is not None and self.masking and whole_indices is not None:
            whole = whole_indices(key)
            if whole is not None:
                whole = whole.to(u.device)
                kept = u.view(-1)[whole]  # advanced indexing copies
        if sparse is not None:
            idx, values = sparse
            flat = total.view(-1)
            idx = idx.to(flat.device)
            flat.index_add_(0, idx, values.to(flat.device, flat.dtype), alpha=-1)
            if u is not None and self.masking:
                u.view(-1)[idx] = 0.0  # momentum factor masking (int32 indices index fine)
        else:
            total.sub_(self.inner.decompress(payload).to(total.device))
            if u is not None and self.masking and getattr(self.inner, "sparse", False):
                u.zero_()  # a sparse compressor's dense fallback sent every coordinate
        if u is not None and whole is not None and kept is not None:
            u.view(-1)[whole] = kept
        self._residuals[key] = total
        stats = {
            "raw_bytes": g.numel() * g.element_size(),
            "wire_bytes": payload.wire_bytes(),
            "residual_norm": float(torch.linalg.vector_norm(total)),
            "clipped": clipped,
            "norm_before": norm_before,
        }
        return payload, stats

    def _momentum_step(self, g: Tensor, prev: Tensor | None, key: str,
                       clip_norm: float | None) -> tuple[Tensor, float, bool]:
        """DGC's ``u = m u + g`` (``g`` clipped first, as DGC clips before accumulating) and
        ``v = v + u``; returns the new ``v`` (a fresh buffer), ``||g||`` and whether it was
        clipped."""
        norm_before = float(torch.linalg.vector_norm(g))
        clipped = clip_norm is not None and norm_before > clip_norm
        if clipped:
            assert clip_norm is not None
            g = g * (clip_norm / norm_before)
        u = self._velocity.get(key)
        if u is None:  # u_0 = 0, so u_1 = g
            u = g.clone().contiguous()
            self._velocity[key] = u
        else:
            u.mul_(self.momentum).add_(g)
        total = (u.add(prev) if prev is not None else u.clone()).contiguous()
        return total, norm_before, clipped
