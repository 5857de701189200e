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
backward; :func:`class_bytes`).

Memory of the split class (``zero3``). Its authoritative parameters are this host's
shard, a tensor of its own (``S`` elements). :meth:`ShardedClass.all_gather`
re-materialises the full tensors into a fresh buffer of ``H x S`` elements (the shard
copied in, the peers' shards received) and points every parameter at its slice;
:meth:`ShardedClass.release` frees it: every parameter becomes a 0-element tensor and
the class drops its last reference, so the buffer's storage is returned to the
allocator (a use that skipped its gather fails on the 0-element tensor instead of
reading a stale copy). The parameter bytes the class holds on a host (the sum of the
distinct storages behind its parameters and shard, :func:`storage_bytes`) are

    resident_bytes = 4 S            after the free (the shard alone)
    resident_bytes = 4 S (H + 1)    between a gather and its free (buffer + shard)

(:func:`zero3_resident_bytes`). Autograd would otherwise keep the forward's buffer
alive to the backward: ``F.linear`` saves ``weight.t()``, a view of the buffer's
storage. So the forward runs under :meth:`ShardedOptimizer.saving_gathered`
(``torch.autograd.graph.saved_tensors_hooks``, the role of DeepSpeed's ZeRO-3 linear
wrapper): a saved tensor on the gathered buffer is kept as its place (size, stride,
offset) and rebuilt from the buffer the backward's gather brought in; a backward that
skipped that gather raises. ``zero2`` keeps the full parameters (``4 H S`` bytes) on
every host.

Gradients of both shared classes (ZeRO's gradient partitioning, stages 2 and 3). A host
needs its full local gradient only until the reduce-scatter has sent every peer its
shard, and keeps only the summed shard of its own after it. :meth:`ShardedClass.zero_grad`
allocates a fresh gradient buffer of ``H x S`` elements (the parameters' ``grad`` are its
slices, so the backward accumulates into it); :meth:`ShardedClass.reduce_scatter` sums
this host's shard over the hosts into a tensor of its own (``grad_shard``, ``S``
elements), then frees the buffer: every parameter's ``grad`` becomes None and the class
drops its last reference, so its storage goes back to the allocator (a weak reference
to it must have expired, or ``grad_buffers_kept_alive`` counts it). The gradient bytes
the class holds (:func:`storage_bytes` over the parameters' ``grad`` and ``grad_shard``)
are

    grad_bytes = 4 S (H + 1)    at the end of the reduce-scatter (buffer + summed shard)
    grad_bytes = 4 S            after it frees the buffer (the shard alone)

(:func:`grad_resident_bytes`). Not counted: the reduce-scatter's ``H - 1`` receive
tensors of ``S`` elements (the peers' contributions to this shard), which the mesh
allocates and which go when the sum is made. The expert class's gradients stay whole:
they are never reduced.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from agents.moe.exchange import CHUNK_ZERO2, CHUNK_ZERO3, CHUNK_ZERO3_BWD
from agents.moe.mesh import Mesh
from agents.net.codec import HEADER_SIZE, MsgType
from agents.workloads.base import sgd_step_

FLOAT32_BYTES = 4


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


def zero3_resident_bytes(numel: int, hosts: int, *, gathered: bool) -> int:
    """Parameter bytes a host holds for a split class of ``numel`` elements (module
    docstring): ``4 S`` freed, ``4 S (H + 1)`` gathered, ``S = ceil(N / H)``."""
    if numel == 0:
        return 0
    shard = math.ceil(numel / hosts)
    return FLOAT32_BYTES * shard * ((hosts + 1) if gathered else 1)


def grad_resident_bytes(numel: int, hosts: int, *, freed: bool) -> int:
    """Gradient bytes a host holds for a shared class of ``numel`` elements (module
    docstring): ``4 S (H + 1)`` at the end of the reduce-scatter, ``4 S`` after it frees
    the buffer, ``S = ceil(N / H)``."""
    if numel == 0:
        return 0
    shard = math.ceil(numel / hosts)
    return FLOAT32_BYTES * shard * (1 if freed else hosts + 1)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: what they keep allocated (a
    storage shared by several views counts once; a freed, 0-element tensor counts 0)."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes():
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


@dataclass(frozen=True)
class _GatheredView:
    """Where a saved tensor lay in the gathered buffer (:meth:`ShardedClass.pack`)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class ClassStats:
    """Bytes this class put on this host's uplink in the current (or last) step, by
    collective, and the parameter bytes it held (:func:`storage_bytes`): the most
    after any gather and the last after a free, and how many freed buffers something
    else still kept allocated; the same for its gradients around the reduce-scatter.
    :meth:`ShardedOptimizer.begin_step` zeroes them."""

    reduce_scatter_bytes: int = 0
    all_gather_bytes: int = 0
    peak_resident_bytes: int = 0
    freed_resident_bytes: int = 0
    buffers_kept_alive: int = 0
    # Gradient bytes (module docstring): at the end of the reduce-scatter and after it
    # freed the buffer, and freed gradient buffers something else still kept allocated.
    grad_peak_bytes: int = 0
    grad_freed_bytes: int = 0
    grad_buffers_kept_alive: int = 0


class ShardedClass:
    """One shared class (zero2 or zero3): its parameters, this host's shard, its momentum.

    zero2: ``flat`` holds the full parameters (each a view of it) and ``shard`` is this
    host's slice of it. zero3: ``shard`` is a tensor of its own and ``flat`` exists only
    between :meth:`all_gather` and :meth:`release` (module docstring); the class starts
    freed. Both: ``flat_grad`` exists only between :meth:`zero_grad` and the end of
    :meth:`reduce_scatter`, ``grad_shard`` (this host's summed gradient shard) after it."""

    def __init__(self, kind: ParamClass, params: list[tuple[str, nn.Parameter]], hosts: int,
                 me: int) -> None:
        self.kind = kind
        self.split = kind is ParamClass.ZERO3
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.shapes = [p.shape for _, p in params]
        self.hosts = hosts
        self.me = me
        self.numel = sum(p.numel() for _, p in params)
        self.shard_numel = math.ceil(self.numel / hosts) if self.numel else 0
        total = self.shard_numel * hosts
        flat = torch.zeros(total)
        off = 0
        for p, n in zip(self.params, self._numels(), strict=True):
            flat[off:off + n].copy_(p.data.reshape(-1))
            p.grad = None
            off += n
        self._point_at(flat)
        self.flat_grad: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.flat: torch.Tensor | None = flat
        self.shard = self.part(flat, me).clone() if self.split else self.part(flat, me)
        self.momentum = torch.zeros(self.shard_numel)
        self.steps = 0
        self.stats = ClassStats()
        self.chunk = CHUNK_ZERO3 if kind is ParamClass.ZERO3 else CHUNK_ZERO2
        if self.split:
            self.release()

    def _numels(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def _point_at(self, flat: torch.Tensor) -> None:
        """Every parameter becomes its slice of ``flat``."""
        off = 0
        for p, shape, n in zip(self.params, self.shapes, self._numels(), strict=True):
            p.data = flat[off:off + n].view(shape)
            off += n

    def part(self, t: torch.Tensor, h: int) -> torch.Tensor:
        return t[h * self.shard_numel:(h + 1) * self.shard_numel]

    def pack(self, t: torch.Tensor) -> Any:
        """Saved-tensor hook: a tensor on the gathered buffer is kept as its place in
        it, so autograd holds no reference to the buffer (module docstring)."""
        flat = self.flat
        if (self.split and flat is not None and t.untyped_storage().nbytes()
                and t.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()):
            return _GatheredView(tuple(t.size()), tuple(t.stride()), int(t.storage_offset()))
        return t

    def unpack(self, saved: Any) -> torch.Tensor:
        """Saved-tensor hook: rebuild a packed view from the buffer gathered now."""
        if not isinstance(saved, _GatheredView):
            return saved
        if self.flat is None:
            raise RuntimeError("ZeRO-3: the backward needs the split parameters, but they "
                               "were freed after the forward (gather_before_backward "
                               "first)")
        return self.flat.as_strided(saved.size, saved.stride, saved.offset)

    def resident_bytes(self) -> int:
        """Parameter bytes this class keeps allocated on this host (:func:`storage_bytes`
        over its parameters and its shard)."""
        return storage_bytes([*self.params, self.shard])

    def grad_bytes(self) -> int:
        """Gradient bytes this class keeps allocated on this host (:func:`storage_bytes`
        over its parameters' ``grad`` and its summed shard)."""
        held = [p.grad for p in self.params if p.grad is not None]
        return storage_bytes(held + ([] if self.grad_shard is None else [self.grad_shard]))

    def zero_grad(self) -> None:
        """A fresh, zeroed gradient buffer of ``H x S`` elements for the backward to
        accumulate into (the parameters' ``grad`` are its slices); the last step's summed
        shard, already applied, goes. zero3: the parameters must be gathered (a
        parameter's ``grad`` has its shape)."""
        if self.split and self.flat is None and self.numel:
            raise RuntimeError("ZeRO-3: zero_grad needs the split parameters gathered "
                               "(gather_before_use first)")
        self.grad_shard = None
        self.flat_grad = torch.zeros(self.shard_numel * self.hosts)
        off = 0
        for p, n in zip(self.params, self._numels(), strict=True):
            p.grad = self.flat_grad[off:off + n].view_as(p)
            off += n

    def reduce_scatter(self, mesh: Mesh | None, step: int) -> torch.Tensor:
        """Sum of every host's gradient, this host's shard (summed in host order), kept
        as ``grad_shard``; the full gradient buffer is freed (module docstring)."""
        flat_grad = self.flat_grad
        if flat_grad is None:
            raise RuntimeError(f"{self.kind.value}: reduce_scatter without a gradient buffer "
                               "(zero_grad before the backward)")
        mine = self.part(flat_grad, self.me)
        if mesh is None or self.hosts == 1 or self.numel == 0:
            total = mine.clone()
        else:
            before = sum(mesh.sent.values())
            got = mesh.exchange(MsgType.REDUCE_SCATTER, step, self.chunk,
                                {j: self.part(flat_grad, j) for j in mesh.peers},
                                dict.fromkeys(mesh.peers, self.shard_numel))
            self.stats.reduce_scatter_bytes += sum(mesh.sent.values()) - before
            total = torch.zeros(self.shard_numel)
            for h in range(self.hosts):
                total += mine if h == self.me else got[h]
            del got
        self.grad_shard = total
        self.stats.grad_peak_bytes = max(self.stats.grad_peak_bytes, self.grad_bytes())
        # Free the full-size gradient: only the summed shard stays.
        buffer = StorageWeakRef(flat_grad.untyped_storage())
        for p in self.params:
            p.grad = None
        del mine, flat_grad
        self.flat_grad = None
        self.stats.grad_freed_bytes = self.grad_bytes()
        self.stats.grad_buffers_kept_alive += int(not buffer.expired())
        return total

    def all_gather(self, mesh: Mesh | None, step: int, chunk: int | None = None) -> None:
        """Every host's parameter shard into the full parameters (``chunk``: the frames'
        chunk id, this class's own unless given). zero3: into a fresh buffer, which the
        parameters then view (module docstring)."""
        if self.numel == 0:
            return
        if self.split:
            flat = torch.empty(self.shard_numel * self.hosts)
            self.part(flat, self.me).copy_(self.shard)
        else:
            assert self.flat is not None
            flat = self.flat
        if mesh is not None and self.hosts > 1:
            before = sum(mesh.sent.values())
            got = mesh.exchange(MsgType.ALL_GATHER, step,
                                self.chunk if chunk is None else chunk,
                                dict.fromkeys(mesh.peers, self.shard),
                                dict.fromkeys(mesh.peers, self.shard_numel))
            self.stats.all_gather_bytes += sum(mesh.sent.values()) - before
            for j, t in got.items():
                self.part(flat, j).copy_(t)
        if self.split:
            self.flat = flat
            self._point_at(flat)
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes,
                                             self.resident_bytes())

    def release(self) -> None:
        """zero3: free the gathered copy (module docstring): every parameter becomes a
        0-element tensor and the buffer is dropped; only the shard stays. zero2: no-op."""
        if not self.split:
            return
        if self.flat is None:
            return
        buffer = StorageWeakRef(self.flat.untyped_storage())
        for p in self.params:
            p.data = torch.empty(0)
        self.flat = None
        self.stats.freed_resident_bytes = self.resident_bytes()
        # Anything still holding the buffer (a saved tensor outside saving_gathered)
        # would keep it allocated: counted, so a free that frees nothing shows.
        self.stats.buffers_kept_alive += int(not buffer.expired())

    def step(self, mesh: Mesh | None, step: int, *, lr: float, momentum: float) -> None:
        """Reduce-scatter the gradients, update this host's shard; zero2 then all-gathers
        (zero3 gathers before the next use: :meth:`all_gather` at the next step)."""
        g = self.reduce_scatter(mesh, step)
        sgd_step_(self.shard, g, self.momentum if momentum > 0 else None,
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
        self.expert_names = [n for n, _ in groups[ParamClass.EXPERT]]
        self.expert_params = [p for _, p in groups[ParamClass.EXPERT]]
        for p in self.expert_params:
            p.grad = torch.zeros_like(p)
        self.expert_momentum = [torch.zeros_like(p) for p in self.expert_params]
        self.classes = {c: ShardedClass(c, groups[c], hosts, me)
                        for c in (ParamClass.ZERO3, ParamClass.ZERO2)}
        self.steps = 0
        self.expert_numel = sum(p.numel() for p in self.expert_params)

    def zero_grad(self) -> None:
        """Fresh gradient buffers for the shared classes (:meth:`ShardedClass.zero_grad`;
        zero3 must be gathered), the experts' gradients zeroed in place."""
        for c in self.classes.values():
            c.zero_grad()
        for p in self.expert_params:
            assert p.grad is not None
            p.grad.zero_()

    def local_state(self) -> dict[str, torch.Tensor]:
        """What this host alone holds: its shard of each shared class and its experts'
        parameters. The hosts' states together are the whole model, read without a
        gather, so saving it puts no byte on the wire."""
        out = {f"{c.value}.shard": sc.shard.detach().clone() for c, sc in self.classes.items()}
        out.update({n: p.detach().clone()
                    for n, p in zip(self.expert_names, self.expert_params, strict=True)})
        return out

    def begin_step(self) -> None:
        """Start a step's byte counts (:meth:`bytes_by_class` reports this step's)."""
        for c in self.classes.values():
            c.stats = ClassStats()

    def saving_gathered(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Run the forward under this: autograd saves the split parameters by their
        place in the gathered buffer, not the buffer (module docstring)."""
        z3 = self.classes[ParamClass.ZERO3]
        return torch.autograd.graph.saved_tensors_hooks(z3.pack, z3.unpack)

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
            sgd_step_(p.data, p.grad, buf if self.momentum > 0 else None, lr=self.lr,
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

    def param_bytes(self) -> dict[str, int]:
        """Parameter bytes this host held in the step since :meth:`begin_step`
        (:func:`storage_bytes`): the split class at its peak (after a gather) and after
        its last free, with their formulas (:func:`zero3_resident_bytes`); the unsplit
        class and this host's experts (always whole); and the host's totals."""
        z3 = self.classes[ParamClass.ZERO3]
        zero2 = self.classes[ParamClass.ZERO2].resident_bytes()
        expert = storage_bytes(self.expert_params)
        return {
            "zero3_peak_bytes": z3.stats.peak_resident_bytes,
            "zero3_freed_bytes": z3.stats.freed_resident_bytes,
            "zero3_peak_formula_bytes": zero3_resident_bytes(z3.numel, z3.hosts,
                                                             gathered=True),
            "zero3_freed_formula_bytes": zero3_resident_bytes(z3.numel, z3.hosts,
                                                              gathered=False),
            "zero3_buffers_kept_alive": z3.stats.buffers_kept_alive,
            "zero2_bytes": zero2, "expert_bytes": expert,
            "host_peak_bytes": z3.stats.peak_resident_bytes + zero2 + expert,
            "host_freed_bytes": z3.stats.freed_resident_bytes + zero2 + expert,
        }

    def grad_bytes(self) -> dict[str, int]:
        """Gradient bytes this host held in the step since :meth:`begin_step`
        (:func:`storage_bytes`): each shared class at the end of its reduce-scatter and
        after it freed its buffer, with their formulas (:func:`grad_resident_bytes`), how
        many freed buffers something else still held, and the experts' (whole, never
        reduced)."""
        out: dict[str, int] = {}
        for c in (ParamClass.ZERO3, ParamClass.ZERO2):
            sc = self.classes[c]
            out |= {f"{c.value}_grad_peak_bytes": sc.stats.grad_peak_bytes,
                    f"{c.value}_grad_freed_bytes": sc.stats.grad_freed_bytes,
                    f"{c.value}_grad_peak_formula_bytes":
                        grad_resident_bytes(sc.numel, sc.hosts, freed=False),
                    f"{c.value}_grad_freed_formula_bytes":
                        grad_resident_bytes(sc.numel, sc.hosts, freed=True)}
        out["grad_buffers_kept_alive"] = sum(sc.stats.grad_buffers_kept_alive
                                             for sc in self.classes.values())
        out["expert_grad_bytes"] = storage_bytes(
            [p.grad for p in self.expert_params if p.grad is not None])
        return out
