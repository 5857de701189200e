"""Shared machinery of the sparse compressors (topk, dgc, threshold, randomk): how the
selected (index, value) pairs go on the wire, and how they come back.

Two index encodings, chosen per compressor instance with ``index_encoding``:

- ``"int32"`` (default): indices as int32 in selection order, values in the original dtype.
  Wire bytes are exactly ``k * (value_bytes + 4) + 2 * header_bytes`` (DESIGN 1.2).
  Tensors up to 2**31 - 1 elements.

Dense fallback: when the sparse encoding would be no smaller than the tensor itself (with
int32 indices, from keep ratio 0.5 up for float32), the payload is one part carrying every
value in order, exactly what ``none`` sends, so a sparse compressor never sends more than
``none`` (values + indices at keep 1 would be twice the dense size). Wire bytes are then
``n * value_bytes + header_bytes``; :meth:`SparseCompressor.decompress_sparse` returns None
for it, so the PS adds it densely (no index arithmetic), and error feedback's residual
becomes zero.
- ``"delta"``: indices sorted ascending, replaced by their gaps (the first gap is the first
  index), and each gap written as an unsigned LEB128 varint (7 bits per byte, high bit =
  "more bytes follow") into a uint8 buffer. A gap below 128 costs 1 byte, below 16384 costs
  2, and so on. Values are permuted to match the sorted order. Measured on a real
  ResNet-50 gradient (25.6 M elements, ``benchmarks/topk.py``, ``delta_encoding_resnet50``):
  top-k indices cluster in a few layers, so gaps are small and the index stream takes
  ~1.0 byte per element at both 1 % and 0.1 % (0.25x of int32), cutting top-k's wire bytes
  by ~37 %. For uniformly spread indices (i.i.d. gradient) the gaps average 1/ratio, so
  expect ~1.3 bytes at 1 % and ~1.9 at 0.1 %. The cost is a sort of k indices at the sender
  and a prefix sum at the receiver; the saving is honest (the varint bytes are what is sent).

Layer-wise selection (DGC's recipe, Lin et al. ICLR 2018, as their code
synxlin/deep-gradient-compression does it; ``[feedback]`` ``per_layer`` and ``dense_1d``,
:meth:`SparseCompressor.select_by_layer`). By default one selection runs over the whole
chunk, so layers whose gradients are small (a conv layer next to the classifier) may send
nothing for many steps. With ``per_layer`` the selection runs on each layer piece of the
chunk (:meth:`Compressor.set_layers`) separately, ``k_for(piece_numel, ratio)`` each (at
least one element per piece), as DGC selects per parameter tensor. With ``dense_1d`` every
piece of a 1-D parameter (biases, norm scales and shifts) is sent whole, every step: DGC
sparsifies only ``param.dim() > 1``. The payload format does not change: the whole pieces
travel as (value, index) pairs like the selected ones, so they cost ``value_bytes + 4``
bytes per element on the wire, and the reported wire bytes count them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from agents.compress.base import Compressor, Payload, PayloadError, flatten, k_for

INDEX_ENCODINGS = ("int32", "delta")

# Each LEB128 byte carries 7 payload bits; 5 bytes cover every gap below 2**35.
_VARINT_MAX_BYTES = 5


def varint_encode(gaps: Tensor) -> Tensor:
    """LEB128-encode non-negative int64 ``gaps`` into a uint8 tensor (vectorised)."""
    gaps = gaps.to(torch.int64)
    if gaps.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    if int(gaps.min()) < 0:
        raise ValueError("varint_encode needs non-negative gaps (sorted unique indices)")
    nbytes = torch.ones_like(gaps)
    for j in range(1, _VARINT_MAX_BYTES):
        nbytes += (gaps >= (1 << (7 * j))).to(torch.int64)
    ends = torch.cumsum(nbytes, 0)
    starts = ends - nbytes
    out = torch.empty(int(ends[-1]), dtype=torch.uint8)
    for j in range(_VARINT_MAX_BYTES):
        sel = nbytes > j
        if not bool(sel.any()):
            break
        chunk = (gaps[sel] >> (7 * j)) & 0x7F
        more = (nbytes[sel] > j + 1).to(torch.int64) << 7
        out[starts[sel] + j] = (chunk | more).to(torch.uint8)
    return out


def varint_decode(buf: Tensor, count: int) -> Tensor:
    """Inverse of :func:`varint_encode`; raises PayloadError unless ``buf`` holds exactly
    ``count`` complete varints."""
    if buf.dtype != torch.uint8:
        raise PayloadError(f"delta indices must be uint8, got {buf.dtype}")
    if buf.numel() == 0:
        if count != 0:
            raise PayloadError(f"delta indices: empty buffer but {count} values")
        return torch.empty(0, dtype=torch.int64)
    b = buf.to(torch.int64)
    last = (b & 0x80) == 0  # final byte of each varint
    if not bool(last[-1]):
        raise PayloadError("delta indices: buffer ends inside a varint")
    n = int(last.sum())
    if n != count:
        raise PayloadError(f"delta indices: {n} indices but {count} values")
    group = torch.cumsum(last.to(torch.int64), 0) - last.to(torch.int64)
    ends = torch.nonzero(last).squeeze(1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1] + 1])
    pos = torch.arange(b.numel()) - starts[group]
    if int(pos.max()) >= _VARINT_MAX_BYTES:
        raise PayloadError(f"delta indices: a varint longer than {_VARINT_MAX_BYTES} bytes")
    gaps = torch.zeros(n, dtype=torch.int64)
    gaps.index_add_(0, group, (b & 0x7F) << (7 * pos))
    return torch.cumsum(gaps, 0)


@dataclass(frozen=True)
class LayerPlan:
    """How one key's flat tensor splits for layer-wise selection: each piece's
    ``(offset, numel)`` in flat order, whether it is sent whole (``dense_1d`` and a 1-D
    parameter), and the flat indices of the whole pieces (``whole_idx``, int64, ascending)
    and of the others (``select_idx``)."""

    pieces: tuple[tuple[int, int], ...]
    whole: tuple[bool, ...]
    whole_idx: Tensor
    select_idx: Tensor

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.pieces)

    def sent_count(self, ratio: float, per_layer: bool) -> int:
        """Elements sent at ``ratio``: every element of the whole pieces plus
        ``k_for`` of each selected piece (``per_layer``) or of all of them together."""
        if per_layer:
            return sum(n if w else k_for(n, ratio) for (_, n), w in zip(
                self.pieces, self.whole, strict=True))
        return self.whole_idx.numel() + k_for(self.select_idx.numel(), ratio)


class SparseCompressor(Compressor):
    """Base class for compressors that send a subset of elements at full precision.

    Subclasses implement :meth:`select`, returning int64 indices into the flattened tensor;
    this class builds the payload (values gathered from the tensor) and decodes it, and
    runs the selection layer by layer when :meth:`select_by_layer` asked for it."""

    sparse: ClassVar[bool] = True
    # True when select() returns about k_for(n, ratio) elements, so the dense fallback can
    # be decided before selecting; False for compressors where the ratio is only a cap.
    sends_k: ClassVar[bool] = True

    def __init__(self, index_encoding: str = "int32") -> None:
        if index_encoding not in INDEX_ENCODINGS:
            raise ValueError(f"index_encoding must be one of {INDEX_ENCODINGS}, "
                             f"got {index_encoding!r}")
        self.index_encoding = index_encoding
        self.per_layer = False
        self.dense_1d = False
        self._plans: dict[str, LayerPlan] = {}

    def select_by_layer(self, *, per_layer: bool, dense_1d: bool) -> None:
        """DGC's layer-wise selection (module docstring): ``per_layer`` selects in each layer
        piece separately, ``dense_1d`` sends the pieces of 1-D parameters whole. Takes
        effect for the keys :meth:`set_layers` describes afterwards."""
        self.per_layer = per_layer
        self.dense_1d = dense_1d

    def set_layers(self, key: str, shapes: Sequence[tuple[int, ...]],
                   param_dims: Sequence[int] | None = None) -> None:
        if not (self.per_layer or self.dense_1d):
            return
        dims = list(param_dims) if param_dims is not None else [len(s) for s in shapes]
        if len(dims) != len(shapes):
            raise ValueError(f"{self.name}: key {key!r}: {len(dims)} parameter dims for "
                             f"{len(shapes)} layer pieces")
        pieces, whole, offset = [], [], 0
        for shape, d in zip(shapes, dims, strict=True):
            n = math.prod(shape)
            pieces.append((offset, n))
            whole.append(self.dense_1d and d <= 1)
            offset += n
        ranges = [torch.arange(o, o + n) for (o, n), w in zip(pieces, whole, strict=True) if w]
        rest = [torch.arange(o, o + n) for (o, n), w in zip(pieces, whole, strict=True) if not w]
        empty = torch.empty(0, dtype=torch.int64)
        self._plans[key] = LayerPlan(tuple(pieces), tuple(whole),
                                     torch.cat(ranges) if ranges else empty,
                                     torch.cat(rest) if rest else empty)

    def whole_indices(self, key: str) -> Tensor | None:
        """Flat indices of ``key`` sent whole every step (``dense_1d``), int64; None when
        there are none. Error feedback leaves their momentum unmasked: DGC masks only the
        sparsified tensors."""
        plan = self._plans.get(key)
        if plan is None or plan.whole_idx.numel() == 0:
            return None
        return plan.whole_idx

    def select(self, flat: Tensor, ratio: float, rng: torch.Generator) -> Tensor:
        """Indices (int64, distinct) of the elements of 1-D ``flat`` to send."""
        raise NotImplementedError

    def compress(self, tensor: Tensor, key: str, ratio: float,
                 rng: torch.Generator) -> Payload:
        flat = flatten(tensor)
        if flat.numel() >= 2**31:
            raise ValueError(f"{self.name}: key {key!r} has {flat.numel()} elements; int32 "
                             "indices cover at most 2**31 - 1")
        plan = self._plans.get(key)
        if plan is not None and plan.numel != flat.numel():
            raise ValueError(f"{self.name}: key {key!r} has {flat.numel()} elements but its "
                             f"layer pieces add up to {plan.numel}")
        k = (k_for(flat.numel(), ratio) if plan is None
             else plan.sent_count(ratio, self.per_layer))
        if self.sends_k and self.index_encoding == "int32" and self._dense_is_smaller(
                k, flat.numel(), flat.element_size()):
            return self.pack_dense(flat, tuple(tensor.shape), tensor.dtype)  # skip selection
        idx = (self.select(flat, ratio, rng) if plan is None
               else self._select_layers(flat, plan, ratio, rng))
        return self.pack(idx, flat, tuple(tensor.shape), tensor.dtype)

    def _select_layers(self, flat: Tensor, plan: LayerPlan, ratio: float,
                       rng: torch.Generator) -> Tensor:
        """The whole pieces' indices, then the selection in each other piece
        (``per_layer``) or in all of them together."""
        parts = [plan.whole_idx.to(flat.device)]
        if self.per_layer:
            for (offset, n), whole in zip(plan.pieces, plan.whole, strict=True):
                if not whole and n > 0:
                    parts.append(self.select(flat[offset:offset + n], ratio, rng) + offset)
        elif plan.select_idx.numel():
            rest = plan.select_idx.to(flat.device)
            parts.append(rest[self.select(flat[rest], ratio, rng)])
        return torch.cat(parts)

    @staticmethod
    def _dense_is_smaller(k: int, n: int, value_bytes: int, index_bytes: int = 4) -> bool:
        return n > 0 and k * (value_bytes + index_bytes) >= n * value_bytes

    def pack_dense(self, flat: Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> Payload:
        """Every value, in order, as one part (see the module docstring)."""
        return Payload(self.name, (flat.contiguous().clone(),), flat.numel(), shape,
                       dtype)

    def pack(self, idx: Tensor, flat: Tensor, shape: tuple[int, ...],
             dtype: torch.dtype) -> Payload:
        """Payload carrying ``flat[idx]`` with the configured index encoding."""
        if self.index_encoding == "delta":
            idx, _ = torch.sort(idx)
            values = flat[idx].contiguous()
            gaps = torch.diff(idx, prepend=idx.new_zeros(1)) if idx.numel() else idx
            # The varint coder is a host algorithm: the delta encoding copies the k gaps
            # (not the tensor) to the host. int32 indices stay on the device.
            enc = varint_encode(gaps.cpu())
        else:
            values = flat[idx].contiguous()
            enc = idx.to(torch.int32).contiguous()
        if enc.numel() * enc.element_size() + values.numel() * values.element_size() \
                >= flat.numel() * flat.element_size() and flat.numel() > 0:
            return self.pack_dense(flat, shape, dtype)
        return Payload(self.name, (values, enc), flat.numel(), shape, dtype)

    @staticmethod
    def is_dense(payload: Payload) -> bool:
        """True for the one-part dense fallback."""
        return len(payload.tensors) == 1

    def check_parts(self, payload: Payload) -> None:
        if len(payload.tensors) not in (1, 2):
            raise PayloadError(f"{self.name}: expected 2 tensor parts (values, indices) or 1 "
                               f"(dense), got {len(payload.tensors)}")
        values = payload.tensors[0]
        if values.dtype != payload.dtype:
            raise PayloadError(f"{self.name}: values dtype {values.dtype} != tensor dtype "
                               f"{payload.dtype}")
        if self.is_dense(payload):
            if values.numel() != payload.numel:
                raise PayloadError(f"{self.name}: dense part has {values.numel()} values, "
                                   f"expected {payload.numel}")
            return
        enc = payload.tensors[1]
        if self.index_encoding == "int32":
            if enc.dtype != torch.int32:
                raise PayloadError(f"{self.name}: indices must be int32, got {enc.dtype}")
            if enc.numel() != values.numel():
                raise PayloadError(f"{self.name}: {enc.numel()} indices but "
                                   f"{values.numel()} values")
        elif enc.dtype != torch.uint8:
            raise PayloadError(f"{self.name}: delta indices must be uint8, got {enc.dtype}")

    def decompress_sparse(self, payload: Payload) -> tuple[Tensor, Tensor] | None:
        """None for the dense fallback (the caller adds :meth:`decompress` densely)."""
        if self.is_dense(payload):
            return None
        values, enc = payload.tensors
        if self.index_encoding == "delta":
            idx = varint_decode(enc, values.numel())
        else:
            # As received: index_add_ and indexing take int32, and widening 250 k indices
            # per payload to int64 cost the PS a copy per worker (benchmarks/ps_aggregate.py).
            idx = enc
        return idx, values

    def decompress(self, payload: Payload) -> Tensor:
        sparse = self.decompress_sparse(payload)
        if sparse is None:
            return payload.tensors[0].reshape(payload.shape)
        idx, values = sparse
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= payload.numel):
            raise PayloadError(f"{self.name}: index out of range [0, {payload.numel})")
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
        out[idx.to(values.device)] = values.to(payload.dtype)
        return out.reshape(payload.shape)


# Elements per chunk when scanning a CPU tensor against a threshold: 1 Mi floats (4 MiB) keep
# the |x| scratch in L2, which made the scan ~1.6x faster than whole-tensor ops on the 2-core
# test machine (25 M floats: ~24 ms vs ~41 ms).
SCAN_CHUNK = 1 << 20


def indices_above(flat: Tensor, threshold: float, *, strict: bool = False) -> Tensor:
    """int64 indices ``i`` with ``|flat[i]| >= threshold`` (``>`` if ``strict``), ascending."""
    if flat.device.type != "cpu" or flat.numel() <= SCAN_CHUNK:
        a = flat.abs()
        return torch.nonzero(a > threshold if strict else a >= threshold).squeeze(1)
    n = flat.numel()
    scratch = torch.empty(SCAN_CHUNK, dtype=flat.dtype)
    mask = torch.empty(SCAN_CHUNK, dtype=torch.bool)
    cmp = torch.gt if strict else torch.ge
    outs = []
    for start in range(0, n, SCAN_CHUNK):
        end = min(n, start + SCAN_CHUNK)
        m = cmp(torch.abs(flat[start:end], out=scratch[: end - start]), threshold,
                out=mask[: end - start])
        outs.append(torch.nonzero(m).squeeze(1).add_(start))
    return torch.cat(outs)


def largest_of(flat: Tensor, candidates: Tensor, k: int) -> Tensor:
    """The ``k`` candidates with the largest ``|flat|`` (all of them if there are <= k)."""
    if candidates.numel() <= k:
        return candidates
    top = torch.topk(flat[candidates].abs(), k, sorted=False).indices
    return candidates[top]
