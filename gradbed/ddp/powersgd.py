"""torch's own PowerSGD (Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization", NeurIPS 2019) as a gradbed hook: ``PowerSGDState`` and
``powerSGD_hook`` unchanged, wrapped so that every bucket is recorded like gradbed's own
hooks (:class:`gradbed.ddp.record.BucketRecord`).

The payload of a bucket is what ``compression_stats()`` counts for it: the P and Q factors
of the matrices it compresses plus the tensors it sends whole (vectors, and matrices where
a rank-r factorisation would not pay), all through all_reduce, so its wire bytes are
``2 (N - 1) / N x 4 x numel_after`` (:mod:`gradbed.ddp.wire`).
"""

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)

from agents.core.events import now_ns
from gradbed.ddp.record import BucketRecord, Listeners
from gradbed.ddp.wire import sent_bytes


class PowerSGDHookState:
    """torch's ``PowerSGDState`` (as :attr:`torch_state`) and gradbed's listeners."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, start_iter: int,
                 error_feedback: bool, seed: int) -> None:
        if start_iter < 2:
            raise ValueError(f"gradbed.ddp.hook('powersgd'): start_iter must be >= 2, got "
                             f"{start_iter}")
        if rank < 1:
            raise ValueError(f"gradbed.ddp.hook('powersgd'): rank must be >= 1, got {rank}")
        self.group = group
        self.torch_state = PowerSGDState(
            process_group=group, matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter, use_error_feedback=error_feedback,
            warm_start=True, random_seed=seed)
        self.listeners = Listeners()

    def compression_stats(self) -> tuple[float, int, int]:
        """torch's ``(compress_rate, numel_before, numel_after)`` so far."""
        rate, before, after = self.torch_state.compression_stats()
        return float(rate), int(before), int(after)


def powersgd_hook(state: PowerSGDHookState, bucket: dist.GradBucket
                  ) -> torch.futures.Future[Tensor]:
    """torch's ``powerSGD_hook`` on ``bucket``, recorded when its result is ready."""
    ts = state.torch_state
    iteration, index = ts.iter, bucket.index()
    buf = bucket.buffer()
    raw = buf.numel() * buf.element_size()
    after0 = ts.total_numel_after_compression
    start = now_ns()
    fut = powerSGD_hook(ts, bucket)
    launched = now_ns()
    # torch's hook waits for its next all_reduce inside a callback, which gloo runs on one
    # of its two worker threads: with two buckets in flight both threads wait and nothing
    # runs the collectives they wait for (a deadlock seen with 4 buckets). Finishing each
    # bucket before DDP launches the next leaves a thread free for them.
    fut.wait()
    after = ts.total_numel_after_compression - after0
    payload = after * buf.element_size() if after else raw  # vanilla allreduce before start
    world = dist.get_world_size(state.group)

    def done(f: torch.futures.Future[Tensor]) -> Tensor:
        out = f.value()
        state.listeners.emit(BucketRecord(
            iteration, index, "powersgd", "allreduce", raw, payload,
            sent_bytes("allreduce", payload, world), payload / raw, start, launched,
            now_ns()))
        return out

    return fut.then(done)
