"""Runs side by side, and the one-line answer to the question gradbed exists for: on this
network, does compression pay?

Pure functions over finished runs' ``summary.json`` dicts (the numbers themselves are
defined once, in :mod:`analysis.metrics`); ``gradbed sweep`` prints what they return when
it ends, and ``scripts/demo.sh`` is such a sweep (``compress.name=none,topk`` over
``configs/demo.toml``).

A compressed run *pays* when its median iteration takes at most :data:`PAYS_SPEED_RATIO`
of the dense run's and its final held-out accuracy is at most :data:`ACCURACY_POINTS`
points below the dense run's. The dense run's bottleneck utilisation (upload windows only)
says whether the network was the bottleneck in the first place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: A compressed run whose median iteration takes more than this fraction of the dense
#: run's saves too little to call it a win (the compressor's own cost eats the rest).
PAYS_SPEED_RATIO = 0.8
#: Accuracy (percentage points) a compressed run may lose to the dense run and still pay.
ACCURACY_POINTS = 3.0
#: Below this utilisation (upload windows), the dense run was not waiting on the network.
NETWORK_BOUND_UTILIZATION = 0.8

#: Rows of the side-by-side table: (summary.json key, format, what it is). The keys are
#: summary.json's own (analysis.metrics.GLOSSARY defines each), so a reader can find them.
ROWS: tuple[tuple[str, str, str], ...] = (
    ("bytes_up_per_iter", "bytes", "bytes up per iteration, all workers"),
    ("iter_time_s_p50", "{:.3f}", "median iteration (s)"),
    ("iter_time_s_p99", "{:.3f}", "p99 iteration (s)"),
    ("bottleneck_utilization", "{:.2f}", "bottleneck busy while uploading"),
    ("final_accuracy", "{:.3f}", "held-out accuracy at the end"),
    ("time_to_target_s", "{:.1f}", "time to the target accuracy (s)"),
    ("iterations", "{}", "iterations"),
)


def _fmt(value: Any, how: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if how == "bytes":
        return human_bytes(float(value))
    return how.format(value)


def human_bytes(n: float) -> str:
    """``317216`` -> ``317 kB`` (three significant digits, decimal units)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def side_by_side(columns: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """A plain-text table, one column per run (``(label, summary)``), one row per
    headline number of :data:`ROWS`: its summary.json key, the runs' values, what it is."""
    head = ["", *(label for label, _ in columns), ""]
    body = [[key, *(_fmt(s.get(key), how) for _, s in columns), what]
            for key, how, what in ROWS]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head) - 1)]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        values = (c.rjust(w) for c, w in zip(cells[1:-1], widths[1:], strict=True))
        return "  ".join([first, *values, cells[-1]]).rstrip()

    return "\n".join([line(head), *(line(r) for r in body)])


def verdict(dense: Mapping[str, Any], compressed: Mapping[str, Any], name: str) -> str:
    """One line: does ``name`` (a compressed run) pay against ``dense`` on this network?

    Raises ValueError when a summary lacks the median iteration time or the accuracy
    (a run that failed or never evaluated cannot be judged)."""
    need = ("iter_time_s_p50", "final_accuracy")
    for label, s in (("dense", dense), (name, compressed)):
        missing = [k for k in need if not isinstance(s.get(k), (int, float))]
        if missing:
            raise ValueError(f"{label} run has no {', '.join(missing)} in its summary")
    ratio = float(compressed["iter_time_s_p50"]) / float(dense["iter_time_s_p50"])
    points = 100.0 * (float(compressed["final_accuracy"]) - float(dense["final_accuracy"]))
    util = dense.get("bottleneck_utilization")
    busy = (f"the dense run kept the bottleneck {util:.2f} busy while uploading"
            if isinstance(util, (int, float)) and math.isfinite(util) else
            "the dense run's bottleneck utilisation is unknown")
    facts = (f"{name}'s median iteration took {ratio:.2f}x dense's and it ended "
             f"{abs(points):.1f} points {'above' if points >= 0 else 'below'} dense's "
             f"accuracy; {busy}")
    if ratio > PAYS_SPEED_RATIO:
        why = ("the network is not the bottleneck here"
               if isinstance(util, (int, float)) and util < NETWORK_BOUND_UTILIZATION
               else "it saves too little time")
        return f"verdict: {name} does not pay on this network ({why}): {facts}"
    if -points > ACCURACY_POINTS:
        return (f"verdict: {name} is faster but costs more than {ACCURACY_POINTS:g} points of "
                f"accuracy at this iteration count: {facts}")
    return f"verdict: {name} pays on this network: {facts}"
