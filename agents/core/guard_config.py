"""``[guard]``: what the PS accepts from authenticated workers.

A worker that proved its key can still send a poisoned gradient; these bounds turn that
into a ``frame_error`` that drops the worker (``run.on_worker_death`` then says whether the
run goes on) instead of a model that silently becomes NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agents.core.checks import check


@dataclass(frozen=True)
class GuardConfig:
    max_abs_grad: float = 1e6          # |gradient value| above this is a payload error; 0 = no bound
    handshake_timeout_s: float = 5.0  # a whole handshake must finish within this (absolute)

    def validate(self, p: str) -> None:
        check(math.isfinite(self.max_abs_grad) and self.max_abs_grad >= 0,
              f"{p}.max_abs_grad", self.max_abs_grad,
              "must be a finite number >= 0 (0 = no bound)")
        check(math.isfinite(self.handshake_timeout_s) and self.handshake_timeout_s > 0,
              f"{p}.handshake_timeout_s", self.handshake_timeout_s, "must be > 0")
