"""The demo's dense run as a topology script: 4 workers train an MLP on the digits through
a star whose switch->PS link is a bottleneck, here 100 Mbit/s (configs/demo.toml with
seeds/004's rate; the demo itself uses 30).

    sudo python examples/star_demo.py [--iterations N] [--out DIR]

Prints the network's shaping points, runs, and prints the summary's headline numbers and
the run directory (its last line).
"""

from __future__ import annotations

from _common import ROOT, parse_args

import gradbed


def main() -> None:
    args = parse_args(__doc__ or "", iterations=80)
    cfg = gradbed.load_config(ROOT / "configs" / "demo.toml",
                              [f"run.iterations={args.iterations}",
                               "net.bottleneck_mbps=100", "net.bottleneck_down_mbps=0"])
    spec = gradbed.shape_spec(cfg)  # the star, as data: hosts, roles, shaping points
    for place in spec.places():
        print(f"{place.point.name:>8}: {place.dev} ({place.host or 'switch'}), "
              f"{place.point.link.rate_mbps:g} Mbit/s")
    run_dir = gradbed.run(cfg, spec, out=args.out, quiet=args.quiet,
                          report=not args.no_report)
    s = gradbed.summary(run_dir)
    print(f"{s['iterations']} iterations, p50 {s['iter_time_s_p50']:.3f} s, "
          f"accuracy {s['final_accuracy']:.3f}, bottleneck utilisation "
          f"{s['bottleneck_utilization']:.3f} ({s['stop_reason']})")
    print(run_dir)


if __name__ == "__main__":
    main()
