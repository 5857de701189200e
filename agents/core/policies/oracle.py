"""The oracle keep ratio: an upper bound that knows the bandwidth trace.

It is not realisable on a real network: it reads the future of B(t) from the trace being
replayed. Each worker gets its link/N share of what the bottleneck allows over the planned
transfer time, and keeps exactly what fits: ``keep = B_bytes(t, t + planned) / N / S``. The
adaptive policy (DESIGN.md 1.1) can at best match it, so the gap between the two measures
what rate estimation costs.
"""

from __future__ import annotations

from agents.core.bandwidth import BandwidthTrace, constant, load_scaled_trace
from agents.core.config import ExperimentConfig
from agents.core.ethernet import TCP_GOODPUT_FRACTION
from agents.core.policies.base import (
    Decision,
    RatioContext,
    check_sent,
    register_ratio_policy,
)


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def oracle_keep(size_bytes: int, planned_s: float, trace: BandwidthTrace, t_s: float,
                n_workers: int, *, keep_min: float = 0.001,
                goodput_fraction: float = 1.0) -> float:
    """Fraction of ``size_bytes`` one of ``n_workers`` can send in ``[t_s, t_s + planned_s]``
    at its share ``B(t) / N`` of the trace, clamped to [keep_min, 1].

    ``goodput_fraction`` discounts headers (1448/1514 for TCP over Ethernet) when the trace
    gives link rates and the sizes are payload bytes.
    """
    if size_bytes <= 0:
        raise ValueError(f"size_bytes={size_bytes}: must be > 0")
    if planned_s <= 0.0:
        raise ValueError(f"planned_s={planned_s}: must be > 0")
    if n_workers <= 0:
        raise ValueError(f"n_workers={n_workers}: must be > 0")
    budget = trace.bytes_between(t_s, t_s + planned_s) * goodput_fraction / n_workers
    return _clamp(budget / size_bytes, keep_min, 1.0)


@register_ratio_policy("oracle")
class OracleRatio:
    """Per chunk: the keep that makes the remaining bytes fit the rest of the planned time.

    ``trace_start_ns`` is when the replayer started (trace time 0), so a report at ``ts_ns``
    is at trace time ``(ts_ns - trace_start_ns) / 1e9``. The clock is the latest ``ts_ns``
    given to ``start`` or ``observe``; the policy reads none itself.
    """

    name = "oracle"
    decides_in_flight = True     # keeps are decided chunk by chunk during the transfer
    follows_bandwidth = True     # rebuilt on each B(t)/N(t) hint from the controller
    budgets_bytes = True         # its keep is a byte budget (adaptive.budget)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, ctx: RatioContext) -> OracleRatio:
        """Reads the future of ``trace.up``, the trace the controller replays; without a
        trace the bottleneck is constant at ``net.bottleneck_mbps``. The planned time is
        ``plan_keep`` of the dense gradient at the planned rate."""
        if cfg.trace.up:
            trace = load_scaled_trace(cfg.trace.up, cfg.trace.granularity_ms, cfg.trace.scale)
        else:
            trace = constant(cfg.net.bottleneck_mbps, 3600.0)
        planned_s = cfg.adaptive.plan_keep * ctx.gradient_bytes * 8 / ctx.planned_bps
        return cls(trace=trace, n_workers=ctx.workers, planned_s=planned_s,
                   trace_start_ns=ctx.trace_start_ns, keep_min=cfg.adaptive.keep_min,
                   goodput_fraction=TCP_GOODPUT_FRACTION)

    def __init__(self, trace: BandwidthTrace, n_workers: int, planned_s: float,
                 trace_start_ns: int = 0, keep_min: float = 0.001,
                 goodput_fraction: float = 1.0) -> None:
        if n_workers <= 0:
            raise ValueError(f"oracle.n_workers={n_workers!r}: must be > 0")
        if planned_s <= 0.0:
            raise ValueError(f"oracle.planned_s={planned_s!r}: must be > 0")
        if not (0.0 < keep_min <= 1.0):
            raise ValueError(f"oracle.keep_min={keep_min!r}: must be in (0, 1]")
        self.trace = trace
        self.n_workers = n_workers
        self.planned_s = planned_s
        self.trace_start_ns = trace_start_ns
        self.keep_min = keep_min
        self.goodput_fraction = goodput_fraction
        self._size_bytes = 0
        self._start_ns = 0
        self._now_ns = 0

    def _t_s(self, ts_ns: int) -> float:
        return (ts_ns - self.trace_start_ns) / 1e9

    def start(self, size_bytes: int, r0_bps: float | None = None, ts_ns: int = 0) -> None:
        if size_bytes <= 0:
            raise ValueError(f"size_bytes={size_bytes}: must be > 0")
        self._size_bytes = int(size_bytes)
        self._start_ns = self._now_ns = ts_ns

    def observe(self, rate_bps: float, ts_ns: int) -> None:
        self._now_ns = max(self._now_ns, ts_ns)

    def set_workers(self, n_workers: int) -> None:
        """N changed (a worker left or joined): the share changes with it."""
        if n_workers <= 0:
            raise ValueError(f"n_workers={n_workers}: must be > 0")
        self.n_workers = n_workers

    def keep_for_next_chunk(self, sent_bytes: int) -> Decision:
        remaining = check_sent(self._size_bytes, sent_bytes)
        share = self.goodput_fraction / self.n_workers
        r0 = self.trace.rate_at(self._t_s(self._start_ns)) * 1e6 * share
        if remaining == 0:
            return Decision(r0, None, sent_bytes, 0, 1.0, "nothing-remaining", 1.0,
                            self._now_ns)
        left_s = self.planned_s - (self._now_ns - self._start_ns) / 1e9
        if left_s <= 0.0:
            keep = self.keep_min
            overall = (sent_bytes + remaining * keep) / self._size_bytes
            return Decision(r0, None, sent_bytes, remaining, keep, "over-plan", overall,
                            self._now_ns)
        t = self._t_s(self._now_ns)
        budget = self.trace.bytes_between(t, t + left_s) * share
        rt = budget * 8 / left_s
        raw = budget / remaining
        keep = _clamp(raw, self.keep_min, 1.0)
        reason = "clamped-min" if raw < self.keep_min else "clamped-max" if raw > 1.0 else "oracle"
        overall = (sent_bytes + remaining * keep) / self._size_bytes
        return Decision(r0, rt, sent_bytes, remaining, keep, reason, overall, self._now_ns)
