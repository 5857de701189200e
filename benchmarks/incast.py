"""Incast with and without link/N shaping (DESIGN.md 1.1, seeds/004).

N=16 replay-mode workers push one flat gradient each into one bottleneck; the sweep covers
100 Mbit/s and 1 Gbit/s, deep (10 MB) and shallow (100 KB) bfifo, cubic and bbr, and
``shaping.method`` tc (every worker capped at B/N on its egress HTB) against none. Each point
is one ``gradbed run configs/incast.toml --set ...`` (subprocess), read back from its
summary.json and events:

- Jain fairness over workers of their mean sending throughput (summary.json);
- bottleneck utilisation during the upload windows (summary.json, tc counters);
- drops on the up bottleneck; p50/p99 of every worker's iteration time;
- p99 and utilisation over the steady state (iteration 0, the warm-up, left out through
  ``run.warmup_iterations``) and over all iterations, side by side;
- per-iteration completion fairness: Jain over workers of 1/send_s, per iteration, median;
- the floor (``analysis.bounds.sync_iteration_floor_s``): the least time a synchronous,
  chunk-pipelined iteration can take on that link, whatever the policy. floor / unshaped
  p99 is the smallest p99 ratio any policy could reach in that row, so the 0.7 target is
  reachable only where it is below 0.7.

Each gradient travels in 16 chunks, and the PS sends chunk c of the new weights back as soon as
every worker has sent it (``agents/dp/ps.py``). That is where fairness pays in a synchronous
iteration: under link/N every worker delivers chunk c at the same moment and the downlink runs
one chunk behind the uplink, while under unfair TCP the slowest worker's chunks arrive late and
push the downlink towards the end of the upload.

Headline: Jain with link/N at N=16, 100 Mbit/s, deep queue, cubic. Also reported: the p99
ratio shaped/unshaped per (rate, queue, cc) and the utilisation. ``GB_INCAST_FULL=1`` runs the
whole 16-point sweep (about 10-15 min on 2 cores); the default is the 100 Mbit/s subset.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

from _common import emit, log, run_child

from agents.core import config as cfgmod
from analysis.bounds import sync_iteration_floor_s
from analysis.load import load_run
from analysis.metrics import (
    iteration_time_percentiles,
    jain,
    upload_window_utilization,
    upload_windows,
)

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "incast.toml"
OUT = Path(os.environ.get("GB_INCAST_OUT", "/tmp/gradbed-incast"))
ITERATIONS = int(os.environ.get("GB_INCAST_ITERS", "10"))
# Iteration 0 (TCP slow start on 32 fresh connections, first-touch costs) is left out of
# the steady-state p99 and utilisation; the all-iteration figures are reported beside them.
WARMUP = 1
# Bytes per worker per iteration: ~3 s of a 16-way incast at either rate.
REPLAY_BYTES = {100.0: 2_000_000, 1000.0: 20_000_000}
QUEUES = {"deep": 10_000_000, "shallow": 100_000}
# GSO/TSO/GRO: off gives packet-exact queues and is what 100 Mbit/s uses; at 1 Gbit/s, two
# cores cannot move 16 flows' worth of single segments through veths, bridges and HTB (sys
# time exceeded wall time and utilisation fell to 0.45-0.65 for both policies), so
# offloads are on there, for shaped and unshaped rows alike.
OFFLOAD = {100.0: False, 1000.0: True}
# Every gradient travels in 16 chunks; the PS pipelines them (chunk c comes down once every
# worker has sent it), which is where even progress across workers shortens an iteration.
CHUNKS = 16
_BASE = cfgmod.load(CONFIG)
WORKERS = _BASE.net.workers
COMPUTE_S = _BASE.workload.compute_ms / 1e3


def floor_s(rate_mbps: float) -> float:
    """The least time one iteration of this row can take (analysis.bounds)."""
    return sync_iteration_floor_s(workers=WORKERS, gradient_bytes=REPLAY_BYTES[rate_mbps],
                                  chunks=CHUNKS, up_bps=rate_mbps * 1e6,
                                  down_bps=rate_mbps * 1e6, compute_s=COMPUTE_S)


def run_point(rate_mbps: float, queue: str, cc: str, method: str) -> dict[str, Any]:
    overrides = [f"net.bottleneck_mbps={rate_mbps}", f"net.queue_bytes={QUEUES[queue]}",
                 f'net.congestion="{cc}"', f'shaping.method="{method}"',
                 f"net.offload={str(OFFLOAD[rate_mbps]).lower()}",
                 f"workload.replay_bytes={REPLAY_BYTES[rate_mbps]}",
                 f"workload.chunk_bytes={REPLAY_BYTES[rate_mbps] // CHUNKS}",
                 f"run.iterations={ITERATIONS}", f"run.warmup_iterations={WARMUP}",
                 f'run.name="incast-{method}"']
    argv = [sys.executable, "-m", "controller.cli", "run", str(CONFIG), "--no-progress",
            "--out", str(OUT)]
    for o in overrides:
        argv += ["--set", o]
    res = run_child(argv, cwd=REPO, timeout_s=900)
    if res.returncode != 0:
        raise RuntimeError(f"gradbed run {' '.join(overrides)} failed:\n{res.stderr[-2000:]}")
    run_dir = Path(res.stdout.strip().splitlines()[-1])
    run = load_run(run_dir)
    s, ev = run.summary, run.events
    sends = ev[(ev["event"] == "send_done") & (ev["iter"] >= 1)]
    per_iter = [jain((1.0 / g["send_s"]).tolist()) for _, g in sends.groupby("iter")
                if (g["send_s"] > 0).all() and len(g) > 1]
    per_iter.sort()
    return {"rate_mbps": rate_mbps, "queue": queue, "queue_bytes": QUEUES[queue], "cc": cc,
            "offload": OFFLOAD[rate_mbps],
            "shaping": method, "jain": s["jain_fairness"],
            "jain_per_iter_median": per_iter[len(per_iter) // 2] if per_iter else None,
            "utilization": s["bottleneck_utilization"], "drops": s.get("drops_up"),
            "iter_p50_s": s["iter_time_s_p50"], "iter_p99_s": s["iter_time_s_p99"],
            "utilization_all": upload_window_utilization(run.links, upload_windows(ev)),
            "iter_p99_all_s": iteration_time_percentiles(ev, (99,))["p99"],
            "iterations": s["iterations"], "stop_reason": s["stop_reason"],
            "run_dir": str(run_dir)}


def main() -> int:
    if os.geteuid() != 0:
        log("incast needs root (Mininet)")
        return 1
    full = os.environ.get("GB_INCAST_FULL") == "1"
    rates = [100.0, 1000.0] if full else [100.0]
    queues = ["deep", "shallow"]
    ccs = ["cubic", "bbr"]
    if os.environ.get("GB_INCAST_HEADLINE_ONLY") == "1":
        queues, ccs = ["deep"], ["cubic"]
    combos = list(itertools.product(rates, queues, ccs))
    if os.environ.get("GB_INCAST_POINTS"):
        # e.g. "100:deep:cubic,100:shallow:cubic": a chosen subset of the table.
        combos = [(float(r), q, c) for r, q, c in
                  (x.split(":") for x in os.environ["GB_INCAST_POINTS"].split(","))]
    points = []
    for rate, queue, cc in combos:
        for method in ("tc", "none"):
            p = run_point(rate, queue, cc, method)
            log(f"{rate:6g} Mbit/s {queue:7s} {cc:5s} {method:4s}: jain {p['jain']:.4f} "
                f"(per-iter {p['jain_per_iter_median']}), util {p['utilization']:.3f}, "
                f"(all {p['utilization_all']:.3f}), drops {p['drops']}, "
                f"p50 {p['iter_p50_s']:.3f} s, p99 {p['iter_p99_s']:.3f} s "
                f"(all {p['iter_p99_all_s']:.3f} s)")
            points.append(p)
    ratios = []
    for rate, queue, cc in combos:
        sel = {p["shaping"]: p for p in points
               if (p["rate_mbps"], p["queue"], p["cc"]) == (rate, queue, cc)}
        if "tc" in sel and "none" in sel:
            floor = floor_s(rate)
            ratios.append({"rate_mbps": rate, "queue": queue, "cc": cc,
                           "p99_shaped_over_unshaped": sel["tc"]["iter_p99_s"]
                           / sel["none"]["iter_p99_s"],
                           "p99_all_shaped_over_unshaped": sel["tc"]["iter_p99_all_s"]
                           / sel["none"]["iter_p99_all_s"],
                           "floor_s": floor,
                           "floor_over_unshaped_p99": floor / sel["none"]["iter_p99_s"],
                           "shaped_p99_over_floor": sel["tc"]["iter_p99_s"] / floor,
                           "jain_shaped": sel["tc"]["jain"], "jain_unshaped": sel["none"]["jain"],
                           "util_shaped": sel["tc"]["utilization"],
                           "util_all_shaped": sel["tc"]["utilization_all"]})
            r = ratios[-1]
            log(f"{rate:6g} Mbit/s {queue:7s} {cc:5s} p99 shaped/unshaped "
                f"{r['p99_shaped_over_unshaped']:.2f} (all iterations "
                f"{r['p99_all_shaped_over_unshaped']:.2f}); floor {r['floor_s']:.3f} s, "
                f"the best any policy could reach {r['floor_over_unshaped_p99']:.2f}, "
                f"shaped p99 {r['shaped_p99_over_floor']:.3f}x the floor")
    # The headline point, or (for a GB_INCAST_POINTS subset without it) the first
    # link/N row, named in the unit so the number is never mistaken for the headline.
    head = next((p for p in points if (p["rate_mbps"], p["queue"], p["cc"], p["shaping"])
                 == (100.0, "deep", "cubic", "tc")), None)
    label = "100 Mbit/s, deep, cubic"
    if head is None:
        head = next(p for p in points if p["shaping"] == "tc")
        label = f"{head['rate_mbps']:g} Mbit/s, {head['queue']}, {head['cc']}"
    emit("incast", round(head["jain"], 4), f"Jain index (link/N, N=16, {label})",
         ">= 0.99 (and utilisation >= 0.95, p99 shaped/unshaped <= 0.7)",
         {"points": points, "ratios": ratios, "workers": WORKERS, "iterations": ITERATIONS,
          "replay_bytes": REPLAY_BYTES, "offload": OFFLOAD, "chunks": CHUNKS,
          "compute_ms": COMPUTE_S * 1e3,
          "warmup_iterations": WARMUP, "full_sweep": full})
    return 0


if __name__ == "__main__":
    sys.exit(main())
