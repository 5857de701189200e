"""The ``[pipeline]`` config section: pipeline-parallel training (DESIGN.md 1.3).

``stages = 0`` (the default) means no pipeline: the run is data-parallel as before. The top-k
keep ratio is ``compress.ratio`` and the stages' ports count up from ``net.port``.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.core.checks import check as _check
from agents.core.checks import check_registered as _check_name
from agents.core.registry import COMPRESSOR, SCHEDULE


@dataclass(frozen=True)
class PipelineConfig:
    stages: int = 0                   # p stages (one process each); 0 = no pipeline
    schedule: str = "1f1b"            # a registered schedule: gpipe, 1f1b, two_group, ...
    micro_batches: int = 4            # m micro-batches per step and pipeline
    micro_batch_size: int = 16        # samples per micro-batch
    # Layers of the workload's nn.Sequential per piece (torchgpipe's balance), stages *
    # chunks pieces (two_group: 2 chunks); () = cut evenly by parameter count.
    balance: tuple[int, ...] = ()
    replicas: int = 1                 # d pipelines whose stage gradients are averaged each step
    recompute: bool = False           # free forward activations, recompute before backward
    act_compress: str = "none"        # activations downstream: a registered compressor (none, fp16, topk, ...)
    grad_compress: str = "none"       # gradients upstream: a registered compressor
    error_feedback: bool = True       # gradients: keep what top-k/fp16 did not send
    # Each forward/backward takes at least this long (the rest is slept): makes compute
    # dominate on a shared CPU without burning it, for the bubble benchmark.
    compute_pad_ms: float = 0.0
    # Pace every stage-to-stage socket at this rate (SO_MAX_PACING_RATE, the pacing shaping
    # method), e.g. on loopback where no tc link exists; 0 = off (the fabric's tc shapes).
    pace_mbps: float = 0.0

    @property
    def chunks(self) -> int:
        return 2 if self.schedule == "two_group" else 1

    @property
    def enabled(self) -> bool:
        return self.stages > 0

    def validate(self, p: str) -> None:
        _check(self.stages == 0 or 2 <= self.stages <= 32, f"{p}.stages", self.stages,
               "must be 0 (no pipeline) or in [2, 32]")
        _check_name(SCHEDULE, f"{p}.schedule", self.schedule)
        _check(1 <= self.micro_batches <= 1024, f"{p}.micro_batches", self.micro_batches,
               "must be in [1, 1024]")
        _check(1 <= self.micro_batch_size <= 4096, f"{p}.micro_batch_size",
               self.micro_batch_size, "must be in [1, 4096]")
        _check(all(b >= 1 for b in self.balance), f"{p}.balance", list(self.balance),
               "every piece must hold >= 1 layer")
        _check(not self.balance or len(self.balance) == self.stages * self.chunks,
               f"{p}.balance", list(self.balance),
               f"must list stages * chunks = {self.stages * self.chunks} pieces "
               f"({self.schedule} has {self.chunks} chunk(s) per stage)")
        _check(1 <= self.replicas <= 16, f"{p}.replicas", self.replicas, "must be in [1, 16]")
        for name in ("act_compress", "grad_compress"):
            _check_name(COMPRESSOR, f"{p}.{name}", getattr(self, name))
        _check(0 <= self.compute_pad_ms <= 60_000, f"{p}.compute_pad_ms",
               self.compute_pad_ms, "must be in [0, 60000] ms")
        _check(0 <= self.pace_mbps <= 100_000, f"{p}.pace_mbps", self.pace_mbps,
               "must be in [0, 100000] Mbit/s (0 = off)")
