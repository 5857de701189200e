"""Headline numbers of a run (``summary.json``), computed from its events and link samples.

Definitions:
- ``iter_time_s_p50/p99``: percentiles of every worker's ``iter_done.iter_s``
  (compute + compress + send + wait for the weights), pooled over workers.
- ``warmup_iterations`` (``run.warmup_iterations``): the first iterations, left out of
  the iteration-time percentiles and mean and of ``bottleneck_utilization``
  (TCP slow start and first-touch costs, not the steady state being measured).
- ``bytes_up`` / ``bytes_down``: bytes the workers put on / took off the wire
  (frame headers included), summed over workers and iterations.
- ``bottleneck_utilization``: the fraction of the *upload windows* during which
  the up bottleneck was delivering at its rate. An iteration's upload window runs
  from the start of the earliest worker's transfer (``send_done.start_ns``) to the
  moment the PS has every gradient (``grads_in``). Delivered bytes come from the bottleneck's ``tc -s`` byte
  counter (Ethernet frames, the unit HTB shapes), interpolated at the window
  edges; capacity is the HTB rate in force. Compute phases, when the link is
  idle by design, are excluded: this measures whether the agents keep the wire busy.
- ``jain_fairness``: Jain's index over workers of their mean sending throughput
  (bytes up / time spent sending).
- ``time_to_target_s``: seconds from the first iteration until the PS's held-out
  accuracy first reaches ``run.target_accuracy`` (absent when never reached or unset).
- ``workers_lost``: every worker the PS lost (its ``worker_lost`` events), in order, each
  ``{"worker", "iter", "t_s", "reason"}``; ``t_s`` counts from the controller's
  ``run_start`` (else the first event). Empty when none was lost; a worker that left by
  the membership schedule (BYE) is not lost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from analysis.metrics import jain, percentile


def upload_windows(events: pd.DataFrame) -> list[tuple[int, int, int]]:
    """(iteration, start_ns, end_ns) of every complete upload window."""
    sends = events[events["event"] == "send_done"]
    ins = events[events["event"] == "grads_in"]
    if sends.empty or ins.empty or "start_ns" not in sends:
        return []
    starts = sends["start_ns"].groupby(sends["iter"]).min()
    ends = ins.groupby("iter")["ts_ns"].max()
    both = pd.concat({"start": starts, "end": ends}, axis=1).dropna()
    it = both.index.to_numpy(dtype=np.int64)
    st = both["start"].to_numpy(dtype=np.int64)
    en = both["end"].to_numpy(dtype=np.int64)
    return [(int(i), int(s), int(e)) for i, s, e in zip(it, st, en, strict=True) if e > s]


def window_utilization(links: pd.DataFrame, windows: list[tuple[int, int, int]],
                       direction: str = "up") -> float:
    """Delivered / allowed bytes on ``direction`` summed over ``windows`` (see module doc)."""
    lk = links[links["direction"] == direction].sort_values("ts_ns")
    if lk.empty or not windows:
        return float("nan")
    ts = lk["ts_ns"].to_numpy(dtype=np.float64)
    sent = lk["sent_bytes"].to_numpy(dtype=np.float64)
    rate = lk["rate_mbps"].to_numpy(dtype=np.float64)
    delivered = allowed = 0.0
    for _, s, e in windows:
        if s < ts[0] or e > ts[-1]:
            continue  # outside the sampled span: no honest answer for this window
        delivered += float(np.interp(e, ts, sent) - np.interp(s, ts, sent))
        # Integrate the (piecewise-constant) rate over the window on a fine grid.
        grid = np.linspace(s, e, 200)
        r = rate[np.clip(np.searchsorted(ts, grid, side="right") - 1, 0, len(ts) - 1)]
        allowed += float(np.mean(r) * 1e6 / 8 * (e - s) / 1e9)
    return delivered / allowed if allowed > 0 else float("nan")


def workers_lost(events: pd.DataFrame) -> list[dict[str, Any]]:
    """The ``workers_lost`` list of the summary (see the module docstring)."""
    if events.empty:
        return []
    lost = events[events["event"] == "worker_lost"].sort_values("ts_ns")
    if lost.empty:
        return []
    starts = events.loc[events["event"] == "run_start", "ts_ns"]
    t0 = int(starts.min()) if len(starts) else int(events["ts_ns"].min())
    return [{"worker": int(r["worker"]), "iter": int(r["iter"]),
             "t_s": round((int(r["ts_ns"]) - t0) / 1e9, 3), "reason": str(r.get("reason", ""))}
            for _, r in lost.iterrows()]


def summarize(events: pd.DataFrame, links: pd.DataFrame, cfg: dict[str, Any],
              wall_s: float, interrupted: bool, stop_reason: str) -> dict[str, Any]:
    ev = events
    it = ev[ev["event"] == "iter_done"] if not ev.empty else ev
    psi = ev[ev["event"] == "ps_iter_done"] if not ev.empty else ev
    evals = ev[ev["event"].isin(["eval", "final_eval"])] if not ev.empty else ev
    warmup = int(cfg["run"].get("warmup_iterations", 0))
    steady = it[it["iter"] >= warmup] if "iter" in it else it
    iter_s = steady["iter_s"].dropna().to_numpy() if "iter_s" in steady else np.array([])
    out: dict[str, Any] = {
        "workers": int(cfg["net"]["workers"]),
        "iterations": int(len(psi)),
        "wall_s": round(wall_s, 3),
        "warmup_iterations": warmup,
        "iter_time_s_p50": percentile(iter_s, 50),
        "iter_time_s_p99": percentile(iter_s, 99),
        "iter_time_s_mean": float(np.mean(iter_s)) if len(iter_s) else float("nan"),
        "bytes_up": int(it["bytes_up"].sum()) if "bytes_up" in it else 0,
        "bytes_down": int(it["bytes_down"].sum()) if "bytes_down" in it else 0,
        "final_loss": float("nan"),
        "final_accuracy": float("nan"),
        "bottleneck_utilization": float("nan"),
        "jain_fairness": float("nan"),
        "interrupted": interrupted,
        "stop_reason": stop_reason,
    }
    if len(psi):
        out["bytes_up_per_iter"] = out["bytes_up"] / len(psi)
    bg = ev[ev["event"] == "background"] if not ev.empty else ev
    if len(bg) and "bytes" in bg:
        out["background_bytes"] = int(bg["bytes"].fillna(0).sum())
        out["background_mbps"] = float(bg["mbps"].fillna(0).sum())
    fl = ev[ev["event"] == "flow_done"] if not ev.empty else ev
    if len(fl) and "fct_s" in fl:
        fct = fl["fct_s"].to_numpy(dtype=float)
        out["background_flows"] = int(len(fl))
        out["fct_s_p50"] = percentile(fct, 50)
        out["fct_s_p99"] = percentile(fct, 99)
    if not evals.empty and "accuracy" in evals:
        last = evals.sort_values("ts_ns").iloc[-1]
        out["final_accuracy"] = float(last["accuracy"])
        out["final_loss"] = float(last["loss"])
    elif "loss" in it and it["loss"].notna().any():
        out["final_loss"] = float(it.sort_values("ts_ns")["loss"].dropna().iloc[-1])
    sends = ev[ev["event"] == "send_done"] if not ev.empty else ev
    if not sends.empty:
        per = sends.groupby("node").agg(b=("bytes", "sum"), s=("send_s", "sum"))
        per = per[per["s"] > 0]
        if len(per):
            out["jain_fairness"] = jain((per["b"] / per["s"]).tolist())
    if not links.empty and not ev.empty:
        windows = [w for w in upload_windows(ev) if w[0] >= warmup]
        out["bottleneck_utilization"] = window_utilization(links, windows)
        up = links[links["direction"] == "up"]
        if len(up):
            out["drops_up"] = int(up["drops"].max() - up["drops"].min())
    out["workers_lost"] = workers_lost(ev)
    target = float(cfg["run"].get("target_accuracy", 0.0))
    if target > 0 and not evals.empty and len(psi):
        t0 = int(ev[ev["event"] == "ps_ready"]["ts_ns"].min()) if (ev["event"] == "ps_ready").any() \
            else int(psi["ts_ns"].min())
        hit = evals[evals["accuracy"] >= target].sort_values("ts_ns")
        if len(hit):
            out["time_to_target_s"] = (int(hit["ts_ns"].iloc[0]) - t0) / 1e9
            out["iterations_to_target"] = int(hit["iter"].iloc[0]) + 1
    return {k: (None if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in out.items()}
