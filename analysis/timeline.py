"""Per-host timelines (Gantt charts) from a run's events, for any role.

One row per interval a host spent on something: ``node``, ``lane`` (what ran concurrently
on that host: ``compute`` for the main thread, ``send`` for a sender thread), ``category``
(one of :data:`CATEGORIES`), ``label`` (e.g. ``F3.1``), ``iter``, ``start_s``, ``end_s``
(seconds from the run's first event, CLOCK_MONOTONIC shared by all hosts).

- Pipeline stages (``pp_action``, ``pp_send`` events, :mod:`agents.pipeline.stage`): forward,
  backward, recompute, optimizer and receive (the time a stage waited for a message) on the
  compute lane; every send on the send lane, from the sender thread's first to last byte
  handed to the kernel.
- Data-parallel workers (``compute_done``, ``compress_done``, ``send_done``,
  ``recv_done``): compute, compress, send and wait per iteration, from each event's
  duration field ending at its timestamp (``send_done`` carries its own ``start_ns``).

Idle is what a lane does not cover; :func:`plot_gantt` leaves it white.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CATEGORIES = ("forward", "backward", "recompute", "optimizer", "receive", "send",
              "compute", "compress", "wait")
COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "recompute": "#8172b3",
          "optimizer": "#937860", "receive": "#c8c8c8", "send": "#55a868",
          "compute": "#4c72b0", "compress": "#8172b3", "wait": "#c8c8c8"}
_PP_KIND = {"F": "forward", "B": "backward", "R": "recompute", "OPT": "optimizer",
            "RA": "receive", "RG": "receive"}
COLUMNS = ["node", "lane", "category", "label", "iter", "start_ns", "end_ns"]


def _rows_pipeline(ev: pd.DataFrame) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    act = ev[ev["event"] == "pp_action"]
    for r in act.to_dict("records"):
        cat = _PP_KIND.get(str(r["kind"]))
        if cat is None:
            continue  # SA/SG on the main thread only queue the message
        chunk = int(r["chunk"])
        label = f"{r['kind']}{int(r['mb'])}" + (f".{chunk}" if chunk else "")
        rows.append({"node": r["node"], "lane": "compute", "category": cat, "label": label,
                     "iter": int(r["iter"]), "start_ns": int(r["start_ns"]),
                     "end_ns": int(r["end_ns"])})
    snd = ev[ev["event"] == "pp_send"]
    for r in snd.to_dict("records"):
        chunk = int(r["chunk"])
        rows.append({"node": r["node"], "lane": "send", "category": "send",
                     "label": f"{r['kind']}{int(r['mb'])}" + (f".{chunk}" if chunk else ""),
                     "iter": int(r["iter"]), "start_ns": int(r["start_ns"]),
                     "end_ns": int(r["end_ns"])})
    return rows


def _rows_workers(ev: pd.DataFrame) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    spec = {"compute_done": ("compute", "compute_s"), "compress_done": ("compress", "compress_s"),
            "recv_done": ("wait", "wait_s")}
    for name, (cat, col) in spec.items():
        if col not in ev:
            continue
        for r in ev[ev["event"] == name].to_dict("records"):
            end = int(r["ts_ns"])
            dur = float(r[col])
            rows.append({"node": r["node"], "lane": "compute", "category": cat, "label": cat,
                         "iter": int(r["iter"]), "start_ns": end - int(dur * 1e9),
                         "end_ns": end})
    if "start_ns" in ev:
        for r in ev[ev["event"] == "send_done"].to_dict("records"):
            rows.append({"node": r["node"], "lane": "send", "category": "send",
                         "label": "send", "iter": int(r["iter"]),
                         "start_ns": int(r["start_ns"]), "end_ns": int(r["ts_ns"])})
    return rows


def host_timeline(events: pd.DataFrame) -> pd.DataFrame:
    """Every host's intervals (see the module docstring), sorted by node and start."""
    rows = _rows_pipeline(events) + _rows_workers(events)
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
