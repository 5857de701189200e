"""A run's timelines as ``trace.json`` in the Chrome Trace Event Format.

The format PyTorch's profiler writes, which Perfetto (https://ui.perfetto.dev, offline-
capable once loaded) and Chrome's ``chrome://tracing`` open (the "Trace Event Format"
document, Google, 2016): a JSON object whose ``traceEvents`` list holds

- ``ph: "M"`` metadata: one process per host (``process_name``), one thread per lane of
  :func:`analysis.timeline.host_timeline` (``thread_name``), with sort indices;
- ``ph: "X"`` complete events, one per timeline interval (compute, compress, send, wait,
  receive, ... of every role): ``name`` the interval's label, ``cat`` its activity, ``ts`` and
  ``dur`` in microseconds;
- ``ph: "C"`` counters: each shaping point's delivered and allowed rate, queue and drops
  (from ``links.parquet``, through :mod:`analysis.metrics`), each worker's TCP_INFO
  cwnd and RTT, and, for a ``gradbed torchrun`` run, every connection its ranks opened to
  another host (``tcp.parquet``): sent and received rate, cwnd and RTT, in its host's
  process;
- ``ph: "i"`` instants for the events that mark a run (start, end, a trace step, an
  evaluation, an error).

Every ``ts`` is on the run's shared clock (CLOCK_MONOTONIC), in microseconds since the run's
origin (:func:`analysis.load.run_origin_ns`, the time zero of every plot of the report);
``otherData.origin_ns`` holds that origin. :func:`chrome_trace` is pure; :func:`write_trace`
reads a run directory and writes the file atomically.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

from analysis import metrics
from analysis.load import TCP_FILE, load_events, load_links, load_tcp, run_origin_ns
from analysis.timeline import host_timeline, lane_sort_key, node_sort_key

TRACE_FILE = "trace.json"
#: The network's counters live in a process of their own, named so.
NETWORK = "network"
#: Events drawn as instants on their host's ``events`` thread (tid 0).
INSTANTS = ("run_start", "run_end", "trace_step", "membership", "eval", "final_eval",
            "worker_error", "worker_lost", "stage_error", "replay_error", "ps_done")
Event = dict[str, Any]


def _us(ns: float, origin_ns: int) -> float:
    return round((ns - origin_ns) / 1e3, 3)


def _scalar_args(r: dict[str, Any], skip: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in r.items():
        if k in skip or v is None:
            continue
        if isinstance(v, bool | int | str):
            out[str(k)] = v
        elif isinstance(v, float) and math.isfinite(v):
            out[str(k)] = v
        elif hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
            item = v.item()
            if not (isinstance(item, float) and not math.isfinite(item)):
                out[str(k)] = item
    return out


def _records(df: pd.DataFrame) -> list[dict[str, Any]]:
    return [{str(k): v for k, v in r.items()} for r in df.to_dict("records")]


class _Ids:
    """pid per host and tid per (host, lane), with their metadata events."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[str, str], int] = {}
        self.meta: list[Event] = []

    def pid(self, node: str) -> int:
        if node not in self.pids:
            pid = len(self.pids) + 1
            self.pids[node] = pid
            self.meta += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"name": node}},
                          {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                           "args": {"sort_index": pid}}]
            self.tid(node, "events")
        return self.pids[node]

    def tid(self, node: str, lane: str) -> int:
        key = (node, lane)
        if key not in self.tids:
            pid = self.pid(node)
            tid = sum(1 for n, _ in self.tids if n == node)  # "events" is 0
            self.tids[key] = tid
            self.meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": lane}},
                          {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"sort_index": tid}}]
        return self.tids[key]


def _spans(events: pd.DataFrame, ids: _Ids, origin_ns: int) -> list[Event]:
    tl = host_timeline(events)
    out: list[Event] = []
    if tl.empty:
        return out
    for node in sorted(tl["node"].unique(), key=node_sort_key):
        ids.pid(node)
        for lane in sorted(tl.loc[tl["node"] == node, "lane"].unique(), key=lane_sort_key):
            ids.tid(node, lane)
    for r in _records(tl):
        out.append({"name": r["label"], "cat": r["activity"], "ph": "X",
                    "ts": _us(r["start_ns"], origin_ns),
                    "dur": round((r["end_ns"] - r["start_ns"]) / 1e3, 3),
                    "pid": ids.pid(r["node"]), "tid": ids.tid(r["node"], r["lane"]),
                    "args": {"iter": int(r["iter"]), "category": r["category"]}})
    return out


def _instants(events: pd.DataFrame, ids: _Ids, origin_ns: int) -> list[Event]:
    out: list[Event] = []
    if events.empty:
        return out
    sub = events[events["event"].isin(list(INSTANTS))]
    for r in _records(sub):
        node = str(r["node"])
        args = _scalar_args(r, ("ts_ns", "run_id", "node", "event", "t_s"))
        out.append({"name": str(r["event"]), "cat": "mark", "ph": "i", "s": "p",
                    "ts": _us(int(r["ts_ns"]), origin_ns), "pid": ids.pid(node),
                    "tid": ids.tid(node, "events"), "args": args})
    return out


def _counter(name: str, pid: int, t_s: Any, args: dict[str, Any]) -> Event | None:
    ok = {k: float(v) for k, v in args.items() if v is not None and math.isfinite(float(v))}
    if not ok or not math.isfinite(float(t_s)):
        return None
    return {"name": name, "ph": "C", "ts": round(float(t_s) * 1e6, 3), "pid": pid, "tid": 0,
            "args": ok}


def _link_counters(links: pd.DataFrame, ids: _Ids, origin_ns: int) -> list[Event]:
    if links.empty:
        return []
    links = links.assign(t_s=(links["ts_ns"] - origin_ns) / 1e9)
    pid = ids.pid(NETWORK)
    out: list[Event | None] = []
    for direction in sorted(links["direction"].unique()):
        for r in _records(metrics.link_throughput(links, direction)):
            point = f"{r['dev']} {direction}"
            out.append(_counter(f"{point} rate (Mbit/s)", pid, r["t_s"],
                                {"delivered": r["throughput_mbps"], "allowed": r["rate_mbps"]}))
            out.append(_counter(f"{point} drops", pid, r["t_s"], {"drops": r["drops"]}))
        for r in _records(metrics.queue_series(links, direction)):
            out.append(_counter(f"{r['dev']} {direction} queue", pid, r["t_s"],
                                {"backlog_bytes": r["backlog_bytes"]}))
    return [e for e in out if e is not None]


def _tcp_counters(events: pd.DataFrame, ids: _Ids, origin_ns: int) -> list[Event]:
    if events.empty:
        return []
    ev = events.assign(t_s=(events["ts_ns"] - origin_ns) / 1e9)
    out: list[Event | None] = []
    for r in _records(metrics.transport_series(ev)):
        pid = ids.pid(str(r["node"]))
        out.append(_counter("cwnd (segments)", pid, r["t_s"], {"cwnd": r["cwnd"]}))
        out.append(_counter("RTT (ms)", pid, r["t_s"], {"rtt_ms": r["rtt_ms"]}))
    return [e for e in out if e is not None]


def _connection_counters(tcp: pd.DataFrame, ids: _Ids, origin_ns: int) -> list[Event]:
    if tcp.empty:
        return []
    tcp = tcp.assign(t_s=(tcp["ts_ns"].astype("int64") - origin_ns) / 1e9)
    out: list[Event | None] = []
    for r in _records(metrics.connection_series(tcp)):
        pid = ids.pid(str(r["host"]))
        conn = r["conn"]
        out.append(_counter(f"tcp {conn} (Mbit/s)", pid, r["t_s"],
                            {"sent": r["sent_mbps"], "received": r["received_mbps"]}))
        out.append(_counter(f"tcp {conn} cwnd (segments)", pid, r["t_s"], {"cwnd": r["cwnd"]}))
        out.append(_counter(f"tcp {conn} RTT (ms)", pid, r["t_s"], {"rtt_ms": r["rtt_ms"]}))
    return [e for e in out if e is not None]


def chrome_trace(events: pd.DataFrame, links: pd.DataFrame, *, run_id: str = "",
                 origin_ns: int | None = None, tcp: pd.DataFrame | None = None
                 ) -> dict[str, Any]:
    """The run's Chrome trace (see the module docstring) as a JSON-ready dict. ``origin_ns``
    defaults to :func:`analysis.load.run_origin_ns`; ``tcp`` is a torchrun run's
    ``tcp.parquet`` (:func:`analysis.load.load_tcp`)."""
    origin = run_origin_ns(events, links) if origin_ns is None else origin_ns
    ids = _Ids()
    body = _spans(events, ids, origin) + _instants(events, ids, origin)
    body += _tcp_counters(events, ids, origin) + _link_counters(links, ids, origin)
    if tcp is not None:
        body += _connection_counters(tcp, ids, origin)
    return {"traceEvents": ids.meta + body, "displayTimeUnit": "ms",
            "otherData": {"run_id": run_id, "clock": "CLOCK_MONOTONIC",
                          "origin_ns": int(origin),
                          "ts": "microseconds since origin_ns"}}


def write_trace(run_dir: str | os.PathLike[str], events: pd.DataFrame | None = None) -> Path:
    """Write ``RUN_DIR/trace.json`` from the run's events, ``links.parquet`` and (a torchrun
    run's) ``tcp.parquet``, atomically
    (a reader sees the old file or the new one), and return its path. ``events``: the
    run's events as ``load_events`` returns them, when the caller has them already (the
    controller's end of a run); read from the run directory otherwise."""
    run = Path(run_dir)
    if events is None:
        events = load_events(run, allow_empty=True)
    links = load_links(run / "links.parquet")
    tcp = load_tcp(run / TCP_FILE)
    text = json.dumps(chrome_trace(events, links, run_id=run.name, tcp=tcp), allow_nan=False,
                      separators=(",", ":"))
    dst = run / TRACE_FILE
    tmp = run / f".{TRACE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, dst)
    return dst
