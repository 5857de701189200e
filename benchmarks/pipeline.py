"""Pipeline benchmark: measured bubble against the closed forms, and the three
schedules' throughput at three link rates.

Part 1, compute dominating: GPipe and 1F1B for p in {2, 4} and m in {4, 8, 16}, stages as
real processes over loopback TCP (links far faster than the compute), every forward and
backward padded to ``PAD_MS`` (``pipeline.compute_pad_ms``: the real compute of a small
MLP, then a sleep, so 2 shared cores are not the bottleneck). Measured bubble/total
(analysis.pipeline, steps after the first) against ``(p-1)/(m+p-1)``; headline: the worst
difference in percentage points (target <= 5).

Part 2, the link matters: p = 4, m = 8, ``digits_deep`` (hidden 512: 64 KB per activation
message), compute padded to ``THR_PAD_MS`` per stage share, in real Mininet: ``gradbed run
configs/pipeline.toml`` on the ``fabric`` shape (4 stage hosts and the pipeline's PS),
every access link shaped both ways by tc at 10, 100 and 1000 Mbit/s
(``net.worker_link_mbps``). GPipe, 1F1B and the two-group schedule run side by side,
interleaved (rate by rate, schedule after schedule, ``--repeats`` rounds), so the machine's
load drifts over all three alike; samples/s and bubble of each, and their ratios to 1F1B
(per round, and the mean over rounds).

Part 3, recomputation (loopback): the most activation bytes a stage held, with and without
recomputation, and with the saved memory spent on micro-batches twice as large.

Part 4, time to accuracy (Mininet, ``configs/pipeline.toml``: 4 stages and the PS on the
fabric, ``digits_deep`` hidden 128): each schedule for ``TTA_STEPS`` steps at 10 and 100
Mbit/s, the PS evaluating every ``TTA_EVERY`` steps; ``time_to_target_s`` to
``TTA_TARGET`` and ``final_accuracy`` from ``summary.json``, for each of ``TTA_SETTINGS``
(the config as it is, momentum 0.9; and momentum 0). Each run's accuracy curve is compared
with its one-process reference's (``controller.loopback.pipeline.reference_evals``); then, in
one process, the synchronous and the 2BW references over ``SWEEP_LR_MOMENTUM``.

Part 5, line rate (Mininet): 1F1B on the fabric sized so its stage links are busy at
100 Mbit/s (``LINERATE_OVERRIDES``: 2 stages, 256 KB activation messages against two
64-wide layers per stage, 16 micro-batches a step, no compute pad), at 100 Mbit/s, 1 Gbit/s and "unshaped" (HTB
at 10 Gbit/s, the config's maximum, above what this host's veths and agents carry), rates
interleaved over ``--repeats`` rounds. Reported: each stage link's load at 100 Mbit/s
(:func:`analysis.pipeline.link_load`, target >= 0.8) and 1F1B's samples/s at 1 Gbit/s over
unshaped (target >= 0.9), with the machine's load average before and after, since a
loaded host lowers both rates' samples/s alike but not the link loads' meaning.

Run as root: ``.venv/bin/python benchmarks/pipeline.py
[--quick] [--parts bubble,sweep,memory,tta,linerate]``; writes Gantt charts to ``docs/`` and
prints one JSON line last (``--parts linerate`` alone: that part's line, headline the
1 Gbit/s / unshaped ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from statistics import mean

import torch
from _common import REPO, emit, gradbed_run, log

sys.path.insert(0, str(REPO))

from agents.core import config as cfgmod  # noqa: E402
from agents.core.schedules import Costs, make, simulate  # noqa: E402
from analysis.load import load_events  # noqa: E402
from analysis.pipeline import link_load, pipeline_metrics  # noqa: E402
from analysis.timeline import host_timeline, plot_gantt  # noqa: E402
from controller.loopback.pipeline import logs, reference_evals, run_pipeline  # noqa: E402

PAD_MS = 40.0
THR_PAD_MS = 20.0
STEPS = 3
THR_STEPS = 6
SCHEDULES = ("gpipe", "1f1b", "two_group")
TTA_STEPS, TTA_EVERY, TTA_TARGET = 60, 5, 0.8
# (name, overrides of configs/pipeline.toml, schedules): the config as it is (lr 0.05,
# momentum 0.9), and without momentum, where the two-group schedule's 2BW weights train.
TTA_SETTINGS = (
    ("momentum0.9", [], SCHEDULES),
    ("momentum0", ["workload.momentum=0.0"], ("1f1b", "two_group")),
)
# Part 5: 256 KB per activation message (1024 x 64 float32) against two 64-wide layers per
# stage (a few ms of forward and backward on a loaded core; no pad): at 100 Mbit/s a
# message takes 21 ms on the wire, so the links, not the compute, set the pace. Two
# stages: 1F1B keeps at most p micro-batches in flight at stage 0, each waiting a round
# trip of 2 (p - 1) messages, so a link can be busy at most p / (2 (p - 1)) of the time
# (0.67 at p = 4, 1 at p = 2). 16 micro-batches a step. At 1 Gbit/s a message takes 2 ms
# and the compute sets the pace again.
LINERATE_M, LINERATE_B = 16, 1024
LINERATE_OVERRIDES = ["workload.name='digits_deep'", "workload.hidden=64", "workload.depth=2",
                      "pipeline.stages=2", "pipeline.schedule='1f1b'",
                      f"pipeline.micro_batches={LINERATE_M}",
                      f"pipeline.micro_batch_size={LINERATE_B}",
                      "pipeline.compute_pad_ms=0", "topo.hosts=3"]
LINERATE_RATES = {"100M": 100.0, "1G": 1000.0, "unshaped": 10000.0}
SWEEP_LR_MOMENTUM = ((0.05, 0.9), (0.02, 0.9), (0.01, 0.9), (0.005, 0.9), (0.002, 0.9),
                     (0.05, 0.5), (0.02, 0.5), (0.05, 0.0), (0.1, 0.0))


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


def fabric_run(out: Path, name: str, sched: str, rate_mbps: float) -> tuple[Path, dict]:
    """One schedule in Mininet on the fabric, every access link tc-shaped at the rate."""
    run_dir = gradbed_run(REPO / "configs" / "pipeline.toml", name, [
        "workload.name='digits_deep'", "workload.hidden=512", "workload.depth=6",
        "pipeline.stages=4", f"pipeline.schedule='{sched}'", "pipeline.micro_batches=8",
        "pipeline.micro_batch_size=32", f"pipeline.compute_pad_ms={THR_PAD_MS}",
        f"net.worker_link_mbps={rate_mbps}", f"run.iterations={THR_STEPS}", "topo.hosts=5"],
        out)
    pp = json.loads((run_dir / "summary.json").read_text())["pipeline"]
    return run_dir, {k: pp[k] for k in ("bubble", "bubble_ideal", "bubble_per_stage",
                                        "samples_per_s", "link_bytes_per_step",
                                        "peak_act_bytes")}


def sweep(tmp: Path, rates: tuple[float, ...], repeats: int
          ) -> tuple[list[dict], dict, dict[str, Path]]:
    """Part 2: every (round, rate, schedule) in Mininet; rows, ratios to 1F1B, Gantt runs."""
    rows = []
    gantt_runs: dict[str, Path] = {}
    for rnd in range(repeats):
        for rate in rates:
            for sched in SCHEDULES:
                name = f"thr-{sched}-{rate:g}mbps-r{rnd}"
                run_dir, r = fabric_run(tmp, name, sched, rate)
                rows.append({"round": rnd, "schedule": sched, "rate_mbps": rate, **r})
                log(f"{name}: {r['samples_per_s']:.1f} samples/s, bubble {r['bubble']:.3f}")
                if rate == 100.0 and rnd == 0:
                    gantt_runs[sched] = run_dir
    ratios: dict[str, dict[str, float]] = {}
    for rate in rates:
        per = {}
        for sched in ("gpipe", "two_group"):
            rs = []
            for rnd in range(repeats):
                by = {r["schedule"]: r["samples_per_s"] for r in rows
                      if r["rate_mbps"] == rate and r["round"] == rnd}
                rs.append(by[sched] / by["1f1b"])
            per[f"{sched}_over_1f1b"] = mean(rs)
            per[f"{sched}_over_1f1b_rounds"] = rs  # type: ignore[assignment]
        ratios[f"{rate:g}"] = per
    return rows, ratios, gantt_runs


def line_rate(tmp: Path, repeats: int) -> dict:
    """Part 5: 1F1B at 100 Mbit/s, 1 Gbit/s and unshaped, interleaved by round."""
    load_before = os.getloadavg()
    rows = []
    for rnd in range(repeats):
        for label, rate in LINERATE_RATES.items():
            name = f"linerate-{label}-r{rnd}"
            run_dir = gradbed_run(REPO / "configs" / "pipeline.toml", name, [
                *LINERATE_OVERRIDES, f"net.worker_link_mbps={rate}",
                f"run.iterations={THR_STEPS}"], tmp)
            met = pipeline_metrics(load_events(run_dir), micro_batches=LINERATE_M,
                                   micro_batch_size=LINERATE_B)
            loads = {f"{a}->{b}": v for (a, b), v in link_load(met, rate).items()}
            rows.append({"round": rnd, "rate": label, "rate_mbps": rate,
                         "samples_per_s": met.samples_per_s, "bubble": met.bubble,
                         "link_load": loads})
            log(f"{name}: {met.samples_per_s:.1f} samples/s, busiest link "
                f"{max(loads.values()):.3f}, least busy {min(loads.values()):.3f}")
    by = {(r["round"], r["rate"]): r for r in rows}
    ratios = [by[(k, "1G")]["samples_per_s"] / by[(k, "unshaped")]["samples_per_s"]
              for k in range(repeats)]
    load_100 = [min(by[(k, "100M")]["link_load"].values()) for k in range(repeats)]
    return {"ratio_1g_over_unshaped": mean(ratios), "ratio_rounds": ratios,
            "least_link_load_at_100m": min(load_100), "least_link_load_rounds": load_100,
            "rows": rows, "overrides": LINERATE_OVERRIDES, "steps": THR_STEPS,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "unshaped_means": "HTB at 10000 Mbit/s (the config's maximum)"}


def _steps_to(curve: dict[int, float], target: float) -> int | None:
    """The first evaluated step (1-based) whose accuracy reaches ``target``."""
    return next((k for k, a in sorted(curve.items()) if a >= target), None)


def _reference_curve(cfg: cfgmod.ExperimentConfig) -> dict[int, float]:
    """Held-out accuracy of the one-process reference of ``cfg``'s schedule by step
    (1-based): plain SGD for GPipe and 1F1B, the 2BW versions for two-group."""
    return {k + 1: m["accuracy"] for k, m in reference_evals(cfg).items()}


def time_to_accuracy(tmp: Path, rates: tuple[float, ...]) -> list[dict]:
    """Part 4: every schedule to ``TTA_TARGET`` on the fabric, setting by setting and rate
    by rate, each next to its one-process reference (``matches_reference``: the PS's
    accuracy after every evaluated step equals the reference's, exactly)."""
    rows = []
    for setting, extra, schedules in TTA_SETTINGS:
        for rate in rates:
            for sched in schedules:
                name = f"tta-{setting}-{sched}-{rate:g}mbps"
                run_dir = gradbed_run(REPO / "configs" / "pipeline.toml", name, [
                    f"pipeline.schedule='{sched}'", f"net.worker_link_mbps={rate}",
                    f"run.iterations={TTA_STEPS}", f"run.eval_every={TTA_EVERY}",
                    f"run.target_accuracy={TTA_TARGET}", *extra], tmp)
                s = json.loads((run_dir / "summary.json").read_text())
                ev = load_events(run_dir)
                evals = ev[(ev["event"] == "eval") & (ev["node"] == "ps")]
                curve = {int(i) + 1: float(a) for i, a in
                         zip(evals["iter"], evals["accuracy"], strict=True)}
                ref = _reference_curve(cfgmod.load(run_dir / "config.toml"))
                # The training loss the last stage logs per step (mean over the step's
                # micro-batches), every TTA_EVERY steps.
                done = ev[(ev["event"] == "pp_step_done") & ev["loss"].notna()]
                loss = {int(i) + 1: round(float(v), 4) for i, v in
                        zip(done["iter"], done["loss"], strict=True)
                        if (int(i) + 1) % TTA_EVERY == 0 or int(i) == 0}
                rows.append({"setting": setting, "schedule": sched, "rate_mbps": rate,
                             "time_to_target_s": s.get("time_to_target_s"),
                             "iterations_to_target": s.get("iterations_to_target"),
                             "final_accuracy": s.get("final_accuracy"),
                             "samples_per_s": s["pipeline"]["samples_per_s"],
                             "accuracy_by_step": curve, "loss_by_step": loss,
                             "reference_accuracy_by_step": ref,
                             "matches_reference": curve == ref})
                log(f"{name}: time to {TTA_TARGET} {s.get('time_to_target_s')} s, final "
                    f"accuracy {s.get('final_accuracy')}, reference's curve "
                    f"{'matched' if curve == ref else 'NOT matched'}")
    return rows


def reference_sweep() -> list[dict]:
    """Part 4's learning-rate and momentum sweep, one process (no network: the fabric runs
    above equal their references): for each (lr, momentum) the synchronous reference (GPipe
    and 1F1B) and the 2BW one (two-group), steps to ``TTA_TARGET`` and final accuracy."""
    rows = []
    for lr, mom in SWEEP_LR_MOMENTUM:
        for sched in ("1f1b", "two_group"):
            cfg = cfgmod.load(REPO / "configs" / "pipeline.toml", [
                f"pipeline.schedule='{sched}'", f"workload.lr={lr}",
                f"workload.momentum={mom}", f"run.iterations={TTA_STEPS}",
                f"run.eval_every={TTA_EVERY}"])
            curve = _reference_curve(cfg)
            rows.append({"lr": lr, "momentum": mom,
                         "weights": "2bw" if sched == "two_group" else "sync",
                         "steps_to_target": _steps_to(curve, TTA_TARGET),
                         "final_accuracy": curve[TTA_STEPS], "accuracy_by_step": curve})
            log(f"reference {rows[-1]['weights']} lr {lr} momentum {mom}: steps to "
                f"{TTA_TARGET} {rows[-1]['steps_to_target']}, final {curve[TTA_STEPS]:.3f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="p=2 only, m in {4, 8}, two rates")
    ap.add_argument("--parts", default="bubble,sweep,memory,tta,linerate",
                    help="comma-separated: bubble (loopback), sweep (Mininet), memory "
                         "(loopback), tta (Mininet), linerate (Mininet)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved rounds of the sweep")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    # The stages compute with one thread; the one-process references of part 4 must too,
    # or their float sums round differently and the curves part after a few dozen steps.
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="gradbed-pipeline-"))
    ps, ms = ((2,), (4, 8)) if args.quick else ((2, 4), (4, 8, 16))
    bubble_rows = []
    for sched in ("gpipe", "1f1b") if "bubble" in parts else ():
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
    worst = max((abs(r["diff_points"]) for r in bubble_rows), default=float("nan"))

    rates = (10.0, 100.0) if args.quick else (10.0, 100.0, 1000.0)
    thr_rows: list[dict] = []
    ratios: dict = {}
    gantt_runs: dict[str, Path] = {}
    if "sweep" in parts:
        thr_rows, ratios, gantt_runs = sweep(tmp, rates, args.repeats)
    # Part 3: recomputation's memory, and spending it on a micro-batch twice as large.
    mem_rows = []
    for rec, mbs in ((False, 32), (True, 32), (True, 64)) if "memory" in parts else ():
        name = f"mem-1f1b-recompute{int(rec)}-b{mbs}"
        _, r = one(tmp, name, [
            "workload.name='digits_deep'", "workload.hidden=512", "workload.depth=6",
            "pipeline.stages=4", "pipeline.schedule='1f1b'", "pipeline.micro_batches=8",
            f"pipeline.micro_batch_size={mbs}", f"pipeline.recompute={str(rec).lower()}",
            f"pipeline.compute_pad_ms={THR_PAD_MS}", "pipeline.pace_mbps=1000",
            f"run.iterations={STEPS}"], mbs, 8)
        mem_rows.append({"recompute": rec, "micro_batch_size": mbs,
                         "peak_act_bytes": r["peak_act_bytes"],
                         "max_peak_act_bytes": max(r["peak_act_bytes"].values()),
                         "samples_per_s": r["samples_per_s"]})
        log(f"{name}: peak {max(r['peak_act_bytes'].values())} B, "
            f"{r['samples_per_s']:.1f} samples/s")
    linerate = line_rate(tmp, args.repeats) if "linerate" in parts else None
    if parts == {"linerate"} and linerate is not None:
        emit("pipeline_linerate", round(linerate["ratio_1g_over_unshaped"], 3), "x",
             "1F1B samples/s at 1 Gbit/s >= 0.9 x unshaped, every stage link >= 0.8 busy "
             "at 100 Mbit/s", linerate)
        return
    tta_rows = time_to_accuracy(tmp, (10.0, 100.0)) if "tta" in parts else []
    ref_rows = reference_sweep() if "tta" in parts else []
    docs = REPO / "docs"
    docs.mkdir(exist_ok=True)
    charts = []
    for sched, run_dir in gantt_runs.items():
        tl = host_timeline(load_events(run_dir))
        window = tl[(tl["iter"] >= 3) & (tl["iter"] <= 4)]  # two steady-state steps
        out = plot_gantt(tl, docs / f"pipeline_gantt_{sched}.png",
                         title=f"{sched}, p=4, m=8, fabric, tc 100 Mbit/s per link: steps 3-4 of "
                               f"{THR_STEPS}",
                         t_range=(window["start_s"].min(), window["end_s"].max()))
        charts.append(str(out.relative_to(REPO)))
    emit("pipeline", round(worst, 3), "points",
         "measured GPipe/1F1B bubble within 5 points of (p-1)/(m+p-1)",
         {"pad_ms": PAD_MS, "thr_pad_ms": THR_PAD_MS, "steps": STEPS, "thr_steps": THR_STEPS,
          "bubble": bubble_rows, "parts": sorted(parts),
          "sweep_shape": "fabric (Mininet, tc on every access link)",
          "repeats": args.repeats, "throughput": thr_rows, "ratios_to_1f1b": ratios,
          "memory": mem_rows, "linerate": linerate, "tta": tta_rows, "tta_reference_sweep": ref_rows,
          "tta_settings": {"steps": TTA_STEPS, "eval_every": TTA_EVERY, "target": TTA_TARGET,
                           "settings": {n: o for n, o, _ in TTA_SETTINGS}},
          "gantt": charts})


if __name__ == "__main__":
    main()
