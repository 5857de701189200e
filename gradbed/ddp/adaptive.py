"""Seed 004's adaptive keep ratio for DDP (DESIGN.md 1.1): one k per bucket per iteration,
the same on every rank.

The ratio comes from :class:`agents.core.policies.AdaptiveRatio`, the PS path's policy,
fed with a planned rate ``r0`` (the access link's TCP payload ceiling) and one measured rate
per iteration: the bytes this rank sent in the previous iteration's collectives
(:func:`gradbed.ddp.wire.sent_bytes`) over the time from the first launch to the last
result. A ring moves every rank's data over every link, so its pace is the slowest link's;
before the first bucket of each iteration the ranks take the minimum of their rates with a
one-element ``all_reduce(MIN)``, and every rank hands the policy the same number. The same
number gives the same keep, the same ``k_for`` and so the same payload shapes: no
all_gather ever sees unequal sizes.

The policy's keep is a byte budget (``adaptive.budget = "bytes"``): a sparse element costs
its value and its int32 index, so the compressor gets ``keep x 4 / (4 + 4)`` of the
elements, and a keep of 1 sends the bucket dense, as the PS path's worker does. On a ring
the bucket also goes dense from the sparse break-even on (:func:`bucket_ratio`): past 1/N
of the elements, values and indices gathered from every rank outweigh the dense
all_reduce.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.distributed as dist

from agents.core.config import AdaptiveConfig
from agents.core.events import now_ns
from agents.core.policies import AdaptiveRatio, Decision
from gradbed.ddp.record import BucketRecord
from gradbed.ddp.wire import sparse_breakeven_ratio

# The DDP defaults: a rate sample per iteration (rate_source "upload", carried across
# iterations with a fixed planned r0), and a wide stability band, since one sample per
# iteration on a shared machine moves by more than the PS path's 10 %.
DDP_ADAPTIVE = AdaptiveConfig(policy="adaptive", r0="planned", carry_rt=True,
                              rate_source="upload", eps=0.5, min_samples=2)


def element_ratio(keep: float, value_bytes: int, keep_min: float) -> float:
    """The compressor ratio that spends ``keep`` of the dense bytes (module docstring)."""
    if keep >= 1.0:
        return 1.0
    return max(keep_min, keep * value_bytes / (value_bytes + 4))


def bucket_ratio(keep: float, value_bytes: int, keep_min: float, world: int) -> float:
    """The compressor ratio for a bucket the policy gave ``keep``: :func:`element_ratio`,
    or 1.0 (the compressor's dense fallback, summed by all_reduce) from the ring's
    break-even on. The policy budgets the bytes as if the payload crossed the link once;
    all_gather carries each rank's sparse payload N - 1 times, so above
    :func:`gradbed.ddp.wire.sparse_breakeven_ratio` (1/N for float32) the dense bucket
    costs less."""
    ratio = element_ratio(keep, value_bytes, keep_min)
    return 1.0 if ratio >= sparse_breakeven_ratio(world, value_bytes) else ratio


class AdaptiveKeep:
    """Per bucket, the keep of :class:`AdaptiveRatio`; per iteration, the agreed rate.

    :meth:`record` takes every bucket's record (from gloo's threads);
    :meth:`decide` is called by the hook for each bucket, and for the iteration's first
    bucket it runs the agreement (a blocking one-element all_reduce on ``group``)."""

    def __init__(self, planned_bps: float, group: dist.ProcessGroup | None = None,
                 config: AdaptiveConfig = DDP_ADAPTIVE) -> None:
        if not planned_bps > 0:
            raise ValueError(f"adaptive: the planned rate must be > 0 bit/s, got "
                             f"{planned_bps!r} (planned_mbps=, or GRADBED_LINK_MBPS in a "
                             "gradbed run)")
        self.planned_bps = float(planned_bps)
        self.group = group
        self.config = config
        self.agreed_bps: float | None = None   # the rate every rank used this iteration
        self._policies: dict[int, AdaptiveRatio] = {}
        self._iteration = -1
        self._lock = threading.Lock()
        self._span: dict[int, tuple[float, int, int]] = {}  # iter -> (bytes, first, last)

    def record(self, rec: BucketRecord) -> None:
        """Count one bucket's bytes and times toward its iteration's rate."""
        with self._lock:
            b, first, last = self._span.get(rec.iteration, (0.0, rec.launched_ns, rec.end_ns))
            self._span[rec.iteration] = (b + rec.wire_bytes, min(first, rec.launched_ns),
                                         max(last, rec.end_ns))

    def measured_bps(self, iteration: int) -> float | None:
        """This rank's rate in ``iteration``: 8 x bytes sent / (last end - first launch)."""
        with self._lock:
            span = self._span.get(iteration)
        if span is None or span[2] <= span[1] or span[0] <= 0:
            return None
        return 8e9 * span[0] / (span[2] - span[1])

    def decide(self, iteration: int, bucket: int, size_bytes: int) -> Decision:
        """The keep (a byte budget) for ``bucket`` in ``iteration``."""
        if iteration != self._iteration:
            self._iteration = iteration
            self.agreed_bps = self._agree(self.measured_bps(iteration - 1))
            with self._lock:
                self._span = {i: s for i, s in self._span.items() if i >= iteration - 1}
        policy = self._policies.get(bucket)
        if policy is None:
            policy = self._policies[bucket] = AdaptiveRatio(self.config)
        ts = now_ns()
        policy.start(size_bytes, self.planned_bps, ts)
        if self.agreed_bps is not None:
            policy.observe(self.agreed_bps, ts)
        return policy.keep_for_next_chunk(0)

    def _agree(self, mine_bps: float | None) -> float | None:
        """The minimum of every rank's rate (a rank without one offers +inf); None when no
        rank has one."""
        t = torch.tensor([math.inf if mine_bps is None else mine_bps], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        agreed = float(t.item())
        return None if math.isinf(agreed) else agreed
