"""How long before a release the delay line stops sleeping and spins (sans-I/O).

The delay line (``topo.delayline``) sleeps in ``select`` until shortly before its next
release and spins the rest, because a timed wake-up lands late. How late depends on the
machine and on how long the loop slept, not on the delay line: on the Firecracker guest
used for development a ``select`` of 20 us woke 11 us late (median, SCHED_FIFO, 1 ns
timer slack), one of 1 ms 29 us, one of 10 ms or more 63-78 us, and more than that on an
idle host (an idle vCPU halts, and the host must schedule it again). A fixed spin window
is therefore either too short (an idle machine's releases land 40-80 us late) or costs
CPU that a busy machine at 100 Mbit/s does not need to pay.

``SpinWindow`` learns the window from the wake-ups the loop itself observes: the window
is a high quantile of the last ``samples`` overshoots (actual wake time minus requested),
plus a margin, clamped to ``[min_ns, max_ns]``. The spin it pays for is bounded: once the
loop has spun ``budget_frac`` of the current ``period_ns``, the window falls to
``min_ns`` (the fixed window used before) until the period ends, so a window learnt while
idle cannot cost a core once traffic keeps the loop awake (with releases closer together
than the window, no wake-up would ever correct it). ``SpinConfig.fixed`` keeps one
window for control runs.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

RERANK_EVERY = 8


class SpinError(ValueError):
    """A bad spin configuration; the message names the field."""


@dataclass(frozen=True)
class SpinConfig:
    """The spin window's knobs. Every field is in nanoseconds unless its name says else."""

    # Window before any wake-up was observed: the floor.
    initial_ns: int = 30_000
    # Floor, also the window while the budget is spent: the fixed window the delay line
    # used before it learnt one (at 100 Mbit/s and 1 ms RTT it cost the two delay lines
    # 0.65 cores, no spin 0.73: the spin itself is cheap there, the notices are not).
    min_ns: int = 30_000
    # Ceiling: more window, fewer late releases on an idle host, more CPU per release.
    max_ns: int = 200_000
    # Added to the quantile: the spin loop's own turn, so a wake at the quantile is in time.
    margin_ns: int = 5_000
    # Overshoots remembered; fewer adapt faster and forget a burst sooner.
    samples: int = 32
    # Which overshoot the window covers; higher, fewer late wake-ups and longer spins.
    quantile: float = 0.9
    # Share of each period the loop may spin before the window drops to min_ns; higher,
    # more releases on time under heavy traffic, more CPU (0.1 of a core per delay line).
    budget_frac: float = 0.1
    period_ns: int = 100_000_000

    def __post_init__(self) -> None:
        for name in ("initial_ns", "min_ns", "max_ns", "margin_ns", "samples", "period_ns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpinError(f"{name}={value!r}: a non-negative integer")
        if not self.min_ns <= self.initial_ns <= self.max_ns:
            raise SpinError(f"initial_ns={self.initial_ns}: must lie in min_ns..max_ns "
                            f"({self.min_ns}..{self.max_ns})")
        if self.samples < 1 or self.period_ns < 1:
            raise SpinError(f"samples={self.samples}, period_ns={self.period_ns}: each >= 1")
        if not 0.0 <= self.quantile <= 1.0:
            raise SpinError(f"quantile={self.quantile!r}: allowed 0..1")
        if not 0.0 <= self.budget_frac <= 1.0:
            raise SpinError(f"budget_frac={self.budget_frac!r}: allowed 0..1")

    @classmethod
    def fixed(cls, window_ns: int) -> SpinConfig:
        """One window, never adapted and never throttled (the control for measurements)."""
        return cls(initial_ns=window_ns, min_ns=window_ns, max_ns=window_ns, budget_frac=1.0)


@dataclass
class SpinWindow:
    """The loop tells it each timed wake-up's overshoot (``woke``) and each spin
    (``spun``); ``window_ns(now_ns)`` is how long before the next release to stop sleeping.
    ``record()`` says what it saw, for the delay line's stats."""

    config: SpinConfig = field(default_factory=SpinConfig)
    _recent: deque[int] = field(init=False)
    _learnt_ns: int = field(init=False)
    _period_start_ns: int | None = None
    _period_spun_ns: int = 0
    wakes: int = 0
    overshoot_sum_ns: int = 0
    overshoot_max_ns: int = 0
    spun_ns: int = 0
    throttled_periods: int = 0
    _throttled: bool = False

    def __post_init__(self) -> None:
        self._recent = deque(maxlen=self.config.samples)
        self._learnt_ns = self.config.initial_ns

    def woke(self, overshoot_ns: int) -> None:
        """A sleep that ended by its timeout woke ``overshoot_ns`` after the time asked
        for. (A sleep ended early by a packet says nothing about the timer: leave it out.)"""
        c = self.config
        over = max(0, overshoot_ns)
        self.wakes += 1
        self.overshoot_sum_ns += over
        self.overshoot_max_ns = max(self.overshoot_max_ns, over)
        self._recent.append(over)
        # Re-rank every few samples only: at 100 Mbit/s the loop wakes ~4000 times a
        # second, and a sort per wake-up was a visible share of its CPU.
        if self.wakes % RERANK_EVERY and len(self._recent) == c.samples:
            return
        ranked = sorted(self._recent)
        q = ranked[min(len(ranked) - 1, int(c.quantile * len(ranked)))]
        self._learnt_ns = min(c.max_ns, max(c.min_ns, q + c.margin_ns))

    def spun(self, spin_ns: int, now_ns: int) -> None:
        """The loop spent ``spin_ns`` spinning, ending at ``now_ns``."""
        self._roll(now_ns)
        self.spun_ns += spin_ns
        self._period_spun_ns += spin_ns

    def window_ns(self, now_ns: int) -> int:
        """The window to use now: the learnt one, or ``min_ns`` while this period's spin
        budget is spent."""
        self._roll(now_ns)
        c = self.config
        if self._period_spun_ns >= c.budget_frac * c.period_ns:
            if not self._throttled:
                self._throttled = True
                self.throttled_periods += 1
            return c.min_ns
        return self._learnt_ns

    def _roll(self, now_ns: int) -> None:
        if self._period_start_ns is None or now_ns - self._period_start_ns >= self.config.period_ns:
            self._period_start_ns = now_ns
            self._period_spun_ns = 0
            self._throttled = False

    def record(self) -> dict[str, float | int]:
        return {"timed_wakes": self.wakes,
                "overshoot_mean_us": self.overshoot_sum_ns / self.wakes / 1e3
                if self.wakes else 0.0,
                "overshoot_max_us": self.overshoot_max_ns / 1e3,
                "window_us": self._learnt_ns / 1e3,
                "spun_s": self.spun_ns / 1e9,
                "throttled_periods": self.throttled_periods}
