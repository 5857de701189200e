"""Parameter classes of an MoE model on expert hosts, and ZeRO-2/3 sharding (seeds/002).

Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (arXiv:1910.02054), stages 2 and 3; DeepSpeed-MoE's split of expert and
non-expert parameters. Three classes:

- ``expert``: an expert's own parameters. Private to the host that owns the expert and
  never reduced: every token routed to it, from every host, came to this host, so its
  gradient is already complete here.
- ``zero3`` (shared, split): tensors of at least ``zero3_min_numel`` elements. Each host
  keeps one shard of the parameters and of the optimizer state; the full tensors are
  all-gathered before the forward uses them, freed after the forward, all-gathered
  again before the backward, freed after it, the gradients reduce-scattered, and each
  host updates only its shard.
- ``zero2`` (shared, not split): the smaller tensors. Every host keeps the full
  parameters; the gradients are reduce-scattered, each host keeps its shard of the
  gradients and of the optimizer state, updates its shard, and the updated parameters
  are all-gathered right away.

Gradients are *summed* over hosts: each host back-propagates ``loss_h / H``, so the sum
is the gradient of the mean loss over the global batch, as one process would compute it.

A class's tensors live in one flat buffer padded to ``H x S`` elements, ``S = ceil(N /
H)``; host h's shard is ``[h S, (h+1) S)``. Both collectives are direct (host h sends
shard j of its buffer to host j), so per step each shared class puts on every host's
uplink, and takes from its downlink, exactly

    class_bytes = 2 x (H - 1) x (4 S + HEADER_SIZE)

for ``zero2`` (one reduce-scatter and one all-gather, one frame per peer each), and

    class_bytes = 3 x (H - 1) x (4 S + HEADER_SIZE)

for ``zero3`` (one reduce-scatter and two all-gathers: before the forward and before the
backward; :func:`class_bytes`). "Freed" here: the other hosts' parts of the gathered
buffer are overwritten with NaN (:meth:`ShardedClass.release`), so a use that skipped
its gather would poison the result instead of silently reading a stale copy; the
buffer's storage itself stays allocated and is reused (on the CPU there is no device
memory to give back). Only the shard is authoritative.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import nn

from agents.codec import HEADER_SIZE, MsgType
from agents.moe.exchange import CHUNK_ZERO2, CHUNK_ZERO3, CHUNK_ZERO3_BWD
from agents.moe.mesh import Mesh


class ParamClass(StrEnum):
    EXPERT = "expert"
    ZERO3 = "zero3"
    ZERO2 = "zero2"


def classify(name: str, param: torch.Tensor, zero3_min_numel: int) -> ParamClass:
    """The class of one named parameter (experts live under ``...experts.<e>.``)."""
    if ".experts." in f".{name}":
        return ParamClass.EXPERT
    return ParamClass.ZERO3 if param.numel() >= zero3_min_numel else ParamClass.ZERO2


#: Collectives per step, one frame to every peer each (module docstring).
COLLECTIVES_PER_STEP = {"zero3": 3, "zero2": 2}


def class_bytes(numel: int, hosts: int, kind: str = "zero2") -> int:
    """Bytes one shared class puts on each host's uplink per step (module docstring):
    ``collectives x (H - 1) x (4 ceil(N / H) + HEADER_SIZE)``, 3 collectives for
    ``zero3``, 2 for ``zero2``."""
    if hosts <= 1 or numel == 0:
        return 0
    shard = math.ceil(numel / hosts)
    return COLLECTIVES_PER_STEP[kind] * (hosts - 1) * (4 * shard + HEADER_SIZE)


def sgd_(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor | None, *, lr: float,
         momentum: float, first: bool) -> None:
    """``torch.optim.SGD`` in place, elementwise (so a shard steps as the whole would)."""
    if momentum > 0:
        assert buf is not None
        if first:
            buf.copy_(grad)
        else:
            buf.mul_(momentum).add_(grad)
        param.add_(buf, alpha=-lr)
    else:
        param.add_(grad, alpha=-lr)


@dataclass
class ClassStats:
    """Bytes this class put on this host's uplink in the current (or last) step, by
    collective; :meth:`ShardedOptimizer.begin_step` zeroes them."""

    reduce_scatter_bytes: int = 0
    all_gather_bytes: int = 0


class ShardedClass:
    """One shared class (zero2 or zero3): flat buffers, this host's shard, its momentum."""

    def __init__(self, kind: ParamClass, params: list[tuple[str, nn.Parameter]], hosts: int,
                 me: int) -> None:
        self.kind = kind
        self.names = [n for n, _ in params]
        self.hosts = hosts
        self.me = me
        self.numel = sum(p.numel() for _, p in params)
        self.shard_numel = math.ceil(self.numel / hosts) if self.numel else 0
        total = self.shard_numel * hosts
        self.flat = torch.zeros(total)
        self.flat_grad = torch.zeros(total)
        off = 0
        for _, p in params:
            n = p.numel()
            self.flat[off:off + n].copy_(p.data.reshape(-1))
            p.data = self.flat[off:off + n].view_as(p)
            p.grad = self.flat_grad[off:off + n].view_as(p)
            off += n
        self.momentum = torch.zeros(self.shard_numel)
        self.steps = 0
        self.stats = ClassStats()
        self.chunk = CHUNK_ZERO3 if kind is ParamClass.ZERO3 else CHUNK_ZERO2

    def part(self, t: torch.Tensor, h: int) -> torch.Tensor:
        return t[h * self.shard_numel:(h + 1) * self.shard_numel]

    def reduce_scatter(self, mesh: Mesh | None, step: int) -> torch.Tensor:
        """Sum of every host's gradient, this host's shard (summed in host order)."""
        mine = self.part(self.flat_grad, self.me)
        if mesh is None or self.hosts == 1 or self.numel == 0:
            return mine.clone()
        before = sum(mesh.sent.values())
        got = mesh.exchange(MsgType.REDUCE_SCATTER, step, self.chunk,
                            {j: self.part(self.flat_grad, j) for j in mesh.peers},
                            dict.fromkeys(mesh.peers, self.shard_numel))
        self.stats.reduce_scatter_bytes += sum(mesh.sent.values()) - before
        total = torch.zeros(self.shard_numel)
        for h in range(self.hosts):
            total += mine if h == self.me else got[h]
        return total

    def all_gather(self, mesh: Mesh | None, step: int, chunk: int | None = None) -> None:
        """Every host's parameter shard into ``flat`` (``chunk``: the frames' chunk id,
        this class's own unless given)."""
        if mesh is None or self.hosts == 1 or self.numel == 0:
            return
        before = sum(mesh.sent.values())
        mine = self.part(self.flat, self.me)
        got = mesh.exchange(MsgType.ALL_GATHER, step, self.chunk if chunk is None else chunk,
                            dict.fromkeys(mesh.peers, mine),
                            dict.fromkeys(mesh.peers, self.shard_numel))
        self.stats.all_gather_bytes += sum(mesh.sent.values()) - before
        for j, t in got.items():
            self.part(self.flat, j).copy_(t)

    def release(self) -> None:
        """Free the other hosts' parts of the gathered copy (module docstring: they
        become NaN); this host's shard stays."""
        for j in range(self.hosts):
            if j != self.me:
                self.part(self.flat, j).fill_(float("nan"))

    def step(self, mesh: Mesh | None, step: int, *, lr: float, momentum: float) -> None:
        """Reduce-scatter the gradients, update this host's shard; zero2 then all-gathers
        (zero3 gathers before the next use: :meth:`all_gather` at the next step)."""
        g = self.reduce_scatter(mesh, step)
        sgd_(self.part(self.flat, self.me), g, self.momentum if momentum > 0 else None,
             lr=lr, momentum=momentum, first=self.steps == 0)
        self.steps += 1
        if self.kind is ParamClass.ZERO2:
            self.all_gather(mesh, step)


class ShardedOptimizer:
    """SGD over the three classes of one host's model (module docstring)."""

    def __init__(self, model: nn.Module, *, hosts: int, me: int, zero3_min_numel: int,
                 lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        groups: dict[ParamClass, list[tuple[str, nn.Parameter]]] = {c: [] for c in ParamClass}
        for name, p in model.named_parameters():
            groups[classify(name, p, zero3_min_numel)].append((name, p))
        self.expert_params = [p for _, p in groups[ParamClass.EXPERT]]
        for p in self.expert_params:
            p.grad = torch.zeros_like(p)
        self.expert_momentum = [torch.zeros_like(p) for p in self.expert_params]
        self.classes = {c: ShardedClass(c, groups[c], hosts, me)
                        for c in (ParamClass.ZERO3, ParamClass.ZERO2)}
        self.steps = 0
        self.expert_numel = sum(p.numel() for p in self.expert_params)

    def zero_grad(self) -> None:
        for c in self.classes.values():
            c.flat_grad.zero_()
        for p in self.expert_params:
            assert p.grad is not None
            p.grad.zero_()

    def begin_step(self) -> None:
        """Start a step's byte counts (:meth:`bytes_by_class` reports this step's)."""
        for c in self.classes.values():
            c.stats = ClassStats()

    def gather_before_use(self, mesh: Mesh | None, step: int) -> None:
        """ZeRO-3: bring every host's shard in before the forward."""
        self.classes[ParamClass.ZERO3].all_gather(mesh, step)

    def gather_before_backward(self, mesh: Mesh | None, step: int) -> None:
        """ZeRO-3: bring every host's shard in again before the backward (chunk
        ``CHUNK_ZERO3_BWD``): the copy gathered for the forward was freed after it."""
        self.classes[ParamClass.ZERO3].all_gather(mesh, step, CHUNK_ZERO3_BWD)

    def release(self) -> None:
        """ZeRO-3: free the gathered copy after the forward or the backward used it."""
        self.classes[ParamClass.ZERO3].release()

    def step(self, mesh: Mesh | None, step: int) -> None:
        for p, buf in zip(self.expert_params, self.expert_momentum, strict=True):
            assert p.grad is not None
            sgd_(p.data, p.grad, buf if self.momentum > 0 else None, lr=self.lr,
                 momentum=self.momentum, first=self.steps == 0)
        for c in (ParamClass.ZERO3, ParamClass.ZERO2):
            self.classes[c].step(mesh, step, lr=self.lr, momentum=self.momentum)
        self.steps += 1

    def bytes_by_class(self) -> dict[str, int]:
        """Uplink bytes per class since :meth:`begin_step` (experts: never reduced, 0)."""
        out = {ParamClass.EXPERT.value: 0}
        for c, sc in self.classes.items():
            out[c.value] = sc.stats.reduce_scatter_bytes + sc.stats.all_gather_bytes
        return out
