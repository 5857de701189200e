"""Loads run directories into pandas, computes metrics, plots, reports and plans."""

from analysis.load import (
    Run,
    RunLoadError,
    default_runs_root,
    latest_run,
    load_run,
    load_runs,
    run_labels,
    varied_keys,
)

__all__ = ["Run", "RunLoadError", "default_runs_root", "latest_run", "load_run", "load_runs",
           "run_labels", "varied_keys"]
