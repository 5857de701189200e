"""Flow-size distributions and the background flows drawn from them (DESIGN.md section 2:
flow-size CDFs and background-flow generators).

A :class:`FlowSizeCDF` is pure data: points ``(size_bytes, cumulative fraction)``, read
linearly between points (as the data-centre workload files of the DCTCP paper (web search)
and of Facebook's Hadoop cluster are published and used by HPCC's ``traffic_gen``) or as
steps (ns-2's empirical CDFs). :func:`load_flow_cdf` reads the published layouts:
``size cdf`` pairs in percent or as fractions, a first line holding the mean (Homa's
workload files), Tcl-style ``size _ cdf`` lines in packets (pFabric's ns-2 files), and
HPCC's flow lists; it detects them, says what it loaded and its mean, and every error
names ``file:line`` and why.

A file that states its mean also says how it is meant to be read: the same points give
means 1 to 5 % apart read linearly or as steps, and the offered background load (flows per
second = load / mean) is off by as much. Unless told otherwise the loader takes the
interpolation whose mean reproduces the stated one within :data:`MEAN_TOLERANCE`, and
warns (:class:`FlowSizeMeanWarning`, naming both means) when none does.

:func:`flow_arrivals` turns a CDF and an offered load into a seeded list of flows: Poisson
arrivals (exponential gaps) at ``load / mean size`` flows per second, each size drawn by
inverting the CDF. It is what ``agents/traffic/flowgen.py`` replays, so a run's background flows
are known before it starts and repeat with the seed.
"""

from __future__ import annotations

import bisect
import math
import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from agents.core.bandwidth import TraceError, read_lines
from agents.core.files import quote_line, write_atomic

__all__ = ["FlowSizeCDF", "FlowSizeMeanWarning", "flow_arrivals", "load_flow_cdf",
           "write_flow_cdf"]


INTERPOLATIONS = ("linear", "step")
#: How far (relative) the loaded mean may be from a file's stated mean; within it the
#: interpolation is taken as the one the file was written for.
MEAN_TOLERANCE = 0.005
FORMATS = ("auto", "pairs", "mean_pairs", "tcl", "flows")
CDF_SCALES = ("auto", "percent", "fraction")


class FlowSizeMeanWarning(UserWarning):
    """A flow-size file states a mean that the loaded distribution does not reproduce."""


@dataclass(frozen=True)
class FlowSizeCDF:
    """``cdf[i]`` (a fraction in [0, 1]) of flows are at most ``sizes_bytes[i]`` bytes.

    interpolation: how sizes between two points are drawn. ``linear`` (the web-search and
        Hadoop CDFs as HPCC's traffic_gen reads them): uniform between the two sizes.
        ``step`` (ns-2's empirical CDFs, flow lists): each point's size holds until the
        next point, so only the listed sizes occur.
    """

    sizes_bytes: tuple[float, ...]
    cdf: tuple[float, ...]
    source: str = "<memory>"
    interpolation: str = "linear"

    def __post_init__(self) -> None:
        where = self.source
        if self.interpolation not in INTERPOLATIONS:
            raise TraceError(f"{where}: interpolation={self.interpolation!r}; allowed "
                             f"{list(INTERPOLATIONS)}")
        if len(self.sizes_bytes) < 2 or len(self.sizes_bytes) != len(self.cdf):
            raise TraceError(f"{where}: a flow-size CDF needs at least two (size, cdf) points")
        for i in range(1, len(self.cdf)):
            if self.sizes_bytes[i] < self.sizes_bytes[i - 1] or self.cdf[i] < self.cdf[i - 1]:
                raise TraceError(f"{where}: point {i} ({self.sizes_bytes[i]:g} B, "
                                 f"{self.cdf[i]:g}) goes below point {i - 1}")
        if not (0.0 <= self.cdf[0] and math.isclose(self.cdf[-1], 1.0)):
            raise TraceError(f"{where}: the CDF must run from >= 0 to 1, "
                             f"got {self.cdf[0]:g} to {self.cdf[-1]:g}")
        if self.sizes_bytes[0] < 0:
            raise TraceError(f"{where}: sizes must be >= 0 bytes")

    def quantile(self, u: float) -> float:
        """The size at cumulative fraction ``u`` in [0, 1] (``interpolation`` between
        points; a CDF that starts above 0 puts that mass on its first size)."""
        if u <= self.cdf[0]:
            return self.sizes_bytes[0]
        i = min(bisect.bisect_left(self.cdf, u), len(self.cdf) - 1)
        if self.interpolation == "step":
            return self.sizes_bytes[i]
        p0, p1 = self.cdf[i - 1], self.cdf[i]
        s0, s1 = self.sizes_bytes[i - 1], self.sizes_bytes[i]
        return s1 if p1 == p0 else s0 + (s1 - s0) * (u - p0) / (p1 - p0)

    def mean_bytes(self) -> float:
        """Exact mean of the distribution :meth:`quantile` samples:
        ``cdf[0] s[0] + sum_i (cdf[i] - cdf[i-1]) m_i`` with ``m_i = (s[i-1] + s[i]) / 2``
        (linear) or ``s[i]`` (step)."""
        mean = self.cdf[0] * self.sizes_bytes[0]
        step = self.interpolation == "step"
        for i in range(1, len(self.cdf)):
            mid = self.sizes_bytes[i] if step else (self.sizes_bytes[i - 1]
                                                    + self.sizes_bytes[i]) / 2
            mean += (self.cdf[i] - self.cdf[i - 1]) * mid
        return mean

    def describe(self) -> str:
        return (f"{self.source}: {len(self.cdf)} points, {self.interpolation}, "
                f"mean {self.mean_bytes():,.0f} bytes")


def _fields(raw: str) -> list[str]:
    return raw.split("#", 1)[0].split()


def _number(name: str, lineno: int, field: str, token: str) -> float:
    try:
        v = float(token)
    except ValueError:
        raise TraceError(f"{name}:{lineno}: {field} {quote_line(name, token)} is not a "
                         "number") from None
    if not math.isfinite(v):
        raise TraceError(f"{name}:{lineno}: {field} {quote_line(name, token)} is not a "
                         "finite number")
    return v


def detect_format(name: str, rows: list[tuple[int, list[str]]]) -> str:
    """The layout of a flow-size file from its data lines (``FORMATS``), or TraceError
    saying why none fits."""
    if not rows:
        raise TraceError(f"{name}: no (size, cdf) lines")
    first = len(rows[0][1])
    rest = {len(f) for _, f in rows[1:]}
    if first == 1 and rows[1:] and len(rows[1][1]) == 6:
        return "flows"  # HPCC's flow list: a count line, then src dst pg dport size start
    if first == 1:
        return "mean_pairs"  # Homa-style: the mean, then size cdf pairs
    if first == 3 and rest <= {3}:
        return "tcl"
    if first == 2:
        return "pairs"
    raise TraceError(f"{name}:{rows[0][0]}: {first} fields is no known flow-size layout "
                     f"(size cdf; a mean line then size cdf; Tcl 'size _ cdf'; a flow list)")


def load_flow_cdf(path: str | os.PathLike[str], *, format: str = "auto",
                  interpolation: str | None = None, cdf_scale: str = "auto",
                  packet_bytes: int | None = None,
                  log: Callable[[str], None] | None = None) -> FlowSizeCDF:
    """Read a flow-size distribution as published.

    format: ``pairs`` (``size cdf`` per line, the DCTCP web-search and Facebook Hadoop
        files), ``mean_pairs`` (a first line holding the mean, then pairs), ``tcl``
        (ns-2's ``size _ cdf``, the middle column ignored, sizes usually in packets),
        ``flows`` (HPCC's flow list: a count line, then ``src dst pg dport size_bytes
        start_s``; the CDF of its sizes), or ``auto`` (detected from the lines).
    interpolation: ``linear`` or ``step``; None (or "" or "auto") takes, for a file whose
        first line states its mean, the interpolation that reproduces that mean within
        :data:`MEAN_TOLERANCE` (else the closest, with a :class:`FlowSizeMeanWarning`
        naming both means), and otherwise the layout's habit (step for tcl and flows,
        linear otherwise). An interpolation given explicitly is used as given, with the
        same warning when it misses the stated mean.
    cdf_scale: ``percent``, ``fraction``, or ``auto`` (fraction when no value exceeds 1).
    packet_bytes: sizes are in packets of this many bytes (None or 0: bytes). Required for
        tcl.
    log: receives one line describing what was loaded, with the distribution's mean.

    Errors name ``file:line`` and say why: a wrong number of fields, a non-number, a
    percentage outside [0, 100], a point below the one before it, a last point that is not
    100 % (or 1), "the first line looks like a mean, not a CDF point" for ``pairs``.
    """
    if format not in FORMATS:
        raise TraceError(f"{path}: format={format!r}; allowed {list(FORMATS)}")
    if cdf_scale not in CDF_SCALES:
        raise TraceError(f"{path}: cdf_scale={cdf_scale!r}; allowed {list(CDF_SCALES)}")
    if packet_bytes == 0:
        packet_bytes = None  # the config's "0 = bytes"
    if packet_bytes is not None and not (isinstance(packet_bytes, int) and packet_bytes > 0):
        raise TraceError(f"{path}: packet_bytes={packet_bytes!r}; allowed an integer > 0")
    name, lines = read_lines(path)
    rows = [(n, f) for n, f in ((n, _fields(raw)) for n, raw in enumerate(lines, 1)) if f]
    layout = detect_format(name, rows) if format == "auto" else format
    requested = None if interpolation in (None, "", "auto") else interpolation
    if requested is not None and requested not in INTERPOLATIONS:
        raise TraceError(f"{name}: interpolation={interpolation!r}; allowed "
                         f"{list(INTERPOLATIONS)}")
    habit = "step" if layout in ("tcl", "flows") else "linear"
    if layout == "flows":
        cdf = _from_flow_list(name, rows, requested or habit, packet_bytes, log)
    else:
        cdf = _from_points(name, rows, layout, requested, habit, cdf_scale, packet_bytes,
                           log)
    if log is not None:
        log(f"{cdf.describe()} ({layout})")
    return cdf


def _from_points(name: str, rows: list[tuple[int, list[str]]], layout: str,
                 requested: str | None, habit: str, cdf_scale: str,
                 packet_bytes: int | None, log: Callable[[str], None] | None) -> FlowSizeCDF:
    declared_mean: float | None = None
    mean_line = 0
    if rows and len(rows[0][1]) == 1:
        if layout != "mean_pairs":
            raise TraceError(f"{name}:{rows[0][0]}: the first line looks like a mean, not a "
                             f"CDF point (use format 'mean_pairs' or 'auto')")
        declared_mean = _number(name, rows[0][0], "mean", rows[0][1][0])
        mean_line = rows[0][0]
        rows = rows[1:]
    elif layout == "mean_pairs":
        raise TraceError(f"{name}:{rows[0][0] if rows else 1}: format 'mean_pairs' needs a "
                         f"first line holding only the mean")
    if layout == "tcl" and packet_bytes is None:
        raise TraceError(f"{name}: Tcl-style CDFs (ns-2) give sizes in packets: state the "
                         f"packet size (packet_bytes)")
    ncols, what = (3, "size _ cdf") if layout == "tcl" else (2, "size cdf")
    sizes: list[float] = []
    raw_cdf: list[float] = []
    lines_of: list[int] = []
    for lineno, f in rows:
        if len(f) != ncols:
            raise TraceError(f"{name}:{lineno}: expected '{what}', got {len(f)} fields: "
                             f"{quote_line(name, ' '.join(f))}")
        size = _number(name, lineno, "size", f[0])
        c = _number(name, lineno, "cdf", f[-1])
        if size < 0:
            raise TraceError(f"{name}:{lineno}: size {f[0]} must be >= 0")
        if sizes and (size < sizes[-1] or c < raw_cdf[-1]):
            raise TraceError(f"{name}:{lineno}: ({f[0]}, {f[-1]}) goes below the line "
                             f"before it")
        sizes.append(size)
        raw_cdf.append(c)
        lines_of.append(lineno)
    if not sizes:
        raise TraceError(f"{name}: no (size, cdf) lines")
    if len(sizes) < 2:
        raise TraceError(f"{name}:{lines_of[-1]}: a CDF needs at least two points")
    scale = cdf_scale
    if scale == "auto":
        scale = "fraction" if max(raw_cdf) <= 1.0 else "percent"
    top = 100.0 if scale == "percent" else 1.0
    for lineno, c in zip(lines_of, raw_cdf, strict=True):
        if not 0.0 <= c <= top:
            raise TraceError(f"{name}:{lineno}: cdf {c:g} must be in [0, {top:g}] "
                             f"({scale})")
    if not math.isclose(raw_cdf[-1], top):
        unit = " %" if scale == "percent" else ""
        raise TraceError(f"{name}:{lines_of[-1]}: the last point is {raw_cdf[-1]:g}{unit}, "
                         f"must be {top:g} ({scale})")
    mult = packet_bytes or 1
    cdf = FlowSizeCDF(tuple(x * mult for x in sizes), tuple(c / top for c in raw_cdf),
                      source=name, interpolation=requested or habit)
    if declared_mean is None:
        return cdf
    return _reading_that_states(cdf, declared_mean * mult, requested, mean_line,
                                "packets" if packet_bytes else "bytes", log)


def _reading_that_states(cdf: FlowSizeCDF, stated_bytes: float, requested: str | None,
                         lineno: int, unit: str, log: Callable[[str], None] | None,
                         ) -> FlowSizeCDF:
    """``cdf`` read with the interpolation whose mean is the file's stated mean: the one
    requested, else the one closest to the stated mean (linear first on a tie). Warns
    (FlowSizeMeanWarning, naming both means) when the reading used misses it by more than
    MEAN_TOLERANCE; ``unit`` is what the mean line was written in (packets are scaled)."""
    readings = [FlowSizeCDF(cdf.sizes_bytes, cdf.cdf, cdf.source, i)
                for i in ((requested,) if requested else INTERPOLATIONS)]

    def miss(c: FlowSizeCDF) -> float:
        return abs(c.mean_bytes() - stated_bytes) / stated_bytes if stated_bytes else math.inf

    chosen = min(readings, key=miss)
    where = f"{cdf.source}:{lineno}"
    stated = f"{stated_bytes:,.0f} bytes" + (" (in packets on the line)" if unit == "packets"
                                             else "")
    if miss(chosen) <= MEAN_TOLERANCE:
        if log is not None:
            how = "as asked" if requested else "the reading that reproduces it"
            log(f"{where}: the file states a mean of {stated}; read {chosen.interpolation} "
                f"({how}), mean {chosen.mean_bytes():,.0f} bytes")
        return chosen
    means = ", ".join(f"{c.interpolation} {c.mean_bytes():,.0f} bytes" for c in readings)
    warnings.warn(FlowSizeMeanWarning(
        f"{where}: the file states a mean of {stated}, but no reading reproduces it within "
        f"{MEAN_TOLERANCE:.1%} ({means}); using {chosen.interpolation}, mean "
        f"{chosen.mean_bytes():,.0f} bytes ({miss(chosen):.1%} off): the background load "
        f"is off by as much"), stacklevel=4)
    return chosen


def _from_flow_list(name: str, rows: list[tuple[int, list[str]]], interpolation: str,
                    packet_bytes: int | None, log: Callable[[str], None] | None,
                    ) -> FlowSizeCDF:
    """The empirical CDF of the sizes in an HPCC flow list. The list ends at the first
    line that is not six numbers (HPCC's example ends with its own usage text)."""
    count_line, count_fields = rows[0]
    if len(count_fields) != 1:
        raise TraceError(f"{name}:{count_line}: a flow list starts with the number of flows")
    declared = _number(name, count_line, "flow count", count_fields[0])
    sizes: list[float] = []
    last = count_line
    for lineno, f in rows[1:]:
        if len(f) != 6:
            break
        sizes.append(_number(name, lineno, "size_bytes", f[4]) * (packet_bytes or 1))
        last = lineno
    if len(sizes) < 1:
        raise TraceError(f"{name}:{count_line + 1}: a flow list needs at least one "
                         f"'src dst pg dport size_bytes start_s' line")
    if log is not None:
        if declared != len(sizes):
            log(f"{name}:{count_line}: the count line says {declared:g} flows, "
                f"{len(sizes)} follow; using the {len(sizes)}")
        ignored = sum(1 for n, _ in rows if n > last)
        if ignored:
            log(f"{name}: ignored {ignored} lines after line {last} (not flows)")
    values = sorted(sizes)
    points: list[tuple[float, float]] = [(values[0], 0.0)]
    for i, v in enumerate(values, 1):
        if points and points[-1][0] == v:
            points[-1] = (v, i / len(values))
        else:
            points.append((v, i / len(values)))
    if len(points) < 2:
        points = [(values[0], 0.0), (values[0], 1.0)]
    return FlowSizeCDF(tuple(p[0] for p in points), tuple(p[1] for p in points),
                       source=name, interpolation=interpolation)


def write_flow_cdf(cdf: FlowSizeCDF, path: str | os.PathLike[str]) -> None:
    write_atomic(path, "".join(f"{s:.0f} {p * 100:g}\n"
                               for s, p in zip(cdf.sizes_bytes, cdf.cdf, strict=True)))


def flow_arrivals(cdf: FlowSizeCDF, load_mbps: float, duration_s: float,
                  seed: int) -> list[tuple[float, int]]:
    """``(start_s, size_bytes)`` of every flow starting in [0, duration): Poisson arrivals
    whose mean offered load is ``load_mbps`` of payload. Sizes are at least 1 byte."""
    if not (load_mbps > 0 and math.isfinite(load_mbps)):
        raise ValueError(f"load_mbps={load_mbps!r} must be > 0")
    if not duration_s >= 0:
        raise ValueError(f"duration_s={duration_s!r} must be >= 0")
    mean = cdf.mean_bytes()
    if mean <= 0:
        raise ValueError(f"{cdf.source}: mean flow size is 0 bytes")
    per_s = load_mbps * 1e6 / 8 / mean
    rng = random.Random(seed)
    out: list[tuple[float, int]] = []
    t = rng.expovariate(per_s)
    while t < duration_s:
        out.append((t, max(1, round(cdf.quantile(rng.random())))))
        t += rng.expovariate(per_s)
    return out
