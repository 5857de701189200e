"""How many iterations a workload needs to reach a target accuracy at a fixed keep ratio,
measured in one process: the input ``analysis.tta_model`` needs, for any workload, without
running a network (DESIGN.md 1.1-1.2).

It runs the same mathematics as a synchronous data-parallel run, with the project's parts:
- the workload's model, its per-worker batches and its held-out evaluation;
- the gradient in the workers' flat send order (``FlatModel``), cut into the same chunks
  (``chunk_ranges``);
- per worker and chunk, the registered compressor wrapped in ``ErrorFeedback`` (DESIGN
  1.2; with ``momentum_correction``, DGC's momentum correction and masking, as
  ``[feedback]`` configures the workers, with its layer-wise selection and sparsity warm-up),
  or bare when ``error_feedback`` is off, with the
  worker's seeded generator;
- at the PS the mean over workers and SGD with ``torch.optim.SGD``'s momentum semantics
  (``agents.workloads.base.sgd_step_``, the PS's own step; without momentum when the
  workers apply it), evaluated after every ``eval_every``-th iteration, as ``agents/dp/ps.py``
  does.

What it leaves out is time: the network decides how long an iteration takes, not what it
computes. ``tests/agents/dp/test_keep_response.py`` checks that with the ``none`` compressor it
reaches exactly the weights of one process training on the concatenated batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agents.compress.builder import CompressionSpec, Sender
from agents.core.feedback_config import warmup_keep
from agents.workloads.base import (
    FlatModel,
    Workload,
    chunk_layer_specs,
    chunk_ranges,
    sgd_step_,
)

__all__ = ["TrainingSpec", "iterations_to_target", "train"]


@dataclass(frozen=True)
class TrainingSpec:
    """The training half of an experiment config (``[workload]``, ``[run]``, ``[net]``)."""

    workers: int = 2
    batch_size: int = 32
    lr: float = 0.3
    momentum: float = 0.0
    chunk_bytes: int = 32_768
    eval_every: int = 2
    seed: int = 0
    compressor: str = "topk"
    error_feedback: bool = True        # compress.error_feedback
    momentum_correction: bool = False  # feedback.momentum_correction (needs error feedback)
    masking: bool = True               # feedback.masking
    per_layer: bool = False            # feedback.per_layer (a sparse compressor)
    dense_1d: bool = False             # feedback.dense_1d (a sparse compressor)
    warmup_iterations: int = 0         # feedback.warmup_iterations (keep = warmup_keep(...))

    def __post_init__(self) -> None:
        for name, ok in (("workers", self.workers >= 1), ("batch_size", self.batch_size >= 1),
                         ("lr", self.lr > 0), ("momentum", 0 <= self.momentum < 1),
                         ("chunk_bytes", self.chunk_bytes >= 4), ("eval_every",
                                                                   self.eval_every >= 1)):
            if not ok:
                raise ValueError(f"TrainingSpec.{name} = {getattr(self, name)!r} is out of range")
        if self.momentum_correction and not (self.error_feedback and self.momentum > 0):
            raise ValueError("TrainingSpec.momentum_correction needs error_feedback and "
                             "momentum > 0")


def train(workload: Workload, spec: TrainingSpec, keep: float, iterations: int,
          *, target: float | None = None) -> tuple[torch.Tensor, list[tuple[int, float]]]:
    """Train for ``iterations`` (or until an evaluation reaches ``target``) with every
    worker sending each chunk at ``keep``. Returns the PS's final flat weights and the
    evaluations as (iterations done, accuracy)."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep = {keep!r} must be in (0, 1]")
    ps = FlatModel(workload.build_model(spec.seed))
    workers = [FlatModel(workload.build_model(spec.seed)) for _ in range(spec.workers)]
    chunks = chunk_ranges(ps.numel, spec.chunk_bytes)
    worker_momentum = spec.momentum if spec.momentum_correction else 0.0
    # The workers' own builder: compressor, layer-wise selection, feedback and generator.
    compression = CompressionSpec(spec.compressor, error_feedback=spec.error_feedback,
                                  momentum=worker_momentum, masking=spec.masking,
                                  per_layer=spec.per_layer, dense_1d=spec.dense_1d)
    senders = [Sender(compression, spec.seed, w, chunk_layer_specs(ps.shapes, chunks))
               for w in range(spec.workers)]
    momentum_buf = torch.zeros_like(ps.flat_params)
    evals: list[tuple[int, float]] = []
    for i in range(iterations):
        keep_i = warmup_keep(i, keep, spec.warmup_iterations)  # as the worker does
        total = torch.zeros_like(ps.flat_params)
        for w, model in enumerate(workers):
            model.flat_params.copy_(ps.flat_params)
            model.zero_grad()
            workload.loss(model.module, workload.batch(i, w, spec.workers,
                                                      spec.batch_size)).backward()
            for c, (s, e) in enumerate(chunks):
                payload, _ = senders[w].compress(model.flat_grad[s:e], f"c{c}", keep_i)
                total[s:e] += senders[w].compressor.decompress(payload).view(-1)
        grad = total / spec.workers
        sgd_step_(ps.flat_params, grad, momentum_buf, lr=spec.lr,
                  momentum=spec.momentum - worker_momentum, first=i == 0)
        if (i + 1) % spec.eval_every == 0:
            metrics = workload.evaluate(ps.module)
            if metrics is None:
                raise ValueError(f"workload {workload.name!r} has no held-out evaluation")
            evals.append((i + 1, float(metrics["accuracy"])))
            if target is not None and evals[-1][1] >= target:
                break
    return ps.flat_params.clone(), evals


def iterations_to_target(workload: Workload, spec: TrainingSpec, keep: float, target: float,
                         max_iterations: int = 2000) -> int | None:
    """Iterations until the first evaluation at or above ``target`` (the PS's count, as
    ``benchmarks/cellular_tta.py`` reads it from a run); None if it is not reached within
    ``max_iterations``."""
    _, evals = train(workload, spec, keep, max_iterations, target=target)
    return evals[-1][0] if evals and evals[-1][1] >= target else None
