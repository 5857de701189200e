"""The fixed keep-ratio baseline: GRACE/DGC-style constant top-k ratio.

Every chunk of every iteration is sent at the same ``keep`` whatever the network does;
``keep = 1`` is dense training. ``compress.worker_ratios`` gives each worker its own
constant keep (per-worker fixed ratios chosen with hindsight, the baseline a per-worker
adaptive keep is compared with). It answers through the same :class:`RatioPolicy` interface as
the adaptive and oracle policies so a config swaps them by name.
"""

from __future__ import annotations

from agents.core.config import ExperimentConfig
from agents.core.policies.base import (
    Decision,
    RatioContext,
    check_sent,
    register_ratio_policy,
)


@register_ratio_policy("fixed")
class FixedRatio:
    """Always ``keep``. Lower keep: fewer bytes per iteration, a larger residual."""

    name = "fixed"
    decides_in_flight = False    # the keep is known before the transfer starts
    follows_bandwidth = False
    budgets_bytes = False    # its keep is an element ratio, as configured

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, ctx: RatioContext) -> FixedRatio:
        """Keeps ``compress.ratio`` of every chunk, or this worker's own entry of
        ``compress.worker_ratios`` when that is set (per-worker fixed ratios)."""
        ratios = cfg.compress.worker_ratios
        if not ratios:
            return cls(keep=cfg.compress.ratio)
        if not 0 <= ctx.worker < len(ratios):
            raise ValueError(f"worker {ctx.worker}: compress.worker_ratios has "
                             f"{len(ratios)} entries")
        return cls(keep=ratios[ctx.worker])

    def __init__(self, keep: float = 1.0) -> None:
        if not (0.0 < keep <= 1.0):
            raise ValueError(f"fixed.keep={keep!r}: must be in (0, 1]")
        self.keep = float(keep)
        self._size_bytes = 0
        self._r0_bps: float | None = None
        self._ts_ns: int | None = None

    def start(self, size_bytes: int, r0_bps: float | None = None, ts_ns: int = 0) -> None:
        if size_bytes <= 0:
            raise ValueError(f"size_bytes={size_bytes}: must be > 0")
        self._size_bytes = int(size_bytes)
        self._r0_bps = r0_bps
        self._ts_ns = ts_ns

    def observe(self, rate_bps: float, ts_ns: int) -> None:
        # The rate is ignored by design; only the clock is kept for the decision log.
        self._ts_ns = ts_ns

    def keep_for_next_chunk(self, sent_bytes: int) -> Decision:
        remaining = check_sent(self._size_bytes, sent_bytes)
        overall = (sent_bytes + remaining * self.keep) / self._size_bytes
        return Decision(self._r0_bps, None, sent_bytes, remaining, self.keep, "fixed", overall,
                        self._ts_ns)
