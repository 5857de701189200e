"""Checks of a Chrome trace (``trace.json``, :mod:`analysis.trace`) shared by the tests of
the trace itself and of the roles whose real runs it is checked on."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd

#: A data-parallel worker's phases, which partition each of its iterations.
PHASES = ("compute", "compress", "send", "wait", "receive")


def format_problems(trace: Any) -> list[str]:
    """What breaks the Trace Event Format's rules (empty when nothing does)."""
    bad: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    evs = trace["traceEvents"]
    procs = {e.get("pid") for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")) for e in evs
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    for i, e in enumerate(evs):
        missing = [k for k in ("name", "ph", "pid", "tid") if k not in e]
        if e.get("ph") != "M" and "ts" not in e:
            missing.append("ts")
        if missing:
            bad.append(f"event {i}: no {missing}")
            continue
        ph = e["ph"]
        if ph == "X" and not (isinstance(e.get("dur"), int | float) and e["dur"] >= 0):
            bad.append(f"event {i}: X without a dur >= 0")
        if ph == "C" and not (e.get("args") and all(
                isinstance(v, int | float) and math.isfinite(v) for v in e["args"].values())):
            bad.append(f"event {i}: C whose args are not all finite numbers")
        if ph != "M" and not isinstance(e["ts"], int | float):
            bad.append(f"event {i}: ts is not a number")
        if e["pid"] not in procs:
            bad.append(f"event {i}: pid {e['pid']} has no process_name")
        if ph in ("X", "i") and (e["pid"], e["tid"]) not in threads:
            bad.append(f"event {i}: pid/tid {e['pid']}/{e['tid']} has no thread_name")
    return bad


def load_trace(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))  # strict JSON: no NaN
    assert format_problems(data) == []
    return data


def spans_by_host(trace: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(host, thread) -> its X events, in time order."""
    evs = trace["traceEvents"]
    hosts = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    out: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in evs:
        if e["ph"] == "X":
            out[(hosts[e["pid"]], lanes[(e["pid"], e["tid"])])].append(e)
    for v in out.values():
        v.sort(key=lambda e: e["ts"])
    return out


def check_worker_partition(trace: dict[str, Any], events: pd.DataFrame,
                           need_receive: bool) -> int:
    """Each worker iteration's five phases sum to its iter_s within 1 %, follow each other
    without overlap, and the compute span is the measured compute_s. Returns how many
    iterations were checked."""
    spans = spans_by_host(trace)
    done = events[events["event"] == "iter_done"]
    checked = 0
    for r in done.to_dict("records"):
        mine = [e for e in spans[(str(r["node"]), "main")] if e["args"]["iter"] == r["iter"]]
        assert {e["cat"] for e in mine} <= set(PHASES)
        total_us = sum(e["dur"] for e in mine)
        want_us = float(r["iter_s"]) * 1e6
        assert abs(total_us - want_us) <= 0.01 * want_us, (r["node"], r["iter"], total_us,
                                                           want_us)
        for a, b in zip(mine, mine[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.002, (a, b)  # rounding to the ns
        assert mine[0]["cat"] == "compute"
        assert abs(mine[0]["dur"] - float(r["compute_s"]) * 1e6) <= 0.01 * want_us
        cats = [e["cat"] for e in mine]
        assert "send" in cats and ("wait" in cats or "receive" in cats)
        if need_receive:
            assert cats[-1] == "receive", cats
        checked += 1
    return checked
