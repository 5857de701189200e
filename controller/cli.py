"""The ``gradbed`` command line.

    gradbed run CONFIG.toml [--set dotted.key=value ...] [--out DIR]
    gradbed sweep CONFIG.toml --grid key=v1,v2 [--grid ...] [--out DIR]
    gradbed probe            kernel capabilities as JSON
    gradbed cleanup          remove what a crashed run left behind (idempotent)
    gradbed report RUN...    self-contained HTML report
    gradbed plan ...         3D-parallel planner (DESIGN 1.5)

Human strings are parsed here and nowhere else.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise SystemExit(f"gradbed {what}: needs root (Mininet creates namespaces and "
                         f"qdiscs); run it with sudo")


def run_main(argv: Sequence[str]) -> int:
    from agents.core import config as cfgmod

    ap = argparse.ArgumentParser(prog="gradbed run", description="Run one experiment.")
    ap.add_argument("config", type=Path)
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a config field, e.g. net.workers=8")
    ap.add_argument("--out", type=Path, default=Path("runs"), help="parent of the run dir")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the tc commands and agent command lines; change nothing")
    args = ap.parse_args(argv)
    try:
        cfg = cfgmod.load(args.config, args.overrides)
    except cfgmod.ConfigError as e:
        print(f"gradbed run: config error: {e}", file=sys.stderr)
        return 2
    from topo.spec import RATE_MAX_MBPS
    from traces.bandwidth import TraceError, load_trace
    from traces.flowsize import load_flow_cdf
    from traces.pcap import pcap_summary

    # A bad trace or flow-size file is named (file:line) before any network is built.
    def trace(path: str) -> object:
        return load_trace(path, granularity_s=cfg.trace.granularity_ms / 1000.0,
                          max_rate_mbps=RATE_MAX_MBPS)

    def flow_cdf(path: str) -> object:
        # Says what it loaded and the distribution's mean, before anything is built.
        bg = cfg.background
        return load_flow_cdf(path, format=bg.flow_cdf_format,
                             interpolation=bg.flow_cdf_interpolation,
                             packet_bytes=bg.flow_cdf_packet_bytes,
                             log=lambda m: print(f"background.flow_cdf: {m}", file=sys.stderr))

    files = [("trace.up", cfg.trace.up, trace), ("trace.down", cfg.trace.down, trace),
             ("background.flow_cdf", cfg.background.flow_cdf if cfg.background.kind == "flows"
              else "", flow_cdf),
             ("background.pcap", cfg.background.pcap, pcap_summary)]
    for field, path, loader in files:
        try:
            if path:
                loader(path)
        except TraceError as e:
            print(f"gradbed run: {args.config}: {field}: {e}", file=sys.stderr)
            return 2
    if args.dry_run:
        from controller.run import plan_commands
        from topo.probe import probe
        from topo.qdisc import CapabilityError

        try:
            print("\n".join(plan_commands(cfg, probe())))
        except CapabilityError as e:
            print(f"gradbed run: {e}", file=sys.stderr)
            return 2
        return 0
    _need_root("run")
    from controller.run import Experiment

    exp = Experiment(cfg, out_root=args.out, argv=["gradbed", "run", *argv],
                     progress=not args.no_progress)
    try:
        run_dir = exp.run()
    except Exception as e:
        if exp.run_dir is not None:
            print(f"gradbed run: failed: {e}", file=sys.stderr)
            print(exp.run_dir)
        raise
    summary = run_dir / "summary.json"
    if summary.exists():
        print(summary.read_text().strip(), file=sys.stderr)
    print(run_dir)
    return 130 if _interrupted(run_dir) else 0


def _interrupted(run_dir: Path) -> bool:
    import json

    try:
        return bool(json.loads((run_dir / "summary.json").read_text()).get("interrupted"))
    except (OSError, ValueError):
        return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {
        "run": run_main,
        "sweep": lambda a: _lazy("controller.sweep", "sweep_main")(a),
        "probe": lambda a: _lazy("topo.cli", "probe_main")(a),
        "cleanup": lambda a: _lazy("topo.cli", "cleanup_main")(a),
        "report": lambda a: _lazy("analysis.cli", "report_main")(a),
        "plan": lambda a: _lazy("analysis.cli", "plan_main")(a),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(__doc__.strip().split("\n\n")[1] if argv[:1] != ["-h"] else __doc__)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ngradbed: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    return int(commands[argv[0]](argv[1:]) or 0)


def _lazy(module: str, func: str):  # type: ignore[no-untyped-def]
    import importlib

    return getattr(importlib.import_module(module), func)


if __name__ == "__main__":
    sys.exit(main())
