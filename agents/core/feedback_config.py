"""The ``[feedback]`` section: DGC's momentum correction, momentum factor masking and sparsity
warm-up as options of error feedback (``agents/compress/feedback.py``; Lin et al., "Deep
Gradient Compression", ICLR 2018). Pure data, plus the warm-up schedule as a pure function.

With ``momentum_correction`` the SGD momentum ``workload.momentum`` moves from the PS onto
the workers, before compression (``u = m u + g; v = v + u``, send ``C(v)``), and the PS steps
without momentum. It needs ``compress.error_feedback`` (the residual is where the corrected
momentum lives) and ``workload.momentum`` > 0; ``ExperimentConfig.validate`` checks both.

With ``per_layer`` the sparse compressor selects in each layer piece separately, and with
``dense_1d`` it sends 1-D parameters whole (DGC's code, synxlin/deep-gradient-compression,
compresses only ``param.dim() > 1``; ``agents/compress/sparse.py``). Both need a sparse
compressor that keeps k elements (``LAYERWISE_COMPRESSORS``; checked by
``ExperimentConfig.validate``).

With ``warmup_iterations`` = W > 0 the workers' keep ratio starts loose and tightens
exponentially (DGC section 3.4, "warm-up training": sparsity 75 %, 93.75 %, 98.4375 %,
99.6 %, then 99.9 %, over the first four epochs): :func:`warmup_keep`.
"""

from __future__ import annotations

from dataclasses import dataclass

from agents.core.checks import check

# DGC's warm-up: four stages, each keeping a quarter of the one before (sparsity 1 - 4^-(s+1):
# 75 %, 93.75 %, 98.4375 %, 99.609375 %); the configured ratio (99.9 % in DGC) follows.
WARMUP_STAGES = 4

# The sparse compressors whose selection keeps k_for(numel, ratio) elements and so can run
# layer by layer (agents/compress/sparse.py); threshold keeps whatever passes its threshold.
LAYERWISE_COMPRESSORS = ("topk", "dgc", "randomk")
WARMUP_STAGE_KEEP = 0.25


def warmup_keep(iteration: int, keep: float, warmup_iterations: int) -> float:
    """The keep ratio (fraction of elements sent) at ``iteration`` (0-based) under DGC's
    sparsity warm-up.

    For ``iteration < W`` (``W = warmup_iterations``) the run is in stage
    ``s = floor(WARMUP_STAGES * iteration / W)`` and keeps
    ``max(keep, WARMUP_STAGE_KEEP ** (s + 1))``: 0.25, 0.0625, 0.015625, 0.00390625 for
    s = 0..3, never sparser than the configured ``keep``. From iteration ``W`` on, and
    always when ``W = 0``, it is ``keep`` itself."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if warmup_iterations <= 0 or iteration >= warmup_iterations:
        return keep
    stage = WARMUP_STAGES * iteration // warmup_iterations
    return max(keep, WARMUP_STAGE_KEEP ** (stage + 1))


@dataclass(frozen=True)
class FeedbackConfig:
    # Apply workload.momentum on each worker before compression (DGC) instead of at the PS.
    # On: compressed-away coordinates keep their momentum in the residual, so sparse updates
    # arrive discounted as momentum SGD would apply them.
    momentum_correction: bool = False
    # With momentum_correction and a sparse compressor, zero the local momentum of every
    # coordinate just sent, so its stale velocity does not push it again (DGC's momentum
    # factor masking). Off keeps the velocity: dense-equivalent at keep 1.
    masking: bool = True
    # DGC's sparsity warm-up over the first this-many iterations (0 = off): four equal
    # stages keeping 25 %, 6.25 %, 1.5625 %, 0.39 % (or the configured ratio, if looser);
    # DGC spends four epochs on it. Early gradients change fast, and a residual that holds
    # 99.9 % of them from the first step sends stale, bursty updates (warmup_keep).
    warmup_iterations: int = 0
    # DGC selects top-k in each parameter tensor separately (k = ceil(ratio * numel) each,
    # at least one), not once over the whole bucket: a layer whose gradients are small next
    # to another's still sends every step. Off: one selection per chunk.
    per_layer: bool = False
    # DGC sparsifies only parameters with more than one dimension: biases and norm scales
    # and shifts (1-D) are sent whole every step, with their momentum unmasked. They travel
    # as (value, int32 index) pairs, 8 bytes per float32 element, counted in the wire bytes.
    dense_1d: bool = False

    def validate(self, p: str) -> None:
        check(0 <= self.warmup_iterations <= 1_000_000_000, f"{p}.warmup_iterations",
              self.warmup_iterations, "must be in [0, 1e9] iterations (0 = no warm-up)")
