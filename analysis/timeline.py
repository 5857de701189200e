"""Per-host timelines (Gantt charts) from a run's events, for any role.

One row per interval a host spent on something: ``node``, ``lane`` (what ran concurrently
on that host: a role's main thread, a sender thread, a model's layers), ``category`` (what
the role calls it: ``forward``, ``dispatch_tokens``, ...), ``activity`` (one of
:data:`ACTIVITIES`, the same words for every role), ``label`` (e.g. ``F3.1``), ``iter``,
``start_ns``, ``end_ns`` (CLOCK_MONOTONIC, shared by all hosts of a run), ``start_s`` and
``end_s`` (seconds from the timeline's first interval).

- Data-parallel workers (``compute_done``, ``compress_done``, ``send_done``, ``recv_done``,
  ``iter_done``): lane ``main``, and the intervals **partition** each iteration, from its
  start (``iter_done`` minus ``iter_s``) to its end (``iter_done``): compute
  (``compute_s``), then per chunk its compression (``compress_s``) and the send until its
  ``compress_done`` (logged once the chunk is written), the rest of the upload until
  ``send_done``, wait until the first weight byte (``recv_done.first_ns``), receive until
  the end. Each boundary is clamped between its neighbours, so the intervals never overlap
  and their durations sum to ``iter_s`` exactly.
- The data-parallel PS (``grads_in``, ``ps_iter_done``, ``weights_sent``): lane ``main``,
  receive from the previous iteration's end to the last gradient byte, then aggregate
  until the iteration's end (the last chunk's mean and step, the evaluation when there is
  one). The PS's event loop sends the weights without blocking, beside both: each
  worker's send (first chunk queued to the kernel taking the last byte) is a span of its
  own on lane ``send wK``.
- Pipeline stages (``pp_action``, ``pp_send``, :mod:`agents.pipeline.stage`): one interval
  per schedule action on lane ``compute`` (forward, backward, recompute, optimizer; receive:
  the time a stage waited for a message; send: queueing a message for the sender thread),
  and every send on lane ``send``, from the sender thread's first to last byte handed to the
  kernel.
- MoE expert hosts (``moe_phase``, :mod:`agents.moe.hosts`): whole-model phases (layer -1)
  on lane ``step``, a layer's phases (inside the forward or backward) on lane ``layers``.
- Any other event carrying ``start_ns`` (ending at ``end_ns``, else at its own timestamp),
  so a role added later appears too: lane and category are the event's name, the label its
  ``kind`` or ``phase`` field when it has one.

Idle is what a lane does not cover; :func:`plot_gantt` leaves it white.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: What a host can be doing, in the same words for every role. ``exchange`` is an
#: all-to-all or collective (sending and receiving at once); ``other`` a generic event whose
#: name says none of these.
ACTIVITIES = ("compute", "compress", "send", "receive", "exchange", "wait", "other")
CATEGORIES = ("forward", "backward", "recompute", "optimizer", "receive", "send",
              "compute", "compress", "wait", "aggregate", "expert", "dispatch_counts",
              "dispatch_tokens", "dispatch_done", "combine", "combine_grad", "tokens_grad",
              "all_gather_zero3", "all_gather_zero3_bwd", "reduce_scatter_and_update")
#: category -> activity; a category not listed is classified by :func:`activity_of`.
ACTIVITY = {"forward": "compute", "backward": "compute", "recompute": "compute",
            "optimizer": "compute", "compute": "compute", "aggregate": "compute",
            "expert": "compute", "compress": "compress", "send": "send",
            "receive": "receive", "wait": "wait", "dispatch_done": "wait",
            "dispatch_counts": "exchange", "dispatch_tokens": "exchange",
            "combine": "exchange", "combine_grad": "exchange", "tokens_grad": "exchange",
            "all_gather_zero3": "exchange", "all_gather_zero3_bwd": "exchange",
            "reduce_scatter_and_update": "exchange"}
COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#8172b3",
          "optimizer": "#937860", "receive": "#a0a0a0", "send": "#55a868",
          "compute": "#4c72b0", "compress": "#8172b3", "wait": "#d8d8d8",
          "aggregate": "#937860", "expert": "#64b5cd", "dispatch_counts": "#c44e52",
          "dispatch_tokens": "#dd8452", "dispatch_done": "#f0e0a0", "combine": "#55a868",
          "combine_grad": "#937860", "tokens_grad": "#da8bc3", "all_gather_zero3": "#8c8c8c",
          "all_gather_zero3_bwd": "#5c5c5c", "reduce_scatter_and_update": "#ccb974"}
_PP_KIND = {"F": "forward", "B": "backward", "R": "recompute", "OPT": "optimizer",
            "RA": "receive", "RG": "receive", "SA": "send", "SG": "send"}
COLUMNS = ["node", "lane", "category", "activity", "label", "iter", "start_ns", "end_ns"]
Row = dict[str, Any]


_LANE_ORDER = ("main", "compute", "step", "layers", "send")


def node_sort_key(node: str) -> tuple[int, str, int]:
    """ps first, then the other hosts by name and number (w2 before w10), controller last."""
    m = re.fullmatch(r"(.*?)(\d+)", node)
    head, num = (m.group(1), int(m.group(2))) if m else (node, -1)
    rank = 0 if node == "ps" else 2 if node == "controller" else 1
    return rank, head, num


def lane_sort_key(lane: str) -> tuple[int, str]:
    """A role's main thread first, its sender thread after."""
    order = {name: i for i, name in enumerate(_LANE_ORDER)}
    return order.get(lane, len(order)), lane


def activity_of(category: str) -> str:
    """The activity of a category: :data:`ACTIVITY`, else a word its name contains."""
    if category in ACTIVITY:
        return ACTIVITY[category]
    name = category.lower()
    for word, act in (("compress", "compress"), ("send", "send"), ("recv", "receive"),
                      ("receive", "receive"), ("wait", "wait"), ("compute", "compute")):
        if word in name:
            return act
    return "other"


def _row(node: Any, lane: str, category: str, label: str, it: Any, start_ns: Any,
         end_ns: Any) -> Row:
    return {"node": str(node), "lane": lane, "category": category,
            "activity": activity_of(category), "label": label, "iter": int(it),
            "start_ns": int(start_ns), "end_ns": int(end_ns)}


def _records(ev: pd.DataFrame, name: str) -> list[Row]:
    return ev[ev["event"] == name].to_dict("records")  # type: ignore[return-value]


def _num(r: Mapping[Any, Any], key: str) -> float | None:
    """A field of an event record as a float, None where absent or NaN."""
    v = r.get(key)
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f


def _rows_pipeline(ev: pd.DataFrame) -> list[Row]:
    rows: list[Row] = []
    for r in _records(ev, "pp_action"):
        kind = str(r["kind"])
        chunk = int(r["chunk"])
        label = f"{kind}{int(r['mb'])}" + (f".{chunk}" if chunk else "")
        rows.append(_row(r["node"], "compute", _PP_KIND.get(kind, kind), label, r["iter"],
                         r["start_ns"], r["end_ns"]))
    for r in _records(ev, "pp_send"):
        chunk = int(r["chunk"])
        rows.append(_row(r["node"], "send", "send",
                         f"{r['kind']}{int(r['mb'])}" + (f".{chunk}" if chunk else ""),
                         r["iter"], r["start_ns"], r["end_ns"]))
    return rows


_WORKER_EVENTS = ("compute_done", "compress_done", "send_done", "recv_done", "iter_done")


def _worker_bounds(g: dict[str, list[Row]]) -> tuple[int, int] | None:
    """(start_ns, end_ns) of one worker iteration: ``start_ns`` to ``start_ns + iter_s``
    from ``iter_done`` (before runs recorded its start: ``iter_done`` minus ``iter_s`` to
    ``iter_done``, late by however long the worker took to write it, which on a busy
    machine pushed the compute past the send); for an iteration cut short, from the
    compute's start to its last event."""
    done = g.get("iter_done", [])
    if done and _num(done[0], "iter_s") is not None:
        iter_ns = round(float(done[0]["iter_s"]) * 1e9)
        start = _num(done[0], "start_ns")
        if start:
            return int(start), int(start) + iter_ns
        end = int(done[0]["ts_ns"])
        return end - iter_ns, end
    comp = g.get("compute_done", [])
    if not comp or _num(comp[0], "compute_s") is None:
        return None
    start = int(comp[0]["ts_ns"]) - round(float(comp[0]["compute_s"]) * 1e9)
    last = max(int(r["ts_ns"]) for rs in g.values() for r in rs)
    return start, last


def _worker_iteration(node: str, it: int, g: dict[str, list[Row]]) -> list[Row]:
    """One worker iteration as intervals that partition it (see the module docstring)."""
    bounds = _worker_bounds(g)
    if bounds is None:
        return []
    start, end = bounds
    src = (g.get("iter_done") or g.get("compute_done") or [{}])[0]
    compute_s = _num(src, "compute_s") or _num((g.get("compute_done") or [{}])[0],
                                               "compute_s") or 0.0
    # (category, label, absolute end or None, duration (ns) when the end is relative)
    marks: list[tuple[str, str, int | None, int]] = [("compute", "compute", None,
                                                      round(compute_s * 1e9))]
    for r in sorted(g.get("compress_done", []), key=lambda r: int(r["ts_ns"])):
        key = str(r.get("key") or "chunk")
        marks.append(("compress", key, None, round((_num(r, "compress_s") or 0.0) * 1e9)))
        marks.append(("send", key, int(r["ts_ns"]), 0))
    if g.get("send_done"):
        marks.append(("send", "send", int(g["send_done"][0]["ts_ns"]), 0))
    first = _num((g.get("recv_done") or [{}])[0], "first_ns")
    if first:
        marks.append(("wait", "wait", int(first), 0))
        marks.append(("receive", "receive", end, 0))
    else:  # no first-byte time (a run before recv_done carried it): all of it waiting
        marks.append(("wait", "wait", end, 0))
    rows: list[Row] = []
    cursor = start
    for cat, label, at, dur in marks:
        b = min(max(at if at is not None else cursor + dur, cursor), end)
        if b > cursor:
            rows.append(_row(node, "main", cat, label, it, cursor, b))
        cursor = b
    return rows


def _group(ev: pd.DataFrame, names: Iterable[str]) -> dict[tuple[str, int], dict[str, list[Row]]]:
    out: dict[tuple[str, int], dict[str, list[Row]]] = {}
    sub = ev[ev["event"].isin(list(names))]
    for r in sub.to_dict("records"):
        out.setdefault((str(r["node"]), int(r["iter"])), {}).setdefault(
            str(r["event"]), []).append(r)  # type: ignore[arg-type]
    return out


def _rows_workers(ev: pd.DataFrame) -> list[Row]:
    rows: list[Row] = []
    for (node, it), g in _group(ev, _WORKER_EVENTS).items():
        rows += _worker_iteration(node, it, g)
    return rows


def _rows_ps(ev: pd.DataFrame) -> list[Row]:
    rows: list[Row] = []
    prev_end: dict[str, int] = {}
    groups = _group(ev, ("grads_in", "ps_iter_done"))
    for (node, it), g in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if not g.get("ps_iter_done"):
            continue
        done = g["ps_iter_done"][0]
        end = int(done["ts_ns"])
        cursor = prev_end.get(node)
        prev_end[node] = end
        if not g.get("grads_in"):
            continue
        gin = int(g["grads_in"][0]["ts_ns"])
        if cursor is not None and gin > cursor:
            rows.append(_row(node, "main", "receive", "gradients in", it, cursor, gin))
        cursor = min(max(gin, cursor or gin), end)
        if end > cursor:
            rows.append(_row(node, "main", "aggregate", "aggregate", it, cursor, end))
    return rows


def _rows_ps_sends(ev: pd.DataFrame) -> list[Row]:
    return [_row(r["node"], f"send w{int(r['worker'])}", "send", f"weights w{int(r['worker'])}",
                 r["iter"], r["start_ns"], r["end_ns"]) for r in _records(ev, "weights_sent")]


def _rows_moe(ev: pd.DataFrame) -> list[Row]:
    rows: list[Row] = []
    for r in _records(ev, "moe_phase"):
        layer = int(r["layer"])
        phase = str(r["phase"])
        lane, label = ("step", phase) if layer < 0 else ("layers", f"{phase} L{layer}")
        rows.append(_row(r["node"], lane, phase, label, r["iter"], r["start_ns"],
                         r["end_ns"]))
    return rows


#: The rules of the known roles, each with the events it draws; every other event with a
#: ``start_ns`` goes to :func:`_rows_generic`.
RULES: tuple[tuple[Callable[[pd.DataFrame], list[Row]], tuple[str, ...]], ...] = (
    (_rows_pipeline, ("pp_action", "pp_send")),
    (_rows_workers, _WORKER_EVENTS),
    (_rows_ps, ("grads_in", "ps_iter_done")),
    (_rows_ps_sends, ("weights_sent",)),
    (_rows_moe, ("moe_phase",)),
)


def _rows_generic(ev: pd.DataFrame) -> list[Row]:
    if "start_ns" not in ev:
        return []
    known = {name for _, names in RULES for name in names}
    sub = ev[~ev["event"].isin(list(known)) & ev["start_ns"].notna()]
    rows: list[Row] = []
    for r in sub.to_dict("records"):
        name = str(r["event"])
        end = _num(r, "end_ns") or float(r["ts_ns"])
        label = next((str(r[k]) for k in ("kind", "phase") if isinstance(r.get(k), str)), name)
        start = int(float(r["start_ns"]))
        if int(end) >= start:
            rows.append(_row(r["node"], name, name, label, r["iter"], start, int(end)))
    return rows


def host_timeline(events: pd.DataFrame) -> pd.DataFrame:
    """Every host's intervals (see the module docstring), sorted by node and start."""
    rows: list[Row] = []
    if len(events) and "event" in events:
        for rule, _ in RULES:
            rows += rule(events)
        rows += _rows_generic(events)
    tl = pd.DataFrame(rows, columns=COLUMNS)
    if tl.empty:
        return tl.assign(start_s=pd.Series(dtype=float), end_s=pd.Series(dtype=float))
    t0 = int(tl["start_ns"].min())
    tl["start_s"] = (tl["start_ns"] - t0) / 1e9
    tl["end_s"] = (tl["end_ns"] - t0) / 1e9
    return tl.sort_values(["node", "start_ns"], kind="stable").reset_index(drop=True)


def gantt_figure(tl: pd.DataFrame, *, title: str = "",
                 t_range: tuple[float, float] | None = None) -> Figure:
    """One row per (host, lane), a bar per interval coloured by category, idle white."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    keys = list(dict.fromkeys(zip(tl["node"], tl["lane"], strict=True)))
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(keys) + 1.6))
    for y, (node, lane) in enumerate(keys):
        sel = tl[(tl["node"] == node) & (tl["lane"] == lane)]
        for cat, g in sel.groupby("category"):
            ax.broken_barh(list(zip(g["start_s"], g["end_s"] - g["start_s"], strict=True)),
                           (y - 0.4, 0.8), color=COLORS.get(str(cat), "#999999"))
    ax.set_yticks(range(len(keys)), [f"{n} {lane}" for n, lane in keys])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    if t_range is not None:
        ax.set_xlim(*t_range)
    present = [c for c in CATEGORIES if c in set(tl["category"])]
    ax.legend(handles=[Patch(color=COLORS[c], label=c) for c in present],
              ncol=max(1, len(present)), loc="lower center", bbox_to_anchor=(0.5, 1.0),
              fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_gantt(tl: pd.DataFrame, path: str | Path, *, title: str = "",
               t_range: tuple[float, float] | None = None) -> Path:
    """:func:`gantt_figure` written to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig = gantt_figure(tl, title=title, t_range=t_range)
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
