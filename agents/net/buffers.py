"""Receive buffers that are used again: flat CPU tensors a payload lands in, by size.

A fresh ``torch.empty`` of a few megabytes is mapped fresh by the allocator, and the
kernel then faults in and zeroes every page on first touch, which is the receive itself:
on this 2-core machine a new 4 MB tensor filled once cost 3-16 ms against 0.6-2.8 ms for
one already touched (``docs/linerate.md``). A PS receiving 125 MB/s of dense gradient
chunks at 1 Gbit/s paid that on every message. A :class:`ReceivePool` hands out tensors
that were received into before and given back by their owner once their contents are
consumed (added to the accumulator), so the pages stay mapped.

The contract is the owner's: give a tensor back only when nothing refers to its contents
any more. A tensor the owner keeps is simply never given back, and the pool allocates a
new one in its place: forgetting to give back costs speed, never correctness.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where a buffer is made: agents.net.wire is the controller's too
    import torch


class ReceivePool:
    """Free flat CPU tensors by ``(dtype, numel)``, at most ``max_free`` of each size.

    Not thread-safe: one receiving thread takes and gives (the PS's event loop)."""

    def __init__(self, max_free: int = 16) -> None:
        if max_free < 1:
            raise ValueError(f"ReceivePool max_free: {max_free}, must be >= 1")
        self.max_free = max_free
        self._free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.reused = 0  # takes served from the free lists
        self.allocated = 0  # takes that allocated a new tensor

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat tensor of ``numel`` elements of ``dtype``, contents undefined."""
        free = self._free.get((dtype, numel))
        if free:
            self.reused += 1
            return free.pop()
        import torch

        self.allocated += 1
        return torch.empty(numel, dtype=dtype)

    def give(self, tensors: Iterable[torch.Tensor]) -> None:
        """Hand back tensors from :meth:`take` whose contents are no longer needed. Only a
        whole flat CPU tensor that owns its storage is kept (a view is ignored: its base
        may still be in use)."""
        for t in tensors:
            if (t.device.type != "cpu" or t.dim() != 1 or t._base is not None
                    or t.storage_offset() != 0
                    or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
                continue
            free = self._free.setdefault((t.dtype, t.numel()), [])
            if len(free) < self.max_free and all(f is not t for f in free):
                free.append(t)
