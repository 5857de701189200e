"""Command-line entry points of the analysis package: ``gradbed report``, ``gradbed trace``
and ``gradbed plan``.

The ``gradbed`` console script (controller.cli) dispatches these sub-commands here. Each
``*_main`` takes the arguments after the sub-command and returns the exit status.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from analysis.load import RunLoadError
from analysis.planner import Layout, Links, ModelShape, format_plan, plan


def report_main(argv: Sequence[str] | None = None) -> int:
    """``gradbed report RUN... [--out DIR]``: write DIR/index.html (default: RUN/report for
    one run, the first run's parent directory/report for several) and print its path."""
    ap = argparse.ArgumentParser(prog="gradbed report",
                                 description="Write a self-contained HTML report of runs.")
    ap.add_argument("runs", nargs="+", type=Path, help="run directories")
    ap.add_argument("--out", type=Path, default=None, help="output directory")
    args = ap.parse_args(argv)
    # Imported here so `gradbed plan` does not pay for matplotlib.
    from analysis.report import write_report

    out = args.out
    if out is None:
        out = args.runs[0] / "report" if len(args.runs) == 1 else args.runs[0].parent / "report"
    try:
        path = write_report(args.runs, out)
    except RunLoadError as e:
        print(f"gradbed report: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def trace_main(argv: Sequence[str] | None = None) -> int:
    """``gradbed trace RUN [--rebuild]``: print where the run's ``trace.json`` is and how to
    open it, writing it first when it is missing (a run from before it was written) or
    ``--rebuild`` is given."""
    ap = argparse.ArgumentParser(prog="gradbed trace",
                                 description="Where a run's Chrome-trace timelines are, and "
                                             "how to open them.")
    ap.add_argument("run", type=Path, help="run directory")
    ap.add_argument("--rebuild", action="store_true", help="write trace.json again")
    args = ap.parse_args(argv)
    from analysis.trace import TRACE_FILE, write_trace

    run: Path = args.run
    if not (run / "meta.json").is_file() and not (run / "events").is_dir():
        print(f"gradbed trace: {run}: not a run directory (no meta.json or events/)",
              file=sys.stderr)
        return 2
    path = run / TRACE_FILE
    try:
        if args.rebuild or not path.exists():
            path = write_trace(run)
            print(f"wrote {path}", file=sys.stderr)
    except (RunLoadError, OSError) as e:
        print(f"gradbed trace: {e}", file=sys.stderr)
        return 2
    print(path.resolve())
    print("open it in https://ui.perfetto.dev (Open trace file; the file stays on this "
          "machine) or chrome://tracing (Load); w/s zoom, a/d pan", file=sys.stderr)
    return 0


def plan_main(argv: Sequence[str] | None = None) -> int:
    """``gradbed plan --layers L --hidden H --seq S --global-batch B --micro-batch b --t T
    --p P --d D [--vocab V] [--link-gbps G | --link-gbps TP PP DP] [--gpu-tflops F]
    [--bytes-per-element 2] [--recompute] [--json]``."""
    ap = argparse.ArgumentParser(prog="gradbed plan",
                                 description="Predict per-step communication, pipeline bubble "
                                             "and compute/communication for a 3D layout.")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--global-batch", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--t", type=int, required=True, help="tensor-parallel size")
    ap.add_argument("--p", type=int, required=True, help="pipeline stages")
    ap.add_argument("--d", type=int, required=True, help="data-parallel replicas")
    ap.add_argument("--link-gbps", type=float, nargs="+", default=None,
                    help="per-GPU Gbit/s: one value for every link type, or three (TP PP DP)")
    ap.add_argument("--gpu-tflops", type=float, default=Links.gpu_tflops)
    ap.add_argument("--bytes-per-element", type=int, default=2)
    ap.add_argument("--recompute", action="store_true",
                    help="count the activation-recomputation forward in the FLOPs")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    gbps = args.link_gbps
    if gbps is None:
        gbps = [Links.tp_gbps, Links.pp_gbps, Links.dp_gbps]
    elif len(gbps) == 1:
        gbps = gbps * 3
    elif len(gbps) != 3:
        ap.error(f"--link-gbps takes 1 or 3 values (TP PP DP), got {len(gbps)}")
    try:
        pl = plan(ModelShape(args.layers, args.hidden, args.seq, args.vocab),
                  Layout(args.t, args.p, args.d, args.global_batch, args.micro_batch),
                  Links(gbps[0], gbps[1], gbps[2], args.gpu_tflops),
                  bytes_per_element=args.bytes_per_element, recompute=args.recompute)
    except ValueError as e:
        print(f"gradbed plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(pl.to_dict(), indent=2, default=float))
    else:
        print(format_plan(pl))
    return 0


if __name__ == "__main__":
    sub = sys.argv[1] if len(sys.argv) > 1 else ""
    mains = {"report": report_main, "trace": trace_main, "plan": plan_main}
    if sub not in mains:
        print("usage: python -m analysis.cli {report,trace,plan} ...", file=sys.stderr)
        sys.exit(2)
    sys.exit(mains[sub](sys.argv[2:]))
