"""Agent overhead on the wire (DESIGN.md section 5): while dense ResNet-50-sized
gradients from 4 workers cross a 100 Mbit/s bottleneck, how busy is the link?

Runs ``configs/wire_utilization.toml`` for real (``gradbed run``: Mininet, real TCP,
the real PS and workers) and measures, per iteration, the bytes the bottleneck's HTB
class delivered during the upload window (first gradient frame to the PS holding every
gradient) against what its rate allows (``analysis.metrics.upload_window_utilization``).
Side by side: the same window measured in TCP payload bytes (what the agents wrote)
against the TCP payload ceiling (rate x 1448/1514). Target: link busy >= 95 %, over the
windows after the run's ``run.warmup_iterations`` (0 in the config: every window; the
value over every window is in ``busy_all_windows``).

Beside it, in the same benchmark and on links shaped the same way (docs/linerate.md):
iperf3 with one flow per worker through the same star (the same formula over the same
bottleneck's samples), and gloo's ring all-reduce among 4 hosts (``gradbed torchrun``,
each access link at the bottleneck's rate); the headline's ratio to each is reported, so
a miss the machine's load causes shows in the peers too. CPU per process (``/proc``),
the kernel's share, system calls and page faults per process (``perf stat``) and the
load average come with every figure. ``--no-peers`` skips the peers. Any other argument
is a ``--set`` override of the run (``--set net.bottleneck_mbps=1000``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from _common import emit, log
from _linerate import ProcSampler, gloo_peer, iperf3_peer

from analysis.load import load_events
from analysis.metrics import upload_window_utilization, upload_windows
from topo.spec import TCP_GOODPUT_FRACTION

REPO = Path(__file__).resolve().parents[1]


CONFIG = REPO / "configs/wire_utilization.toml"


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--no-peers"]
    peers = "--no-peers" not in sys.argv[1:]
    overrides = [a for a in args if a != "--set"]
    out = Path(tempfile.mkdtemp(prefix="gradbed-wire-"))
    log(f"running {CONFIG.name} (4 workers x 102 MB) {' '.join(overrides)}")
    procs = ProcSampler(str(out))
    procs.start()
    proc = subprocess.run([sys.executable, "-m", "controller.cli", "run",
                           str(CONFIG), "--out", str(out),
                           "--no-progress", *args], cwd=REPO, capture_output=True,
                          text=True)
    cpu = procs.result()
    if proc.returncode != 0:
        log(proc.stderr[-3000:])
        raise SystemExit(f"run failed with status {proc.returncode}")
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    events = load_events(run_dir)
    links = pd.read_parquet(run_dir / "links.parquet")
    windows = upload_windows(events)
    rate_mbps = float(links[links["direction"] == "up"]["rate_mbps"].iloc[0])
    per_iter = []
    for w in windows:
        it, s, e = w
        util = upload_window_utilization(links, [w])
        up_bytes = float(events[(events["event"] == "send_done") & (events["iter"] == it)]
                         ["bytes"].sum())
        payload_util = up_bytes / (rate_mbps * 1e6 / 8 * (e - s) / 1e9)
        per_iter.append({"iter": it, "window_s": (e - s) / 1e9, "link_busy": util,
                         "payload_bytes": up_bytes, "payload_util": payload_util,
                         "payload_vs_tcp_ceiling": payload_util / TCP_GOODPUT_FRACTION})
        log(f"iter {it}: window {(e - s) / 1e9:.2f} s, link busy {util:.4f}, "
            f"payload {payload_util:.4f} of rate "
            f"({payload_util / TCP_GOODPUT_FRACTION:.4f} of TCP ceiling)")
    summary = json.loads((run_dir / "summary.json").read_text())
    # The headline leaves out the first run.warmup_iterations windows, as the summary's
    # utilisation does (TCP's slow start, first-touch pages); every window is beside it.
    warmup = int(summary.get("warmup_iterations", 0))
    overall_all = upload_window_utilization(links, windows)
    overall = upload_window_utilization(links, [w for w in windows if w[0] >= warmup])
    # Chunk messages each process handled over the whole run (up and down): a worker sends
    # and receives its own, the PS every worker's.
    per_worker = 2 * int(summary["iterations"]) * -(-25_557_032 * 4 // 4_000_000)

    def chunks(label: str) -> int:
        return per_worker * (int(summary["workers"]) if "dp.ps" in label else 1)
    peer: dict[str, object] = {}
    if peers:
        ip = iperf3_peer(CONFIG, overrides)
        gl = gloo_peer(rate_mbps, out)
        peer = {"iperf3": ip, "gloo_allreduce": gl,
                "gradbed_over_iperf3": overall / ip["busy"],
                "gradbed_over_gloo": overall / gl["efficiency"]}
        log(f"gradbed {overall:.4f}, iperf3 {ip['busy']:.4f}, gloo ring "
            f"{gl['efficiency']:.4f}: gradbed/iperf3 {peer['gradbed_over_iperf3']:.3f}, "
            f"gradbed/gloo {peer['gradbed_over_gloo']:.3f}")
    emit("wire_utilization", round(overall, 4), "fraction of upload-window time the up "
         "bottleneck is busy (delivered wire bytes / rate x window)", ">= 0.95",
         {"run_dir": str(run_dir), "rate_mbps": rate_mbps, "workers": summary["workers"],
          "warmup_iterations": warmup, "busy_all_windows": overall_all,
          "gradient_bytes_per_worker": 25_557_032 * 4, "per_iteration": per_iter,
          "payload_util_mean": sum(p["payload_util"] for p in per_iter) / max(1, len(per_iter)),
          "tcp_payload_ceiling": TCP_GOODPUT_FRACTION, "summary": summary,
          "agent_limited": summary.get("agent_limited"), "cpu": cpu,
          "syscalls_per_chunk_message": {
              k: round(v.get("raw_syscalls:sys_enter", 0) / max(1, chunks(k)), 1)
              for k, v in cpu.get("perf_counts", {}).items()},
          "peers": peer})


if __name__ == "__main__":
    main()
