"""Replay workload: real models' gradient sizes, simulated compute.

Each worker holds parameters with the exact per-layer shapes of a real model
(ResNet-50 by default, 25,557,032 parameters, defined in ``resnet.py``) and
produces a synthetic gradient of those sizes after sleeping ``compute_ms`` (the
measured forward+backward time it stands in for). The network sees exactly the
bytes, chunk boundaries and timing the real model would send, while 16-32
workers fit on two cores. The gradient is drawn once per worker from a seeded
generator and reused, so replay costs no CPU per iteration beyond compression
and I/O; with error feedback the residual still evolves as in real training.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from agents.core.config import WorkloadConfig
from agents.workloads.base import Batch, Workload, register_workload


class ReplayModel(nn.Module):
    """Parameters with a real model's shapes and nothing else."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        self.names = [n for n, _ in shapes]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.zeros(s), requires_grad=True) for _, s in shapes)


def model_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    from agents.workloads import resnet

    net = {"resnet50": resnet.resnet50, "resnet18": resnet.resnet18}[model]()
    return [(n, tuple(p.shape)) for n, p in net.named_parameters()]


@register_workload("replay")
class Replay(Workload):
    name = "replay"

    @classmethod
    def from_config(cls, cfg: WorkloadConfig) -> Replay:
        return cls(model=str(cfg.model), compute_ms=float(cfg.compute_ms),
                   replay_bytes=int(cfg.replay_bytes))

    def __init__(self, model: str = "resnet50", compute_ms: float = 100.0,
                 replay_bytes: int = 0) -> None:
        self.model = model
        self.replay_bytes = replay_bytes
        self.compute_ms = compute_ms
        self._grad: dict[int, list[torch.Tensor]] = {}

    def build_model(self, seed: int) -> nn.Module:
        torch.manual_seed(seed)
        shapes: list[tuple[str, tuple[int, ...]]] = (
                  [("flat", (self.replay_bytes // 4,))] if self.replay_bytes
                  else model_shapes(self.model))
        m = ReplayModel(shapes)
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.01)
        return m

    def batch(self, iteration: int, worker: int, n_workers: int, batch_size: int) -> Batch:
        return Batch(torch.tensor([worker]), torch.tensor([iteration]))

    def prepare(self, model: nn.Module, worker: int, seed: int) -> None:
        """Draw this worker's synthetic gradient now (the worker calls it before it
        connects). Drawn lazily instead, iteration 0's "compute" would also hold 16
        workers drawing 20 MB each on two cores: about 0.9 s instead of ``compute_ms``."""
        if worker >= 0 and worker not in self._grad:  # the PS (-1) needs none
            gen = torch.Generator().manual_seed(seed * 1_000_003 + worker)
            self._grad[worker] = [torch.randn(p.shape, generator=gen) * 1e-3
                                  for p in model.parameters()]

    def fill_grad(self, model: nn.Module, worker: int, seed: int) -> None:
        """Sleep for the compute time, then write this worker's fixed synthetic
        gradient into the parameters' ``.grad`` (the flat gradient buffer)."""
        time.sleep(self.compute_ms / 1000.0)
        self.prepare(model, worker, seed)
        with torch.no_grad():
            for p, grad in zip(model.parameters(), self._grad[worker], strict=True):
                assert p.grad is not None
                p.grad.copy_(grad)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        raise NotImplementedError("replay has no loss: use fill_grad")

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "model": self.model, "compute_ms": self.compute_ms,
                "replay_bytes": self.replay_bytes}


