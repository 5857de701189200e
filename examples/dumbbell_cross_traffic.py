"""Training beside cross traffic on a dumbbell: the demo's 4 workers on one switch, the
PS on the other, and a background host sending two greedy iperf3 TCP flows to its sink
across the same trunk, the only link the two traffics share (Mininet-HiFi's and
Pantheon's dumbbell).

    sudo python examples/dumbbell_cross_traffic.py [--iterations N] [--out DIR]

Prints the trunk, runs, and prints what the training and the background flows got.
"""

from __future__ import annotations

import json

from _common import ROOT, parse_args

import gradbed


def main() -> None:
    args = parse_args(__doc__ or "", iterations=40)
    cfg = gradbed.load_config(ROOT / "configs" / "demo.toml", [
        f"run.iterations={args.iterations}",
        "net.bottleneck_mbps=100",        # a 100 Mbit/s trunk both ways
        "net.bottleneck_down_mbps=0",
        'topo.shape="dumbbell"',          # workers | trunk | PS
        "net.background_hosts=1",         # bg0 beside the workers, sink0 beside the PS
        "background.flows=2",             # two iperf3 flows, bg0 -> sink0, over the trunk
    ])
    spec = gradbed.shape_spec(cfg)
    trunk = spec.place("up")
    print(f"trunk: {trunk.dev} -> {spec.place('down').dev}, "
          f"{trunk.point.link.rate_mbps:g} Mbit/s, queue {trunk.point.link.queue_bytes} B")
    run_dir = gradbed.run(cfg, spec, out=args.out, quiet=args.quiet,
                          report=not args.no_report)
    s = gradbed.summary(run_dir)
    print(f"training: {s['iterations']} iterations, p50 {s['iter_time_s_p50']:.3f} s, "
          f"trunk utilisation {s['bottleneck_utilization']:.3f}")
    for path in sorted((run_dir / "background").glob("*.json")):
        end = json.loads(path.read_text()).get("end", {}).get("sum_sent", {})
        print(f"background {path.stem}: {end.get('bytes', 0) / 1e6:.1f} MB at "
              f"{end.get('bits_per_second', 0) / 1e6:.1f} Mbit/s")
    print(run_dir)


if __name__ == "__main__":
    main()
