"""Agent overhead on the wire (DESIGN.md section 5): while dense ResNet-50-sized
gradients from 4 workers cross a 100 Mbit/s bottleneck, how busy is the link?

Runs ``configs/wire_utilization.toml`` for real (``gradbed run``: Mininet, real TCP,
the real PS and workers) and measures, per iteration, the bytes the bottleneck's HTB
class delivered during the upload window (first gradient frame to the PS holding every
gradient) against what its rate allows (``analysis.metrics.upload_window_utilization``).
Side by side: the same window measured in TCP payload bytes (what the agents wrote)
against the TCP payload ceiling (rate x 1448/1514). Target: link busy >= 95 %.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
from _common import emit, log

from analysis.load import load_events
from analysis.metrics import upload_window_utilization, upload_windows
from topo.spec import TCP_GOODPUT_FRACTION

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="gradbed-wire-"))
    log("running configs/wire_utilization.toml (4 workers x 102 MB, 100 Mbit/s; ~2 min)")
    proc = subprocess.run([sys.executable, "-m", "controller.cli", "run",
                           str(REPO / "configs/wire_utilization.toml"), "--out", str(out),
                           "--no-progress", *sys.argv[1:]], cwd=REPO, capture_output=True,
                          text=True)
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
    overall = upload_window_utilization(links, windows)
    summary = json.loads((run_dir / "summary.json").read_text())
    emit("wire_utilization", round(overall, 4), "fraction of upload-window time the up "
         "bottleneck is busy (delivered wire bytes / rate x window)", ">= 0.95",
         {"run_dir": str(run_dir), "rate_mbps": rate_mbps, "workers": summary["workers"],
          "gradient_bytes_per_worker": 25_557_032 * 4, "per_iteration": per_iter,
          "payload_util_mean": sum(p["payload_util"] for p in per_iter) / max(1, len(per_iter)),
          "tcp_payload_ceiling": TCP_GOODPUT_FRACTION, "summary": summary})


if __name__ == "__main__":
    main()
