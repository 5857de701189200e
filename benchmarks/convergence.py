"""Published compression results at small scale, over the emulated network.

DGC (Lin et al., ICLR 2018, Table 2: ResNet-110 on CIFAR-10, 93.75 % dense vs 93.87 % at
99.9 % sparsity) says top-k at 0.1 % with error feedback and momentum correction keeps dense
accuracy; GRACE (Xu et al., ICDCS 2021) says sparsification without error feedback loses
clearly. Three real runs (``gradbed run``: Mininet, real TCP through the 100 Mbit/s
bottleneck, 4 worker processes and the PS) of ``configs/convergence.toml`` (the Fashion-MNIST
ResNet), identical but for the compression:

- ``dense``: ``compress.name = "none"``, SGD momentum 0.9 at the PS;
- ``topk_0.1pct_ef_mc``: top-k 0.1 %, error feedback, ``feedback.momentum_correction`` (the
  momentum moves onto the workers, masking on; the PS steps without momentum) and DGC's
  sparsity warm-up (``feedback.warmup_iterations`` from the config: 75 % ... 99.6 % sparsity
  in four stages, then 99.9 %), and DGC's layer-wise selection as their code does it
  (``feedback.per_layer``: top-k 0.1 % in each parameter tensor, at least one element each;
  ``feedback.dense_1d``: the 1-D parameters, biases and norm scales, sent whole every step;
  their bytes count in ``bytes_up_per_iter``);
- ``topk_1pct_no_ef``: top-k 1 %, ``compress.error_feedback = false``, momentum at the PS.

Accuracy is the PS's ``final_accuracy`` on all 10,000 test images after the last iteration;
the details also carry each run's curve (the PS's ``eval`` events, every ``run.eval_every``
iterations) and the mean of its last two evaluations (both after the last lr decay of the
config's step schedule, ``workload.lr_schedule``: a less noisy reading than one).
Headline: ``100 x (acc_dense - acc_topk_0.1pct_ef_mc)``, in points (target <= 0.5); also
``100 x (acc_dense - acc_topk_1pct_no_ef)`` (target >= 1). ``GB_CONV_SET`` (comma-separated
dotted overrides) resizes every run; ``GB_CONV_OUT`` is where the run directories go;
``GB_CONV_RUNS`` (comma-separated names of ``RUNS``, default all) runs some of the arms, for
a longer run that fits a measurement slot: a gap whose arm did not run is null.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from _common import REPO, emit, gradbed_run, log

from agents.core import config as cfgmod

CONFIG = REPO / "configs" / "convergence.toml"
OUT = Path(os.environ.get("GB_CONV_OUT", str(REPO / "runs" / "bench-convergence")))
# The top-k 0.1 % run keeps the config's feedback.warmup_iterations (DGC's warm-up is part
# of its recipe); the other two turn it off (dense has nothing to warm up; GRACE's no-EF arm
# is plain top-k).
RUNS: dict[str, list[str]] = {
    "dense": ['compress.name="none"', "feedback.warmup_iterations=0"],
    "topk_0.1pct_ef_mc": ['compress.name="topk"', "compress.ratio=0.001",
                          "compress.error_feedback=true", "feedback.momentum_correction=true",
                          "feedback.per_layer=true", "feedback.dense_1d=true"],
    "topk_1pct_no_ef": ['compress.name="topk"', "compress.ratio=0.01",
                        "compress.error_feedback=false", "feedback.warmup_iterations=0"],
}


def eval_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(iteration + 1, accuracy) of every PS ``eval`` event of a run, in order."""
    curve = []
    for line in (run_dir / "events" / "ps.jsonl").read_text().splitlines():
        ev = json.loads(line)
        if ev.get("event") == "eval" and ev.get("accuracy") is not None:
            curve.append((int(ev["iter"]) + 1, float(ev["accuracy"])))
    return curve


def last_iteration_wire_bytes(run_dir: Path) -> int | None:
    """Bytes the workers' payloads of the last iteration take on the wire, all workers
    together: the sum of ``wire_bytes`` over the ``compress_done`` events (every key) whose
    ``iter`` is the largest any worker logged; the steady state after any warm-up, where
    ``bytes_up_per_iter`` averages the whole run. None without such events."""
    by_iter: dict[int, int] = {}
    for path in sorted((run_dir / "events").glob("w*.jsonl")):
        for line in path.read_text().splitlines():
            ev = json.loads(line)
            if ev.get("event") == "compress_done" and ev.get("wire_bytes") is not None:
                it = int(ev["iter"])
                by_iter[it] = by_iter.get(it, 0) + int(ev["wire_bytes"])
    return by_iter[max(by_iter)] if by_iter else None


def lr_schedule(extra: list[str]) -> dict[str, object]:
    """The workload's lr, schedule and decay points as every run had them."""
    wl = cfgmod.load(CONFIG, extra).workload
    return {"lr": wl.lr, "schedule": wl.lr_schedule, "decay_at": list(wl.lr_decay_at),
            "decay_factor": wl.lr_decay_factor}


def main() -> int:
    if os.geteuid() != 0:
        log("convergence needs root (Mininet)")
        return 1
    extra = [s for s in os.environ.get("GB_CONV_SET", "").split(",") if s]
    chosen = [s for s in os.environ.get("GB_CONV_RUNS", ",".join(RUNS)).split(",") if s]
    unknown = sorted(set(chosen) - set(RUNS))
    if unknown or not {"dense", "topk_0.1pct_ef_mc"} <= set(chosen):
        log(f"GB_CONV_RUNS: {unknown or chosen} - names from {list(RUNS)}; the headline "
            "needs dense and topk_0.1pct_ef_mc")
        return 2
    out = OUT / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    t0 = time.monotonic()
    for name, sets in RUNS.items():
        if name not in chosen:
            continue
        t1 = time.monotonic()
        run_dir = gradbed_run(CONFIG, f"conv-{name}", [*sets, *extra], out, timeout_s=3600)
        s = json.loads((run_dir / "summary.json").read_text())
        curve = eval_curve(run_dir)
        results[name] = {"final_accuracy": s.get("final_accuracy"),
                         "last_two_mean": (round(sum(a for _, a in curve[-2:]) / 2, 5)
                                           if len(curve) >= 2 else None),
                         "curve": curve,
                         "iterations": s.get("iterations"),
                         "iter_s_mean": s.get("iter_time_s_mean"),
                         "bytes_up_per_iter": s.get("bytes_up_per_iter"),
                         "wire_bytes_last_iter": last_iteration_wire_bytes(run_dir),
                         "wall_s": round(time.monotonic() - t1, 1), "run_dir": str(run_dir)}
        log(f"{name}: {results[name]}")
    acc = {n: float(r["final_accuracy"]) for n, r in results.items()}

    def gap(arm: str) -> float | None:
        return round(100 * (acc["dense"] - acc[arm]), 2) if arm in acc else None

    gap_mc, gap_no_ef = gap("topk_0.1pct_ef_mc"), gap("topk_1pct_no_ef")
    assert gap_mc is not None  # both arms are required above
    emit("convergence", gap_mc, "accuracy points (dense - top-k 0.1 % + EF + momentum corr.)",
         "<= 0.5; and dense - top-k 1 % without EF >= 1",
         {"runs": results, "dense_minus_topk_1pct_no_ef_points": gap_no_ef,
          "config": str(CONFIG.relative_to(REPO)), "overrides": extra,
          "lr_schedule": lr_schedule(extra),
          "total_wall_s": round(time.monotonic() - t0, 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
