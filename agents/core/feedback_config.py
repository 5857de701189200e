"""The ``[feedback]`` section: DGC's momentum correction and momentum factor masking as
options of error feedback (``agents/compress/feedback.py``; Lin et al., ICLR 2018). Pure data.

With ``momentum_correction`` the SGD momentum ``workload.momentum`` moves from the PS onto
the workers, before compression (``u = m u + g; v = v + u``, send ``C(v)``), and the PS steps
without momentum. It needs ``compress.error_feedback`` (the residual is where the corrected
momentum lives) and ``workload.momentum`` > 0; ``ExperimentConfig.validate`` checks both.
"""

from __future__ import annotations

from dataclasses import dataclass


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

    def validate(self, p: str) -> None:
        return None  # two booleans; the cross-section rules live in ExperimentConfig
