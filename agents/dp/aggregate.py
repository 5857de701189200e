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

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload, PayloadError
from agents.compress.checks import checked_sparse, validate_sparse
from agents.net.codec import FrameHeader, MsgType
from agents.net.protocol import ProtocolError

__all__ = ["PayloadError", "SparseAccumulator", "aggregate", "max_message_bytes",
           "uplink_bound", "weights_delta"]

# Sparse accumulation wins while the total number of received elements is below this
# fraction of the tensor; above it, decompressing and adding dense tensors streams better.
SPARSE_FRACTION = 0.25


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


def uplink_bound(compressor: str, chunks: Sequence[tuple[int, int]]
                 ) -> Callable[[FrameHeader], None]:
    """What one frame from a worker may weigh, checked before its payload is read (the
    PS's receivers call it on every header): a BYE at most 64 bytes, a GRAD of a chunk in
    range at most :func:`max_message_bytes` of that chunk in at most 16 parts."""

    def bound(h: FrameHeader) -> None:
        if h.msg_type == MsgType.BYE:
            if h.payload_len > 64:
                raise ProtocolError(f"BYE of {h.payload_len} bytes")
            return
        if not 0 <= h.chunk < len(chunks):
            raise ProtocolError(f"chunk {h.chunk} out of range 0..{len(chunks) - 1}")
        s, e = chunks[h.chunk]
        limit = max_message_bytes(compressor, e - s)
        if h.payload_len > limit or h.nparts > 16:
            raise ProtocolError(
                f"{h.describe()}: {h.payload_len} bytes in {h.nparts} parts exceeds "
                f"what chunk {h.chunk} ({e - s} elements) may weigh ({limit} bytes)")

    return bound


def weights_delta(params: Tensor, shadow: Tensor) -> list[Tensor]:
    """The change of ``params`` since ``shadow`` (what the workers hold): sparse (int32
    indices, values) when under a third of the entries changed, else dense. ``shadow`` is
    updated in place with exactly the operation the workers apply, so both stay
    identical."""
    delta = params - shadow
    nz = delta.nonzero().reshape(-1)
    if nz.numel() * 3 < params.numel():
        vals = delta[nz]
        shadow.index_add_(0, nz, vals)
        return [nz.to(torch.int32), vals]
    shadow.add_(delta)
    return [delta]


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


def _sparse_forms(payloads: Sequence[Payload], compressor: Compressor, names: list[str]
                  ) -> list[tuple[Tensor, Tensor] | None]:
    """Each payload's sparse form (None where it has none), once every payload is checked
    to have the first one's shape and ``compressor``'s name; errors name the sender."""
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
    return sparse


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
    sparse = _sparse_forms(payloads, compressor, names)
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
