"""The Workload interface and the flat parameter buffer every workload shares.

A workload owns a model, its data and its loss. Workers and the PS both build it
from the same seed, so they start from identical weights.

Parameters are packed into one flat float32 buffer in *send order*: the reverse of
registration order, the order backprop produces gradients in (as DDP buckets do).
``p.data`` and ``p.grad`` of every parameter are views into two flat buffers, so:
- a gradient chunk is a contiguous slice of ``flat_grad`` (no gather copy), and
- weights arriving from the PS are received straight into ``flat_params``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from agents.core.config import WorkloadConfig
from agents.core.registry import WORKLOAD, Registry
from agents.core.vision_config import VisionConfig

# Every workload, one file each in agents/workloads/, registered by name.
WORKLOADS: Registry[Any] = Registry(WORKLOAD)

_W = TypeVar("_W")


def register_workload(name: str) -> Callable[[_W], _W]:
    """Class decorator: ``workload.name = name`` builds this class through its
    :meth:`Workload.from_config`."""
    return WORKLOADS.register(name)


def make_workload(cfg: WorkloadConfig, vision: VisionConfig | None = None) -> Workload:
    """The workload ``cfg.name`` names, built from the ``[workload]`` section; a workload
    that declares ``sections = ("vision",)`` also gets the ``[vision]`` section (default
    ``VisionConfig()``)."""
    cls = WORKLOADS.get(cfg.name, "workload.name")
    if "vision" in getattr(cls, "sections", ()):
        workload: Workload = cls.from_config(cfg, vision or VisionConfig())
    else:
        workload = cls.from_config(cfg)
    return workload


class FlatModel:
    """A module whose parameters and gradients live in two flat buffers."""

    def __init__(self, module: nn.Module, device: torch.device | str = "cpu") -> None:
        self.module = module.to(device)
        self.device = torch.device(device)
        self.params = [p for p in module.parameters()][::-1]
        total = sum(p.numel() for p in self.params)
        self.numel = total
        self.flat_params = torch.empty(total, dtype=torch.float32, device=self.device)
        self.flat_grad = torch.zeros(total, dtype=torch.float32, device=self.device)
        self.layout: list[tuple[str, int, int]] = []
        names = {id(p): n for n, p in module.named_parameters()}
        offset = 0
        for p in self.params:
            n = p.numel()
            self.flat_params[offset:offset + n].copy_(p.data.reshape(-1))
            p.data = self.flat_params[offset:offset + n].view_as(p)
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            self.layout.append((names[id(p)], offset, n))
            offset += n

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The parameters' shapes in send order (the flat buffers' layout)."""
        return [tuple(p.shape) for p in self.params]

    def zero_grad(self) -> None:
        self.flat_grad.zero_()


def sgd_step_(params: torch.Tensor, grad: torch.Tensor, momentum_buf: torch.Tensor | None,
              *, lr: float, momentum: float, first: bool) -> None:
    """The PS's optimizer step, in place, with ``torch.optim.SGD``'s semantics: with
    momentum the buffer becomes the gradient itself on the ``first`` step, then
    ``momentum * buf + grad``; ``params -= lr * buf`` (or ``lr * grad`` without momentum).
    SGD is elementwise, so a chunk's slices step exactly as the whole model would."""
    if momentum > 0:
        assert momentum_buf is not None, "momentum needs a buffer"
        if first:
            momentum_buf.copy_(grad)
        else:
            momentum_buf.mul_(momentum).add_(grad)
        params.add_(momentum_buf, alpha=-lr)
    else:
        params.add_(grad, alpha=-lr)


def chunk_ranges(numel: int, chunk_bytes: int, itemsize: int = 4) -> list[tuple[int, int]]:
    """Contiguous [start, end) element ranges of at most ``chunk_bytes`` each, in send
    order. Chunks are the unit of compression, framing and adaptive-ratio decisions."""
    step = max(1, chunk_bytes // itemsize)
    return [(s, min(s + step, numel)) for s in range(0, numel, step)]


def chunk_layers(shapes: Sequence[tuple[int, ...]], start: int,
                 end: int) -> list[tuple[int, ...]]:
    """The layer pieces of the flat range [start, end) of parameters laid out consecutively
    with ``shapes`` (send order, as :class:`FlatModel` packs them), as shapes in flat order.

    A parameter wholly inside the range keeps its shape. One cut by the range's ends is split
    along its rows (its matrix view is ``shape[0] x rest``, as PowerSGD sees it): a partial
    row at the cut (1-D), the whole rows inside (``(rows, rest)``), a partial row at the
    other cut (1-D). 1-D parameters stay 1-D. The pieces' numels sum to ``end - start``."""
    pieces: list[tuple[int, ...]] = []
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        lo, hi = max(offset, start) - offset, min(offset + n, end) - offset
        offset += n
        if lo >= hi:
            continue
        if lo == 0 and hi == n or len(shape) < 2:
            pieces.append(tuple(shape) if lo == 0 and hi == n else (hi - lo,))
            continue
        row = n // shape[0]
        first_row_end = min(hi, -(-lo // row) * row)  # the first row boundary at or after lo
        last_row_start = max(first_row_end, hi // row * row)
        if first_row_end > lo:
            pieces.append((first_row_end - lo,))
        if last_row_start > first_row_end:
            pieces.append(((last_row_start - first_row_end) // row, row))
        if hi > last_row_start:
            pieces.append((hi - last_row_start,))
    return pieces


def chunk_layer_dims(shapes: Sequence[tuple[int, ...]], start: int, end: int) -> list[int]:
    """For each piece :func:`chunk_layers` gives for [start, end), the number of dimensions
    of the parameter it belongs to. A cut 2-D parameter's partial rows are 1-D pieces of a
    2-D parameter; only a piece whose parameter is itself 1-D (a bias, a norm's scale) has
    1 here, which is what DGC's "send 1-D parameters dense" needs to know."""
    dims: list[int] = []
    offset = 0
    for shape in shapes:
        n = math.prod(shape)
        lo, hi = max(offset, start), min(offset + n, end)
        offset += n
        if lo < hi:
            dims.extend([len(shape)] * len(chunk_layers([shape], lo - (offset - n),
                                                        hi - (offset - n))))
    return dims


def chunk_layer_specs(shapes: Sequence[tuple[int, ...]], chunks: Sequence[tuple[int, int]]
                      ) -> list[tuple[str, list[tuple[int, ...]], list[int]]]:
    """``(key "c<i>", layer pieces, their parameters' dims)`` of every chunk ``(start, end)``:
    what a sender's compressor is told (``agents.compress.builder.Sender``)."""
    return [(f"c{c}", chunk_layers(shapes, s, e), chunk_layer_dims(shapes, s, e))
            for c, (s, e) in enumerate(chunks)]


@dataclass(frozen=True)
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class Workload(ABC):
    """A model plus its data. ``compute_ms`` > 0 marks a replay workload whose
    forward/backward is simulated by sleeping; its gradients are synthetic."""

    name: str = ""
    compute_ms: float = 0.0

    @classmethod
    def from_config(cls, cfg: WorkloadConfig) -> Workload:
        """Build it from the ``[workload]`` section; each workload takes the fields it uses."""
        return cls()

    @abstractmethod
    def build_model(self, seed: int) -> nn.Module: ...

    @abstractmethod
    def batch(self, iteration: int, worker: int, n_workers: int, batch_size: int) -> Batch:
        """Worker ``worker``'s share of the global batch of ``iteration``. The global
        batch is ``n_workers * batch_size`` samples; worker k takes slice k, so the mean
        of the workers' mean gradients is the mean gradient of the global batch."""

    @abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor: ...

    @classmethod
    def warm_imports(cls) -> None:
        """Import the modules :meth:`prepare` will need (a data set's reader), without
        loading any data. The agents' warm process (``controller.warm``) calls it once
        per run, so that every agent forked from it has them: otherwise the PS and then
        each worker import them in turn, on the run's critical path. Default: none."""
        return None

    def prepare(self, model: nn.Module, worker: int, seed: int) -> None:
        """Whatever must not be paid inside iteration 0 (loading data, drawing synthetic
        gradients). Agents call it before they connect; the default does nothing."""
        return None

    def evaluate(self, model: nn.Module) -> dict[str, float] | None:
        """Held-out loss and accuracy, or None when the workload has no data."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}
