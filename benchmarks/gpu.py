"""The GPU figures, in one script for a lent GPU machine: top-k at the memory limit, CUDA
stages, expert hosts and torchrun ranks in Mininet equal to their CPU references, and the
workers' iteration time on the GPU against the CPU.

Run as root from the checkout's root on the GPU machine (docs/gpu.md says how it gets
there; ``../shared/GPU.md`` has the recipe for a machine without Mininet):

    python3 benchmarks/gpu.py --out DIR [--only STEP ...] [--device cpu]

Steps, in order, each under its own time cap (``--caps`` scales them):

1. ``topk``: ``benchmarks/topk.py --gpu-only``.
2. ``pipeline``, ``moe``, ``torchrun``: ``configs/pipeline.toml`` and ``configs/moe.toml`` (the Belady offloader on
   the device) twice on the device and once on the CPU, and the torchrun DDP example twice
   with CUDA tensors over gloo and once on the CPU; every run with ``run.deterministic``
   (TF32 off, deterministic algorithms). Each device run must equal the other bit for bit;
   against the CPU run, the largest difference relative to the tensor's largest weight.
3. ``speed``: the demo's MLP and ``fashion_resnet`` for 50 iterations with the workers on
   the device and on the CPU over the same network: compute and iteration time, each
   worker's peak device memory, the GPU's load from ``nvidia-smi`` while they share it,
   and one process's compute alone on the device (what sharing costs).

Results go to DIR/gpu.json after every run (an interrupted script keeps what it had) and
one JSON line at the end. ``--device cpu`` runs the "device" runs on the CPU too: it tries
the script's plumbing on a machine without a GPU (the figures then mean nothing).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import REPO, emit, log, run_child

from agents.core.files import write_atomic

# The difference a device run may show against its CPU reference, relative to the
# tensor's largest weight. One float32 rounding is 2^-24 (6e-8) of it; kernels that sum
# in another order differ by a few such roundings per reduction, which the few steps of
# these runs carry (measured: 1.2-1.8e-7, two or three roundings; docs/gpu.md). A real
# difference is far larger: TF32 keeps 10 mantissa bits (about 5e-4 relative per product),
# and one SGD step more or less moves the weights by lr x |g|, 1e-3 to 1e-2 of them.
CPU_TOLERANCE = 1e-5
#: Set on every run: the machine's own limits (filled in by :func:`main`).
MACHINE_SETS: list[str] = []
CAPS_S = {"topk": 90, "pipeline": 60, "moe": 70, "torchrun": 80, "speed_run": 60}


class Results:
    """gpu.json, rewritten whole (atomically) after every change."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                              time.gmtime())}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        write_atomic(self.path, json.dumps(self.data, indent=1, default=str))


def _run(cmd: list[str], cap_s: float, logf: Path) -> tuple[int, float]:
    """``cmd`` from the checkout's root, its output appended to ``logf``; (exit status,
    seconds). A command past its cap is stopped as Ctrl-C stops it, so its network is torn
    down (status 124)."""
    t0 = time.monotonic()
    try:
        res = run_child(cmd, cwd=REPO, timeout_s=cap_s)
        rc, said = res.returncode, res.stdout + res.stderr
    except subprocess.TimeoutExpired:
        rc, said = 124, f"stopped past its cap of {cap_s:g} s\n"
    with open(logf, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{said}")
    return rc, time.monotonic() - t0


def _newest_run(parent: Path) -> Path | None:
    runs = [d for d in parent.glob("*/") if (d / "config.toml").exists()]
    return max(runs, key=lambda d: d.stat().st_mtime) if runs else None


def gradbed(verb: str, config: str, sets: list[str], out: Path, cap_s: float,
            logf: Path, script: list[str] | None = None) -> dict[str, Any]:
    """One ``gradbed run`` or ``gradbed torchrun`` into its own folder under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "controller.cli", verb, config, "--no-progress",
           "--no-report", "--out", str(out)]
    for s in [*sets, *MACHINE_SETS]:
        cmd += ["--set", s]
    if script:
        cmd += ["--", *script]
    rc, took_s = _run(cmd, cap_s, logf)
    run_dir = _newest_run(out)
    summary: dict[str, Any] = {}
    if run_dir is not None and (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    log(f"{verb} {config} {' '.join(sets)}: exit {rc} in {took_s:.0f} s")
    return {"rc": rc, "wall_s": round(took_s, 1), "run_dir": str(run_dir),
            "stop_reason": summary.get("stop_reason"), "summary": summary}


# -- comparing weights ---------------------------------------------------------------------

def _flat_tensors(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Every tensor in a saved dict or list, by a path name."""
    import torch

    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().cpu()}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj)
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_flat_tensors(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def load_weights(files: list[Path]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    for f in files:
        out.update(_flat_tensors(torch.load(f, map_location="cpu"), f.stem))
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Bitwise equality, and the largest difference relative to each tensor's largest
    weight (the worst tensor's), of two sets of weights with the same names."""
    import torch

    if not a or set(a) != set(b):
        return {"comparable": False, "only_a": sorted(set(a) - set(b))[:5],
                "only_b": sorted(set(b) - set(a))[:5], "empty": not a}
    rel = 0.0
    for k in a:
        if a[k].numel() == 0:
            continue
        scale = float(a[k].abs().max()) or 1.0
        rel = max(rel, float((a[k].double() - b[k].double()).abs().max()) / scale)
    return {"comparable": True, "tensors": len(a),
            "numel": sum(t.numel() for t in a.values()),
            "bit_identical": all(torch.equal(a[k], b[k]) for k in a),
            "max_rel_diff": rel}


def twice_and_cpu(name: str, run: Callable[[str, int], dict[str, Any]],
                  weights: Callable[[dict[str, Any]], dict[str, Any]], device: str
                  ) -> dict[str, Any]:
    """Runs ``run(device, i)`` twice and ``run("cpu", 2)`` once; compares their weights."""
    runs = [run(device, 0), run(device, 1), run("cpu", 2)]
    w = [weights(r) if r["rc"] == 0 else {} for r in runs]
    same = compare(w[0], w[1])
    cpu = compare(w[2], w[0])
    ok = (all(r["rc"] == 0 for r in runs) and same.get("bit_identical") is True
          and cpu.get("comparable") is True and cpu["max_rel_diff"] <= CPU_TOLERANCE)
    log(f"{name}: {device} twice bit-identical {same.get('bit_identical')}, against the "
        f"CPU {cpu.get('max_rel_diff')}")
    return {"runs": [{k: v for k, v in r.items() if k != "summary"} for r in runs],
            "final_accuracy": [r["summary"].get("final_accuracy") for r in runs],
            "final_loss": [r["summary"].get("final_loss") for r in runs],
            "device_twice": same, "against_cpu": cpu, "tolerance": CPU_TOLERANCE,
            "pass": ok}


# -- step 2: equal to the CPU ------------------------------------------------------------

MOE_SETS = ["moe.offload_budget_bytes=70000", "moe.offload_policy='belady'",
            "run.iterations=10", "moe.eval_every=5"]  # room for one of a host's two experts


def _weights(pattern: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda r: load_weights(sorted(Path(r["run_dir"]).glob(pattern)))


def step_pipeline(out: Path, device: str, logf: Path, res: Results, caps: float) -> None:
    def pipeline(dev: str, i: int) -> dict[str, Any]:
        return gradbed("run", "configs/pipeline.toml", [f"run.device='{dev}'"],
                       out / f"pipeline_{dev}{i}", CAPS_S["pipeline"] * caps, logf)

    res.put("pipeline", twice_and_cpu("pipeline", pipeline, _weights("*_final_weights.pt"),
                                      device))


def step_moe(out: Path, device: str, logf: Path, res: Results, caps: float) -> None:
    def moe(dev: str, i: int) -> dict[str, Any]:
        return gradbed("run", "configs/moe.toml", [*MOE_SETS, f"moe.offload_device='{dev}'"],
                       out / f"moe_{dev}{i}", CAPS_S["moe"] * caps, logf)

    res.put("moe", twice_and_cpu("moe", moe, _weights("e*_final_weights.pt"), device))


def step_torchrun(out: Path, device: str, logf: Path, res: Results, caps: float) -> None:
    # The example's fabric delays and drops packets, which needs NFQUEUE (iptables) on a
    # kernel without netem: where there is no iptables the links keep their rates and trace.
    sets = [] if shutil.which("iptables") else ["net.delay_ms=0", "net.loss_pct=0"]
    res.put("torchrun_sets", sets)

    def torchrun(dev: str, i: int) -> dict[str, Any]:
        save = out / f"torchrun_{dev}{i}" / "params.pt"
        save.parent.mkdir(parents=True, exist_ok=True)
        r = gradbed("torchrun", "examples/torchrun_ddp/fabric4.toml", sets,
                    out / f"torchrun_{dev}{i}", CAPS_S["torchrun"] * caps, logf,
                    ["examples/torchrun_ddp/train.py", "--steps", "10", "--device", dev,
                     "--save", str(save)])
        r["saved"] = str(save)
        return r

    res.put("torchrun", twice_and_cpu(
        "torchrun", torchrun,
        lambda r: load_weights([Path(r["saved"])]) if Path(r["saved"]).exists() else {},
        device))


# -- step 3: GPU against CPU ---------------------------------------------------------------

SPEED = {
    "demo_mlp": ("configs/demo.toml", ["run.iterations=50", "compress.name='none'"]),
    "fashion_resnet": ("configs/convergence.toml",
                       ["run.iterations=50", "run.eval_every=50", "vision.eval_samples=1000",
                        "feedback.warmup_iterations=5", "run.warmup_iterations=5",
                        "run.timeout_s=300"]),
    # The same at 1 Gbit/s, where the network no longer hides the compute.
    "fashion_resnet_1g": ("configs/convergence.toml",
                          ["run.iterations=50", "run.eval_every=50", "vision.eval_samples=1000",
                           "feedback.warmup_iterations=5", "run.warmup_iterations=5",
                           "run.timeout_s=300", "net.bottleneck_mbps=1000",
                           "net.bottleneck_down_mbps=10000"]),
}


class GpuSampler:
    """``nvidia-smi`` every 200 ms while the device runs share the GPU: its load and
    memory, and each process's memory (absent where nvidia-smi is)."""

    QUERIES = {"gpu": "--query-gpu=utilization.gpu,memory.used",
               "apps": "--query-compute-apps=pid,used_memory"}

    def __init__(self, folder: Path, name: str) -> None:
        self.files = {k: folder / f"{name}_nvidia_smi_{k}.csv" for k in self.QUERIES}
        self.procs: list[subprocess.Popen[bytes]] = []
        if shutil.which("nvidia-smi"):
            for k, q in self.QUERIES.items():
                with open(self.files[k], "wb") as f:
                    self.procs.append(subprocess.Popen(
                        ["nvidia-smi", q, "--format=csv,noheader,nounits", "-lms", "200"],
                        stdout=f, stderr=subprocess.DEVNULL))

    def stop(self) -> dict[str, Any]:
        for p in self.procs:
            p.terminate()
            p.wait()
        if not self.procs:
            return {"skipped": "no nvidia-smi"}
        rows = [line.split(", ") for line in self.files["gpu"].read_text().splitlines()]
        util = [float(r[0]) for r in rows if len(r) == 2 and r[0].strip().isdigit()]
        per_pid: dict[str, float] = {}
        for line in self.files["apps"].read_text().splitlines():
            pid, _, mib = line.partition(", ")
            if mib.strip().isdigit():
                per_pid[pid] = max(per_pid.get(pid, 0.0), float(mib))
        return {"gpu_util_pct_mean": statistics.fmean(util) if util else None,
                "gpu_util_pct_busy_samples": sum(u > 0 for u in util), "samples": len(util),
                "process_peak_MiB": sorted(per_pid.values(), reverse=True)}


def worker_figures(run_dir: Path, warmup: int) -> dict[str, Any]:
    """Per worker: median compute time of an iteration past warm-up, and peak memory."""
    out: dict[str, Any] = {}
    for f in sorted((run_dir / "events").glob("w*.jsonl")):
        ev = [json.loads(line) for line in f.read_text().splitlines()]
        comp = [e["compute_s"] for e in ev
                if e.get("event") == "compute_done" and e.get("iter", 0) >= warmup]
        mem = [e for e in ev if e.get("event") == "device_memory"]
        out[f.stem] = {"compute_s_p50": statistics.median(comp) if comp else None,
                       "device_memory": {k: v for k, v in mem[-1].items()
                                         if k.startswith("cuda_")} if mem else None}
    return out


def alone_compute_s(config: str, sets: list[str], device: str, iters: int = 30) -> float:
    """One worker's forward and backward alone on ``device`` (no other process, no
    network), median of ``iters`` after 5 warm-ups: the compute a shared GPU gives away."""
    import torch

    from agents.core import config as cfgmod
    from agents.workloads.base import Batch, FlatModel
    from agents.workloads.device import make_deterministic
    from agents.workloads.factory import make_workload

    cfg = cfgmod.load(REPO / config, sets)
    make_deterministic(cfg.run.deterministic)
    torch.set_num_threads(1)  # as the agents run
    wl = make_workload(cfg.workload, cfg.vision)
    fm = FlatModel(wl.build_model(cfg.run.seed), device)
    wl.prepare(fm.module, 0, cfg.run.seed)
    times = []
    for i in range(iters + 5):
        b = wl.batch(i, 0, cfg.net.workers, cfg.workload.batch_size)
        t0 = time.perf_counter()
        fm.zero_grad()
        loss = wl.loss(fm.module, Batch(b.x.to(device), b.y.to(device)))
        loss.backward()
        float(loss.detach())  # waits for the device, as the worker's loss does
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])


def step_speed(out: Path, device: str, logf: Path, res: Results, caps: float,
               names: list[str]) -> None:
    for name in names:
        config, sets = SPEED[name]
        got: dict[str, Any] = {}
        for dev in (device, "cpu"):
            sampler = GpuSampler(out, name) if dev == "cuda" else None
            r = gradbed("run", config, [*sets, f"run.device='{dev}'"], out / f"{name}_{dev}",
                        CAPS_S["speed_run"] * caps, logf)
            s = r.pop("summary")
            got[dev] = {**r, "iter_time_s_p50": s.get("iter_time_s_p50"),
                        "final_accuracy": s.get("final_accuracy"),
                        "bottleneck_utilization": s.get("bottleneck_utilization"),
                        "workers": worker_figures(Path(r["run_dir"]), 5)
                        if r["run_dir"] != "None" else {},
                        "alone_compute_s_p50": alone_compute_s(config, sets, dev)}
            if sampler is not None:
                got[dev]["nvidia_smi"] = sampler.stop()
            res.put(f"speed_{name}", got)


STEPS = ("topk", "pipeline", "moe", "torchrun", "speed")


def step_topk(out: Path, device: str, logf: Path, res: Results, caps: float) -> None:
    line = out / "topk.json"
    with open(line, "wb") as f:
        p = subprocess.run([sys.executable, "benchmarks/topk.py", "--gpu-only"], cwd=REPO,
                           stdout=f, stderr=open(logf, "ab"), timeout=CAPS_S["topk"] * caps,
                           check=False)
    text = line.read_text().strip().splitlines()
    res.put("topk", json.loads(text[-1]) if p.returncode == 0 and text
            else {"rc": p.returncode, "skipped": "see gpu.log"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", nargs="*", choices=STEPS, default=list(STEPS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: try the plumbing without a GPU (figures meaningless)")
    ap.add_argument("--runs", type=Path, default=None,
                    help="where the run directories go (default: OUT/runs)")
    ap.add_argument("--speed", nargs="*", choices=list(SPEED), default=list(SPEED),
                    help="which runs the speed step makes")
    ap.add_argument("--caps", type=float, default=1.0, help="scale every step's time cap")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = Results(args.out / "gpu.json")
    logf = args.out / "gpu.log"
    import torch

    res.put("machine", {"device": torch.cuda.get_device_name() if torch.cuda.is_available()
                        else "cpu only", "torch": torch.__version__, "cpus": os.cpu_count(),
                        "tried_on": args.device})
    if shutil.which("iptables") is None:  # the lent GPU machine has none
        MACHINE_SETS.append("guard.kernel_admission=false")
    res.put("machine_sets", MACHINE_SETS)
    Step = Callable[[Path, str, Path, Results, float], None]
    steps: dict[str, Step] = {"topk": step_topk, "pipeline": step_pipeline, "moe": step_moe,
             "torchrun": step_torchrun,
             "speed": functools.partial(step_speed, names=args.speed)}
    runs = args.runs or args.out / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for name in STEPS:
        if name in args.only:
            t0 = time.monotonic()
            try:
                steps[name](runs, args.device, logf, res, args.caps)
            except Exception as e:  # one step's failure must not cost the others' figures
                res.put(f"{name}_error", f"{type(e).__name__}: {e}")
            log(f"step {name}: {time.monotonic() - t0:.0f} s")
    eq = [res.data.get(k, {}).get("pass") for k in ("pipeline", "moe", "torchrun")]
    emit("gpu", float(sum(bool(x) for x in eq)), "of 3 kinds equal to their CPU references",
         "3", res.data)


if __name__ == "__main__":
    main()
