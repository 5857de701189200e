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

from analysis.metrics import agent_limited, headline, upload_windows, workers_lost
from analysis.pipeline import pipeline_metrics


def pipeline_summary(events: pd.DataFrame, pc: dict[str, Any]) -> dict[str, Any]:
    """A pipeline run's headline (analysis.pipeline defines each figure): bubble overall and
    per stage, samples/s, bytes per link per step, peak activation bytes, the last loss."""
    m = pipeline_metrics(events, micro_batches=int(pc["micro_batches"]),
                         micro_batch_size=int(pc["micro_batch_size"]),
                         replicas=int(pc.get("replicas", 1)), skip=1)
    losses = events[(events["event"] == "pp_step_done")]
    losses = losses[losses["loss"].notna()] if "loss" in losses else losses.iloc[:0]
    steps = int(events.loc[events["event"] == "pp_step_done", "iter"].max()) + 1
    return {"schedule": pc.get("schedule"), "steps": steps, "bubble": m.bubble,
            "bubble_ideal": m.bubble_ideal, "bubble_per_stage": m.bubble_per_stage,
            "samples_per_s": m.samples_per_s,
            "link_bytes_per_step": {f"{a}->{b}": v for (a, b), v
                                    in m.link_bytes_per_step.items()},
            "peak_act_bytes": m.peak_act_bytes,
            "dp_link_bytes_per_step": {f"{a}->{b}": v for (a, b), v
                                       in m.dp_link_bytes_per_step.items()},
            "first_loss": float(losses.sort_values("iter")["loss"].iloc[0]) if len(losses)
            else None,
            "final_loss": float(losses.sort_values("iter")["loss"].iloc[-1]) if len(losses)
            else None}


def run_agent_limited(events: pd.DataFrame, links: pd.DataFrame, cfg: dict[str, Any]
                      ) -> tuple[bool | None, str]:
    """:func:`analysis.metrics.agent_limited` over the run's transfer windows: a PS run's
    upload windows after warm-up on its up bottleneck; ``(None, why)`` for a run whose
    windows the controller's link samples do not cover."""
    if events.empty:
        return None, "no events: the run moved no data"
    if int(cfg.get("pipeline", {}).get("stages", 0)) > 0:
        return None, ("a pipeline run's stage links are shaped per pair of stages, not at "
                      "the bottleneck the link sampler watches; see the stages' bubble")
    if cfg.get("topo", {}).get("role") == "expert":
        return None, ("an MoE run's dispatch windows cross every access link, which only "
                      "the HTB class sampler (topo.class_sample_ms) reads; benchmarks/moe.py "
                      "measures them")
    warmup = int(cfg["run"].get("warmup_iterations", 0))
    windows = [w for w in upload_windows(events) if w[0] >= warmup]
    if not windows:
        return None, ("no upload windows (send_done to grads_in): not a parameter-server "
                      "run, or no iteration completed")
    return agent_limited(links, windows, "up")


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
    pc = cfg.get("pipeline", {})
    if int(pc.get("stages", 0)) > 0 and not events.empty \
            and (events["event"] == "pp_action").any():
        out["pipeline"] = pipeline_summary(events, pc)
        out["iterations"] = out["pipeline"]["steps"]
    out["agent_limited"], out["agent_limited_why"] = run_agent_limited(events, links, cfg)
    out.update({"interrupted": interrupted, "stop_reason": stop_reason})
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in out.items()}
