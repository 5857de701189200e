"""``gradbed report``: one self-contained HTML page for one run or a sweep of runs.

The page holds the summary tables and every plot of :mod:`analysis.plots`, with the images
embedded as base64 PNG so the single ``index.html`` opens offline, can be mailed, and survives
being moved (Pantheon's per-run report, in one file). It is written atomically: a reader sees
the old page or the new one, never half of one.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from analysis import metrics, plots, timeline
from analysis.load import Run, flatten, load_run, load_runs

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; }
table { border-collapse: collapse; font-size: .85em; margin: .5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
figure { margin: 1em 0; } img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: .85em; color: #555; }
.meta { font-size: .85em; color: #555; }
.glossary dl { font-size: .85em; display: grid; grid-template-columns: max-content auto;
               gap: .1em 1em; } .glossary dd { margin: 0; }
"""


def _img(fig: Figure, caption: str) -> str:
    data = base64.b64encode(plots.png_bytes(fig)).decode("ascii")
    cap = html.escape(caption)
    return (f'<figure><img alt="{cap}" src="data:image/png;base64,{data}">'
            f"<figcaption>{cap}</figcaption></figure>")


def _table(df: pd.DataFrame, index: bool = False) -> str:
    return ('<div style="overflow-x:auto">'
            + df.to_html(index=index, escape=True, na_rep="–", border=0,
                         float_format=lambda v: f"{v:.4g}") + "</div>")


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
    return ('<details class="glossary" open><summary>What the columns mean</summary>'
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


def _run_section(run: Run, label: str) -> str:
    parts = [f'<h2 id="{html.escape(label)}">Run {html.escape(label)}</h2>',
             f'<p class="meta">{html.escape(str(run.path))} &middot; git '
             f'{html.escape(str(run.meta.get("git_sha", "?"))[:12])} &middot; command '
             f'<code>{html.escape(" ".join(map(str, run.meta.get("command", []) or [])))}</code>'
             f"</p>"]
    if run.summary:
        summ = pd.DataFrame([{k: v for k, v in run.summary.items()
                              if not isinstance(v, dict | list)}])
        parts.append("<h3>Summary</h3>" + _table(summ))
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
    if not run.decisions.empty:
        parts.append(_img(plots.plot_keep_ratio(run.decisions, run.links),
                          "Adaptive keep ratio and the bandwidth it reacted to"))
    tl = timeline.host_timeline(run.events)
    if not tl.empty:
        parts.append(_img(timeline.gantt_figure(tl),
                          "Per-host timeline (Gantt): what each host did when; white is idle"))
    cfg = pd.DataFrame(sorted(flatten(run.config).items()), columns=["config key", "value"])
    cfg["value"] = cfg["value"].map(str)
    parts.append("<details><summary>Resolved config</summary>" + _table(cfg) + "</details>")
    return "\n".join(parts)


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
    body = [f"<h1>{html.escape(title)}</h1>", "<h2>Overview</h2>", _table(shown),
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
    for lab, r in zip(labels, runs, strict=True):
        body.append(_run_section(r, lab))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


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
