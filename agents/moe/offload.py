"""Parameter offload into a device budget, evicting by Belady's rule or by LRU (seeds/002).

Parameters live in host memory. A parameter that is about to be used moves into the
device, which holds at most ``budget_bytes``; when it is full, a resident parameter is
evicted. Which one:

- ``belady`` (Belady, 1966, "A study of replacement algorithms for a virtual-storage
  computer", IBM Systems Journal 5(2)): the one whose next use lies furthest in the
  future. A training step uses parameters in the same order every step, so the order is
  recorded on the first step and predicts every later one; a parameter the recorded
  order never uses again is furthest of all. The first step, with nothing recorded yet,
  evicts by LRU.
- ``lru``: the one used least recently (the baseline Belady is measured against).

With equal sizes, Belady's rule gives the fewest transfers possible for a known trace;
with unequal sizes it is the classic heuristic (exact optimum is NP-hard), so the
comparison with LRU is measured, not assumed. A transfer is one host-to-device copy of
one parameter (``bytes_moved`` adds its size). Eviction copies nothing back: the host
copy is the master that the optimizer updates, so a device copy is only ever read.

:func:`simulate` replays a trace by the rule alone (pure, for tests and benchmarks).
:class:`Offloader` does it for real: on CUDA it keeps the host copies in pinned memory
and copies with ``non_blocking`` on a side stream, checks the budget against the bytes
it holds, and frees an evicted copy; on the CPU (no GPU on the development machine) the
"device" copy is a CPU clone and the budget is a count of bytes, so the same decisions
and the same transfer counts come out, but no memory hierarchy is exercised.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

POLICIES = ("belady", "lru")
NEVER = float("inf")


@dataclass
class OffloadStats:
    """``transfers``: host-to-device copies; ``bytes_moved``: their total size;
    ``hits``: uses that found the parameter resident; ``evictions``."""

    transfers: int = 0
    bytes_moved: int = 0
    hits: int = 0
    evictions: int = 0


@dataclass
class NextUse:
    """Predicts the next use of a parameter from a recorded step order.

    ``next_after(name, i)`` = the position, in uses counted from the start of the
    current step, of ``name``'s next use after position ``i``: its next occurrence in
    the recorded order after ``i``, else its first occurrence plus the step length
    (the next step), else NEVER.
    """

    order: Sequence[Hashable]
    _where: dict[Hashable, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, name in enumerate(self.order):
            self._where.setdefault(name, []).append(i)

    def next_after(self, name: Hashable, i: int) -> float:
        pos = self._where.get(name)
        if not pos:
            return NEVER
        j = bisect.bisect_right(pos, i)
        return float(pos[j]) if j < len(pos) else float(pos[0] + len(self.order))


class Policy:
    """The eviction decision alone, sans I/O: which names are resident, which to evict."""

    def __init__(self, policy: str, budget_bytes: int, sizes: Mapping[Hashable, int], *,
                 order: Sequence[Hashable] | None = None) -> None:
        """``order``: a step's order known in advance (else the first step records it)."""
        if policy not in POLICIES:
            raise ValueError(f"offload policy: {policy!r} must be one of {', '.join(POLICIES)}")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes: {budget_bytes} must be > 0")
        too_big = [n for n, s in sizes.items() if s > budget_bytes]
        if too_big:
            raise ValueError(f"budget_bytes: {budget_bytes} cannot hold {too_big[0]!r} "
                             f"({sizes[too_big[0]]} bytes)")
        self.policy = policy
        self.budget_bytes = budget_bytes
        self.sizes = dict(sizes)
        self.resident: OrderedDict[Hashable, None] = OrderedDict()  # LRU order, oldest first
        self.used_bytes = 0
        self.recorded: list[Hashable] = []
        self.predict: NextUse | None = None if order is None else NextUse(list(order))
        self.step = -1
        self.pos = 0
        self.stats = OffloadStats()

    def begin_step(self) -> None:
        """Call before each step's first use. The first step's uses become the order."""
        if self.step == 0 and self.predict is None:
            self.predict = NextUse(list(self.recorded))
        self.step += 1
        self.pos = 0

    def use(self, name: Hashable) -> tuple[bool, list[Hashable]]:
        """Record one use. Returns (needs a transfer, names to evict first)."""
        if self.step < 0:
            raise RuntimeError("Policy.use before begin_step")
        if name not in self.sizes:
            raise KeyError(f"offload: unknown parameter {name!r}")
        if self.step == 0:
            self.recorded.append(name)
        i = self.pos
        self.pos += 1
        if name in self.resident:
            self.resident.move_to_end(name)
            self.stats.hits += 1
            return False, []
        evict: list[Hashable] = []
        while self.used_bytes + self.sizes[name] > self.budget_bytes:
            victim = self._victim(i)
            del self.resident[victim]
            self.used_bytes -= self.sizes[victim]
            evict.append(victim)
        self.resident[name] = None
        self.used_bytes += self.sizes[name]
        self.stats.transfers += 1
        self.stats.bytes_moved += self.sizes[name]
        self.stats.evictions += len(evict)
        return True, evict

    def invalidate(self, name: Hashable) -> None:
        """The master copy changed (the optimizer stepped): a resident copy is stale and
        leaves the device; the next use transfers again (and is counted)."""
        if name in self.resident:
            del self.resident[name]
            self.used_bytes -= self.sizes[name]

    def _victim(self, i: int) -> Hashable:
        if self.policy == "lru" or self.predict is None:
            return next(iter(self.resident))
        predict = self.predict
        # Furthest next use; among equals (e.g. several never used again) the LRU one.
        return max(self.resident, key=lambda n: predict.next_after(n, i))


def simulate(steps: Sequence[Sequence[Hashable]], sizes: Mapping[Hashable, int],
             budget_bytes: int, policy: str, *,
             order: Sequence[Hashable] | None = None,
             invalidate_each_step: bool = False) -> OffloadStats:
    """Replay ``steps`` (each a step's uses, in order) through :class:`Policy`.
    ``invalidate_each_step``: every parameter's master changes between steps (training:
    the optimizer updates them), so nothing resident survives into the next step."""
    p = Policy(policy, budget_bytes, sizes, order=order)
    for uses in steps:
        if invalidate_each_step:
            for name in sizes:
                p.invalidate(name)
        p.begin_step()
        for name in uses:
            p.use(name)
    return p.stats


class Offloader:
    """Real offload of named host tensors into a device budget.

    ``fetch(name)`` returns the device copy, transferring (and evicting) as the policy
    says. On CUDA the host tensors are pinned and copies go on a side stream that the
    current stream waits on before the copy is used; an evicted copy is dropped so the
    caching allocator can reuse its block. ``device_bytes`` is what this object holds
    on the device, never more than ``budget_bytes``.
    """

    def __init__(self, host: Mapping[Hashable, torch.Tensor], budget_bytes: int,
                 policy: str, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise RuntimeError("offload: device cuda requested but CUDA is not available")
        # A tensor already pinned stays the same storage (the caller's master, which its
        # optimizer updates in place); pinning anything else makes a pinned copy.
        self.host = {n: (t.detach() if not self.cuda or t.is_pinned()
                         else t.detach().pin_memory()) for n, t in host.items()}
        sizes = {n: t.numel() * t.element_size() for n, t in self.host.items()}
        self.policy = Policy(policy, budget_bytes, sizes)
        self.on_device: dict[Hashable, torch.Tensor] = {}
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    @property
    def stats(self) -> OffloadStats:
        return self.policy.stats

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.on_device.values())

    def begin_step(self) -> None:
        self.policy.begin_step()

    def fetch(self, name: Hashable) -> torch.Tensor:
        transfer, evict = self.policy.use(name)
        for victim in evict:
            del self.on_device[victim]
        if transfer:
            src = self.host[name]
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    dst = src.to(self.device, non_blocking=True)
                torch.cuda.current_stream(self.device).wait_stream(self._stream)
                dst.record_stream(torch.cuda.current_stream(self.device))
            else:
                dst = src.clone()
            self.on_device[name] = dst
        assert self.device_bytes <= self.policy.budget_bytes
        return self.on_device[name]

    def update_host(self, name: Hashable, value: torch.Tensor) -> None:
        """The optimizer changed the master copy: write it and drop a stale device copy
        (the next fetch transfers it again, and is counted)."""
        self.host[name].copy_(value)
        self.invalidate(name)

    def invalidate(self, name: Hashable) -> None:
        """The master copy was changed in place: drop a stale device copy."""
        self.on_device.pop(name, None)
        self.policy.invalidate(name)
