"""Writes ``throughput.ipynb`` and ``compare.ipynb`` beside this file, without outputs.

The notebooks are generated rather than hand-edited so that what is committed never carries
outputs or execution counts, and so a change to the analysis API is one edit here. They only
call :mod:`analysis` functions. Regenerate with ``python analysis/notebooks/make_notebooks.py``.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

THROUGHPUT = [
    new_markdown_cell(
        "# One run: bottleneck, flows, queue\n\n"
        "Set `GRADBED_RUN` to a run directory before starting Jupyter; without it the most "
        "recent run under `runs/` (or `GRADBED_RUNS_ROOT`) is used."),
    new_code_cell(
        "%matplotlib inline\n"
        "import os\n\n"
        "from analysis import latest_run, load_run, metrics, plots\n\n"
        "RUN = os.environ.get('GRADBED_RUN') or str(latest_run())\n"
        "run = load_run(RUN)\n"
        "print(run.path, '|', run.name, '|', len(run.events), 'events |', len(run.links),"
        " 'link samples')\n"
        "run.summary"),
    new_markdown_cell("## The bottleneck\nDelivered rate against what the trace allowed, "
                      "and the queue."),
    new_code_cell("plots.plot_bottleneck(run.links, 'up')"),
    new_code_cell(
        "if (run.links['direction'] == 'down').any():\n"
        "    display(plots.plot_bottleneck(run.links, 'down'))\n"
        "# Two utilisations (analysis.metrics.GLOSSARY): upload windows only, and the busy span\n"
        "{'bottleneck_utilization': metrics.bottleneck_utilization(run.events, run.links),\n"
        " 'busy_utilization_up': metrics.busy_utilization(run.links, 'up'),\n"
        " 'busy_utilization_down': metrics.busy_utilization(run.links, 'down')}"),
    new_code_cell("metrics.drops(run.links, 'up').tail()"),
    new_markdown_cell("## Flows\nPer-worker goodput (application bytes) and the kernel's "
                      "view (TCP_INFO bytes acknowledged); fairness per 1 s window."),
    new_code_cell("plots.plot_worker_throughput(run.events, window_s=1.0)"),
    new_code_cell(
        "gp = metrics.goodput(run.events, window_s=1.0)\n"
        "gp_tcp = metrics.goodput(run.events, window_s=1.0, source='tcp_info')\n"
        "print('mean Jain index over 1 s windows:', metrics.jain_mean_over_windows(run.events))\n"
        "print('Jain index of mean sending rates:', metrics.jain_fairness(run.events))\n"
        "gp.groupby('node')['bytes'].sum().to_frame('send_done bytes').join(\n"
        "    gp_tcp.groupby('node')['bytes'].sum().to_frame('bytes acked'))"),
    new_markdown_cell("## Iterations"),
    new_code_cell("metrics.iteration_breakdown(run.events, by='node')"),
    new_code_cell("plots.plot_iteration_cdf({run.name: run.events})"),
    new_code_cell("metrics.bytes_per_iteration(run.events).head()"),
    new_code_cell(
        "if len(run.decisions):\n"
        "    display(plots.plot_keep_ratio(run.decisions, run.links))\n"
        "metrics.keep_ratio_vs_bandwidth(run.decisions, run.links).head()"),
]

COMPARE = [
    new_markdown_cell(
        "# A sweep: time-to-accuracy and iteration time\n\n"
        "Set `GRADBED_RUNS` to a glob of run directories (e.g. `runs/sweep1/*`); without it "
        "every run directly under `runs/` (or `GRADBED_RUNS_ROOT`) is used. Runs are grouped "
        "by the config keys that differ between them (compressor, bandwidth, policy...)."),
    new_code_cell(
        "%matplotlib inline\n"
        "import os\n\n"
        "from analysis import (\n"
        "    default_runs_root,\n"
        "    load_run,\n"
        "    load_runs,\n"
        "    metrics,\n"
        "    plots,\n"
        "    run_labels,\n"
        "    varied_keys,\n"
        ")\n\n"
        "RUNS = os.environ.get('GRADBED_RUNS') or str(default_runs_root() / '*')\n"
        "table = load_runs(RUNS)\n"
        "labels = run_labels(table)\n"
        "runs = {lab: load_run(p) for lab, p in zip(labels, table['run'], strict=True)}\n"
        "print(len(runs), 'runs; varied config keys:', varied_keys(table))\n"
        "table"),
    new_markdown_cell("## Time to accuracy\nThe target is 95 % of the best final accuracy in "
                      "the sweep, so at least one run reaches it."),
    new_code_cell(
        "accs = [r.evals()['accuracy'].max() for r in runs.values() if 'accuracy' in r.evals()]\n"
        "target = 0.95 * max(accs) if accs else float('nan')\n"
        "table['tta_s'] = [metrics.time_to_accuracy(r.events, target) for r in runs.values()]\n"
        "table['iter_time_s_mean'] = [metrics.iteration_time_percentiles(r.events)['mean']\n"
        "                             for r in runs.values()]\n"
        "table['label'] = labels\n"
        "print(f'target accuracy {target:.3f}')\n"
        "table[['label', 'tta_s', 'iter_time_s_mean', 'final_accuracy']]"),
    new_code_cell("plots.plot_accuracy_vs_time({lab: r.events for lab, r in runs.items()}, "
                  "target=target)"),
    new_markdown_cell("## Grouped by each varied key\n(compressor, bandwidth, policy: whatever "
                      "the sweep changed)"),
    new_code_cell(
        "for key in varied_keys(table):\n"
        "    display(table.groupby(key, dropna=False)[['tta_s', 'iter_time_s_mean']].mean())"),
    new_markdown_cell("## Iteration time"),
    new_code_cell("plots.plot_iteration_cdf({lab: r.events for lab, r in runs.items()})"),
    new_code_cell("plots.plot_iteration_breakdown({lab: metrics.iteration_breakdown(r.events)\n"
                  "                                for lab, r in runs.items()})"),
    new_code_cell("plots.plot_summary_scatter(table, x='iter_time_s_mean', y='final_accuracy')"),
]


def write(path: Path, cells: list[nbformat.NotebookNode]) -> None:
    nb = new_notebook(cells=cells, metadata={
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"}})
    for i, c in enumerate(nb.cells):
        c["id"] = f"{path.stem}-{i}"  # deterministic ids: regenerating changes nothing
        if c.cell_type == "code":
            c.outputs = []
            c.execution_count = None
    nbformat.validate(nb)
    nbformat.write(nb, str(path))


def main() -> None:
    write(HERE / "throughput.ipynb", THROUGHPUT)
    write(HERE / "compare.ipynb", COMPARE)


if __name__ == "__main__":
    main()
