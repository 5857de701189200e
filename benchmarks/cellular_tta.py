"""Time to accuracy on a cellular uplink: adaptive keep ratio against fixed ratios and the
oracle, plus the high-bandwidth check against dense (DESIGN.md 1.1 and section 5,
seeds/004).

Part 1, cellular: ``configs/cellular.toml`` (2 workers, digits MLP hidden 256: 340 KB of
gradient per worker per iteration, target 90 % held-out accuracy). The up bottleneck replays
``../shared/traces/mahimahi/Verizon-LTE-short.up`` when it exists (mean 6.05 Mbit/s), else the
shipped ``traces/data/cellular_like.log`` (mean 10.5 Mbit/s); ``net.bottleneck_mbps`` (B0, the
rate the adaptive policy plans against, r0 = B0/N) is set to the mean of the trace used,
computed here from the file. Policies, side by side: fixed keep 1 (plain dense float32),
fixed 0.1 and 0.01 (top-k + error feedback), adaptive (DESIGN 1.1, r0 = planned, planning the
dense gradient), adaptive_plan_0.02 (the same rule planning 0.02 of the dense bytes, what
fixed 0.01 sends, ``adaptive.plan_keep``) and the oracle (knows the trace) with each of the two
plans: the adaptive run is compared with the oracle of its own plan. The best fixed ratio
is the one with the lowest time to accuracy (TTA); the headline uses the better adaptive plan.

Part 2, high bandwidth: ``configs/cellular_dense_1g.toml``, a constant 1 Gbit/s bottleneck,
dense against adaptive (top-k). A TTA there is about 1 s (80 iterations of ~12 ms), and one
slow moment of the 2-core machine moves it by 15 %, so the pair runs ``GB_CELL_1G_REPS``
times (default 5), interleaved, and the ratio reported is the median of the pairs' ratios
(each pair's ratio is listed too).

TTA (seconds): from the start of the first iteration (the earliest ``iter_done.ts_ns -
iter_s`` of iteration 0) to the first PS ``eval`` whose accuracy reaches the target. A run that
stops at its iteration cap or timeout without reaching the target has TTA ``None`` ("not
reached"); it is never extrapolated.

Headline: ``1 - TTA_adaptive / TTA_best_fixed`` (target >= 0.20); -1.0 when adaptive did not
reach the target (then there is no honest ratio). Also: ``TTA_dense / TTA_adaptive`` at 1 Gbit/s
(median of the interleaved pairs; target >= 0.95) and adaptive against the oracle.

``details.model`` (analysis/tta_model.py) reads the result against what any keep schedule
could reach on this trace: from the fixed runs' iterations to the target and fixed 0.01's
keep-independent time per iteration, the best schedule's modelled TTA and its gain over the
best modelled fixed ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
from _common import emit, gradbed_run, log

from agents.core import config as cfgmod
from agents.core.bandwidth import BandwidthTrace, load_trace
from agents.workloads.factory import make_workload
from analysis.load import load_events
from analysis.tta_model import best_schedule_tta_s, keep_independent_s, schedule_tta_s

REPO = Path(__file__).resolve().parents[1]
CELLULAR = REPO / "configs" / "cellular.toml"
HIGH_BW = REPO / "configs" / "cellular_dense_1g.toml"
VERIZON = REPO.parent / "shared" / "traces" / "mahimahi" / "Verizon-LTE-short.up"
SHIPPED = REPO / "traces" / "data" / "cellular_like.log"
OUT = Path(os.environ.get("GB_CELL_OUT", str(REPO / "runs" / "bench-cellular-tta")))
HIGH_BW_REPS = int(os.environ.get("GB_CELL_1G_REPS", "5"))
TARGET = 0.9
TOPK = ['compress.name="topk"']
POLICIES: dict[str, list[str]] = {
    "fixed_1": ['adaptive.policy="fixed"', 'compress.name="none"', "compress.ratio=1.0"],
    "fixed_0.1": ['adaptive.policy="fixed"', *TOPK, "compress.ratio=0.1"],
    "fixed_0.01": ['adaptive.policy="fixed"', *TOPK, "compress.ratio=0.01"],
    "adaptive": ['adaptive.policy="adaptive"', *TOPK, "compress.ratio=1.0"],
    # The same rule planned around fixed 0.01's bytes (top-k 0.01 with int32 indices sends
    # 0.02 of the dense bytes): 0.02 at B0, scaled by the measured rate.
    "adaptive_plan_0.02": ['adaptive.policy="adaptive"', *TOPK, "compress.ratio=1.0",
                           "adaptive.plan_keep=0.02"],
    "oracle": ['adaptive.policy="oracle"', *TOPK, "compress.ratio=1.0"],
    "oracle_plan_0.02": ['adaptive.policy="oracle"', *TOPK, "compress.ratio=1.0",
                         "adaptive.plan_keep=0.02"],
}
# Each adaptive run is compared with the oracle of the same plan.
ORACLE_OF = {"adaptive": "oracle", "adaptive_plan_0.02": "oracle_plan_0.02"}
# Every run reports its time to the target in summary.json.
TTA = [f"run.target_accuracy={TARGET}"]
HIGH_BW_POLICIES: dict[str, list[str]] = {
    "dense": ['adaptive.policy="fixed"', 'compress.name="none"'],
    "adaptive": ['adaptive.policy="adaptive"', *TOPK],
}


def tta_s(ev: pd.DataFrame, target: float) -> tuple[float | None, int | None]:
    """(seconds, iterations) from the first iteration's start to the first eval >= target."""
    it = ev[ev["event"] == "iter_done"]
    first = it[it["iter"] == it["iter"].min()]
    t0 = int((first["ts_ns"] - first["iter_s"] * 1e9).min())
    evals = ev[ev["event"].isin(["eval", "final_eval"])].sort_values("ts_ns")
    hit = evals[evals["accuracy"] >= target]
    if hit.empty:
        return None, None
    return (int(hit["ts_ns"].iloc[0]) - t0) / 1e9, int(hit["iter"].iloc[0]) + 1


def describe(run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    ev = load_events(run_dir)
    tta, iters = tta_s(ev, TARGET)
    comp = ev[ev["event"] == "compress_done"]
    sent = float((comp["raw_bytes"] * comp["ratio"]).sum() / comp["raw_bytes"].sum()) \
        if len(comp) else 1.0
    evals = ev[ev["event"] == "eval"]
    return {"tta_s": tta, "iterations_to_target": iters,
            "final_accuracy": s.get("final_accuracy"),
            "max_accuracy": float(evals["accuracy"].max()) if len(evals) else None,
            "iterations": s.get("iterations"), "iter_s_mean": s.get("iter_time_s_mean"),
            "bytes_up_per_iter": s.get("bytes_up_per_iter"), "mean_sent_fraction": sent,
            "stop_reason": s.get("stop_reason"), "run_dir": str(run_dir)}


# The fixed runs' keep ratios (top-k element fractions; 1 = dense).
FIXED_KEEP = {"fixed_1": 1.0, "fixed_0.1": 0.1, "fixed_0.01": 0.01}


def modelled_best(cell: dict[str, dict[str, Any]], trace: BandwidthTrace,
                  mean_mbps: float) -> dict[str, Any]:
    """What the best keep schedule could gain over the best fixed ratio on this trace
    (analysis/tta_model.py), from the fixed runs' measured iterations to the target and
    the keep-independent part of an iteration (fixed 0.01's mean iteration time less its
    modelled upload at the trace's mean rate)."""
    iters = {FIXED_KEEP[n]: float(cell[n]["iterations_to_target"]) for n in FIXED_KEEP
             if cell[n]["iterations_to_target"]}
    if len(iters) < 2 or not cell["fixed_0.01"]["iter_s_mean"]:
        return {"skipped": "fewer than two fixed ratios reached the target"}
    cfg = cfgmod.load(CELLULAR)
    model = make_workload(cfg.workload).build_model(cfg.run.seed)
    dense = 4 * sum(p.numel() for p in model.parameters())
    workers = cfg.net.workers
    overhead = keep_independent_s(float(cell["fixed_0.01"]["iter_s_mean"]), 0.01,
                                  mean_rate_mbps=mean_mbps, dense_bytes=dense, workers=workers)
    common: dict[str, Any] = dict(trace=trace, iterations=iters,
                                  dense_bytes=dense, workers=workers, overhead_s=overhead)
    fixed = {f"{k:g}": schedule_tta_s(choose=lambda _t, k=k: k, **common)[0] for k in iters}
    best, n = best_schedule_tta_s(**common)
    return {"iterations_to_target": {f"{k:g}": v for k, v in iters.items()},
            "dense_bytes": dense, "overhead_s": round(overhead, 4),
            "fixed_tta_s": {k: round(v, 2) for k, v in fixed.items()},
            "best_schedule_tta_s": round(best, 2), "best_schedule_iterations": n,
            "best_schedule_gain": round(1 - best / min(fixed.values()), 4)}


def main() -> int:
    if os.geteuid() != 0:
        log("cellular_tta needs root (Mininet)")
        return 1
    out = OUT / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    trace_path = VERIZON if VERIZON.exists() else SHIPPED
    trace = load_trace(str(trace_path), granularity_s=0.1)
    mean_mbps = round(trace.mean_mbps(), 3)
    log(f"trace {trace_path} (mean {mean_mbps} Mbit/s over {trace.period_s:g} s)")
    base = [f'trace.up="{trace_path}"', f"net.bottleneck_mbps={mean_mbps}"]
    cell = {name: describe(gradbed_run(CELLULAR, f"cell-{name}", [*TTA, *base, *extra], out))
            for name, extra in POLICIES.items()}
    for name, r in cell.items():
        log(f"cellular {name}: tta={r['tta_s']} it={r['iterations_to_target']} "
            f"acc={r['final_accuracy']} iter_s={r['iter_s_mean']} "
            f"sent={r['mean_sent_fraction']:.3f}")
    pairs = [{name: describe(gradbed_run(HIGH_BW, f"1g-{name}-{rep}", [*TTA, *extra], out))
              for name, extra in HIGH_BW_POLICIES.items()} for rep in range(HIGH_BW_REPS)]
    for rep, high in enumerate(pairs):
        for name, r in high.items():
            log(f"1 Gbit/s {name} #{rep}: tta={r['tta_s']} acc={r['final_accuracy']}")

    fixed = {n: r["tta_s"] for n, r in cell.items() if n.startswith("fixed_")}
    reached = {n: t for n, t in fixed.items() if t is not None}
    best_fixed = min(reached, key=lambda n: reached[n]) if reached else None
    # The headline takes the better of the two adaptive plans (dense, and fixed 0.01's bytes).
    plans = {n: cell[n]["tta_s"] for n in ORACLE_OF
             if cell[n]["tta_s"] is not None}
    best_adaptive = min(plans, key=lambda n: plans[n]) if plans else "adaptive"
    ad = cell[best_adaptive]["tta_s"]
    if ad is None:
        headline = -1.0
    elif best_fixed is None:
        headline = 1.0  # adaptive reached the target and no fixed ratio did
    else:
        headline = 1.0 - ad / reached[best_fixed]
    model = modelled_best(cell, trace, mean_mbps)
    log(f"model: {model}")
    orc = cell[ORACLE_OF[best_adaptive]]["tta_s"]
    ratios = [p["dense"]["tta_s"] / p["adaptive"]["tta_s"] for p in pairs
              if p["dense"]["tta_s"] and p["adaptive"]["tta_s"]]
    emit("cellular_tta", round(headline, 4), "fraction faster than the best fixed ratio",
         ">= 0.20 (adaptive TTA at least 20 % below the best fixed ratio's); "
         "and at 1 Gbit/s dense_tta/adaptive_tta >= 0.95",
         {"target_accuracy": TARGET, "trace": str(trace_path), "trace_mean_mbps": mean_mbps,
          "b0_mbps": mean_mbps, "best_fixed": best_fixed,
          "best_fixed_tta_s": reached.get(best_fixed) if best_fixed else None,
          "best_adaptive": best_adaptive, "adaptive_tta_s": ad, "oracle_tta_s": orc,
          "oracle_plan_tta_s": {n: cell[n]["tta_s"] for n in ORACLE_OF.values()},
          "adaptive_vs_oracle_tta": (ad / orc) if ad and orc else None,
          "headline_rule": "1 - tta_adaptive/tta_best_fixed; -1 = adaptive did not reach "
                           "the target",
          "cellular": cell,
          "model": model,
          "high_bandwidth": {"rate_mbps": 1000, "runs": pairs,
                             "dense_over_adaptive_tta": (float(statistics.median(ratios))
                                                         if len(ratios) == len(pairs)
                                                         else None),
                             "pair_ratios": [round(r, 4) for r in ratios],
                             "target": ">= 0.95 (median of the interleaved pairs)"}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
