"""PS-side aggregation of compressed payloads, without densifying when that is cheaper.

DESIGN 1.2's last step: the PS sums the workers' (sparse) gradients. A sparse payload is
added straight into one dense accumulator with ``index_add_`` (O(k) per worker instead of
decompressing to a dense tensor, O(n), and adding it). Indices are used in the order they
arrive; sorting them first was measured slower than the scattered adds it would speed up
(``benchmarks/ps_aggregate.py`` reports both). The aggregated *sparse* update (the union of
the workers' indices, sorted, with the summed values) is available for the configs that
send the sparse update back down instead of dense weights.

Every payload received off the wire is validated first (:func:`validate_sparse`): a bad
payload raises :class:`PayloadError` naming the worker, and the caller (the PS) logs it and
keeps serving the others; nothing is added to the accumulator before validation passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload, PayloadError

__all__ = ["PayloadError", "SparseAccumulator", "aggregate", "check_gradient",
           "checked_sparse", "max_message_bytes", "validate_sparse"]

# Sparse accumulation wins while the total number of received elements is below this
# fraction of the tensor; above it, decompressing and adding dense tensors streams better.
SPARSE_FRACTION = 0.25


def validate_sparse(idx: Tensor, values: Tensor, numel: int, *, who: str) -> None:
    """Raise :class:`PayloadError` naming ``who`` unless ``idx``/``values`` are 1-D, equally
    long, ``idx`` is an integer tensor and every index lies in ``[0, numel)``."""
    if idx.dim() != 1 or values.dim() != 1:
        raise PayloadError(f"{who}: indices and values must be 1-D, got shapes "
                           f"{tuple(idx.shape)} and {tuple(values.shape)}")
    if idx.numel() != values.numel():
        raise PayloadError(f"{who}: {idx.numel()} indices but {values.numel()} values")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise PayloadError(f"{who}: indices must be integers, got {idx.dtype}")
    if idx.numel() == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0:
        raise PayloadError(f"{who}: negative index {lo} (tensor has {numel} elements)")
    if hi >= numel:
        raise PayloadError(f"{who}: index {hi} out of range for a tensor of {numel} elements")


# The most one chunk's message may weigh, as a multiple of the dense chunk, plus slack
# for headers of small parts (scales, norms): every compressor here sends at most the
# dense chunk (the sparse ones fall back to dense when the encoding would be larger),
# PowerSGD's P and Q stay under it at its ranks, and twice leaves room for the next.
MESSAGE_DENSE_FACTOR = 2
MESSAGE_SLACK_BYTES = 4096


def max_message_bytes(compressor: str, numel: int) -> int:
    """Upper bound, in bytes, of one GRAD message for a chunk of ``numel`` float32
    elements: what the PS lets a worker announce before it allocates anything."""
    del compressor  # one bound serves every registered compressor (see above)
    return MESSAGE_DENSE_FACTOR * 4 * numel + MESSAGE_SLACK_BYTES


def _check_values(values: Tensor, *, who: str, max_abs: float) -> None:
    if values.numel():
        lo, hi = (float(x) for x in torch.aminmax(values))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise PayloadError(f"{who}: non-finite gradient value (min {lo}, max {hi})")
        if max_abs > 0 and max(-lo, hi) > max_abs:
            raise PayloadError(f"{who}: gradient value {max(-lo, hi):.3g} in magnitude "
                               f"exceeds guard.max_abs_grad = {max_abs:g}")


def checked_sparse(idx: Tensor, values: Tensor, numel: int, *, who: str, max_abs: float,
                   unique_indices: bool) -> tuple[Tensor, Tensor]:
    """Every check of one sparse contribution (:func:`validate_sparse`, then the values
    as in :func:`check_gradient`, then, where the encoding sends each index once, no
    duplicate), returning the ``(indices, values)`` to add: with ``unique_indices``,
    sorted by index. Raises :class:`PayloadError` naming ``who``.

    The duplicate test is the sort the add can use: sorting k indices (1.6 ms for 250 k
    here) makes duplicates neighbours (one sequential compare), and the sorted add walks
    the accumulator in address order, which pays back about what the sort cost
    (``benchmarks/ps_aggregate.py``). Each index is unique, so the add's result is
    bit-identical to the unsorted one."""
    validate_sparse(idx, values, numel, who=who)
    _check_values(values, who=who, max_abs=max_abs)
    if not unique_indices or idx.numel() < 2:
        return idx, values
    sorted_idx, order = torch.sort(idx)
    same = sorted_idx[1:] == sorted_idx[:-1]
    if bool(same.any()):
        first = int(sorted_idx[int(same.nonzero()[0])])
        raise PayloadError(f"{who}: duplicate indices (index {first} more than once); this "
                           "encoding sends each index once")
    return sorted_idx, values.index_select(0, order)


def check_gradient(sparse: tuple[Tensor, Tensor] | None, dense: Tensor | None, numel: int,
                   *, who: str, max_abs: float, unique_indices: bool) -> None:
    """Gradient sanity at the PS: raise :class:`PayloadError` naming ``who``
    for a non-finite value, a value with ``|v| > max_abs`` (``max_abs`` = 0: no bound),
    or, where the encoding sends each index once (``unique_indices``), a duplicate.

    Cost: one ``aminmax`` pass over the values (NaN propagates through it) and, for
    unique indices, a sort of the k indices. The PS does not call this for a sparse
    contribution: :meth:`SparseAccumulator.add_checked` runs the same checks and adds
    in the order the duplicate test sorted."""
    if sparse is not None:
        checked_sparse(sparse[0], sparse[1], numel, who=who, max_abs=max_abs,
                       unique_indices=unique_indices)
        return
    assert dense is not None
    _check_values(dense, who=who, max_abs=max_abs)


class SparseAccumulator:
    """Sum of sparse and dense contributions to one tensor of ``numel`` elements.

    ``into``: accumulate in this 1-D buffer instead of one of its own (the PS passes the
    slice of its gradient buffer): :meth:`result` with ``out=into`` then costs no pass
    over the tensor, when :meth:`expect` announced the number of contributions first (each
    is scaled by 1/n as it is added, so the sum is already the mean). The buffer is zeroed
    here and by every :meth:`reset`.

    Not thread-safe: the PS feeds it from one aggregation thread."""

    def __init__(self, numel: int, dtype: torch.dtype = torch.float32, *,
                 into: Tensor | None = None) -> None:
        if numel < 0:
            raise ValueError(f"SparseAccumulator numel must be >= 0, got {numel}")
        self.numel = numel
        self.dtype = dtype
        if into is None:
            self._sum = torch.zeros(numel, dtype=dtype)
        else:
            if into.dim() != 1 or into.numel() != numel or into.dtype != dtype \
                    or not into.is_contiguous():
                raise ValueError(f"SparseAccumulator into: needs a contiguous 1-D {dtype} "
                                 f"tensor of {numel} elements, got {tuple(into.shape)} "
                                 f"{into.dtype}")
            self._sum = into
            self._sum.zero_()
        self._scale = 1.0  # each contribution is added times this (1/n after expect(n))
        self._touched: list[Tensor] = []  # indices of sparse adds, for result_sparse()
        self._dense_added = False
        self.added = 0  # contributions so far

    def expect(self, n: int) -> None:
        """Announce ``n`` contributions before the first: each is added times 1/n, so a
        :meth:`result` over n into the accumulator's own buffer needs no division pass."""
        if n < 1:
            raise ValueError(f"expect: n must be >= 1, got {n}")
        if self.added:
            raise ValueError(f"expect: {self.added} contributions were added already")
        self._scale = 1.0 / n

    def add_sparse(self, idx: Tensor, values: Tensor, *, who: str = "worker",
                   validate: bool = True) -> None:
        """Add ``values`` at ``idx``; duplicate indices accumulate."""
        if validate:
            validate_sparse(idx, values, self.numel, who=who)
        if idx.dtype not in (torch.int32, torch.int64):
            idx = idx.to(torch.int64)
        self._sum.index_add_(0, idx, values.to(self.dtype), alpha=self._scale)
        self._touched.append(idx)
        self.added += 1

    def add_checked(self, idx: Tensor, values: Tensor, *, who: str, max_abs: float,
                    unique_indices: bool) -> None:
        """Check one sparse contribution as the PS must (:func:`checked_sparse`: range,
        finite and bounded values, no duplicate index where the encoding forbids one),
        then add it, in the order the duplicate test sorted it. A bad contribution
        raises PayloadError and adds nothing."""
        idx, values = checked_sparse(idx, values, self.numel, who=who, max_abs=max_abs,
                                     unique_indices=unique_indices)
        self.add_sparse(idx, values, who=who, validate=False)

    def add_dense(self, t: Tensor, *, who: str = "worker") -> None:
        if t.numel() != self.numel:
            raise PayloadError(f"{who}: dense tensor has {t.numel()} elements, expected "
                               f"{self.numel}")
        self._sum.add_(t.reshape(-1).to(self.dtype), alpha=self._scale)
        self._dense_added = True
        self.added += 1

    def result(self, mean_over: int, *, out: Tensor | None = None) -> Tensor:
        """The sum divided by ``mean_over`` (the number of workers): a new tensor, or
        written into ``out`` (a PS that reuses its buffers avoids a 4n-byte allocation).
        With ``out`` the accumulator's own buffer and ``mean_over`` the number announced
        by :meth:`expect`, nothing is left to do."""
        if mean_over < 1:
            raise ValueError(f"mean_over must be >= 1, got {mean_over}")
        if self._scale == 1.0:
            if out is None:
                return self._sum / mean_over
            return torch.div(self._sum, mean_over, out=out)
        factor = 1.0 / (self._scale * mean_over)  # 1 when mean_over is what was expected
        if out is None:
            return self._sum * factor
        if out.data_ptr() == self._sum.data_ptr() and out.numel() == self.numel:
            if factor != 1.0:  # a contribution expected did not come
                out.mul_(factor)
            return out
        return torch.mul(self._sum, factor, out=out)

    def reset(self) -> None:
        """Zero the sum in place for the next iteration. Reusing one accumulator avoids
        faulting in fresh pages every iteration (a fresh 100 MB buffer cost more than the
        adds themselves in ``benchmarks/ps_aggregate.py``)."""
        self._sum.zero_()
        self._touched.clear()
        self._dense_added = False
        self._scale = 1.0
        self.added = 0

    def result_sparse(self, mean_over: int) -> tuple[Tensor, Tensor]:
        """``(sorted unique int64 indices, mean values)`` over the union of the sparse
        contributions; only valid when nothing dense was added."""
        if self._dense_added:
            raise ValueError("result_sparse: a dense tensor was added; use result()")
        if mean_over < 1:
            raise ValueError(f"mean_over must be >= 1, got {mean_over}")
        if not self._touched:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=self.dtype)
        idx = torch.unique(torch.cat([t.to(torch.int64) for t in self._touched]))
        return idx, self._sum[idx] / (self._scale * mean_over)


def aggregate(payloads: Sequence[Payload], compressor: Compressor, *,
              workers: Sequence[str] | None = None, mean: bool = True,
              acc: SparseAccumulator | None = None, out: Tensor | None = None) -> Tensor:
    """Mean (or sum, ``mean=False``) of the payloads' dense tensors, in the original shape.

    Sparse accumulation is used when the compressor has a sparse form and the total number
    of received elements is below ``SPARSE_FRACTION * numel``; otherwise each payload is
    decompressed and added densely. ``workers`` names the senders for error messages.
    ``acc``: a persistent accumulator to reuse (it is reset first). ``out``: a buffer of
    ``numel`` elements to write the result into (what the PS does with its gradient
    buffer: no 4n-byte allocation and its page faults); otherwise the result is a new
    tensor. An ``acc`` made ``into=out`` saves the pass that writes the mean, as the PS's
    accumulators do."""
    if not payloads:
        raise ValueError("aggregate: no payloads")
    names = list(workers) if workers is not None else [f"worker {i}" for i in
                                                       range(len(payloads))]
    if len(names) != len(payloads):
        raise ValueError(f"aggregate: {len(payloads)} payloads but {len(names)} worker names")
    first = payloads[0]
    for who, p in zip(names, payloads, strict=True):
        if p.numel != first.numel or p.shape != first.shape:
            raise PayloadError(f"{who}: payload shape {p.shape} differs from {first.shape}")
        if p.compressor != compressor.name:
            raise PayloadError(f"{who}: payload from compressor {p.compressor!r}, expected "
                               f"{compressor.name!r}")
    sparse: list[tuple[Tensor, Tensor] | None] = []
    for who, p in zip(names, payloads, strict=True):
        try:
            sparse.append(compressor.decompress_sparse(p))
        except PayloadError as exc:
            raise PayloadError(f"{who}: {exc}") from exc
    if acc is None:
        acc = SparseAccumulator(first.numel, first.dtype)
    elif acc.numel != first.numel or acc.dtype != first.dtype:
        raise ValueError(f"aggregate: accumulator is {acc.numel} x {acc.dtype}, payloads are "
                         f"{first.numel} x {first.dtype}")
    else:
        acc.reset()
    if mean:
        acc.expect(len(payloads))
    nnz = sum(s[0].numel() for s in sparse if s is not None)
    if all(s is not None for s in sparse) and nnz < SPARSE_FRACTION * first.numel:
        checked = []
        for who, s in zip(names, sparse, strict=True):
            assert s is not None
            validate_sparse(s[0], s[1], first.numel, who=who)
            checked.append(s)
        for s in checked:  # add only once every payload passed, so a bad one changes nothing
            acc.add_sparse(s[0], s[1], validate=False)
    else:
        dense = []
        for who, p in zip(names, payloads, strict=True):
            try:
                dense.append(compressor.decompress(p))
            except PayloadError as exc:
                raise PayloadError(f"{who}: {exc}") from exc
        for d in dense:
            acc.add_dense(d)
    if out is not None and (out.numel() != first.numel or out.dtype != first.dtype):
        raise ValueError(f"aggregate: out is {out.numel()} x {out.dtype}, payloads are "
                         f"{first.numel} x {first.dtype}")
    result = acc.result(len(payloads) if mean else 1,
                        out=None if out is None else out.reshape(-1))
    return result.reshape(first.shape)
