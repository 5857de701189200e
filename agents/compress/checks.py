"""What a gradient received off the wire must satisfy before anything adds it.

Every role that takes gradients from a peer (the data-parallel PS, the pipeline's PS)
checks them here first: indices in range and of an integer type, values finite and within
``guard.max_abs_grad``, and, where the encoding sends each index once, no duplicate. A
failed check raises :class:`PayloadError` naming the peer; nothing has been added yet.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from agents.compress.base import PayloadError

__all__ = ["check_gradient", "checked_sparse", "validate_sparse"]


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
    """Gradient sanity where gradients arrive: raise :class:`PayloadError` naming ``who``
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
