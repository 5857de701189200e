"""``summary.json``: the headline numbers of a run, written by the controller when it ends.

Every number is computed by :func:`analysis.metrics.headline` (the one definition of each
quantity, with its formula in that module; :data:`analysis.metrics.GLOSSARY` says what
each key means), so the summary, the HTML report and the notebooks always agree. This
module adds only what the controller alone knows: the worker count it asked for, the wall
time, and how and why the run ended.

``workers_lost``: every worker the PS lost (its ``worker_lost`` events), in order, each
``{"worker", "iter", "t_s", "reason"}``; ``t_s`` counts from the controller's ``run_start``
(else the first event). Empty when none was lost; a worker that left by the membership
schedule (BYE) is not lost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import headline, workers_lost


def summarize(events: pd.DataFrame, links: pd.DataFrame, cfg: dict[str, Any],
              wall_s: float, interrupted: bool, stop_reason: str) -> dict[str, Any]:
    """The summary of one run from its events, link samples and config (as a dict)."""
    run = cfg["run"]
    warmup = int(run.get("warmup_iterations", 0))
    out: dict[str, Any] = {"workers": int(cfg["net"]["workers"]), "wall_s": round(wall_s, 3),
                           "warmup_iterations": warmup}
    if not events.empty:
        out.update(headline(events, links, warmup_iterations=warmup,
                            target_accuracy=float(run.get("target_accuracy", 0.0))))
    else:
        out.update({"iterations": 0, "bytes_up": 0, "bytes_down": 0})
    out["workers_lost"] = workers_lost(events)
    out.update({"interrupted": interrupted, "stop_reason": stop_reason})
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in out.items()}
