"""Heterogeneous workers: one worker behind a cellular uplink, the others at 100 Mbit/s.

Every worker of the digits demo's star gets a 100 Mbit/s access link and the PS's link is made
wide (1 Gbit/s), so each worker's own link is what limits it; then worker w0's uplink
(the shaping point ``w0.up``, the egress of ``w0-eth0``) replays the cellular-like trace
``traces/data/cellular_like.trace`` (1-22 Mbit/s), stepped every 100 ms with
``tc class change``. The synchronous PS waits for the slowest upload, so w0 sets the pace;
the per-worker send times show by how much.

    sudo python examples/heterogeneous_workers.py [--iterations N] [--out DIR]
"""

from __future__ import annotations

import pandas as pd
from _common import ROOT, parse_args

import gradbed


def main() -> None:
    args = parse_args(__doc__ or "", iterations=30)
    cfg = gradbed.load_config(ROOT / "configs" / "digits.toml", [
        f"run.iterations={args.iterations}",
        "net.worker_link_mbps=100",
        "net.bottleneck_mbps=1000",
    ])
    spec = gradbed.shape_spec(cfg).with_traces(
        {"w0.up": str(ROOT / "traces" / "data" / "cellular_like.trace")})
    run_dir = gradbed.run(cfg, spec, out=args.out, quiet=args.quiet,
                          report=not args.no_report)
    events = pd.concat([pd.read_parquet(p) for p in (run_dir / "events").glob("*.parquet")],
                       ignore_index=True, sort=False)
    sends = events[events["event"] == "send_done"].groupby("node")["send_s"].median()
    for node, send_s in sends.items():
        print(f"{node}: median upload {send_s:.3f} s")
    steps = events[(events["event"] == "trace_step") & (events["direction"] == "w0.up")]
    print(f"w0.up: {len(steps)} trace steps, {steps['rate_mbps'].min():.1f}-"
          f"{steps['rate_mbps'].max():.1f} Mbit/s")
    print(run_dir)


if __name__ == "__main__":
    main()
