"""Pipeline benchmark (issue 18): measured bubble against the closed forms, and the three
schedules' throughput at three link rates.

Part 1, compute dominating: GPipe and 1F1B for p in {2, 4} and m in {4, 8, 16}, stages as
real processes over loopback TCP (links far faster than the compute), every forward and
backward padded to ``PAD_MS`` (``pipeline.compute_pad_ms``: the real compute of a small
MLP, then a sleep, so 2 shared cores are not the bottleneck). Measured bubble/total
(analysis.pipeline, steps after the first) against ``(p-1)/(m+p-1)``; headline: the worst
difference in percentage points (target <= 5).

Part 2, the link matters: p = 4, m = 8, ``digits_deep`` (hidden 512: 64 KB per activation
message), compute padded to ``THR_PAD_MS`` per stage share, every stage-to-stage socket
paced at 10, 100 and 1000 Mbit/s (``pipeline.pace_mbps``, SO_MAX_PACING_RATE on loopback:
the pacing shaping method; the fabric shape's tc links are the Mininet form). Samples/s of
GPipe, 1F1B and the two-group schedule, and the two-group gain over 1F1B.

Run: ``.venv/bin/python benchmarks/pipeline.py [--quick]``; writes Gantt charts to
``docs/`` and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import REPO, emit, log

sys.path.insert(0, str(REPO))

from agents.core.schedules import Costs, make, simulate  # noqa: E402
from analysis.load import load_events  # noqa: E402
from analysis.pipeline import pipeline_metrics  # noqa: E402
from analysis.timeline import host_timeline, plot_gantt  # noqa: E402
from tests.pipeline_loopback import logs, run_pipeline  # noqa: E402

PAD_MS = 40.0
THR_PAD_MS = 20.0
STEPS = 3
THR_STEPS = 6


def one(tmp: Path, name: str, overrides: list[str], mb: int, m: int) -> tuple[Path, dict]:
    run_dir, cfg, rcs = run_pipeline(tmp, overrides, timeout_s=600, name=name)
    if any(rcs):
        raise RuntimeError(f"{name}: exit codes {rcs}\n{logs(run_dir)[-3000:]}")
    ev = load_events(run_dir)
    met = pipeline_metrics(ev, micro_batches=m, micro_batch_size=mb, skip=1)
    return run_dir, {"bubble": met.bubble, "bubble_ideal": met.bubble_ideal,
                     "bubble_per_stage": met.bubble_per_stage, "wall_s": met.wall_s,
                     "samples_per_s": met.samples_per_s,
                     "link_bytes_per_step": {f"{a}->{b}": v for (a, b), v
                                             in met.link_bytes_per_step.items()},
                     "peak_act_bytes": met.peak_act_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="p=2 only, m in {4, 8}, two rates")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gradbed-pipeline-"))
    ps, ms = ((2,), (4, 8)) if args.quick else ((2, 4), (4, 8, 16))
    bubble_rows = []
    for sched in ("gpipe", "1f1b"):
        for p in ps:
            for m in ms:
                name = f"bubble-{sched}-p{p}-m{m}"
                _, r = one(tmp, name, [
                    "workload.name='digits_deep'", "workload.hidden=32", "workload.depth=6",
                    f"pipeline.stages={p}", f"pipeline.schedule='{sched}'",
                    f"pipeline.micro_batches={m}", "pipeline.micro_batch_size=8",
                    f"pipeline.compute_pad_ms={PAD_MS}", f"run.iterations={STEPS}"], 8, m)
                formula = (p - 1) / (m + p - 1)
                sim = simulate(make(sched, p, m), Costs.uniform(PAD_MS / 1e3, PAD_MS / 1e3))
                row = {"schedule": sched, "p": p, "m": m, "measured": r["bubble"],
                       "formula": formula, "simulated": sim.bubble,
                       "diff_points": 100 * (r["bubble"] - formula),
                       "measured_ideal": r["bubble_ideal"], "megatron": (p - 1) / m,
                       "per_stage": r["bubble_per_stage"], "peak_act_bytes": r["peak_act_bytes"]}
                bubble_rows.append(row)
                log(f"{name}: bubble {r['bubble']:.4f} formula {formula:.4f} "
                    f"({row['diff_points']:+.2f} points)")
    worst = max(abs(r["diff_points"]) for r in bubble_rows)

    rates = (10.0, 100.0) if args.quick else (10.0, 100.0, 1000.0)
    thr_rows = []
    gantt_runs = {}
    for rate in rates:
        for sched in ("gpipe", "1f1b", "two_group"):
            name = f"thr-{sched}-{rate:g}mbps"
            run_dir, r = one(tmp, name, [
                "workload.name='digits_deep'", "workload.hidden=512", "workload.depth=6",
                "pipeline.stages=4", f"pipeline.schedule='{sched}'",
                "pipeline.micro_batches=8", "pipeline.micro_batch_size=32",
                f"pipeline.compute_pad_ms={THR_PAD_MS}", f"pipeline.pace_mbps={rate}",
                f"run.iterations={THR_STEPS}"], 32, 8)
            thr_rows.append({"schedule": sched, "rate_mbps": rate, **r})
            log(f"{name}: {r['samples_per_s']:.1f} samples/s, bubble {r['bubble']:.3f}")
            if rate == 100.0:
                gantt_runs[sched] = run_dir
    # Part 3: recomputation's memory, and spending it on a micro-batch twice as large.
    mem_rows = []
    for rec, mbs in ((False, 32), (True, 32), (True, 64)):
        name = f"mem-1f1b-recompute{int(rec)}-b{mbs}"
        _, r = one(tmp, name, [
            "workload.name='digits_deep'", "workload.hidden=512", "workload.depth=6",
            "pipeline.stages=4", "pipeline.schedule='1f1b'", "pipeline.micro_batches=8",
            f"pipeline.micro_batch_size={mbs}", f"pipeline.recompute={str(rec).lower()}",
            f"pipeline.compute_pad_ms={THR_PAD_MS}", f"pipeline.pace_mbps={rates[-1]}",
            f"run.iterations={STEPS}"], mbs, 8)
        mem_rows.append({"recompute": rec, "micro_batch_size": mbs,
                         "peak_act_bytes": r["peak_act_bytes"],
                         "max_peak_act_bytes": max(r["peak_act_bytes"].values()),
                         "samples_per_s": r["samples_per_s"]})
        log(f"{name}: peak {max(r['peak_act_bytes'].values())} B, "
            f"{r['samples_per_s']:.1f} samples/s")
    gain = {}
    for rate in rates:
        by = {r["schedule"]: r["samples_per_s"] for r in thr_rows if r["rate_mbps"] == rate}
        gain[f"{rate:g}"] = by["two_group"] / by["1f1b"] - 1
    docs = REPO / "docs"
    docs.mkdir(exist_ok=True)
    charts = []
    for sched, run_dir in gantt_runs.items():
        tl = host_timeline(load_events(run_dir))
        out = plot_gantt(tl, docs / f"pipeline_gantt_{sched}.png",
                         title=f"{sched}, p=4, m=8, 100 Mbit/s per link, {THR_STEPS} steps")
        charts.append(str(out.relative_to(REPO)))
    emit("pipeline", round(worst, 3), "points",
         "measured GPipe/1F1B bubble within 5 points of (p-1)/(m+p-1)",
         {"pad_ms": PAD_MS, "thr_pad_ms": THR_PAD_MS, "steps": STEPS, "thr_steps": THR_STEPS, "bubble": bubble_rows,
          "throughput": thr_rows, "two_group_gain_over_1f1b": gain, "memory": mem_rows,
          "gantt": charts})


if __name__ == "__main__":
    main()
