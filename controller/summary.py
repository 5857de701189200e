"""``summary.json``: the headline numbers of a run, written by the controller when it ends.

Every number is computed by :func:`analysis.metrics.headline` (the one definition of each
quantity, with its formula in that module; :data:`analysis.metrics.GLOSSARY` says what
each key means), so the summary, the HTML report and the notebooks always agree. This
module adds only what the controller alone knows: the worker count it asked for, the wall
time, and how and why the run ended.

``agents_lost``: every agent the controller declared lost (``agent_lost`` events), any
role, each ``{"host", "role", "t_s", "reason", "action"}``.

``workers_lost``: every worker the PS lost (its ``worker_lost`` events), in order, each
``{"worker", "iter", "t_s", "reason"}``; ``t_s`` counts from the controller's ``run_start``
(else the first event). Empty when none was lost; a worker that left by the membership
schedule (BYE) is not lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import (
    agent_limited,
    agent_limited_points,
    agents_lost,
    busiest_point_windows,
    headline,
    merge_windows,
    upload_windows,
    workers_lost,
)
from analysis.moe import transfer_windows as moe_transfer_windows
from analysis.pipeline import pipeline_metrics, transfer_windows


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


def read_classes(path: Path) -> pd.DataFrame | None:
    """The run's HTB class samples (``classes.parquet``), or None where the run took none
    or the file cannot be read (a full disk cut it short): the summary is written anyway,
    its ``agent_limited`` null with the reason."""
    try:
        return pd.read_parquet(path) if path.exists() else None
    except Exception:  # pyarrow raises its own types for a truncated file
        return None


def run_agent_limited(events: pd.DataFrame, links: pd.DataFrame, cfg: dict[str, Any],
                      classes: pd.DataFrame | None = None) -> tuple[bool | None, str]:
    """:func:`analysis.metrics.agent_limited` over the run's transfer windows: a PS run's
    upload windows after warm-up on its up bottleneck; a pipeline's stage-to-stage
    messages (:func:`analysis.pipeline.transfer_windows`) and an MoE run's exchanges of
    token rows (:func:`analysis.moe.transfer_windows`: dispatch, combine and their
    backward), after warm-up, each on the busiest access link of the HTB
    class samples ``classes`` (``classes.parquet``); ``(None, why)`` for a run whose
    windows the samples do not cover."""
    if events.empty:
        return None, "no events: the run moved no data"
    warmup = int(cfg["run"].get("warmup_iterations", 0))
    pipeline = int(cfg.get("pipeline", {}).get("stages", 0)) > 0
    if pipeline or cfg.get("topo", {}).get("role") == "expert":
        return _fabric_agent_limited(events, cfg, classes, warmup, pipeline)
    windows = [w for w in upload_windows(events) if w[0] >= warmup]
    if not windows:
        return None, ("no upload windows (send_done to grads_in): not a parameter-server "
                      "run, or no iteration completed")
    return agent_limited(links, windows, "up")


def _fabric_agent_limited(events: pd.DataFrame, cfg: dict[str, Any],
                          classes: pd.DataFrame | None, warmup: int, pipeline: bool
                          ) -> tuple[bool | None, str]:
    what = "pipeline" if pipeline else "MoE"
    if classes is None or classes.empty:
        return None, (f"no HTB class samples (classes.parquet): a {what} run's transfers "
                      "cross every access link, which only the class sampler reads, and it "
                      "reads only this machine's links")
    if pipeline:
        # A message's last byte reaches its receiver the path's one-way delay (the fabric
        # delays each host's up link) after the link let it out: the network's, not the
        # agents' time.
        delay_ns = int(float(cfg.get("net", {}).get("delay_ms", 0.0)) * 1e6)
        windows = [(i, s, e - delay_ns) for i, s, e in transfer_windows(events)
                   if e - delay_ns > s]
    else:
        rows = [{str(k): v for k, v in r.items()}
                for r in events[events["event"] == "moe_phase"].to_dict("records")]
        try:
            windows = moe_transfer_windows(rows)
        except ValueError as e:  # a dispatch of no duration: a run cut short
            return None, f"the MoE transfer windows are unusable: {e}"
    windows = [w for w in windows if w[0] >= warmup]
    if not windows:
        return None, f"no {what} transfer windows after warm-up: no step completed"
    samples = classes.rename(columns={"point": "direction"})
    return agent_limited_points(samples, busiest_point_windows(samples, windows))


#: ``agent_limited_why`` of a torchrun run whose script records no bucket windows.
UNINSTRUMENTED_WHY = (
    "unknown: the script's collectives (gloo's, in the script's own processes) leave no "
    "transfer windows gradbed can see, since data waiting in a process is invisible from "
    "outside it; gradbed.ddp.instrument(ddp_model) records each bucket's window (docs/ddp.md); "
    "each link's busy fraction over the whole run is torchrun.points_busy_utilization")


def torchrun_agent_limited(events: pd.DataFrame, classes: pd.DataFrame | None, world: int,
                           hop_delay_ms: float, warmup: int = 0) -> tuple[bool | None, str]:
    """:func:`analysis.metrics.agent_limited_points` for a ``gradbed torchrun`` run: the
    transfer windows are the ``ddp_bucket`` events of :func:`gradbed.ddp.instrument`, each
    from the collective's launch to its decoded mean (``end_ns - comm_s``), less the
    collective's latency floor (a ring all_reduce among ``world`` ranks waits on
    2 (world - 1) hops in turn, an all_gather on world - 1, each at least ``hop_delay_ms``,
    the network's time), a rank's overlapping buckets merged; each window judged on the
    access link that let out the most bytes in it, from the HTB class samples. ``(None,
    why)`` for a script that records no buckets (:data:`UNINSTRUMENTED_WHY`) or a run
    without class samples."""
    buckets = events[events["event"] == "ddp_bucket"] \
        if not events.empty and "event" in events else events.iloc[:0]
    if buckets.empty:
        return None, UNINSTRUMENTED_WHY
    if classes is None or classes.empty:
        return None, ("no HTB class samples (classes.parquet): the ranks' collectives cross "
                      "every training host's access link, which only the class sampler reads")
    hop_ns = hop_delay_ms * 1e6
    intervals = []
    for b in buckets.to_dict("records"):
        hops = 2 * (world - 1) if b["collective"] == "allreduce" else world - 1
        end = int(b["end_ns"])
        intervals.append((str(b["node"]), int(b["iter"]), end - round(float(b["comm_s"]) * 1e9),
                          end - round(hops * hop_ns)))
    windows = [w for w in merge_windows(intervals) if w[0] >= warmup]
    if not windows:
        return None, ("no bucket's collective outlasted its latency floor after warm-up: "
                      "the links' delay, not their rate or the ranks, set its time")
    samples = classes.rename(columns={"point": "direction"})
    limited, why = agent_limited_points(samples, busiest_point_windows(samples, windows),
                                        agents="the ranks", measured="the script and gloo")
    return limited, f"{why}; the windows: the ranks' DDP buckets (gradbed.ddp.instrument)"


def summarize(events: pd.DataFrame, links: pd.DataFrame, cfg: dict[str, Any],
              wall_s: float, interrupted: bool, stop_reason: str,
              classes: pd.DataFrame | None = None) -> dict[str, Any]:
    """The summary of one run from its events, link samples, config (as a dict) and HTB
    class samples (``classes.parquet``, where the run took them)."""
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
    out["agents_lost"] = agents_lost(events)
    pc = cfg.get("pipeline", {})
    if int(pc.get("stages", 0)) > 0 and not events.empty \
            and (events["event"] == "pp_action").any():
        out["pipeline"] = pipeline_summary(events, pc)
        out["iterations"] = out["pipeline"]["steps"]
    out["agent_limited"], out["agent_limited_why"] = run_agent_limited(events, links, cfg, classes)
    out.update({"interrupted": interrupted, "stop_reason": stop_reason})
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in out.items()}
