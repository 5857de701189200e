"""Adaptive keep ratio after a bandwidth step, 100 -> 20 -> 100 Mbit/s (DESIGN.md 1.1,
seeds/004; target from DESIGN.md section 5: the keep ratio settles within 3 iterations).

One ``gradbed run configs/step_trace.toml`` per policy, side by side in one benchmark run:
``adaptive`` (r0 = the planned share B0/N, B0 = net.bottleneck_mbps = 100) against fixed keep
ratios 1 (plain dense float32), 0.1 and 0.01 (top-k with error feedback). Same workload for
all: 2 workers train the digits MLP (hidden 512: 1.2 MB of float32 gradient per worker per
iteration, sent in 128 KB chunks, so the adaptive policy can change the keep ratio between
chunks), which gives held-out accuracy as well as timing. ``shaping.method = "tc"``: every
worker's egress is capped at its link/N share B(t)/N, so the rate each worker's kernel
measures is that share, and the ideal adaptive keep ratio is exactly ``B(t) / B0`` (1, then
0.2, then 1).

The bottleneck follows a shortened step trace (written next to the runs, 12 s at 100, 10 s at
20, then 100 until the run stops): each phase holds at least 5 iterations of the slowest policy
(dense at 20 Mbit/s: about 1.3 s per iteration). Every run is stopped by ``run.timeout_s``
after the same wall time, so ``final_accuracy`` is the accuracy reached in the same time.

Per policy and phase (an iteration belongs to the phase in which it *starts*; phase bounds are
the ``trace_step`` events actually applied): mean iteration time, bytes up per iteration (both
workers), iteration count. For adaptive, per iteration: the keep ratio of its last chunk (the
policy's settled decision for that iteration; the first chunks of every iteration go dense
until two kernel rate samples agree) and the fraction of the gradient actually sent.

**Settled** (per worker, per step): iteration k after the step (k = 1 is the first iteration
that starts after the step) is settled when its keep ratio and those of the next two
iterations of the phase are all within 20 % (relative) of the ideal ``clamp(B_new/B0)``. The
settle count is the first such k. Headline: the largest settle count over both steps and both
workers; a step that never settles inside its phase counts as (iterations in the phase + 1).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from _common import emit, gradbed_run, log

from analysis.load import load_events
from traces.generate import steps, write_rate_log

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "step_trace.toml"
OUT = Path(os.environ.get("GB_STEP_OUT", str(REPO / "runs" / "bench-adaptive-step")))
B0_MBPS = 100.0
# Trace: (start_s, rate_mbps). The first phase is longer: the workers spend ~2-4 s of it
# importing torch and connecting.
PHASES = [(0.0, 100.0), (12.0, 20.0), (22.0, 100.0)]
RUN_S = 33.0                # run.timeout_s: the last phase gets ~11 s
TOLERANCE = 0.20            # settled = within 20 % of the ideal keep ratio ...
HOLD_ITERS = 3              # ... for this many consecutive iterations
KEEP_MIN = 0.001
WORKLOAD = ['workload.name="digits_mlp"', "workload.hidden=512", "workload.batch_size=32",
            "workload.lr=0.1", "workload.momentum=0.9", "workload.chunk_bytes=131072",
            "run.eval_every=2", 'shaping.method="tc"', "net.workers=2",
            f"net.bottleneck_mbps={B0_MBPS}", "run.iterations=1000",
            f"run.timeout_s={RUN_S}", f"adaptive.keep_min={KEEP_MIN}"]
POLICIES: dict[str, list[str]] = {
    "adaptive": ['adaptive.policy="adaptive"', 'adaptive.r0="planned"', "compress.ratio=1.0"],
    # Dense is plain float32 (compress.name="none"), the baseline every ratio is compared to.
    "fixed_1": ['adaptive.policy="fixed"', 'compress.name="none"', "compress.ratio=1.0"],
    "fixed_0.1": ['adaptive.policy="fixed"', "compress.ratio=0.1"],
    "fixed_0.01": ['adaptive.policy="fixed"', "compress.ratio=0.01"],
}


def iterations(ev: pd.DataFrame) -> pd.DataFrame:
    """Per (worker, iteration): start_ns, iter_s, bytes_up (from ``iter_done``)."""
    it = ev[ev["event"] == "iter_done"].copy()
    it["start_ns"] = it["ts_ns"] - (it["iter_s"] * 1e9).astype("int64")
    return it[["node", "iter", "start_ns", "ts_ns", "iter_s", "bytes_up"]].sort_values(
        ["node", "iter"])


def step_times(ev: pd.DataFrame) -> list[int]:
    """ts_ns of the applied up-trace steps, in order (the first is the initial rate)."""
    st = ev[(ev["event"] == "trace_step") & (ev["direction"] == "up")].sort_values("ts_ns")
    rates = st["rate_mbps"].tolist()[:len(PHASES)]
    want = [r for _, r in PHASES]
    if rates != want:
        raise RuntimeError(f"trace steps applied {rates}, expected {want}")
    return [int(t) for t in st["ts_ns"].iloc[:len(PHASES)]]


def phase_of(ts_ns: np.ndarray, bounds: list[int]) -> np.ndarray:
    return np.searchsorted(np.asarray(bounds[1:]), ts_ns, side="right")


def phase_stats(it: pd.DataFrame, bounds: list[int]) -> list[dict[str, Any]]:
    it = it.assign(phase=phase_of(it["start_ns"].to_numpy(), bounds))
    out = []
    for p, (_, rate) in enumerate(PHASES):
        g = it[it["phase"] == p]
        per_iter_bytes = g.groupby("iter")["bytes_up"].sum()
        out.append({"phase": p, "rate_mbps": rate, "iterations": int(g["iter"].nunique()),
                    "iter_s_mean": float(g["iter_s"].mean()) if len(g) else None,
                    "bytes_up_per_iter": float(per_iter_bytes.mean()) if len(g) else None})
    return out


def keep_per_iteration(ev: pd.DataFrame, it: pd.DataFrame, bounds: list[int]) -> pd.DataFrame:
    """Per (worker, iteration): the last chunk's keep and the fraction of the gradient sent."""
    dec = ev[ev["event"] == "decision"].sort_values(["node", "iter", "chunk"])
    last = dec.groupby(["node", "iter"]).agg(keep=("keep", "last")).reset_index()
    comp = ev[ev["event"] == "compress_done"]
    sent = comp.assign(kept=comp["raw_bytes"] * comp["ratio"]).groupby(["node", "iter"]).agg(
        kept=("kept", "sum"), raw=("raw_bytes", "sum")).reset_index()
    sent["sent_fraction"] = sent["kept"] / sent["raw"]
    per = it.merge(last, on=["node", "iter"]).merge(
        sent[["node", "iter", "sent_fraction"]], on=["node", "iter"])
    per["phase"] = phase_of(per["start_ns"].to_numpy(), bounds)
    per["t_s"] = (per["start_ns"] - bounds[0]) / 1e9
    return per


def settle_count(keeps: list[float], ideal: float) -> int | None:
    """First k (1-based) with keeps[k-1 : k-1+HOLD] all within TOLERANCE of ``ideal``; None
    when no such k exists inside the phase."""
    ok = [abs(k - ideal) <= TOLERANCE * ideal for k in keeps]
    for i in range(len(ok)):
        window = ok[i:i + HOLD_ITERS]
        if window and all(window) and (len(window) == HOLD_ITERS or i + len(window) == len(ok)):
            return i + 1
    return None


def ideal_keep(rate_mbps: float) -> float:
    return min(1.0, max(KEEP_MIN, rate_mbps / B0_MBPS))


def main() -> int:
    if os.geteuid() != 0:
        log("adaptive_step needs root (Mininet)")
        return 1
    out = OUT / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / "step_100_20_100_short.log"
    write_rate_log(steps(PHASES, period_s=120.0), trace_path)
    results: dict[str, Any] = {}
    adaptive_keep: pd.DataFrame | None = None
    for name, extra in POLICIES.items():
        run_dir = gradbed_run(CONFIG, f"step-{name}",
                              [*WORKLOAD, *extra, f'trace.up="{trace_path}"'], out)
        s = json.loads((run_dir / "summary.json").read_text())
        ev = load_events(run_dir)
        bounds = step_times(ev)
        it = iterations(ev)
        results[name] = {"phases": phase_stats(it, bounds),
                         "final_accuracy": s.get("final_accuracy"),
                         "iterations": s.get("iterations"), "stop_reason": s.get("stop_reason"),
                         "run_dir": str(run_dir)}
        if name == "adaptive":
            adaptive_keep = keep_per_iteration(ev, it, bounds)
        log(f"{name}: " + json.dumps(results[name]["phases"]) +
            f" acc={results[name]['final_accuracy']}")
    assert adaptive_keep is not None
    settle: list[dict[str, Any]] = []
    keep_table: dict[str, list[list[float]]] = {}
    for node, g in adaptive_keep.groupby("node"):
        g = g.sort_values("iter")
        keep_table[str(node)] = [[int(r.iter), round(float(r.t_s), 2), int(r.phase),
                                  round(float(r.keep), 4), round(float(r.sent_fraction), 4)]
                                 for r in g.itertuples()]
        for p in range(1, len(PHASES)):
            keeps = g[g["phase"] == p]["keep"].tolist()
            ideal = ideal_keep(PHASES[p][1])
            k = settle_count(keeps, ideal)
            settle.append({"worker": str(node), "step": f"{PHASES[p - 1][1]:g}->{PHASES[p][1]:g}",
                           "ideal_keep": ideal, "settle_iters": k,
                           "iterations_in_phase": len(keeps),
                           "keep_median_in_phase": float(np.median(keeps)) if keeps else None})
    counts = [s["settle_iters"] if s["settle_iters"] is not None
              else s["iterations_in_phase"] + 1 for s in settle]
    headline = float(max(counts))
    dense = results["fixed_1"]["phases"][1]["iter_s_mean"]
    ratios = {name: (r["phases"][1]["iter_s_mean"] / dense
                     if r["phases"][1]["iter_s_mean"] and dense else None)
              for name, r in results.items()}
    emit("adaptive_step", headline, "iterations",
         "<= 3 iterations for the keep ratio to settle after each step",
         {"settle": settle, "settle_definition":
          f"first k with keep of iterations k..k+{HOLD_ITERS - 1} after the step all within "
          f"{TOLERANCE:.0%} of clamp(B_new/B0); B0={B0_MBPS} Mbit/s; keep = last chunk's",
          "policies": results, "low_phase_iter_time_vs_dense": ratios,
          "adaptive_keep_per_iter": {"columns": ["iter", "t_s", "phase", "keep_last_chunk",
                                                 "sent_fraction"], "rows": keep_table},
          "trace": {"phases": PHASES, "file": str(trace_path)},
          "setup": {"workers": 2, "workload": "digits_mlp hidden=512 (1.2 MB/worker/iter)",
                    "chunk_bytes": 131072, "shaping": "tc (B(t)/N per worker)",
                    "run_s": RUN_S}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
