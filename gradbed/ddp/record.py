"""What a gradbed hook did with one bucket in one iteration: the row the instrumentation
turns into a ``ddp_bucket`` event, and the listeners that receive it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketRecord:
    """One bucket of one iteration. Times are CLOCK_MONOTONIC (the run's shared clock)."""

    iteration: int
    bucket: int              # DDP's bucket index (GradBucket.index())
    hook: str                # the hook's name (topk, fp16, powersgd, allreduce, ...)
    collective: str          # allreduce or allgather (gradbed.ddp.wire)
    raw_bytes: int           # the bucket's dense gradient
    payload_bytes: int       # the compressed tensor buffers this rank contributes
    wire_bytes: float        # bytes this rank sends for it (gradbed.ddp.wire.sent_bytes)
    keep: float              # the ratio the compressor was given (1.0: dense)
    start_ns: int            # the hook was called (the bucket's gradients are ready)
    launched_ns: int         # compression done, the collective launched
    end_ns: int              # the collective's result is decoded into the bucket

    @property
    def compress_s(self) -> float:
        """Time in the hook before the collective was launched (compression, and under the
        adaptive policy the one-element agreement)."""
        return (self.launched_ns - self.start_ns) / 1e9

    @property
    def comm_s(self) -> float:
        """From the collective's launch to the bucket's decoded mean."""
        return (self.end_ns - self.launched_ns) / 1e9


Listener = Callable[[BucketRecord], None]


class Listeners:
    """Who hears each :class:`BucketRecord` (the instrumentation, the adaptive policy's
    rate measurement). Records arrive from gloo's threads, hence the lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fns: list[Listener] = []

    def add(self, fn: Listener) -> None:
        with self._lock:
            self._fns.append(fn)

    def emit(self, rec: BucketRecord) -> None:
        with self._lock:
            fns = list(self._fns)
        for fn in fns:
            fn(rec)
