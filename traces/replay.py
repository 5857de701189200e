"""Sans-I/O trace replayer: turns a bandwidth trace and a clock into rate changes.

This is the scheduling half of Mahimahi-style trace replay (Netravali et al., "Mahimahi",
USENIX ATC 2015) done with HTB instead of a packet scheduler: DESIGN.md section 1.1 replays
B(t) on the bottleneck by changing the HTB class rate (``tc class change``, never deleting the
qdisc). The replayer owns no clock, no socket and no process: the controller asks it what is
:meth:`TraceReplayer.due` at ``now_ns`` and when the next change is
(:meth:`TraceReplayer.next_deadline_ns`), runs the ``tc`` commands itself and logs each
applied change as a ``trace_step`` event. Tests drive it with a fake clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from agents.core.bandwidth import BandwidthTrace, _same_rate


@dataclass(frozen=True)
class RateChange:
    """Set the bottleneck to ``rate_mbps`` at ``t_ns`` (the scheduled time, not the time the
    replayer was asked). ``index`` is the step's position in one period of the trace and
    ``loop`` counts completed periods."""

    t_ns: int
    rate_mbps: float
    index: int
    loop: int = 0


class TraceReplayer:
    """Replays ``trace`` from ``start_ns`` on a ``granularity_s`` grid, looping forever.

    Contract: the first :meth:`due` call at or after ``start_ns`` returns the initial rate;
    afterwards only real changes are returned (when the end of the trace wraps to a step
    with the same rate, nothing is emitted). A caller that was late gets every change it
    missed, in order, each with its scheduled ``t_ns``; applying the last one gives the
    current rate.
    """

    def __init__(self, trace: BandwidthTrace, *, granularity_s: float = 0.1,
                 start_ns: int) -> None:
        self.trace = trace
        self.granularity_s = granularity_s
        self.start_ns = int(start_ns)
        steps = trace.steps(granularity_s)
        self._step_ns = [round(t_s * 1e9) for t_s, _ in steps]
        self._rates = [r for _, r in steps]
        self._period_ns = round(trace.period_s * 1e9)
        if self._period_ns <= self._step_ns[-1]:
            raise ValueError(f"{trace.source}: period {trace.period_s} s is too short to "
                             f"replay at 1 ns resolution")
        self._loop = 0
        self._idx = 0
        self._last_rate: float | None = None

    @property
    def steps(self) -> list[tuple[int, float]]:
        """One period as (offset_ns from the period start, rate_mbps)."""
        return list(zip(self._step_ns, self._rates, strict=True))

    def _time_of(self, loop: int, idx: int) -> int:
        # Computed from integers every time so a long replay does not accumulate drift.
        return self.start_ns + loop * self._period_ns + self._step_ns[idx]

    def _is_change(self, idx: int) -> bool:
        return self._last_rate is None or not _same_rate(self._rates[idx], self._last_rate)

    def _skip_non_changes(self) -> None:
        """Advance the cursor past steps that would not change the rate (only the wrap can
        produce one, since neighbouring steps are merged)."""
        if self._last_rate is None:
            return
        if len(self._rates) == 1:
            return
        while not self._is_change(self._idx):
            self._advance()

    def _advance(self) -> None:
        self._idx += 1
        if self._idx == len(self._rates):
            self._idx = 0
            self._loop += 1

    def due(self, now_ns: int) -> list[RateChange]:
        """The rate changes scheduled at or before ``now_ns`` not yet returned."""
        out: list[RateChange] = []
        if self._last_rate is not None and len(self._rates) == 1:
            return out  # a constant trace changes nothing after its initial rate
        self._skip_non_changes()
        while self._time_of(self._loop, self._idx) <= now_ns:
            rate = self._rates[self._idx]
            out.append(RateChange(self._time_of(self._loop, self._idx), rate, self._idx,
                                  self._loop))
            self._last_rate = rate
            self._advance()
            if len(self._rates) == 1:
                break
            self._skip_non_changes()
        return out

    def next_deadline_ns(self) -> int | None:
        """When the next change is due, or None if the rate never changes again."""
        if self._last_rate is not None and len(self._rates) == 1:
            return None
        self._skip_non_changes()
        return self._time_of(self._loop, self._idx)

    def rate_at_ns(self, now_ns: int) -> float:
        """The rate the trace allows at ``now_ns`` on the replay grid (a pure query)."""
        if now_ns < self.start_ns:
            raise ValueError(f"now_ns={now_ns} is before start_ns={self.start_ns}")
        offset = (now_ns - self.start_ns) % self._period_ns
        i = 0
        for k, t in enumerate(self._step_ns):
            if t <= offset:
                i = k
        return self._rates[i]


@dataclass
class LeadTimer:
    """Issues rate changes early by the lag they have recently shown, so they land on time.

    A rate change lands some milliseconds after the replay thread wakes for it: the wake-up
    itself, and on these 2-vCPU virtual machines a few slow ms after sleeping while the
    other vCPU is busy with the packets of a saturated link (measured in
    ``benchmarks/trace_fidelity.py``: 8-17 ms, the netlink change itself well under 1 ms).
    Either side of a step gains or loses ``lag x |old - new|`` bytes: 13 ms late after a
    100 -> 20 Mbit/s step is +5 % in that second. The replayer therefore asks for changes
    ``lead_ns`` ahead (``due(now + lead_ns)``) and :meth:`observe` tracks the lag (an
    exponential average with weight ``gain``, at most ``max_lead_ns``). Pure: the caller
    supplies the clock.
    """

    max_lead_ns: int = 25_000_000
    gain: float = 0.5
    lead_ns: int = 0

    def observe(self, due_ns: int, applied_ns: int, lead_used_ns: int | None = None) -> None:
        """A change due at ``due_ns``, issued ``lead_used_ns`` before it (default: the
        current lead), was in the kernel at ``applied_ns``."""
        used = self.lead_ns if lead_used_ns is None else lead_used_ns
        lag_ns = applied_ns - (due_ns - used)
        self.lead_ns = int(min(self.max_lead_ns,
                               max(0.0, self.lead_ns + self.gain * (lag_ns - self.lead_ns))))


def calibrate_lead(lead: LeadTimer, apply: Callable[[], None], *, clock_ns: Callable[[], int],
                   sleep_s: Callable[[float], None], rounds: int = 8,
                   spacing_s: float = 0.05) -> None:
    """Prime ``lead`` before the trace clock starts, so the first steps land on time too.

    Each round schedules a no-op change (``apply`` re-sets the current rate) ``spacing_s``
    ahead, sleeps until it is due minus the lead, applies it and observes how late it landed:
    the same wake-up and netlink path as a real step. Eight rounds at the default gain take
    the lead within 0.5 % of a steady lag.

    Two rounds in a row that land later than ``lead.max_lead_ns`` end it early: the lead is
    pinned at its cap and more such rounds cannot move it. A point on another server (a
    change over ssh, some 300 ms) would otherwise spend 8 slow changes, seconds that a short
    run waits for at its end; one slow first round alone (a cold netlink path) does not
    end it.
    """
    over_cap = 0
    for _ in range(rounds):
        due = clock_ns() + round(spacing_s * 1e9)
        wait = (due - lead.lead_ns - clock_ns()) / 1e9
        if wait > 0:
            sleep_s(wait)
        used = lead.lead_ns
        apply()
        applied = clock_ns()
        lead.observe(due, applied, used)
        over_cap = over_cap + 1 if applied - (due - used) >= lead.max_lead_ns else 0
        if over_cap == 2:
            return
