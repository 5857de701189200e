"""Bandwidth traces: the time-varying bottleneck rate B(t) of DESIGN.md section 1.1.

A :class:`BandwidthTrace` is pure data: a piecewise-constant rate over one period that
loops at its end, as Mahimahi's ``mm-link`` loops its trace files (Winstein et al.,
"Stochastic Forecasts Achieve High Throughput and Low Delay over Cellular Networks",
NSDI 2013; Netravali et al., "Mahimahi", USENIX ATC 2015). Three file formats load into it:

- Mahimahi delivery opportunities (``.up``, ``.down``, ``.trace``): one integer millisecond
  timestamp per line, each line one 1500-byte packet that may cross the link then. The file
  loops with period equal to its *last* timestamp, exactly like Mahimahi's ``LinkQueue``
  (``base_timestamp += schedule.back()`` on wrap-around), so an opportunity at time ``P``
  coincides with time 0 of the next loop.
- Rate logs: ``time_s Mbps`` per line, ``#`` comments allowed.
- CSV with the header ``time_s,rate_mbps``.

Every loader error is a :class:`TraceError` naming ``file:line``. Loaders stream their
file (a 200 MB trace read whole took 4.4 GB and 37 s): memory is the output's
steps, kept in ``array('d')`` while loading, plus one line. ``max_rate_mbps`` (the
shaper's maximum, ``topo.spec.RATE_MAX_MBPS``, passed by the controller) makes a rate
above it an error naming the line.
"""

from __future__ import annotations

import bisect
import math
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from agents.core.checks import MAX_DURATION_S
from agents.core.files import quote_line

# Mahimahi's fixed packet size: one delivery opportunity drains one MTU-sized packet.
MAHIMAHI_PACKET_BYTES = 1500
# Every input file is bounded before it is expanded (a trace of 10^12 ms, a file that is
# one endless line): one line names the file, the line and the limit.
#: Most lines read from a trace, CDF or similar text file.
MAX_LINES = 10_000_000
#: Longest line (bytes); longer is not a trace, and is read in pieces no larger.
MAX_LINE_BYTES = 64 * 1024
#: Longest span a trace may cover (and so the most windows a binned trace has).
MAX_SPAN_S = MAX_DURATION_S

# Rates closer than this (relative) are one step; float sums otherwise split equal steps.
_MERGE_REL_TOL = 1e-9


class TraceError(ValueError):
    """A malformed trace file or trace spec; the message starts with ``file:line:``."""


@dataclass(frozen=True)
class BandwidthTrace:
    """A piecewise-constant rate that loops every ``period_s``.

    ``rates_mbps[i]`` holds from ``times_s[i]`` until ``times_s[i+1]`` (or ``period_s`` for
    the last step); then the trace starts over at ``times_s[0] == 0``.
    """

    times_s: tuple[float, ...]
    rates_mbps: tuple[float, ...]
    period_s: float
    source: str = "<memory>"

    def __post_init__(self) -> None:
        where = self.source
        if not self.times_s:
            raise TraceError(f"{where}: trace has no steps")
        if len(self.times_s) != len(self.rates_mbps):
            raise TraceError(f"{where}: {len(self.times_s)} step times but "
                             f"{len(self.rates_mbps)} rates")
        if self.times_s[0] != 0.0:
            raise TraceError(f"{where}: first step must start at 0 s, got {self.times_s[0]}")
        for i in range(1, len(self.times_s)):
            if not self.times_s[i] > self.times_s[i - 1]:
                raise TraceError(f"{where}: step {i} at {self.times_s[i]} s is not after "
                                 f"step {i - 1} at {self.times_s[i - 1]} s")
        if not (math.isfinite(self.period_s) and self.period_s > self.times_s[-1]):
            raise TraceError(f"{where}: period_s={self.period_s} must be finite and after the "
                             f"last step at {self.times_s[-1]} s")
        if self.period_s > MAX_SPAN_S:
            raise TraceError(f"{where}: period_s={self.period_s:g} is past {MAX_SPAN_S:g} s; a "
                             "trace spans at most a week")
        for i, r in enumerate(self.rates_mbps):
            if not (math.isfinite(r) and r >= 0.0):
                raise TraceError(f"{where}: step {i} rate_mbps={r} must be finite and >= 0")

    # -- queries ---------------------------------------------------------------------------

    def _index(self, phase_s: float) -> int:
        return bisect.bisect_right(self.times_s, phase_s) - 1

    def _phase(self, t_s: float) -> float:
        phase = math.fmod(t_s, self.period_s)
        if phase < 0.0:
            phase += self.period_s
        # fmod can return period_s itself for values a hair below a multiple of it.
        return 0.0 if phase >= self.period_s else phase

    def rate_at(self, t_s: float) -> float:
        """The allowed rate (Mbit/s) at time ``t_s``, looping past the period."""
        return self.rates_mbps[self._index(self._phase(t_s))]

    def mean_mbps(self) -> float:
        """Time-weighted mean rate over one period."""
        return self._bits_in_period(0.0, self.period_s) / 1e6 / self.period_s

    def _end(self, i: int) -> float:
        return self.times_s[i + 1] if i + 1 < len(self.times_s) else self.period_s

    @cached_property
    def _cum_bits(self) -> tuple[float, ...]:
        """Bits allowed from 0 to the start of each step, then to ``period_s`` (prefix sums,
        so a query costs a binary search instead of a walk over every step)."""
        cum = [0.0]
        for i, r in enumerate(self.rates_mbps):
            cum.append(cum[-1] + r * 1e6 * (self._end(i) - self.times_s[i]))
        return tuple(cum)

    def _bits_to(self, phase_s: float) -> float:
        """Bits allowed in [0, phase] with 0 <= phase <= period."""
        i = self._index(phase_s)
        return self._cum_bits[i] + self.rates_mbps[i] * 1e6 * (phase_s - self.times_s[i])

    def _bits_in_period(self, a_s: float, b_s: float) -> float:
        """Megabit-seconds * 1e6 (i.e. bits) allowed in [a, b] with 0 <= a <= b <= period."""
        if b_s <= a_s:
            return 0.0
        return max(0.0, self._bits_to(b_s) - self._bits_to(a_s))

    def bytes_between(self, t0_s: float, t1_s: float) -> float:
        """Exact integral of the allowed rate over [t0, t1], in bytes, looping as needed."""
        if t1_s < t0_s:
            raise ValueError(f"bytes_between: t1_s={t1_s} is before t0_s={t0_s}")
        if t1_s == t0_s:
            return 0.0
        period_bits = self._cum_bits[-1]
        loop0 = math.floor(t0_s / self.period_s)
        loop1 = math.floor(t1_s / self.period_s)
        a = t0_s - loop0 * self.period_s
        b = t1_s - loop1 * self.period_s
        a = min(max(a, 0.0), self.period_s)
        b = min(max(b, 0.0), self.period_s)
        if loop0 == loop1:
            bits = self._bits_in_period(a, b)
        else:
            bits = (self._bits_in_period(a, self.period_s) + (loop1 - loop0 - 1) * period_bits
                    + self._bits_in_period(0.0, b))
        return bits / 8.0

    def seconds_to_carry(self, t0_s: float, n_bytes: float) -> float:
        """The least s >= 0 with ``bytes_between(t0_s, t0_s + s) >= n_bytes`` (the inverse of
        :meth:`bytes_between`, exact). ValueError when the trace carries nothing at all."""
        if n_bytes <= 0:
            return 0.0
        period_bits = self._cum_bits[-1]
        if period_bits <= 0:
            raise ValueError(f"{self.source}: the trace allows no bytes at all")
        loop0 = math.floor(t0_s / self.period_s)
        a = min(max(t0_s - loop0 * self.period_s, 0.0), self.period_s)
        target = self._bits_to(a) + n_bytes * 8.0
        loops = math.ceil(target / period_bits) - 1  # whole periods before the one it ends in
        rem = target - loops * period_bits  # in (0, period_bits]
        # cum[j-1] < rem <= cum[j]; the clamp only absorbs rounding at the period's ends.
        j = min(max(bisect.bisect_left(self._cum_bits, rem), 1), len(self.times_s))
        k = j - 1
        phase = self.times_s[k] + (rem - self._cum_bits[k]) / (self.rates_mbps[k] * 1e6)
        return max(0.0, (loop0 + loops) * self.period_s + min(phase, self._end(k)) - t0_s)

    def steps(self, granularity_s: float = 0.1) -> list[tuple[float, float]]:
        """One period as (start_s, rate_mbps) steps on a ``granularity_s`` grid.

        Each grid window carries the mean rate the trace allows in it (so bytes are
        preserved exactly), and neighbours with equal rates merge into one step. A window
        lying inside one trace step keeps that step's rate bit for bit.
        """
        if not (math.isfinite(granularity_s) and granularity_s > 0.0):
            raise ValueError(f"granularity_s={granularity_s} must be a positive number")
        out: list[tuple[float, float]] = []
        n_windows = max(1, math.ceil(self.period_s / granularity_s - 1e-9))
        for k in range(n_windows):
            a = k * granularity_s
            b = min((k + 1) * granularity_s, self.period_s)
            if b <= a:
                break
            i = self._index(a)
            if self._end(i) >= b:
                rate = self.rates_mbps[i]
            else:
                rate = self._bits_in_period(a, b) / 1e6 / (b - a)
            if out and _same_rate(out[-1][1], rate):
                continue
            out.append((a, rate))
        return out

    def resampled(self, granularity_s: float = 0.1) -> BandwidthTrace:
        """The same trace on a ``granularity_s`` grid (see :meth:`steps`)."""
        st = self.steps(granularity_s)
        return BandwidthTrace(tuple(t for t, _ in st), tuple(r for _, r in st), self.period_s,
                              f"{self.source}@{granularity_s}s")


def _same_rate(a: float, b: float) -> bool:
    return abs(a - b) <= _MERGE_REL_TOL * max(abs(a), abs(b), 1e-12)


# -- loaders -------------------------------------------------------------------------------


def read_lines(path: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """``(name, lines)`` of a text file, with :func:`iter_lines`'s bounds and errors. For
    small files (flow-size CDFs); traces stream (:func:`iter_lines`)."""
    return str(path), [line for _, line in iter_lines(path)]


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """``(lineno, line)`` of a text file, read as it goes in pieces of at most
    :data:`MAX_LINE_BYTES`: memory stays one line, not the file (a 200 MB trace read whole
    took 4.4 GB), and a file that is one endless line fails at its first 64 KiB. TraceError
    naming the file (and the line) when it is missing, unreadable, not text, has a line
    longer than :data:`MAX_LINE_BYTES` or more than :data:`MAX_LINES` lines."""
    name = str(path)
    lineno = 0
    try:
        with open(path, "rb") as f:
            while raw := f.readline(MAX_LINE_BYTES + 1):
                lineno += 1
                if lineno > MAX_LINES:
                    raise TraceError(f"{name}:{lineno}: more than {MAX_LINES} lines; a trace "
                                     f"or distribution file has at most {MAX_LINES}")
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    raise TraceError(f"{name}:{lineno}: line longer than {MAX_LINE_BYTES} "
                                     f"bytes; lines are at most {MAX_LINE_BYTES}")
                yield lineno, raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as e:
        raise TraceError(f"{name}:{lineno}: not a text file ({e.reason})") from e
    except OSError as e:
        raise TraceError(f"{name}: cannot read: {e.strerror or e}") from e


def split_pair(name: str, lineno: int, raw: str, what: str) -> tuple[str, str] | None:
    """The two whitespace-separated fields of one line of a two-column file (``#`` starts
    a comment); None for a blank or comment-only line. ``what`` names the columns in the
    error a line with another number of fields gets."""
    s = raw.split("#", 1)[0].strip()
    if not s:
        return None
    parts = s.split()
    if len(parts) != 2:
        raise TraceError(f"{name}:{lineno}: expected '{what}', got {len(parts)} fields: "
                         f"{quote_line(name, s)}")
    return parts[0], parts[1]


def _parse_float(name: str, lineno: int, field: str, token: str) -> float:
    try:
        value = float(token)
    except ValueError:
        raise TraceError(f"{name}:{lineno}: {field} {quote_line(name, token)} is not a "
                         "number") from None
    if not math.isfinite(value):
        raise TraceError(f"{name}:{lineno}: {field} {quote_line(name, token)} is not a "
                         "finite number")
    return value


class _Points:
    """(time_s, rate_mbps) steps as they stream in: checked against the previous line,
    consecutive equal rates merged (the output has one step per change), stored in
    ``array('d')`` (16 bytes a step)."""

    def __init__(self, name: str, max_rate_mbps: float | None) -> None:
        self.name = name
        self.max_rate_mbps = max_rate_mbps
        self.times = array("d")
        self.rates = array("d")
        self.n = 0
        self.first_t: float | None = None
        self.last_t = -1.0
        self.last_line = 0
        self.gaps: dict[float, int] = {}  # gap -> count, for the median step

    def add(self, lineno: int, time_token: str, rate_token: str) -> None:
        name = self.name
        t_s = _parse_float(name, lineno, "time_s", time_token)
        rate = _parse_float(name, lineno, "rate_mbps", rate_token)
        if t_s < 0.0:
            raise TraceError(f"{name}:{lineno}: time_s {t_s} is negative")
        if t_s > MAX_SPAN_S:
            raise TraceError(f"{name}:{lineno}: time_s {t_s:g} is past {MAX_SPAN_S:g} s; a "
                             f"trace spans at most a week")
        if rate < 0.0:
            raise TraceError(f"{name}:{lineno}: rate {rate} Mbit/s is negative")
        if self.max_rate_mbps is not None and rate > self.max_rate_mbps:
            raise TraceError(f"{name}:{lineno}: rate {rate:g} Mbit/s is above the shaper's "
                             f"maximum of {self.max_rate_mbps:g} Mbit/s")
        if self.n and t_s <= self.last_t:
            what = "goes backwards" if t_s < self.last_t else "repeats"
            raise TraceError(f"{name}:{lineno}: time_s {t_s} {what} (line {self.last_line} "
                             f"has {self.last_t})")
        if self.n:
            gap = t_s - self.last_t
            self.gaps[gap] = self.gaps.get(gap, 0) + 1
        else:
            self.first_t = t_s
        self.n += 1
        self.last_t, self.last_line = t_s, lineno
        if self.rates and _same_rate(self.rates[-1], rate):
            return
        self.times.append(t_s)
        self.rates.append(rate)

    def median_gap(self) -> float:
        total = sum(self.gaps.values())
        if not total:
            return 1.0
        seen = 0
        for gap in sorted(self.gaps):
            seen += self.gaps[gap]
            if seen > total // 2:
                return gap
        return 1.0  # unreachable

    def trace(self, period_s: float | None) -> BandwidthTrace:
        """The last point's rate holds for as long as the median step (so a log sampled
        every second ends one second after its last line) unless ``period_s`` says
        otherwise. Nothing is known before the first line; its rate is taken to hold from
        0, so the file's own timestamps (a step "at 10 s") stay where the file puts them."""
        if period_s is None:
            period_s = self.last_t + self.median_gap()
        self.times[0] = 0.0
        return BandwidthTrace(tuple(self.times), tuple(self.rates), period_s, self.name)


def load_mahimahi(path: str | os.PathLike[str], granularity_s: float = 0.1,
                  max_rate_mbps: float | None = None) -> BandwidthTrace:
    """Load a Mahimahi delivery-opportunity file, binned into ``granularity_s`` windows.

    Each window's rate is ``packets * 1500 * 8 / window_length``; the last window is shorter
    when the period is not a multiple of the granularity, and its rate uses its real length,
    so the mean is exactly ``opportunities * 12000 bit / period``. The period is the last
    timestamp (Mahimahi's wrap-around); an opportunity at exactly the period belongs to
    time 0 of the next loop.
    """
    if not (math.isfinite(granularity_s) and granularity_s > 0.0):
        raise ValueError(f"granularity_s={granularity_s} must be a positive number")
    name = str(path)
    op = _MahimahiCounts(name, granularity_s)
    for lineno, raw in iter_lines(path):
        s = raw.strip()
        if s:
            op.add(lineno, s)
    period_s, n_windows = op.close()
    times: list[float] = []
    rates: list[float] = []
    for k in range(n_windows):
        c = op.counts.get(k, 0)
        a = k * granularity_s
        b = min((k + 1) * granularity_s, period_s)
        rate = c * MAHIMAHI_PACKET_BYTES * 8 / (b - a) / 1e6
        if max_rate_mbps is not None and rate > max_rate_mbps:
            raise TraceError(f"{name}:{op.last_line_of.get(k, op.prev_line)}: {c} opportunities "
                             f"in the {granularity_s:g} s window at {a:g} s are {rate:g} "
                             f"Mbit/s, above the shaper's maximum of {max_rate_mbps:g} Mbit/s")
        if rates and _same_rate(rates[-1], rate):
            continue
        times.append(a)
        rates.append(rate)
    return BandwidthTrace(tuple(times), tuple(rates), period_s, name)


class _MahimahiCounts:
    """Delivery opportunities per ``granularity_s`` window, read line by line (memory: the
    output's windows, not the file's lines), with each line's checks."""

    def __init__(self, name: str, granularity_s: float) -> None:
        self.name = name
        self.granularity_s = granularity_s
        self.counts: dict[int, int] = {}  # window -> opportunities
        self.last_line_of: dict[int, int] = {}
        self.prev_ms = -1
        self.prev_line = 0
        self.run_at_prev = 0  # opportunities at exactly prev_ms (at the period they wrap to 0)
        self.n = 0

    def add(self, lineno: int, s: str) -> None:
        name = self.name
        try:
            ms = int(s)
        except ValueError:
            raise TraceError(f"{name}:{lineno}: timestamp {quote_line(name, s)} is not an "
                             f"integer number of milliseconds") from None
        if ms < 0:
            raise TraceError(f"{name}:{lineno}: timestamp {ms} ms is negative")
        if ms > MAX_SPAN_S * 1000:
            raise TraceError(f"{name}:{lineno}: timestamp {ms} ms is past {MAX_SPAN_S * 1000:g} "
                             f"ms; a trace spans at most a week")
        if ms < self.prev_ms:
            raise TraceError(f"{name}:{lineno}: timestamp {ms} ms goes backwards (line "
                             f"{self.prev_line} has {self.prev_ms} ms)")
        self.run_at_prev = self.run_at_prev + 1 if ms == self.prev_ms else 1
        k = self.window(ms)
        self.counts[k] = self.counts.get(k, 0) + 1
        self.last_line_of[k] = lineno
        self.prev_ms, self.prev_line = ms, lineno
        self.n += 1

    def window(self, ms: int) -> int:
        return int(ms / 1000.0 / self.granularity_s + 1e-9)

    def close(self) -> tuple[float, int]:
        """The period (s) and the number of windows, once every line is read; the
        opportunities at exactly the period move to time 0 of the next loop (Mahimahi)."""
        name, period_ms = self.name, self.prev_ms
        if not self.n:
            raise TraceError(f"{name}:1: empty trace: no delivery opportunities")
        if period_ms <= 0:
            raise TraceError(f"{name}:{self.prev_line}: trace lasts 0 ms; Mahimahi needs the "
                             f"last timestamp to be > 0")
        period_s = period_ms / 1000.0
        n_windows = max(1, math.ceil(period_s / self.granularity_s - 1e-9))
        if n_windows > MAX_LINES:
            raise TraceError(f"{name}:{self.prev_line}: {period_s:g} s in "
                             f"{self.granularity_s:g} s windows are {n_windows} steps; a "
                             f"trace has at most {MAX_LINES}")
        k_end = self.window(period_ms)
        self.counts[k_end] -= self.run_at_prev
        self.counts[0] = self.counts.get(0, 0) + self.run_at_prev
        if k_end >= n_windows:  # only the wrapped ones were there
            self.counts.pop(k_end)
        return period_s, n_windows


def load_rate_log(path: str | os.PathLike[str], period_s: float | None = None,
                  max_rate_mbps: float | None = None) -> BandwidthTrace:
    """Load ``time_s Mbps`` lines (whitespace separated; ``#`` starts a comment).

    The last rate lasts one median step unless ``period_s`` is given, either as the argument
    or as a ``# period_s X`` comment line.
    """
    name = str(path)
    points = _Points(name, max_rate_mbps)
    for lineno, raw in iter_lines(path):
        directive = raw.strip().lstrip("#").split()
        if raw.lstrip().startswith("#") and len(directive) == 2 and directive[0] == "period_s":
            # ``# period_s X`` (written by traces.generate.write_rate_log) keeps the loop length.
            if period_s is None:
                period_s = _parse_float(name, lineno, "period_s", directive[1])
            continue
        pair = split_pair(name, lineno, raw, "time_s Mbps")
        if pair is not None:
            points.add(lineno, pair[0], pair[1])
    if not points.n:
        raise TraceError(f"{name}:1: empty trace: no 'time_s Mbps' lines")
    return points.trace(period_s)


def load_csv(path: str | os.PathLike[str], period_s: float | None = None,
             max_rate_mbps: float | None = None) -> BandwidthTrace:
    """Load a CSV whose header is ``time_s,rate_mbps``."""
    name = str(path)
    points = _Points(name, max_rate_mbps)
    header_seen = False
    for lineno, raw in iter_lines(path):
        s = raw.strip()
        if not s or s.startswith("#"):
            continue
        cells = [c.strip() for c in s.split(",")]
        if not header_seen:
            if cells != ["time_s", "rate_mbps"]:
                raise TraceError(f"{name}:{lineno}: expected the header 'time_s,rate_mbps', "
                                 f"got {quote_line(name, s)}")
            header_seen = True
            continue
        if len(cells) != 2:
            raise TraceError(f"{name}:{lineno}: expected 2 columns, got {len(cells)}: "
                             f"{quote_line(name, s)}")
        points.add(lineno, cells[0], cells[1])
    if not points.n:
        raise TraceError(f"{name}:1: empty trace: no data rows after the header")
    return points.trace(period_s)


_MAHIMAHI_SUFFIXES = {".up", ".down", ".trace"}


def load_trace(path: str | os.PathLike[str], granularity_s: float = 0.1,
               max_rate_mbps: float | None = None) -> BandwidthTrace:
    """Load any supported trace: by extension (.up/.down/.trace -> Mahimahi, .csv -> CSV),
    else by content (a first data line of one integer -> Mahimahi, else a rate log).
    ``max_rate_mbps``: a rate above it is an error naming the line."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in _MAHIMAHI_SUFFIXES:
        return load_mahimahi(p, granularity_s, max_rate_mbps)
    if suffix == ".csv":
        return load_csv(p, max_rate_mbps=max_rate_mbps)
    for _lineno, raw in iter_lines(p):
        s = raw.split("#", 1)[0].strip()
        if not s:
            continue
        if s.isdigit():
            return load_mahimahi(p, granularity_s, max_rate_mbps)
        if s.replace(" ", "") == "time_s,rate_mbps":
            return load_csv(p, max_rate_mbps=max_rate_mbps)
        break
    return load_rate_log(p, max_rate_mbps=max_rate_mbps)


def load_scaled_trace(path: str | os.PathLike[str], granularity_ms: float,
                      scale: float = 1.0, max_rate_mbps: float | None = None
                      ) -> BandwidthTrace:
    """A trace named in a config's ``[trace]`` section: loaded at ``granularity_ms`` and
    every rate multiplied by ``scale`` (the controller replays it; the oracle policy in the
    workers reads its future). ``max_rate_mbps``: as :func:`load_trace`."""
    tr = load_trace(path, granularity_s=granularity_ms / 1000.0, max_rate_mbps=max_rate_mbps)
    if scale != 1.0:
        tr = BandwidthTrace(times_s=tr.times_s,
                            rates_mbps=tuple(r * scale for r in tr.rates_mbps),
                            period_s=tr.period_s, source=f"{tr.source} x{scale}")
    return tr


# -- generated ------------------------------------------------------------------------------


def _check_rate(name: str, rate_mbps: float) -> None:
    if not (math.isfinite(rate_mbps) and rate_mbps >= 0.0):
        raise TraceError(f"{name}: rate_mbps={rate_mbps} must be finite and >= 0")


def constant(rate_mbps: float, duration_s: float) -> BandwidthTrace:
    """A fixed rate for ``duration_s`` (the loop length)."""
    _check_rate("constant", rate_mbps)
    if not (math.isfinite(duration_s) and duration_s > 0.0):
        raise TraceError(f"constant: duration_s={duration_s} must be finite and > 0")
    return BandwidthTrace((0.0,), (float(rate_mbps),), float(duration_s),
                          f"constant({rate_mbps}Mbps,{duration_s}s)")
