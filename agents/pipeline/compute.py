"""A stage's compute: its layer slices, forward and backward of micro-batches with
recomputation, and the optimizer step with 2BW weight versions (PipeDream-2BW, Narayanan
et al., 2021). No sockets: :mod:`agents.pipeline.runtime` calls it action by action and
hands it what the links received.

Activation bytes held are counted exactly: every tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``) plus the stashed inputs.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agents.core import config as cfgmod
from agents.core.lr_schedule import lr_at
from agents.core.schedules import Schedule
from agents.pipeline.common import micro_batch
from agents.pipeline.partition import balance_by_params, boundary_shapes, split
from agents.workloads.base import Batch, FlatModel, Workload, sgd_step_
from agents.workloads.device import pick_device
from agents.workloads.factory import make_workload

#: ``average(step, chunk, grad)``: replace ``grad`` in place by its mean over the replicas.
Average = Callable[[int, int, torch.Tensor], None]


class _SavedBytes:
    """Counts the bytes autograd saves for backward during a forward. Weights are not
    activations: a saved tensor living in a weight buffer (a parameter, or a view of one
    such as ``weight.t()`` that ``addmm`` saves) is not counted."""

    def __init__(self, weight_storages: set[int]) -> None:
        self.bytes = 0
        self.weights = weight_storages

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.weights:
            self.bytes += t.numel() * t.element_size()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t


@dataclass
class _Held:
    """What a forward left for its backward."""

    x: torch.Tensor  # the piece's input (always kept: the recompute needs it)
    out: torch.Tensor | None = None  # output with autograd history (None until recomputed)
    saved_bytes: int = 0


def _versions(schedule: Schedule, stage: int, pieces: Sequence[nn.Module],
              device: torch.device) -> dict[int, list[FlatModel]]:
    """One FlatModel per chunk; a chunk in ``stale_chunks`` keeps two versions (2BW)."""
    out: dict[int, list[FlatModel]] = {}
    for c in range(schedule.chunks):
        piece = pieces[schedule.position(stage, c)]
        flat = FlatModel(piece, device)
        if c in schedule.stale_chunks:
            twin = FlatModel(copy.deepcopy(piece), device)
            twin.flat_params.copy_(flat.flat_params)
            out[c] = [flat, twin]
        else:
            out[c] = [flat]
    return out


class StageCompute:
    """Stage ``stage``'s pieces of the model (piece ``chunk * p + stage`` of each chunk),
    on ``run.device``. What crosses this class's surface (inputs from the links, outputs
    and gradients for them, weights for the PS) is on the CPU; a CUDA stage copies in and
    out here, so the links never see a device tensor."""

    def __init__(self, cfg: cfgmod.ExperimentConfig, schedule: Schedule, stage: int,
                 replica: int) -> None:
        self.cfg, self.pc = cfg, cfg.pipeline
        self.schedule, self.s, self.replica = schedule, stage, replica
        self.workload: Workload = make_workload(cfg.workload, cfg.vision)
        model = self.workload.build_model(cfg.run.seed)
        balance = list(self.pc.balance) or balance_by_params(model, schedule.positions)
        pieces = split(model, balance)
        self.workload.prepare(model, stage, cfg.run.seed)
        sample = micro_batch(self.workload, self.pc, 0, replica).x
        self.shapes = boundary_shapes(pieces, sample)  # output shape of every piece
        # The shape of what each chunk receives: activations in, and gradients of its output.
        self.in_shape = {c: (sample.shape if schedule.position(stage, c) == 0
                             else self.shapes[schedule.position(stage, c) - 1])
                         for c in range(schedule.chunks)}
        self.out_shape = {c: self.shapes[schedule.position(stage, c)]
                          for c in range(schedule.chunks)}
        self.device = pick_device(cfg.run.device)
        self.versions = _versions(schedule, stage, pieces, self.device)
        self._weight_storages = {fm.flat_params.untyped_storage().data_ptr()
                                 for vs in self.versions.values() for fm in vs}
        self.momentum: dict[int, torch.Tensor] = {}
        self.opt_count: dict[int, int] = {}
        self.held: dict[tuple[int, int], _Held] = {}
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.losses: dict[int, float] = {}
        self._batches: dict[int, Batch] = {}  # step -> its whole batch (see _micro_batch)

    @property
    def params(self) -> int:
        return sum(v[0].numel for v in self.versions.values())

    def _model(self, chunk: int, mb: int) -> FlatModel:
        """The weights micro-batch ``mb`` uses through ``chunk``: a stale (2BW) chunk
        alternates two versions by step parity (version ``V_k`` serves step ``k``)."""
        vs = self.versions[chunk]
        return vs[(mb // self.pc.micro_batches) % len(vs)]

    def _pad(self, t0: float) -> None:
        """Sleep out the rest of ``compute_pad_ms`` (per stage share of the layers: a
        stage with two chunks pads each action to half of it, so every schedule does the
        same work per stage and step)."""
        want_s = self.pc.compute_pad_ms / 1000.0 / self.schedule.chunks
        pad = want_s - (time.perf_counter() - t0)
        if pad > 0:
            time.sleep(pad)

    def _micro_batch(self, mb: int) -> Batch:
        """:func:`~agents.pipeline.common.micro_batch`, with the last two steps' batches
        kept: every micro-batch is a slice of its step's batch, which is not rebuilt for
        each of them (the two-group schedule interleaves two steps)."""
        k, i = divmod(mb, self.pc.micro_batches)
        if k not in self._batches:
            if len(self._batches) == 2:
                del self._batches[min(self._batches)]
            self._batches[k] = self.workload.batch(k, self.replica, self.pc.replicas,
                                                   self.pc.micro_batches * self.pc.micro_batch_size)
        full, b = self._batches[k], self.pc.micro_batch_size
        return Batch(full.x[i * b:(i + 1) * b], full.y[i * b:(i + 1) * b])

    def first_input(self, mb: int) -> torch.Tensor:
        """The input of micro-batch ``mb`` at pipeline position 0: the workload's data."""
        return self._micro_batch(mb).x

    def forward(self, mb: int, chunk: int, x: torch.Tensor, grad: bool) -> torch.Tensor:
        """Run micro-batch ``mb`` through ``chunk`` and return its output (the loss at the
        last position). With ``grad`` the autograd graph is kept for the backward;
        without, only the input is (a recompute rebuilds the graph)."""
        t0 = time.perf_counter()
        pos = self.schedule.position(self.s, chunk)
        last = pos == self.schedule.positions - 1
        module = self._model(chunk, mb).module
        x = x.detach().to(self.device)
        if pos > 0:
            x.requires_grad_(True)
        held = _Held(x=x)
        self.held_bytes += x.numel() * x.element_size()
        if grad:
            counter = _SavedBytes(self._weight_storages)
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                out = module(x)
                if last:
                    y = self._micro_batch(mb).y.to(self.device)
                    out = nn.functional.cross_entropy(out, y) / self.pc.micro_batches
            held.out, held.saved_bytes = out, counter.bytes
            self.held_bytes += counter.bytes
        else:
            with torch.no_grad():
                out = module(x)
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self.held[(mb, chunk)] = held
        if last and held.out is not None:
            self.losses[mb] = float(held.out.detach()) * self.pc.micro_batches
        self._pad(t0)
        return out.detach().cpu()

    def recompute(self, mb: int, chunk: int) -> None:
        """Re-run a forward made without autograd, this time keeping its graph."""
        held = self.held.pop((mb, chunk))
        self.held_bytes -= held.x.numel() * held.x.element_size()  # forward re-adds it
        self.forward(mb, chunk, held.x, grad=True)

    def backward(self, mb: int, chunk: int, grad_out: torch.Tensor | None
                 ) -> torch.Tensor | None:
        """Backward of micro-batch ``mb`` through ``chunk`` from ``grad_out`` (None at the
        last position: the loss); returns the gradient of the chunk's input (None at
        position 0) and frees what the forward held."""
        t0 = time.perf_counter()
        held = self.held.pop((mb, chunk))
        assert held.out is not None, f"B{mb}.{chunk} without a forward's autograd graph"
        if grad_out is None:
            held.out.backward()
        else:
            held.out.backward(grad_out.to(self.device))
        self.held_bytes -= held.saved_bytes + held.x.numel() * held.x.element_size()
        self._pad(t0)
        return None if held.x.grad is None else held.x.grad.cpu()

    def optimizer(self, step: int, chunk: int, average: Average | None) -> None:
        """SGD on this stage's slice, after ``average`` (None with one replica) replaced the
        gradient by its mean over the replicas. Synchronous chunk: the step's gradient
        updates the weights the next step uses. Stale chunk (2BW): the weights of step
        ``k`` (``vs[k % 2]``) had ``g(k)``; they become ``V_{k+2} = V_{k+1} - lr g(k)``."""
        vs = self.versions[chunk]
        fm = vs[step % len(vs)]
        if average is not None:
            grad = fm.flat_grad.cpu()  # the links average host tensors (itself on the CPU)
            average(step, chunk, grad)
            fm.flat_grad.copy_(grad)
        first = self.opt_count.get(chunk, 0) == 0
        self.opt_count[chunk] = self.opt_count.get(chunk, 0) + 1
        wl = self.cfg.workload
        buf = None
        if wl.momentum > 0:
            buf = self.momentum.setdefault(chunk, torch.zeros_like(fm.flat_params))
        if len(vs) == 2:
            fm.flat_params.copy_(vs[(step + 1) % 2].flat_params)
        lr = lr_at(wl.lr, step, self.cfg.run.iterations, wl.lr_schedule, wl.lr_decay_at,
                   wl.lr_decay_factor)
        sgd_step_(fm.flat_params, fm.flat_grad, buf, lr=lr, momentum=wl.momentum,
                  first=first)
        fm.zero_grad()

    def step_loss(self, step: int) -> float | None:
        """The mean loss of step ``step``'s micro-batches (None off the last position)."""
        m = self.pc.micro_batches
        losses = [self.losses[i] for i in range(step * m, (step + 1) * m) if i in self.losses]
        return sum(losses) / len(losses) if losses else None

    def fresh_weights(self, step: int) -> dict[int, torch.Tensor]:
        """Every chunk's weights just after step ``step``'s update (a stale chunk's
        just-updated version): what the PS evaluates."""
        return {c: vs[step % len(vs)].flat_params.cpu() for c, vs in self.versions.items()}

    def final_params(self, chunk: int) -> torch.Tensor:
        """The weights after the run: for a stale chunk, ``V_{S+1}`` (the last gradient
        applied once more, the flush at the end of training)."""
        vs = self.versions[chunk]
        return (vs[(self.cfg.run.iterations + 1) % len(vs)] if len(vs) == 2
                else vs[0]).flat_params.cpu()
