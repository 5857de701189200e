"""Expert offload in the training loop: a host's experts live in host memory and move
into a device budget when a forward or a backward uses them (seeds/002).

ZeRO-Offload/ZeRO-Infinity's idea (Ren et al., 2021, arXiv:2101.06840; Rajbhandari et
al., 2021, arXiv:2104.07857) applied to one expert host's experts, with the eviction
chosen by :mod:`agents.moe.offload` (Belady's rule on the first step's recorded order,
or LRU). Each expert's four tensors become views of one flat host buffer (pinned on
CUDA): the *master*, which the optimizer updates in place. An expert is one unit of the
policy (its size: the buffer's bytes).

A use is one fetch of an expert's buffer into the device:

- forward: the expert runs on its rows with the device copy, under ``no_grad``; only the
  input rows are kept for the backward (nothing of the device copy is, so an evicted
  copy is really gone);
- backward: the expert is fetched again, its forward recomputed on the device copy and
  differentiated there (activation recomputation, as the checkpointed layers of
  ZeRO-Infinity do); the parameter gradients are copied to the master's ``grad`` and
  the input gradient returned.

So a step uses the host's experts in forward order, then in backward order, which is
the order :meth:`agents.moe.hosts.StepLog.use_trace` logs. An expert that got no row
computes nothing and is not used. After the optimizer step every master has changed:
:meth:`ExpertOffload.end_step` drops every device copy, so each step starts with an
empty device and the first use of each expert is a transfer.

Counted per step (:class:`OffloadStepStats`): host-to-device ``transfers`` and
``bytes_moved``, ``hits`` (uses that found the copy resident), ``evictions``,
``grad_bytes`` (device-to-host gradient bytes, one expert buffer's worth per backward
use) and the peak of device bytes held. The recomputed forward gives bit-for-bit the
gradients of the plain expert (same operations on the same values), so training with
offload gives the weights of training without it.

On the CPU the device copy is a clone and the budget is counted; on CUDA the copies are
real (``Offloader``'s pinned memory and side stream) -- written, not run on this
project's machines (no GPU).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agents.moe.layer import Expert
from agents.moe.offload import Offloader, OffloadStats

Key = tuple[int, int]  # (MoE layer, expert index)


def expert_math(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                b2: torch.Tensor) -> torch.Tensor:
    """:class:`agents.moe.layer.Expert`'s forward on explicit tensors (same operations)."""
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2)


@dataclass(frozen=True)
class OffloadStepStats:
    """One step's offload counters on one host (the ``moe_offload`` event)."""

    uses: int
    transfers: int
    bytes_moved: int
    hits: int
    evictions: int
    grad_bytes: int
    peak_device_bytes: int

    def as_event(self) -> dict[str, Any]:
        return asdict(self)


class _OffloadedExpert(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hook: ExpertHook, x: torch.Tensor) -> torch.Tensor:
        ctx.hook = hook
        ctx.save_for_backward(x)
        return hook.owner.run_forward(hook.key, x)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        hook: ExpertHook = ctx.hook
        return None, hook.owner.run_backward(hook.key, x, gy)


@dataclass(frozen=True)
class ExpertHook:
    """Set as an :class:`~agents.moe.layer.Expert`'s ``offload``: its forward goes here."""

    owner: ExpertOffload
    key: Key

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = _OffloadedExpert.apply(self, x)
        assert isinstance(out, torch.Tensor)
        return out


class ExpertOffload:
    """The experts of one host behind one :class:`~agents.moe.offload.Offloader`."""

    def __init__(self, experts: Mapping[Key, Expert], budget_bytes: int, policy: str,
                 device: str = "cpu") -> None:
        cuda = torch.device(device).type == "cuda"
        self.params: dict[Key, list[nn.Parameter]] = {}
        self.shapes: dict[Key, list[tuple[torch.Size, int, int]]] = {}
        self.out_width: dict[Key, int] = {}
        host: dict[Hashable, torch.Tensor] = {}
        for key, ex in experts.items():
            ps = list(ex.parameters())
            flat = torch.empty(sum(p.numel() for p in ps), dtype=torch.float32)
            if cuda:
                flat = flat.pin_memory()
            off, shapes = 0, []
            for p in ps:
                n = p.numel()
                flat[off:off + n].copy_(p.data.reshape(-1))
                # The parameter becomes a view of the master: the optimizer's in-place
                # update writes it, and state_dict names stay what they were.
                p.data = flat[off:off + n].view_as(p)
                shapes.append((p.shape, off, n))
                off += n
            self.params[key] = ps
            self.shapes[key] = shapes
            self.out_width[key] = int(ps[-1].shape[0])
            host[key] = flat
            ex.offload = ExpertHook(self, key)
        self.offloader = Offloader(host, budget_bytes, policy, device)
        self.device = self.offloader.device
        self.uses: list[Key] = []
        self._grad_bytes = 0
        self._peak = 0
        self._before = OffloadStats()

    def _views(self, key: Key, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[off:off + n].view(shape) for shape, off, n in self.shapes[key]]

    def _fetch(self, key: Key) -> list[torch.Tensor]:
        flat = self.offloader.fetch(key)
        self.uses.append(key)
        self._peak = max(self._peak, self.offloader.device_bytes)
        return self._views(key, flat)

    def run_forward(self, key: Key, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_zeros(0, self.out_width[key])
        w = self._fetch(key)
        with torch.no_grad():
            y = expert_math(x.to(self.device), *w)
        return y.to(x.device)

    def run_backward(self, key: Key, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        ws = [w.detach().requires_grad_() for w in self._fetch(key)]
        xd = x.detach().to(self.device).requires_grad_()
        with torch.enable_grad():
            y = expert_math(xd, *ws)
            gx, *gw = torch.autograd.grad(y, [xd, *ws], gy.to(self.device))
        for p, g in zip(self.params[key], gw, strict=True):
            assert p.grad is not None, "the optimizer gives every expert parameter a grad"
            p.grad.add_(g.to(p.grad.device))
            self._grad_bytes += g.numel() * g.element_size()
        return gx.to(x.device)

    def begin_step(self) -> None:
        """Before a step's (or an evaluation's) first use."""
        self.offloader.begin_step()
        self.uses = []
        self._grad_bytes = 0
        self._peak = self.offloader.device_bytes
        st = self.offloader.stats
        self._before = OffloadStats(st.transfers, st.bytes_moved, st.hits, st.evictions)

    def end_step(self) -> OffloadStepStats:
        """After the optimizer updated the masters: every device copy is stale and goes.
        Returns the step's counters."""
        for key in self.params:
            self.offloader.invalidate(key)
        st, b = self.offloader.stats, self._before
        return OffloadStepStats(uses=len(self.uses), transfers=st.transfers - b.transfers,
                                bytes_moved=st.bytes_moved - b.bytes_moved,
                                hits=st.hits - b.hits, evictions=st.evictions - b.evictions,
                                grad_bytes=self._grad_bytes, peak_device_bytes=self._peak)
