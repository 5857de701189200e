"""Scale on one machine (DESIGN.md section 5, Mininet-HiFi's fidelity check).

1. Bring-up: how long a 32-worker star takes to build, shaped and ready
   (``StarNetwork.__enter__``: namespaces, veths, bridge, offloads, every HTB/bfifo).
   Target: at most 10 s.
2. Load: 32 replay workers (synthetic gradients of ``replay_bytes``, simulated compute)
   training through one 1 Gbit/s bottleneck, with ``/proc/stat`` sampled while the
   iterations run. Target: the CPU at least 35 % idle, the margin Mininet-HiFi asks
   for before trusting an emulation's timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import emit, log

from topo.build import StarNetwork
from topo.shapes.star import StarSpec
from topo.spec import LinkSpec

REPO = Path(__file__).resolve().parents[1]
WORKERS = 32


def cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies over all CPUs."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    v = [int(x) for x in f]
    return v[3] + v[4], sum(v[:8])


def bringup_s() -> dict[str, float]:
    spec = StarSpec(workers=WORKERS, bottleneck_up=LinkSpec(rate_mbps=1000.0),
                    bottleneck_down=LinkSpec(rate_mbps=1000.0))
    with StarNetwork(spec) as net:
        t1 = time.monotonic()
    return {"bringup_s": net.build_s, "lock_wait_s": net.lock_wait_s,
            "teardown_s": time.monotonic() - t1}


def load_run(iterations: int, replay_bytes: int, compute_ms: float) -> dict[str, object]:
    out = Path(tempfile.mkdtemp(prefix="gradbed-scale-"))
    argv = [sys.executable, "-m", "controller.cli", "run", str(REPO / "configs/digits.toml"),
            "--out", str(out), "--no-progress", "--set", f"net.workers={WORKERS}",
            "--set", "net.bottleneck_mbps=1000", "--set", "workload.name='replay'",
            "--set", f"workload.replay_bytes={replay_bytes}",
            "--set", f"workload.compute_ms={compute_ms}",
            "--set", f"run.iterations={iterations}", "--set", "run.name='scale'"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample() -> None:
        # Sample only while iterations run: from the PS's first iteration to its last.
        ps_log = None
        prev = cpu_times()
        while not stop.wait(0.5):
            cur = cpu_times()
            if ps_log is None:
                found = list(out.glob("scale-*/events/ps.jsonl"))
                ps_log = found[0] if found else None
            busy_iter = ps_log is not None and '"ps_iter_done"' in ps_log.read_text()
            done = ps_log is not None and '"ps_done"' in ps_log.read_text()
            if busy_iter and not done:
                d_idle, d_tot = cur[0] - prev[0], cur[1] - prev[1]
                if d_tot > 0:
                    samples.append((time.monotonic(), d_idle / d_tot))
            prev = cur

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    stdout, stderr = proc.communicate()
    stop.set()
    t.join()
    if proc.returncode != 0:
        log(stderr[-3000:])
        raise SystemExit(f"scale run failed ({proc.returncode})")
    run_dir = Path(stdout.strip().splitlines()[-1])
    idle = [s for _, s in samples]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"run_dir": str(run_dir), "idle_fraction_mean": sum(idle) / max(1, len(idle)),
            "idle_fraction_min": min(idle) if idle else None, "samples": len(idle),
            "summary": summary}


def main() -> None:
    log(f"bring-up of a {WORKERS}-worker star")
    b = bringup_s()
    log(f"  up in {b['bringup_s']:.2f} s, down in {b['teardown_s']:.2f} s")
    log(f"{WORKERS} replay workers, 1 MB gradients, 500 ms compute, 1 Gbit/s")
    r = load_run(iterations=12, replay_bytes=1_000_000, compute_ms=500)
    idle = float(r["idle_fraction_mean"])  # type: ignore[arg-type]
    log(f"  CPU idle {r['idle_fraction_mean']:.3f} (min {r['idle_fraction_min']})")
    emit("scale", round(idle, 4),
         "CPU idle fraction with 32 replay workers running", ">= 0.35 idle; bring-up <= 10 s",
         {"workers": WORKERS, **b, "load": r,
          "bringup_ok": b["bringup_s"] <= 10.0})


if __name__ == "__main__":
    main()
