"""A run's record once it has ended: ``links.parquet``, ``summary.json``, the final
``meta.json``, the timelines and ``report/index.html``.

Written after the network is down, in the order a full disk can afford: the summary, for
which room was kept from the start (``controller.rundir.reserve_room``), is the one file
that must be written; every other one is best effort. Shared by every kind of run
(``controller.run``, ``controller.torchrun.experiment``, which adds its own sections).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.core import config as cfgmod
from agents.core.events import now_ns
from agents.core.files import write_atomic_with
from controller import rundir

if TYPE_CHECKING:
    import pandas as pd


def write_record(run_dir: Path, cfg: cfgmod.ExperimentConfig, links: pd.DataFrame,
                 meta: dict[str, Any], impairment: dict[str, Any] | None, wall_s: float,
                 interrupted: bool, stop_reason: str, say: Callable[[str], None]) -> None:
    """The tables, the summary, meta.json with how the run ended (``impairment``: the
    network's record after its teardown, None when none was built), and the timelines.
    The run's secret goes: nobody else may join it."""
    from analysis.load import load_events
    from controller.summary import read_classes, summarize

    # A full disk may fail any of these but the summary, for which room was kept.
    rundir.convert_events(run_dir)
    rundir.best_effort(lambda: write_atomic_with(
        run_dir / "links.parquet", lambda fh: links.to_parquet(fh, index=False)),
        "links.parquet", say)
    events = load_events(run_dir, allow_empty=True)
    summary = summarize(events, links, cfg.to_dict(), wall_s, interrupted, stop_reason,
                        read_classes(run_dir / "classes.parquet"))
    rundir.write_summary(run_dir, summary)
    meta = {**meta, "ended_ns": now_ns(), "interrupted": interrupted,
            "stop_reason": stop_reason}
    if impairment is not None:
        # Torn down by now: the record holds what each delay line did, and whether
        # one died (its link then dropped every packet).
        meta["impairment"] = impairment
        for host in impairment["hosts"]:
            if host.get("delay_line_died"):
                say(f"warning: the delay line in {host['host']} died "
                    f"({host['delay_line_died']}); its link dropped every packet")
    rundir.best_effort(lambda: rundir.write_json(run_dir / "meta.json", meta), "meta.json",
                       say)
    secret = run_dir / "secret"
    if secret.exists():
        secret.unlink()
    rundir.write_timelines(run_dir, say, events)  # every run, a sweep's too


def write_report(run_dir: Path, say: Callable[[str], None], quiet: bool) -> None:
    """report/index.html for this run; a failure is a warning, never the run's end."""
    try:
        from analysis.report import write_report as write_html

        write_html([run_dir], run_dir / "report")
    except Exception as e:  # plots are a convenience; the data is what must survive
        say(f"warning: report not written: {e}")
        if not quiet:
            print(f"warning: report not written: {e}", file=sys.stderr)
