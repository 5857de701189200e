"""``gradbed report``: one self-contained HTML page for one run or a sweep of runs.

The page holds the summary tables and every plot of :mod:`analysis.plots`, with the images
embedded as base64 PNG so the single ``index.html`` opens offline, can be mailed, and survives
being moved (Pantheon's per-run report, in one file). Each run's per-host timeline is
interactive (zoom with the wheel, drag, pan): drawn by uPlot (MIT, ``analysis/vendor/uplot``),
inlined with its licence, never fetched. Tables wrap their cells to the page's width rather
than run off it; a run's one-row summary and an overview of a few runs are shown transposed
(one row per number). It is written atomically: a reader sees the old page or the new one,
never half of one.
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from analysis import metrics, plots, timeline, torchrun
from analysis.load import Run, flatten, load_run, load_runs

VENDOR = Path(__file__).resolve().parent / "vendor" / "uplot"
TIMELINE_JS = Path(__file__).resolve().parent / "report_timeline.js"
#: Up to this many runs the overview is transposed: one row per number, one column per run.
TRANSPOSE_MAX_RUNS = 8
#: A table with more columns than this is set smaller so its headers break less.
WIDE_COLUMNS = 12

# Cells may break anywhere (long config values, snake_case names), so a table's narrowest
# layout always fits the page; its box scrolls only if even that does not.
CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222;
       padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; }
.table-box { overflow-x: auto; max-width: 100%; margin: .5em 0 1.5em; }
table { border-collapse: collapse; font-size: .85em; max-width: 100%; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: right;
         overflow-wrap: anywhere; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
td.n { white-space: nowrap; overflow-wrap: normal; }
.wide table { font-size: .72em; } .wide th, .wide td { padding: .2em .3em; }
tbody tr:nth-child(even) { background: #fafafa; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: .85em; color: #555; }
.meta { font-size: .85em; color: #555; overflow-wrap: anywhere; }
.glossary dl { font-size: .85em; display: grid; grid-template-columns: minmax(8em, max-content)
               minmax(0, 1fr); gap: .1em 1em; } .glossary dd { margin: 0; }
.glossary dt { overflow-wrap: anywhere; }
.gb-timeline { border: 1px solid #eee; padding: .3em 0; }
.gb-info { font-size: .8em; color: #555; min-height: 1.3em; padding: 0 .5em; }
.gb-legend { font-size: .8em; padding: .2em .5em; }
.gb-legend span { margin-right: 1em; white-space: nowrap; }
.gb-legend i { display: inline-block; width: .9em; height: .9em; margin-right: .3em;
               vertical-align: -.1em; }
"""


def _img(fig: Figure, caption: str) -> str:
    data = base64.b64encode(plots.png_bytes(fig)).decode("ascii")
    cap = html.escape(caption)
    return (f'<figure><img alt="{cap}" src="data:image/png;base64,{data}">'
            f"<figcaption>{cap}</figcaption></figure>")


_NUMBER_CELL = re.compile(r"<td>([-+]?[0-9][0-9.e+-]*|–|nan|inf|True|False)</td>")
_HEADER_CELL = re.compile(r"<th>([^<]*)</th>")


def _table(df: pd.DataFrame, index: bool = False) -> str:
    """The table in a box of the page's width. Headers may break after ``_`` and ``.``
    (then anywhere); numbers never break, other cells anywhere."""
    text = df.to_html(index=index, escape=True, na_rep="–", border=0,
                      float_format=lambda v: f"{v:.4g}")
    text = _HEADER_CELL.sub(lambda m: "<th>" + m.group(1).replace("_", "_<wbr>")
                            .replace(".", ".<wbr>") + "</th>", text)
    text = _NUMBER_CELL.sub(r'<td class="n">\1</td>', text)
    box = "table-box wide" if df.shape[1] > WIDE_COLUMNS else "table-box"
    return f'<div class="{box}">' + text + "</div>"


def _transposed(df: pd.DataFrame, first: str, names: list[str]) -> str:
    """A table of a few rows shown as one row per column of ``df`` (``first`` heads the
    names' column), each original row a column named by ``names``."""
    t = df.T
    t.columns = names
    t = t.map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
    t.insert(0, first, [str(c) for c in df.columns])
    return _table(t)


def _json_script(ident: str, data: object) -> str:
    # "</" inside a <script> would end it early.
    text = json.dumps(data, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")
    return f'<script type="application/json" id="{ident}">{text}</script>'


def interactive_timeline(tl: pd.DataFrame, origin_ns: int, ident: str) -> str:
    """The per-host timeline as an interactive chart (``report_timeline.js`` on uPlot):
    one row per host and lane, a bar per interval coloured by category, on the run's
    time axis (seconds since ``origin_ns``)."""
    keys = sorted(dict.fromkeys(zip(tl["node"], tl["lane"], strict=True)),
                  key=lambda k: (timeline.node_sort_key(str(k[0])),
                                 timeline.lane_sort_key(str(k[1]))))
    row = {k: i for i, k in enumerate(keys)}
    present = set(tl["category"])
    cats = [c for c in timeline.CATEGORIES if c in present] + sorted(
        present - set(timeline.CATEGORIES))
    cat = {c: i for i, c in enumerate(cats)}
    labels = list(dict.fromkeys(tl["label"].astype(str)))
    lab = {x: i for i, x in enumerate(labels)}
    start = (tl["start_ns"] - origin_ns) / 1e9
    end = (tl["end_ns"] - origin_ns) / 1e9
    spans = [[row[(n, ln)], cat[c], lab[str(lb)], round(float(a), 9), round(float(b), 9)]
             for n, ln, c, lb, a, b in zip(tl["node"], tl["lane"], tl["category"],
                                           tl["label"], start, end, strict=True)]
    names = [f"{n} {ln}" for n, ln in keys]
    data = {"rows": names, "cats": cats, "labels": labels, "spans": spans,
            "colors": [timeline.COLORS.get(c, "#999999") for c in cats],
            "t_min": float(start.min()), "t_max": float(end.max()),
            "label_px": 16 + 7 * max(len(x) for x in names)}
    return (f'<figure><div class="gb-timeline" data-src="{ident}"></div>'
            + _json_script(ident, data)
            + "<figcaption>Per-host timeline: what each host did when, one row per host and "
              "thread (white is idle); the same intervals as the run's trace.json</figcaption>"
              "</figure>")


def _timeline_assets() -> str:
    """uPlot and the timeline script, inlined (the page must open offline and alone)."""
    lic = (VENDOR / "LICENSE").read_text(encoding="utf-8").replace("*/", "* /")
    return (f"<style>{(VENDOR / 'uPlot.min.css').read_text(encoding='utf-8')}</style>\n"
            f"<script>/* uPlot licence:\n{lic}*/\n"
            f"{(VENDOR / 'uPlot.iife.min.js').read_text(encoding='utf-8')}</script>\n"
            f"<script>{TIMELINE_JS.read_text(encoding='utf-8')}</script>\n")


def _labels(runs: Sequence[Run]) -> list[str]:
    """Run directory names, made unique (two sweeps can reuse a name)."""
    out: list[str] = []
    for r in runs:
        lab = r.path.name or str(r.path)
        n = 2
        base = lab
        while lab in out:
            lab = f"{base} ({n})"
            n += 1
        out.append(lab)
    return out


def run_metrics(run: Run) -> dict[str, Any]:
    """The run's numbers recomputed from its events and link samples by the same functions
    ``summary.json`` is written with (:func:`analysis.metrics.headline`), so the report also
    works for an interrupted run with no summary, plus two the summary does not carry:
    the busy-span utilisation of both directions and the short-term fairness."""
    r = run.config.get("run", {})
    out: dict[str, Any] = dict(metrics.headline(
        run.events, run.links, warmup_iterations=int(r.get("warmup_iterations", 0)),
        target_accuracy=float(r.get("target_accuracy", 0.0))))
    out["iter_time_s_p95"] = metrics.iteration_time_percentiles(run.events, (95,))["p95"]
    out["busy_utilization_up"] = metrics.busy_utilization(run.links, "up")
    out["busy_utilization_down"] = metrics.busy_utilization(run.links, "down")
    out["jain_mean_1s"] = metrics.jain_mean_over_windows(run.events, 1.0)
    return out


def glossary(columns: Sequence[str]) -> str:
    """A definition list of the printed columns that :data:`analysis.metrics.GLOSSARY`
    defines, in the order printed."""
    known = [c for c in dict.fromkeys(columns) if c in metrics.GLOSSARY]
    if not known:
        return ""
    items = "".join(f"<dt><code>{html.escape(c)}</code></dt>"
                    f"<dd>{html.escape(metrics.GLOSSARY[c])}</dd>" for c in known)
    return ('<details class="glossary" open><summary>What the numbers mean</summary>'
            f"<dl>{items}</dl></details>")


def _overview(paths: Sequence[Path], runs: Sequence[Run], labels: Sequence[str]) -> pd.DataFrame:
    table = load_runs(paths)
    table.insert(0, "label", list(labels))
    computed = pd.DataFrame([run_metrics(r) for r in runs])
    for col in computed.columns:
        # The recomputed value wins only where summary.json lacks it.
        if col in table:
            table[col] = table[col].where(table[col].notna(), computed[col])
        else:
            table[col] = computed[col]
    return table


def regime(summary: dict[str, Any], config: dict[str, Any]) -> str:
    """The run's regime in words (``agent_limited``, ``agent_limited_why``), as HTML:
    whether its figures measure the emulated network or, on this machine, the processes
    that fed it, named by the kind of run (``config``, the run's resolved config; a
    torchrun run's summary has its ``torchrun`` section). Empty when the summary has
    no reason."""
    why = summary.get("agent_limited_why")
    if not why:
        return ""
    if summary.get("agent_limited"):
        return (f'<p class="warning"><b>Agent-limited run.</b> {html.escape(str(why))}. '
                f"Its times and utilisation describe {html.escape(_feeders(summary, config))} on this "
                "machine, not the emulated network.</p>")
    return f'<p class="meta">Regime: {html.escape(str(why))}.</p>'


def _feeders(summary: dict[str, Any], config: dict[str, Any]) -> str:
    """Who held the data an agent-limited run's links waited for."""
    if "torchrun" in summary:
        return "the script's ranks (its compute and gloo)"
    if int(config.get("pipeline", {}).get("stages", 0) or 0) > 0:
        return "gradbed's pipeline stages"
    if config.get("topo", {}).get("role") == "expert":
        return "gradbed's MoE expert hosts"
    return "gradbed's agents (the workers and the PS)"


def _run_section(run: Run, label: str, ident: int) -> str:
    parts = [f'<h2 id="{html.escape(label)}">Run {html.escape(label)}</h2>',
             f'<p class="meta">{html.escape(str(run.path))} &middot; git '
             f'{html.escape(str(run.meta.get("git_sha", "?"))[:12])} &middot; command '
             f'<code>{html.escape(" ".join(map(str, run.meta.get("command", []) or [])))}</code>'
             f"</p>"]
    if run.summary:
        summ = pd.DataFrame([{k: v for k, v in run.summary.items()
                              if not isinstance(v, dict | list)}])
        parts.append("<h3>Summary</h3>" + regime(run.summary, run.config)
                     + _transposed(summ, "number", ["value"]))
    parts.append(_torchrun_hosts(run.summary))
    parts.append("<h3>Iteration time breakdown (mean per iteration, s)</h3>"
                 + _table(metrics.iteration_breakdown(run.events, by="node").reset_index()))
    parts.append(_img(plots.plot_bottleneck(run.links, "up"),
                      "Uplink bottleneck (workers to PS): delivered rate, allowed rate, queue"))
    if (run.links["direction"] == "down").any():
        parts.append(_img(plots.plot_bottleneck(run.links, "down"),
                          "Downlink bottleneck (PS to workers)"))
    parts.append(_img(plots.plot_worker_throughput(run.events),
                      "Per-worker goodput (send_done bytes), stacked"))
    if not metrics.transport_series(run.events).empty:
        parts.append(_img(plots.plot_transport(run.events, run.links),
                          "Per flow: cwnd, RTT, pacing rate and retransmissions (TCP_INFO), "
                          "beside the uplink queue"))
    if not metrics.connection_series(run.tcp).empty:
        parts.append(_img(plots.plot_connections(run.tcp),
                          "TCP connections between hosts (tcp.parquet, sock_diag): each "
                          "connection's sending rate, cwnd and RTT, coloured by host"))
    if not run.decisions.empty:
        parts.append(_img(plots.plot_keep_ratio(run.decisions, run.links),
                          "Adaptive keep ratio and the bandwidth it reacted to"))
    tl = timeline.host_timeline(run.events)
    if not tl.empty:
        parts.append("<h3>Per-host timeline</h3>"
                     + interactive_timeline(tl, run.start_ns, f"timeline-{ident}"))
    cfg = pd.DataFrame(sorted(flatten(run.config).items()), columns=["config key", "value"])
    cfg["value"] = cfg["value"].map(str)
    parts.append("<details><summary>Resolved config</summary>" + _table(cfg) + "</details>")
    return "\n".join(parts)


def _torchrun_hosts(summary: dict[str, Any]) -> str:
    """A torchrun run's hosts (ranks, exit codes, bytes) and its shaping points' busy
    fractions, from summary.json's ``torchrun`` section; "" for any other run."""
    hosts = torchrun.host_table(summary)
    if hosts.empty:
        return ""
    out = ("<h3>Hosts of the torchrun run: ranks, exit codes and bytes</h3>" + _table(hosts)
           + '<p class="meta">payload: TCP payload of the ranks\' connections to other '
             "hosts (sock_diag's bytes acked and received); store: the part sent to the "
             "rendezvous store; local: over loopback or to the host's own address (no link "
             "saw it); interface: the emulated interface's counters, headers and ACKs "
             "included; allreduce_equivalent: the S a ring all-reduce sending the payload "
             "would have reduced.</p>")
    points = torchrun.points_table(summary)
    if not points.empty:
        out += "<h3>Shaping points: busy fraction</h3>" + _table(points)
    return out


def render_report(paths: Sequence[str | os.PathLike[str]]) -> str:
    """The report's HTML for the given run directories (loads them; no files written)."""
    if not paths:
        raise ValueError("render_report: no runs given")
    ppaths = [Path(p) for p in paths]
    runs = [load_run(p) for p in ppaths]
    labels = _labels(runs)
    overview = _overview(ppaths, runs, labels)
    title = (f"gradbed report: {labels[0]}" if len(runs) == 1
             else f"gradbed report: {len(runs)} runs")
    shown = overview.drop(columns=["run"])
    table = (_transposed(shown.drop(columns=["label"]), "number", list(labels))
             if len(runs) <= TRANSPOSE_MAX_RUNS else _table(shown))
    body = [f"<h1>{html.escape(title)}</h1>", "<h2>Overview</h2>", table,
            glossary(list(shown.columns))]
    by_label_events = {lab: r.events for lab, r in zip(labels, runs, strict=True)}
    body.append(_img(plots.plot_iteration_cdf(by_label_events), "Iteration time CDF"))
    body.append(_img(plots.plot_accuracy_vs_time(
        {lab: r.events for lab, r in zip(labels, runs, strict=True)}),
        "Accuracy against time since training started"))
    body.append(_img(plots.plot_iteration_breakdown(
        {lab: metrics.iteration_breakdown(r.events) for lab, r in zip(labels, runs, strict=True)}),
        "Mean iteration time breakdown"))
    if len(runs) > 1:
        body.append(_img(plots.plot_summary_scatter(overview),
                         "One point per run: mean iteration time against final accuracy"))
    for i, (lab, r) in enumerate(zip(labels, runs, strict=True)):
        body.append(_run_section(r, lab, i))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style>\n{_timeline_assets()}"
            "</head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(runs: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str]
                 ) -> Path:
    """Write ``out_dir/index.html`` for the runs, atomically, and return its path."""
    page = render_report(runs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / "index.html"
    tmp = out / f".index.html.{os.getpid()}.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, dst)
    return dst
