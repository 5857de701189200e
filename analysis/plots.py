"""Figures for runs and sweeps (matplotlib, Agg), in the forms networking papers use.

- the bottleneck's throughput and queue over time with the trace's allowed rate overlaid
  (Mahimahi's ``mm-throughput-graph``);
- per-worker throughput, stacked;
- iteration-time CDFs, one line per run;
- accuracy against wall-clock time (time-to-accuracy curves, DAWNBench);
- keep ratio and measured rate over time (the adaptive-ratio policy, DESIGN.md 1.1);
- the Pantheon summary scatter (Yan et al. 2018): one point per run;
- each flow's cwnd, RTT, pacing rate and retransmissions over time beside the bottleneck's
  queue (from the workers' TCP_INFO samples; with real RTTs these decide what a congestion
  control does).

Every function takes the tables of :mod:`analysis.load` / :mod:`analysis.metrics` and returns
a :class:`matplotlib.figure.Figure` built without pyplot, so nothing touches global state or
needs a display; save it with :func:`save` or embed it with :func:`png_bytes`.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from agents.core.nodes import is_worker_node, worker_index
from analysis import metrics

FIGSIZE = (9.0, 4.5)
DPI = 100


def _figure(nrows: int = 1, sharex: bool = True, height: float | None = None
            ) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(FIGSIZE[0], height or FIGSIZE[1] * (1 if nrows == 1 else 0.75 * nrows)),
                 dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 1, sharex=sharex, squeeze=False)[:, 0]
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _no_data(ax: Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in this run", ha="center", va="center",
            transform=ax.transAxes, color="0.4")


def save(fig: Figure, path: str | os.PathLike[str]) -> Path:
    """Write the figure (format from the suffix, e.g. ``.png``, ``.pdf``) and return the path."""
    p = Path(path)
    fig.savefig(p)
    return p


def png_bytes(fig: Figure) -> bytes:
    """The figure as PNG bytes (for embedding in HTML)."""
    buf = io.BytesIO()
    # The canvas's own print lays the figure out and renders it in one draw; ``savefig``
    # with a layout engine draws it twice (a pass that only lays out, then the render):
    # the same pixels, one pass over every artist less.
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def plot_bottleneck(links: pd.DataFrame, direction: str = "up", title: str | None = None
                    ) -> Figure:
    """Delivered throughput of the bottleneck with the trace's allowed rate (top) and its
    queue backlog with cumulative drops (bottom), per ``tc -s`` sample interval."""
    fig, (ax_rate, ax_q) = _figure(2)
    thr = metrics.link_throughput(links, direction)
    fig.suptitle(title or f"Bottleneck ({direction}link): throughput and queue")
    if thr.empty:
        _no_data(ax_rate, f"{direction}link samples")
        _no_data(ax_q, f"{direction}link samples")
    else:
        for dev, d in thr.groupby("dev", sort=True):
            ax_rate.plot(d["t_s"], d["throughput_mbps"], lw=1.2, label=f"delivered ({dev})")
            ax_rate.step(d["t_s"], d["rate_mbps"], where="pre", ls="--", lw=1.2,
                         label=f"allowed by trace ({dev})")
        q = metrics.queue_series(links, direction)
        dr = metrics.drops(links, direction)
        for dev, d in q.groupby("dev", sort=True):
            ax_q.plot(d["t_s"], d["backlog_bytes"] / 1e3, lw=1.0, label=f"backlog ({dev})")
        ax_d = ax_q.twinx()
        for dev, d in dr.groupby("dev", sort=True):
            ax_d.plot(d["t_s"], d["drops_total"], color="tab:red", lw=1.0,
                      label=f"drops, cumulative ({dev})")
        ax_d.set_ylabel("drops (packets, cumulative)")
        h1, l1 = ax_q.get_legend_handles_labels()
        h2, l2 = ax_d.get_legend_handles_labels()
        ax_q.legend(h1 + h2, l1 + l2, loc="upper right", fontsize="small")
        ax_rate.legend(loc="upper right", fontsize="small")
    ax_rate.set_ylabel("rate (Mbit/s)")
    ax_q.set_ylabel("queue backlog (kB)")
    ax_q.set_xlabel("time since run start (s)")
    return fig


def plot_worker_throughput(events: pd.DataFrame, window_s: float = 1.0,
                           source: str = "send_done", title: str | None = None) -> Figure:
    """Each worker's goodput over ``window_s`` windows, stacked (the top edge is the total the
    bottleneck carried for training). ``source`` as in :func:`analysis.metrics.goodput`."""
    fig, (ax,) = _figure(1)
    gp = metrics.goodput(events, by="node", window_s=window_s, source=source)
    gp = gp[gp["node"].astype(str).map(is_worker_node)]
    if gp.empty:
        _no_data(ax, source + " events")
    else:
        wide = gp.pivot_table(index="t_s", columns="node", values="goodput_mbps", fill_value=0.0)
        wide = wide[sorted(wide.columns, key=lambda n: worker_index(str(n)) or 0)]
        x = wide.index.to_numpy(float) + window_s / 2
        ax.stackplot(x, wide.to_numpy(float).T, labels=[str(c) for c in wide.columns],
                     alpha=0.85)
        ax.legend(loc="upper right", fontsize="small", ncol=max(1, len(wide.columns) // 8))
    ax.set_title(title or f"Per-worker goodput ({source}, {window_s:g} s windows), stacked")
    ax.set_xlabel("time since run start (s)")
    ax.set_ylabel("goodput (Mbit/s)")
    return fig


def plot_iteration_cdf(runs: Mapping[str, pd.DataFrame], title: str | None = None) -> Figure:
    """Empirical CDF of per-worker iteration times, one line per run (label -> events)."""
    fig, (ax,) = _figure(1)
    drawn = 0
    for label, events in runs.items():
        it = metrics.iteration_times(events).to_numpy(float)
        if it.size == 0:
            continue
        y = np.arange(1, it.size + 1) / it.size
        ax.step(it, y, where="post", label=f"{label} (p50 {np.median(it):.3g} s)")
        drawn += 1
    if not drawn:
        _no_data(ax, "iter_done events")
    else:
        ax.legend(loc="lower right", fontsize="small")
    ax.set_ylim(0, 1.02)
    ax.set_title(title or "Iteration time CDF")
    ax.set_xlabel("iteration time (s)")
    ax.set_ylabel("fraction of iterations")
    return fig


def plot_accuracy_vs_time(runs: Mapping[str, pd.DataFrame], target: float | None = None,
                          title: str | None = None) -> Figure:
    """Accuracy of the PS's evaluations against time since training started, one line per
    run (label -> the run's events); with ``target``, a horizontal line and each run's
    :func:`analysis.metrics.time_to_accuracy`, on the same time axis."""
    fig, (ax,) = _figure(1)
    drawn = 0
    for label, events in runs.items():
        ev = metrics.evaluations(events)
        ev = ev.dropna(subset=["accuracy"]) if "accuracy" in ev else ev.iloc[0:0]
        if ev.empty:
            continue
        lab = label
        if target is not None:
            tta = metrics.time_to_accuracy(events, target)
            lab = f"{label} (TTA {tta:.3g} s)" if np.isfinite(tta) else f"{label} (not reached)"
        ax.plot(ev["train_s"], ev["accuracy"], marker="o", ms=3, label=lab)
        drawn += 1
    if target is not None:
        ax.axhline(target, color="0.3", ls=":", lw=1, label=f"target {target:g}")
    if not drawn:
        _no_data(ax, "eval events")
    else:
        ax.legend(loc="lower right", fontsize="small")
    ax.set_title(title or "Accuracy against time since training started")
    ax.set_xlabel("time since training started (s)")
    ax.set_ylabel("accuracy")
    return fig


def plot_keep_ratio(decisions: pd.DataFrame, links: pd.DataFrame, direction: str = "up",
                    title: str | None = None) -> Figure:
    """Top: each worker's keep ratio at every adaptive decision. Bottom: the bottleneck's
    allowed and delivered rate, and the workers' measured target rate ``rt`` times N (what the
    policy believed the bottleneck gave them together)."""
    fig, (ax_k, ax_r) = _figure(2)
    kv = metrics.keep_ratio_vs_bandwidth(decisions, links, direction)
    if kv.empty:
        _no_data(ax_k, "decision events")
    else:
        for node, d in kv.groupby("node", sort=True):
            ax_k.step(d["t_s"], d["keep"], where="post", lw=1.0, label=str(node))
        ax_k.legend(loc="upper right", fontsize="small", ncol=max(1, kv["node"].nunique() // 8))
        per_t = kv.groupby("t_s", sort=True).agg(rt=("rt_mbps", "sum"))
        ax_r.plot(per_t.index, per_t["rt"], ".", ms=3, label="sum of workers' rt")
    thr = metrics.link_throughput(links, direction)
    if not thr.empty:
        tot = thr.groupby("t_s", sort=True)[["throughput_mbps", "rate_mbps"]].sum()
        ax_r.plot(tot.index, tot["throughput_mbps"], lw=1.0, label="bottleneck delivered")
        ax_r.step(tot.index, tot["rate_mbps"], where="pre", ls="--", lw=1.2,
                  label="allowed by trace")
    if ax_r.lines:
        ax_r.legend(loc="upper right", fontsize="small")
    else:
        _no_data(ax_r, "rate samples")
    ax_k.set_ylabel("keep ratio")
    ax_k.set_ylim(0, 1.05)
    ax_r.set_ylabel("rate (Mbit/s)")
    ax_r.set_xlabel("time since run start (s)")
    fig.suptitle(title or "Adaptive keep ratio against bandwidth")
    return fig


def plot_iteration_breakdown(breakdowns: Mapping[str, pd.DataFrame], title: str | None = None
                             ) -> Figure:
    """Stacked bars of the mean iteration phases (label -> one-row
    :func:`analysis.metrics.iteration_breakdown`)."""
    fig, (ax,) = _figure(1, height=max(2.5, 0.6 * len(breakdowns) + 1.8))
    labels = list(breakdowns)
    left = np.zeros(len(labels))
    for part in metrics.ITERATION_PARTS:
        vals = np.array([float(breakdowns[lab][part].iloc[0]) if len(breakdowns[lab]) else 0.0
                         for lab in labels])
        vals = np.nan_to_num(vals)
        ax.barh(labels, vals, left=left, label=part.removesuffix("_s"))
        left += vals
    ax.legend(loc="lower right", fontsize="small", ncol=len(metrics.ITERATION_PARTS))
    ax.set_xlabel("mean time per iteration (s)")
    ax.set_title(title or "Iteration time breakdown")
    return fig


def plot_summary_scatter(table: pd.DataFrame, x: str = "iter_time_s_mean",
                         y: str = "final_accuracy", label: str = "label",
                         title: str | None = None) -> Figure:
    """Pantheon-style summary: one point per run at (``x``, ``y``), annotated with ``label``.
    Defaults: mean iteration time against final accuracy (up and left is better)."""
    fig, (ax,) = _figure(1)
    ok = table.dropna(subset=[c for c in (x, y) if c in table]) if x in table and y in table \
        else table.iloc[0:0]
    if ok.empty:
        _no_data(ax, f"runs with both {x} and {y}")
    else:
        for _, row in ok.iterrows():
            ax.plot(row[x], row[y], "o", ms=7)
            ax.annotate(str(row[label]) if label in row else "", (row[x], row[y]),
                        xytext=(5, 5), textcoords="offset points", fontsize="small")
    ax.set_xlabel(x.replace("_s_", " (s) ").replace("_", " "))
    ax.set_ylabel(y.replace("_", " "))
    ax.set_title(title or "Runs: iteration time against final accuracy")
    return fig


def plot_transport(events: pd.DataFrame, links: pd.DataFrame, direction: str = "up",
                   title: str | None = None) -> Figure:
    """Per flow (worker), from its ``tcp_info`` samples: cwnd, smoothed RTT, pacing rate
    and cumulative retransmissions (:func:`analysis.metrics.transport_series`), and below
    them the bottleneck queue on the same time axis."""
    fig, axes = _figure(5, height=11.0)
    tr = metrics.transport_series(events)
    fig.suptitle(title or "Transport per flow (TCP_INFO) and the bottleneck queue")
    panels = [("cwnd", "cwnd (segments)"), ("rtt_ms", "RTT (ms)"),
              ("pacing_rate_mbps", "pacing rate (Mbit/s)"),
              ("retrans", "retransmitted (segments, cumulative)")]
    if tr.empty:
        for ax, (_, what) in zip(axes[:4], panels, strict=True):
            _no_data(ax, "tcp_info samples")
            ax.set_ylabel(what)
    else:
        nodes = sorted(tr["node"].unique(), key=lambda n: (len(n), n))
        for ax, (col, what) in zip(axes[:4], panels, strict=True):
            for node in nodes:
                d = tr[tr["node"] == node]
                ax.plot(d["t_s"], d[col], lw=1.0, label=node)
            ax.set_ylabel(what)
        axes[0].legend(loc="upper right", fontsize="small", ncol=max(1, len(nodes) // 8))
    q = metrics.queue_series(links, direction) if not links.empty else pd.DataFrame()
    ax_q = axes[4]
    if q.empty:
        _no_data(ax_q, f"{direction}link samples")
    else:
        for dev, d in q.groupby("dev", sort=True):
            ax_q.plot(d["t_s"], d["backlog_bytes"] / 1e3, lw=1.0, color="0.3",
                      label=f"backlog ({dev})")
        ax_q.legend(loc="upper right", fontsize="small")
    ax_q.set_ylabel(f"{direction}link queue (kB)")
    ax_q.set_xlabel("time since run start (s)")
    return fig



def plot_connections(tcp: pd.DataFrame, title: str | None = None) -> Figure:
    """A torchrun run's TCP connections between hosts (``tcp.parquet`` through
    :func:`analysis.metrics.connection_series`): each connection's sending rate, cwnd and
    RTT over time, one line per connection, coloured by the host whose socket it is."""
    fig, axes = _figure(3, height=8.0)
    fig.suptitle(title or "TCP connections between hosts (sock_diag): rate, cwnd, RTT")
    series = metrics.connection_series(tcp)
    panels = [("sent_mbps", "sent (Mbit/s)"), ("cwnd", "cwnd (segments)"),
              ("rtt_ms", "RTT (ms)")]
    if series.empty:
        for ax, (_, what) in zip(axes, panels, strict=True):
            _no_data(ax, "connection samples")
            ax.set_ylabel(what)
        return fig
    hosts = sorted(series["host"].unique(), key=lambda h: (len(h), h))
    colors = {h: f"C{i % 10}" for i, h in enumerate(hosts)}
    for ax, (col, what) in zip(axes, panels, strict=True):
        for (host, _), d in series.groupby(["host", "conn"], sort=True):
            ax.plot(d["t_s"], d[col], lw=0.9, color=colors[str(host)], alpha=0.8)
        ax.set_ylabel(what)
    for h in hosts:  # one legend entry per host, not per connection
        axes[0].plot([], [], color=colors[h], label=h)
    axes[0].legend(loc="upper right", fontsize="small", ncol=max(1, len(hosts) // 8))
    axes[-1].set_xlabel("time since run start (s)")
    return fig
