"""Flow-size distributions and the background flows drawn from them (DESIGN.md section 2:
flow-size CDFs and background-flow generators).

A :class:`FlowSizeCDF` is pure data: points ``(size_bytes, cumulative fraction)``, read
linearly between points, as the data-centre workload files of the DCTCP paper (web search)
and of Facebook's Hadoop cluster are published and used by HPCC's ``traffic_gen``. The file
format is one ``size_bytes cdf_percent`` pair per line (``#`` comments allowed); every
loader error names ``file:line``.

:func:`flow_arrivals` turns a CDF and an offered load into a seeded list of flows: Poisson
arrivals (exponential gaps) at ``load / mean size`` flows per second, each size drawn by
inverting the CDF. It is what ``agents/flowgen.py`` replays, so a run's background flows
are known before it starts and repeat with the seed.
"""

from __future__ import annotations

import bisect
import math
import os
import random
from dataclasses import dataclass

from agents.core.bandwidth import TraceError, read_lines, split_pair
from agents.core.files import write_atomic

__all__ = ["FlowSizeCDF", "flow_arrivals", "load_flow_cdf", "write_flow_cdf"]


@dataclass(frozen=True)
class FlowSizeCDF:
    """``cdf[i]`` (a fraction in [0, 1]) of flows are at most ``sizes_bytes[i]`` bytes."""

    sizes_bytes: tuple[float, ...]
    cdf: tuple[float, ...]
    source: str = "<memory>"

    def __post_init__(self) -> None:
        where = self.source
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
        """The size at cumulative fraction ``u`` in [0, 1] (linear between points; a CDF
        that starts above 0 puts that mass on its first size)."""
        if u <= self.cdf[0]:
            return self.sizes_bytes[0]
        i = min(bisect.bisect_left(self.cdf, u), len(self.cdf) - 1)
        p0, p1 = self.cdf[i - 1], self.cdf[i]
        s0, s1 = self.sizes_bytes[i - 1], self.sizes_bytes[i]
        return s1 if p1 == p0 else s0 + (s1 - s0) * (u - p0) / (p1 - p0)

    def mean_bytes(self) -> float:
        """Exact mean of the distribution :meth:`quantile` samples."""
        mean = self.cdf[0] * self.sizes_bytes[0]
        for i in range(1, len(self.cdf)):
            mean += (self.cdf[i] - self.cdf[i - 1]) * (self.sizes_bytes[i - 1]
                                                      + self.sizes_bytes[i]) / 2
        return mean


def load_flow_cdf(path: str | os.PathLike[str]) -> FlowSizeCDF:
    """Read ``size_bytes cdf_percent`` lines. Errors name ``file:line``: a missing or
    empty file, a wrong number of fields, a non-number, a percentage outside [0, 100], a
    point below the one before it, or a last point that is not 100 %; a file that is not
    text names line 1."""
    name, lines = read_lines(path)
    sizes: list[float] = []
    cdf: list[float] = []
    last_line = 0
    for lineno, raw in enumerate(lines, 1):
        fields = split_pair(name, lineno, raw, "size_bytes cdf_percent")
        if fields is None:
            continue
        try:
            size, pct = float(fields[0]), float(fields[1])
        except ValueError:
            raise TraceError(f"{name}:{lineno}: '{' '.join(fields)}' is not two "
                             "numbers") from None
        if not (math.isfinite(size) and size >= 0):
            raise TraceError(f"{name}:{lineno}: size_bytes {fields[0]} must be >= 0")
        if not 0.0 <= pct <= 100.0:
            raise TraceError(f"{name}:{lineno}: cdf_percent {fields[1]} must be in [0, 100]")
        if sizes and (size < sizes[-1] or pct / 100 < cdf[-1]):
            raise TraceError(f"{name}:{lineno}: ({fields[0]}, {fields[1]}) goes below the "
                             f"line before it")
        sizes.append(size)
        cdf.append(pct / 100)
        last_line = lineno
    if not sizes:
        raise TraceError(f"{name}: no (size, cdf) lines")
    if len(sizes) < 2:
        raise TraceError(f"{name}:{last_line}: a CDF needs at least two points")
    if not math.isclose(cdf[-1], 1.0):
        raise TraceError(f"{name}:{last_line}: the last point is {cdf[-1] * 100:g} %, "
                         "must be 100")
    return FlowSizeCDF(tuple(sizes), tuple(cdf), source=name)


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
