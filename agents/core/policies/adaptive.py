"""The adaptive compression ratio of seeds/004 (DESIGN.md section 1.1), sans-I/O.

Per worker and per iteration i:

1. ``S`` is the size of this iteration's gradient before compression.
2. ``r0`` is the sending rate measured as the transfer starts.
3. ``r(t)`` is sampled from the kernel (``TCP_INFO`` bytes_acked deltas or delivery_rate)
   while the chunks go out; ``rt`` is the rate once it is stable,
   ``|r(t) - r(t+1)| / r(t) <= eps``.
4. ``sent`` is the gradient bytes already sent, ``remaining = S - sent``.
5. The keep ratio of the chunks not yet sent follows from one of two readings of the
   patent's formula.

**The literal reading** (``formula="literal"``). The patent defines the rate-change ratio
``c = (r0 - rt) / r0`` and the compression ratio ``CR = (sent + remaining * c) / S``, the bytes
sent being ``CR * gradient``. Worked example: ``S = 100 MB``, ``sent = 40 MB``, ``r0 = 100``,
``rt = 60`` Mbit/s: ``c = 0.4``, ``CR = (40 + 60 * 0.4) / 100 = 0.64``; the remaining 60 MB are
sent at ``(0.64 * 100 - 40) / 60 = 0.4``. Taken at its word an unchanged rate (``c = 0``)
gives ``CR = sent / S``: nothing more would be sent at all, and a *faster* link would send
less than a slower one.

**The consistent reading** (``formula="consistent"``, the default).
``overall = clamp((sent + remaining * rt / r0) / S, keep_min, 1)``: the remaining bytes shrink
in proportion to the rate, so the transfer still ends on the schedule planned at ``r0``. An
unchanged rate cuts nothing; a halved rate halves the unsent part. It is the default because
it is the only reading under which the policy is a no-op when nothing changes.

**Two ratios.** ``overall_keep`` is the fraction of the *whole* gradient that gets sent
(the patent's CR). The compressor, though, only acts on the chunks not yet sent, so what it
needs is ``chunk_keep = clamp((overall * S - sent) / remaining, keep_min, 1)``. Under the
consistent reading ``chunk_keep`` is simply ``rt / r0``; under the literal one it is ``c``
(both within the clamps).
Both are exposed, and both go into the ``decision`` event.

Everything not sent stays in the error-feedback residual (DESIGN.md 1.2).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from agents.core.config import AdaptiveConfig, ExperimentConfig
from agents.core.drain import conservative_rate_bps
from agents.core.policies.base import Decision, RatioContext, register_ratio_policy

FORMULAS = ("consistent", "literal")


def _clamp(x: float, lo: float, hi: float) -> float:
    return lo if x < lo else hi if x > hi else x


def _check_sizes(size_bytes: int, sent_bytes: int) -> None:
    if size_bytes <= 0:
        raise ValueError(f"size_bytes={size_bytes}: must be > 0")
    if not (0 <= sent_bytes <= size_bytes):
        raise ValueError(f"sent_bytes={sent_bytes}: must be in [0, size_bytes={size_bytes}]")


def overall_keep(size_bytes: int, sent_bytes: int, r0_bps: float, rt_bps: float,
                 formula: str = "consistent", keep_min: float = 0.001) -> float:
    """The fraction of the whole gradient sent this iteration (the patent's CR), clamped to
    [keep_min, 1]. See the module docstring for the two formulas."""
    _check_sizes(size_bytes, sent_bytes)
    if r0_bps <= 0.0:
        raise ValueError(f"r0_bps={r0_bps}: must be > 0")
    if rt_bps < 0.0:
        raise ValueError(f"rt_bps={rt_bps}: must be >= 0")
    remaining = size_bytes - sent_bytes
    if formula == "consistent":
        raw = (sent_bytes + remaining * rt_bps / r0_bps) / size_bytes
    elif formula == "literal":
        c = (r0_bps - rt_bps) / r0_bps
        raw = (sent_bytes + remaining * c) / size_bytes
    else:
        raise ValueError(f"formula={formula!r}: must be one of {FORMULAS}")
    return _clamp(raw, keep_min, 1.0)


# The name for the same function.
keep_ratio = overall_keep


def chunk_keep(size_bytes: int, sent_bytes: int, overall: float,
               keep_min: float = 0.001) -> float:
    """The keep ratio for the *remaining* chunks that makes the iteration's total equal
    ``overall * size_bytes``: ``clamp((overall * S - sent) / remaining, keep_min, 1)``.
    With nothing remaining there is nothing to compress, and the answer is 1."""
    _check_sizes(size_bytes, sent_bytes)
    remaining = size_bytes - sent_bytes
    if remaining == 0:
        return 1.0
    return _clamp((overall * size_bytes - sent_bytes) / remaining, keep_min, 1.0)


def ack_clock_rate_bps(samples: list[tuple[int, int]]) -> float | None:
    """The rate an upload's ACKs came back at: ``samples`` are (ts_ns, bytes_acked)
    readings taken while the upload drains, in time order; the rate is the bytes acked
    between the first and the last reading at which ``bytes_acked`` rose, over the time
    between them, in bits/s:

        rate = 8 x (acked_last_rise - acked_first_rise) / (t_last_rise - t_first_rise)

    The first rise's own bytes are left out (they were sent before the first reading), so
    neither the RTT before the first ACK nor a delayed final ACK after the last rise counts.
    None with fewer than two rises (nothing to time)."""
    rises: list[tuple[int, int]] = []
    prev: int | None = None
    for ts_ns, acked in samples:
        if prev is not None and acked > prev:
            rises.append((ts_ns, acked))
        prev = acked
    if len(rises) < 2 or rises[-1][0] <= rises[0][0]:
        return None
    return 8e9 * (rises[-1][1] - rises[0][1]) / (rises[-1][0] - rises[0][0])


def _raw_chunk_keep(formula: str, r0_bps: float, rt_bps: float) -> float:
    # Unclamped chunk ratio, only used to name the clamp in the decision's reason.
    return rt_bps / r0_bps if formula == "consistent" else (r0_bps - rt_bps) / r0_bps


@register_ratio_policy("adaptive")
class AdaptiveRatio:
    """The per-worker adaptive keep ratio, configured by the ``[adaptive]`` section
    (:class:`agents.core.config.AdaptiveConfig`, one definition for the file and the
    policy). Feed it ``start`` once per iteration, every
    kernel rate sample through ``observe``, and ask ``keep_for_next_chunk`` before each
    chunk. It keeps no history across iterations -- ``start`` resets it -- unless
    ``carry_rt`` is set and r0 is fixed, when the last stable rate carries over.

    ``rt`` tracks the latest stable rate: whenever the last ``min_samples`` samples agree
    pairwise within ``eps``, the newest becomes ``rt``; unstable samples leave the previous
    ``rt`` in place, so a second bandwidth change inside one iteration is followed too.
    """

    name = "adaptive"
    decides_in_flight = True     # keeps are decided from rate samples during the transfer
    follows_bandwidth = False    # the controller's B(t) hints are not used
    budgets_bytes = True         # its keep is a byte budget (adaptive.budget)

    @classmethod
    def from_config(cls, cfg: ExperimentConfig, ctx: RatioContext) -> AdaptiveRatio:
        """The ``[adaptive]`` section as it stands; the last stable rate is carried over
        only when r0 is the planned share (a fixed r0 to compare it with)."""
        a = cfg.adaptive
        return cls(dataclasses.replace(a, carry_rt=a.carry_rt and a.r0 == "planned"))

    def __init__(self, config: AdaptiveConfig | None = None, **params: object) -> None:
        if config is not None and params:
            raise ValueError("give either an AdaptiveConfig or keyword parameters, not both")
        self.config = config if config is not None else AdaptiveConfig(**params)  # type: ignore[arg-type]
        self._size_bytes = 0
        self._r0_bps: float | None = None
        self._rt_bps: float | None = None
        self._window: deque[float] = deque(maxlen=self.config.min_samples)
        # rate_source "drain": the last drain_window link-rate samples (agents.core.drain).
        self._drains: deque[float] = deque(maxlen=self.config.drain_window)
        self._ts_ns: int | None = None
        self._ewma: float | None = None

    @property
    def r0_bps(self) -> float | None:
        return self._r0_bps

    @property
    def rt_bps(self) -> float | None:
        return self._rt_bps

    def start(self, size_bytes: int, r0_bps: float | None = None, ts_ns: int = 0) -> None:
        if size_bytes <= 0:
            raise ValueError(f"size_bytes={size_bytes}: must be > 0")
        if r0_bps is not None and not r0_bps > 0.0:
            raise ValueError(f"r0_bps={r0_bps}: must be > 0 (or None to use the first sample)")
        same_r0 = r0_bps is not None and r0_bps == self._r0_bps
        carry = self.config.carry_rt and same_r0
        self._size_bytes = int(size_bytes)
        self._r0_bps = r0_bps
        if not carry:
            self._rt_bps = None
        # With one upload sample per iteration (rate_source "upload"), stability compares
        # consecutive iterations' samples, so the window carries over with rt.
        if not (carry and self.config.rate_source == "upload"):
            self._window.clear()
            self._ewma = None
        # Drain samples come after an upload, and not from every one: the last drain_window
        # samples are the estimator, so they carry over whenever r0 is the same fixed plan,
        # and rt is their conservative rate (agents.core.drain.conservative_rate_bps). An
        # upload without a sample (none of its packets waited in the shaper) leaves them as
        # they are: a slow link must not fall back to the (dense) plan between samples.
        if self.config.rate_source == "drain":
            if not same_r0 or r0_bps is None:
                self._drains.clear()
            self._rt_bps = (None if r0_bps is None else
                            conservative_rate_bps(self._drains, r0_bps, self.config.eps))
        self._ts_ns = ts_ns

    def observe(self, rate_bps: float, ts_ns: int) -> None:
        if rate_bps < 0.0:
            raise ValueError(f"rate_bps={rate_bps}: must be >= 0")
        self._ts_ns = ts_ns
        if self._r0_bps is None and rate_bps > 0.0:
            self._r0_bps = rate_bps
        if self.config.rate_source == "drain":
            self._drains.append(rate_bps)
            if self._r0_bps is not None:
                self._rt_bps = conservative_rate_bps(self._drains, self._r0_bps,
                                                     self.config.eps)
            return
        a = self.config.ewma_alpha
        self._ewma = rate_bps if self._ewma is None else a * rate_bps + (1 - a) * self._ewma
        self._window.append(self._ewma)
        if len(self._window) < self.config.min_samples:
            return
        w = list(self._window)
        if all(a > 0.0 and abs(a - b) / a <= self.config.eps for a, b in zip(w, w[1:], strict=False)):
            self._rt_bps = w[-1]

    def keep_for_next_chunk(self, sent_bytes: int) -> Decision:
        if self._size_bytes <= 0:
            raise RuntimeError("keep_for_next_chunk before start()")
        _check_sizes(self._size_bytes, sent_bytes)
        remaining = self._size_bytes - sent_bytes
        r0, rt = self._r0_bps, self._rt_bps
        if remaining == 0:
            return Decision(r0, rt, sent_bytes, 0, 1.0, "nothing-remaining", 1.0, self._ts_ns)
        cfg = self.config
        if r0 is None or rt is None:
            # No basis for a cut yet: follow the plan (dense by default) rather than guess.
            keep = max(cfg.plan_keep, cfg.keep_min)
            return Decision(r0, rt, sent_bytes, remaining, keep, "no-stable-rate", keep,
                            self._ts_ns)
        r0_plan = r0 / cfg.plan_keep
        overall = overall_keep(self._size_bytes, sent_bytes, r0_plan, rt, cfg.formula,
                               cfg.keep_min)
        keep = chunk_keep(self._size_bytes, sent_bytes, overall, cfg.keep_min)
        raw = _raw_chunk_keep(cfg.formula, r0_plan, rt)
        reason = "clamped-min" if raw < cfg.keep_min else "clamped-max" if raw > 1.0 else "stable"
        return Decision(r0, rt, sent_bytes, remaining, keep, reason, overall, self._ts_ns)
