"""gradbed's compressors as DDP communication hooks (``register_comm_hook``).

``ddp.register_comm_hook(*gradbed.ddp.hook("topk", ratio=0.01))``: each bucket's flat
gradient goes through the registered compressor of :mod:`agents.compress` and its error
feedback (:class:`agents.compress.builder.Sender`, the PS path's sender: GRACE's split,
Xu et al. ICDCS 2021), then over a collective, and comes back as the mean of what every
rank sent. Contract, as PowerSGD's ``Aggregator`` states its own: the bucket is overwritten
with that mean, and with error feedback the rank keeps ``residual = (grad + old residual) -
sent`` per bucket index, added to the bucket's next gradient.

- ``fp16`` sends a half-precision payload, which sums on the wire: an ``all_reduce``.
- ``topk``, ``randomk``, ``qsgd`` and ``signsgd`` payloads differ from rank to rank (other
  indices, other scales), so every rank's payload travels through one ``all_gather`` (its
  parts as bytes: values then int32 indices for the sparse ones) and each rank decodes and
  averages them all. Every rank uses the same ratio, so every payload has the same size.
  A top-k or random-k keep of half the elements or more sends the bucket dense (as on the
  PS path), and that is all-reduced.
- ``allreduce`` is DDP's own dense mean, recorded like the others (what
  :func:`gradbed.ddp.instrument` registers when no hook is).

Like torch's PowerSGD (``start_powerSGD_iter`` >= 2) the first ``start_iter`` iterations
(default 2) run a plain dense all_reduce: DDP rebuilds its buckets after the first
iteration, so a residual keyed by bucket index before that would meet another bucket's
gradient. The compressor's ratio is fixed (``ratio``) or chosen every iteration by the
adaptive policy (:mod:`gradbed.ddp.adaptive`).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from agents.compress.base import Payload
from agents.compress.builder import CompressionSpec, Sender
from agents.core.events import now_ns
from gradbed.ddp.adaptive import AdaptiveKeep, bucket_ratio
from gradbed.ddp.record import BucketRecord, Listeners
from gradbed.ddp.wire import sent_bytes

# The compressors a hook can use, with the collective their payloads travel by. A
# compressor whose payload size depends on the data (threshold, dgc) would give the ranks
# unequal all_gather shapes, so it is not offered.
COLLECTIVE = {"allreduce": "allreduce", "none": "allreduce", "fp16": "allreduce",
              "topk": "allgather", "randomk": "allgather", "qsgd": "allgather",
              "signsgd": "allgather"}


@dataclass(frozen=True)
class HookConfig:
    """How a compression hook runs (``gradbed.ddp.hook``'s arguments)."""

    name: str                       # a key of COLLECTIVE
    ratio: float = 0.01             # kept fraction (topk, randomk); lower: fewer bytes, more residual
    error_feedback: bool = True     # keep what was not sent, add it to the next gradient
    start_iter: int = 2             # dense all_reduce before this iteration (bucket rebuild)
    seed: int = 0                   # randomk's and qsgd's generator: seed x 7919 + rank


class CompressState:
    """One rank's hook state: the sender (compressor, error feedback, generator), the
    iteration count, the keep source and the listeners of every :class:`BucketRecord`."""

    def __init__(self, config: HookConfig, group: dist.ProcessGroup | None = None,
                 adaptive: AdaptiveKeep | None = None) -> None:
        if config.name not in COLLECTIVE:
            raise ValueError(f"gradbed.ddp.hook: unknown name {config.name!r}; allowed "
                             f"{sorted([*COLLECTIVE, 'powersgd'])}")
        if not 0.0 < config.ratio <= 1.0:
            raise ValueError(f"gradbed.ddp.hook: ratio must be in (0, 1], got {config.ratio!r}")
        if config.start_iter < 2:
            raise ValueError(f"gradbed.ddp.hook: start_iter must be >= 2 (DDP rebuilds its "
                             f"buckets after iteration 1), got {config.start_iter}")
        self.config = config
        self.group = group
        self.collective = COLLECTIVE[config.name]
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.sender = None if self.collective == "allreduce" and config.name != "fp16" else \
            Sender(CompressionSpec(name=config.name, error_feedback=config.error_feedback),
                   config.seed, rank)
        self.adaptive = adaptive
        self.listeners = Listeners()
        if adaptive is not None:
            self.listeners.add(adaptive.record)
        self.iteration = 0
        self._world: int | None = None

    @property
    def world(self) -> int:
        """The group's size, asked once: asking the process group from the callbacks, on
        gloo's threads, made every iteration of a 2-rank ResNet about 40 % slower."""
        if self._world is None:
            self._world = dist.get_world_size(self.group)
        return self._world

    def keep_for(self, iteration: int, bucket: int, size_bytes: int, value_bytes: int
                 ) -> float:
        """The compressor ratio for ``bucket`` in ``iteration`` (fixed, or adaptive)."""
        if self.adaptive is None:
            return self.config.ratio
        d = self.adaptive.decide(iteration, bucket, size_bytes)
        return bucket_ratio(d.keep, value_bytes, self.adaptive.config.keep_min, self.world)


def compress_hook(state: CompressState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """The hook ``register_comm_hook`` calls for every bucket (module docstring)."""
    buf = bucket.buffer()
    index = bucket.index()
    start = now_ns()
    iteration = state.iteration
    state.world  # noqa: B018  (asked here, on DDP's thread, never from gloo's)
    if bucket.is_last():
        state.iteration += 1
    if state.sender is None or iteration < state.config.start_iter:
        return _dense(state, buf, index, iteration, start)
    keep = state.keep_for(iteration, index, buf.numel() * buf.element_size(),
                          buf.element_size())
    payload, _ = state.sender.compress(buf, f"bucket{index}", keep)
    # A sparse compressor's dense fallback (keep >= 1/2 of the elements) is the bucket
    # itself, which sums on the wire: all_reduce moves 2 (N-1)/N of it, all_gather N-1.
    if state.collective == "allreduce" or _dense_fallback(payload):
        return _summed(state, buf, payload, index, iteration, start, keep)
    return _gathered(state, buf, payload, index, iteration, start, keep)


def _finish(state: CompressState, iteration: int, index: int, collective: str, raw: int,
            payload_bytes: int, keep: float, start: int, launched: int) -> None:
    state.listeners.emit(BucketRecord(
        iteration, index, state.config.name, collective, raw, payload_bytes,
        sent_bytes(collective, payload_bytes, state.world), keep, start, launched, now_ns()))


def _dense(state: CompressState, buf: Tensor, index: int, iteration: int, start: int
           ) -> torch.futures.Future[Tensor]:
    """DDP's own mean: ``buf / N`` summed over the ranks."""
    world = state.world
    buf.div_(world)
    launched = now_ns()
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    raw = buf.numel() * buf.element_size()

    def done(f: torch.futures.Future[list[Tensor]]) -> Tensor:
        out = f.value()[0]
        _finish(state, iteration, index, "allreduce", raw, raw, 1.0, start, launched)
        return out

    return fut.then(done)


def _summed(state: CompressState, buf: Tensor, payload: Payload, index: int, iteration: int,
            start: int, keep: float) -> torch.futures.Future[Tensor]:
    """A payload that sums on the wire (fp16): all_reduce it, decode the sum, divide."""
    assert state.sender is not None
    part = payload.tensors[0].contiguous()
    launched = now_ns()
    fut = dist.all_reduce(part, group=state.group, async_op=True).get_future()
    compressor = state.sender.compressor

    def done(f: torch.futures.Future[list[Tensor]]) -> Tensor:
        total = Payload(payload.compressor, (f.value()[0],), payload.numel, payload.shape,
                        payload.dtype)
        buf.copy_(compressor.decompress(total).reshape(-1)).div_(state.world)
        _finish(state, iteration, index, "allreduce", buf.numel() * buf.element_size(),
                payload.buffer_bytes(), keep, start, launched)
        return buf

    return fut.then(done)


def _dense_fallback(payload: Payload) -> bool:
    """True for a sparse compressor's one-part payload of every value, in order."""
    (first, *rest) = payload.tensors
    return not rest and first.dtype == payload.dtype and first.numel() == payload.numel \
        and payload.compressor in ("topk", "randomk")


def pack(payload: Payload) -> Tensor:
    """The payload's parts, in order, as one uint8 tensor (what all_gather carries)."""
    return torch.cat([t.contiguous().view(torch.uint8) for t in payload.tensors])


def unpack(flat: Tensor, like: Payload) -> tuple[Tensor, ...]:
    """The parts of a peer's :func:`pack`, cut and typed as ``like``'s parts."""
    parts, offset = [], 0
    for t in like.tensors:
        n = t.numel() * t.element_size()
        parts.append(flat[offset:offset + n].clone().view(t.dtype))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"all_gather: a peer's payload has {flat.numel()} bytes, this "
                         f"rank's {offset}: the ranks disagree on the ratio")
    return tuple(parts)


def _gathered(state: CompressState, buf: Tensor, payload: Payload, index: int,
              iteration: int, start: int, keep: float) -> torch.futures.Future[Tensor]:
    """Every rank's payload through one all_gather; the bucket becomes their decoded mean."""
    assert state.sender is not None
    mine = pack(payload)
    world = state.world
    outs = [torch.empty_like(mine) for _ in range(world)]
    launched = now_ns()
    fut = dist.all_gather(outs, mine, group=state.group, async_op=True).get_future()
    compressor = state.sender.compressor

    def done(f: torch.futures.Future[list[list[Tensor]]]) -> Tensor:
        total = torch.zeros(payload.numel, dtype=buf.dtype, device=buf.device)
        for flat in outs:
            p = compressor.from_parts(unpack(flat, payload), payload.numel, payload.shape,
                                      payload.dtype)
            sparse = compressor.decompress_sparse(p)
            if sparse is None:
                total += compressor.decompress(p).reshape(-1)
            else:
                idx, values = sparse
                total.index_add_(0, idx.to(torch.int64), values.to(total.dtype))
        buf.copy_(total.div_(world))
        _finish(state, iteration, index, "allgather", buf.numel() * buf.element_size(),
                payload.buffer_bytes(), keep, start, launched)
        return buf

    return fut.then(done)
