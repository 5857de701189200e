"""Old against new: benchmarks run on two revisions, alternated, in one sitting.

Each revision is checked out as a detached worktree under a temporary folder (removed at the
end, on Ctrl-C and on SIGTERM too), and each tree runs its OWN benchmark script with the
tree as the working directory and alone on ``PYTHONPATH``, so every process (the benchmark,
the controller and the agents it spawns) imports that tree's code. Runs go old, new, new,
old, old, new (ABBAAB for three rounds): a drift of the machine's load over the sitting
then weighs on both sides alike. Each run's last JSON line (``_common.emit``) gives its
headline; the 1-minute load average is read before and after every run, since on a shared
machine the load is part of the figure.

For each benchmark the ratio is taken of the medians over rounds, oriented so that a ratio
of at least 1 reads "new is as good as old": new/old where higher is better, old/new where
lower is better (:func:`ratio`). Headline: the lowest ratio over the benchmarks; each
passes at ``--min-ratio`` (0.97, issue 31's acceptance).

    python benchmarks/old_vs_new.py --old 8469ee5^ --rounds 3          # the six, quick
    python benchmarks/old_vs_new.py --old 8469ee5^ --bench "pipeline --quick --parts bubble"

``--bench "NAME ARGS..."`` (repeatable) names a benchmark of :data:`BENCHES` and the
arguments passed to it; both trees must accept them. Without ``--bench`` the six of the
acceptance run with their quickest settings (:data:`ACCEPTANCE`). ``moe_dispatch_100`` is
the moe benchmark's headline run alone; ``moe_first_entry_100`` reads the same run over one
window on both trees (:func:`first_entry_efficiency`). The Mininet benchmarks need root,
and take the machine-wide network lock themselves. ``--save DIR`` keeps each run's stdout
and stderr. The result is one JSON line (``_common.emit``); docs/performance.md holds the
sittings measured with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from _common import REPO, emit, log, run_child

Side = Literal["old", "new"]

# The moe benchmark has no quick flag: its dispatch part runs 10, 100 and 1000 Mbit/s and
# then the offload parts. The headline is the 100 Mbit/s run's alone, so this runs the
# tree's own part_dispatch at that rate only (12 steps, as in the full benchmark).
MOE_DISPATCH_100 = """\
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, "benchmarks")
import moe
moe.RATES_MBPS = (100.0,)
moe.PLOTS.mkdir(parents=True, exist_ok=True)
with tempfile.TemporaryDirectory(prefix="gradbed-moe-") as tmp:
    d = moe.part_dispatch(Path(tmp))["100"]
print(json.dumps({"name": "moe", "headline": d["efficiency_median"],
                  "details": {k: v for k, v in d.items() if not isinstance(v, list)}},
                 default=float))
"""

# The same run, read over one window on both trees (first_entry_efficiency): the run's
# dispatch phases and its own table go out, and the headline is taken here.
MOE_FIRST_ENTRY_100 = """\
import json, statistics, sys, tempfile
from pathlib import Path
sys.path.insert(0, "benchmarks")
import moe
from analysis import moe as amoe
with tempfile.TemporaryDirectory(prefix="gradbed-moe-") as tmp:
    rows = amoe.load_events(moe.run_fabric(100.0, Path(tmp)))
own = [d for d in amoe.dispatch_table(rows, 100.0) if d["iter"] >= 1]
phases = [{k: r[k] for k in ("iter", "layer", "node", "phase", "start_ns", "end_ns")}
          for r in rows if r.get("event") == "moe_phase"
          and r["phase"] in ("dispatch_counts", "dispatch_tokens")]
print(json.dumps({"name": "moe", "headline": statistics.median(d["efficiency"] for d in own),
                  "details": {"phases": phases, "dispatch": [
                      {k: d[k] for k in ("iter", "layer", "payload_bytes", "efficiency")}
                      for d in own]}}, default=int))
"""


def first_entry_efficiency(details: dict[str, Any], rate_mbps: float = 100.0) -> float:
    """The MoE dispatch's efficiency over one window on both trees: from the first host
    entering a (step, layer)'s dispatch to the last host leaving it, the median over the
    benchmark's own dispatches (steps after the first). The benchmark's own window starts
    at the last host entering where the counts go in a round of their own (before
    80420b3) and at the first where they ride with the tokens, so its headline counts the
    hosts' arrival spread on one side only."""
    from agents.core.moe_metrics import dispatch_efficiency

    window: dict[tuple[int, int], tuple[int, int]] = {}
    for p in details["phases"]:
        key = (int(p["iter"]), int(p["layer"]))
        first, last = window.get(key, (int(p["start_ns"]), int(p["end_ns"])))
        window[key] = (min(first, int(p["start_ns"])), max(last, int(p["end_ns"])))
    eff = []
    for d in details["dispatch"]:
        first, last = window[(int(d["iter"]), int(d["layer"]))]
        eff.append(dispatch_efficiency(int(d["payload_bytes"]), (last - first) / 1e9,
                                       rate_mbps))
    if not eff:
        raise ValueError("no dispatch to measure")
    return statistics.median(eff)


@dataclass(frozen=True)
class Bench:
    """One benchmark as this tool runs it: ``benchmarks/{script}.py`` of each tree (or
    ``code``, Python run with ``-c`` in the tree, for a part the script has no flag for),
    whose JSON line's ``headline`` is compared in the direction given."""

    name: str
    script: str
    higher_is_better: bool  # False: a smaller headline is better (an error, a time)
    headline_unit: str
    code: str | None = None
    # The headline taken from the run's details here instead of its own ``headline``.
    headline_of: Callable[[dict[str, Any]], float] | None = None


BENCHES: dict[str, Bench] = {b.name: b for b in (
    Bench("wire_utilization", "wire_utilization", True, "busy fraction of the upload windows"),
    Bench("ps_aggregate", "ps_aggregate", True, "M elements/s, best round"),
    Bench("codec", "codec", True, "GB/s"),
    Bench("pipeline", "pipeline", False, "worst bubble error, points"),
    Bench("moe", "moe", True, "dispatch efficiency median"),
    Bench("moe_dispatch_100", "moe", True, "dispatch efficiency median at 100 Mbit/s",
          MOE_DISPATCH_100),
    Bench("moe_first_entry_100", "moe", True, "dispatch efficiency median at 100 Mbit/s, "
          "first host in to last out", MOE_FIRST_ENTRY_100, first_entry_efficiency),
    Bench("link_fidelity", "link_fidelity", True, "goodput/ceiling, min over rates"),
)}

# Issue 31's six, each with the quickest settings that keep its headline and that both the
# parent of the moves and main accept: wire_utilization with two iterations (the config's
# three less one; the old script has no --no-peers, so the new one runs its peers after the
# measured run), pipeline's bubble part at p = 2, moe at 100 Mbit/s alone.
ACCEPTANCE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("codec", ()),
    ("ps_aggregate", ()),
    ("pipeline", ("--quick", "--parts", "bubble")),
    ("moe_dispatch_100", ()),
    ("link_fidelity", ()),
    ("wire_utilization", ("--set", "run.iterations=2")),
)


def run_order(rounds: int) -> list[Side]:
    """old, new, then new, old, and so on: ABBAAB for three rounds."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    pair: tuple[Side, Side] = ("old", "new")
    return [side for r in range(rounds) for side in (pair if r % 2 == 0 else pair[::-1])]


def parse_result(stdout: str, source: str) -> dict[str, Any]:
    """The last stdout line that is a JSON object with a ``headline``; ``source`` names the
    run in the error."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict) and "headline" in obj:
                return obj
    tail = stdout.strip().splitlines()[-1:] or ["(no output)"]
    raise ValueError(f"{source}: no JSON line with a headline in its output; last line: "
                     f"{tail[0][:200]}")


def headline(result: dict[str, Any], source: str) -> float:
    """The run's headline as a finite number (a NaN headline is a failed run, not a figure)."""
    value = result.get("headline")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{source}: headline {value!r} is not a finite number")
    return float(value)


def ratio(old: float, new: float, higher_is_better: bool) -> float:
    """How good new is against old, >= 1 when new is at least as good: new/old when higher
    is better, old/new when lower is better."""
    num, den = (new, old) if higher_is_better else (old, new)
    if den <= 0:
        raise ValueError(f"cannot take a ratio over {den} (old {old}, new {new})")
    return num / den


def summarize(bench: Bench, old: Sequence[float | None], new: Sequence[float | None],
              min_ratio: float) -> dict[str, Any]:
    """Per benchmark: each side's headlines in round order (None: a failed run), the medians
    of the runs that gave one, the ratio of the medians and whether it passes (a side
    without any headline has no ratio and does not pass)."""
    old_ok, new_ok = [v for v in old if v is not None], [v for v in new if v is not None]
    old_median = statistics.median(old_ok) if old_ok else None
    new_median = statistics.median(new_ok) if new_ok else None
    r = (ratio(old_median, new_median, bench.higher_is_better)
         if old_median is not None and new_median is not None else None)
    return {"unit": bench.headline_unit, "better": "higher" if bench.higher_is_better
            else "lower", "old": list(old), "new": list(new), "old_median": old_median,
            "new_median": new_median, "new_vs_old": None if r is None else round(r, 4),
            "pass": r is not None and r >= min_ratio}


@dataclass(frozen=True)
class Run:
    """One benchmark run on one tree, and the machine's load around it."""

    side: Side
    headline: float | None  # None: the run failed (its error beside it)
    start_utc: str
    wall_s: float
    load_before: float
    load_after: float
    error: str | None = None


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@contextmanager
def worktrees(revs: dict[Side, str]) -> Iterator[dict[Side, Path]]:
    """A detached worktree per revision under a temporary folder, removed on the way out
    (SIGTERM is turned into an exception so that the removal runs then too)."""
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="gradbed-old-vs-new-"))
    trees: dict[Side, Path] = {}
    try:
        for side, rev in revs.items():
            trees[side] = tmp / side
            git("worktree", "add", "--detach", str(trees[side]), rev)
        yield trees
    finally:
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                           capture_output=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "prune"], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        signal.signal(signal.SIGTERM, previous)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def tree_env(tree: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(tree)}


def check_imports(tree: Path) -> None:
    """The tree's own packages are the ones its processes import (not an installed copy)."""
    out = subprocess.run([sys.executable, "-c", "import agents, topo, controller; "
                          "print(agents.__file__, topo.__file__, controller.__file__)"],
                         cwd=tree, env=tree_env(tree), capture_output=True, text=True,
                         check=True).stdout.split()
    stray = [p for p in out if not Path(p).resolve().is_relative_to(tree.resolve())]
    if stray:
        raise RuntimeError(f"{tree}: imports come from outside the tree: {stray}")


def run_bench(tree: Path, side: Side, bench: Bench, args: Sequence[str],
              timeout_s: float, save: Path | None, index: int) -> Run:
    argv = ([sys.executable, "-c", bench.code, *args] if bench.code is not None
            else [sys.executable, str(tree / "benchmarks" / f"{bench.script}.py"), *args])
    source = f"{bench.name} on {side} ({tree})"
    load_before = round(os.getloadavg()[0], 2)
    start = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    t0 = time.monotonic()
    try:
        proc = run_child(argv, cwd=tree, env=tree_env(tree), timeout_s=timeout_s)
    except subprocess.TimeoutExpired as e:  # stopped by run_child; a failed run, as below
        proc = subprocess.CompletedProcess(argv, -1, "", f"past --timeout-s {e.timeout:g} s")
    wall_s = time.monotonic() - t0
    load_after = round(os.getloadavg()[0], 2)
    if save is not None:
        stem = save / f"{bench.name}-{index}-{side}"
        stem.with_suffix(".out").write_text(proc.stdout)
        stem.with_suffix(".err").write_text(proc.stderr)
    # A failed run is recorded and said, and the sitting goes on: one crash must not
    # throw away the other runs' figures.
    try:
        if proc.returncode != 0:
            raise ValueError(f"{source} exited with {proc.returncode}: {proc.stderr[-1500:]}")
        result = parse_result(proc.stdout, source)
        value: float | None = (headline(result, source) if bench.headline_of is None
                               else bench.headline_of(result["details"]))
        error = None
    except (ValueError, KeyError, TypeError) as e:
        value, error = None, f"{source}: {type(e).__name__}: {e}"
        log(f"FAILED: {error}")
    log(f"{bench.name} {side}: {value} ({start} UTC, {wall_s:.0f} s, load "
        f"{load_before:.2f} -> {load_after:.2f})")
    return Run(side, value, start, round(wall_s, 1), load_before, load_after, error)


def parse_bench(spec: str) -> tuple[Bench, tuple[str, ...]]:
    words = shlex.split(spec)
    if not words or words[0] not in BENCHES:
        raise ValueError(f"--bench {spec!r}: the name must be one of {sorted(BENCHES)}")
    return BENCHES[words[0]], tuple(words[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the old revision (e.g. 8469ee5^)")
    ap.add_argument("--new", default="HEAD", help="the new revision (default HEAD)")
    ap.add_argument("--bench", action="append", default=[], metavar='"NAME [ARGS...]"',
                    help=f"a benchmark and its arguments, repeatable; one of {sorted(BENCHES)}"
                    " (default: the six of the acceptance, quick)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (old, new) pairs")
    ap.add_argument("--min-ratio", type=float, default=0.97, help="pass at this new/old")
    ap.add_argument("--timeout-s", type=float, default=1800, help="limit on one run")
    ap.add_argument("--save", type=Path, default=None,
                    help="write each run's stdout and stderr into this folder")
    args = ap.parse_args()
    try:
        benches = ([parse_bench(s) for s in args.bench] if args.bench
                   else [(BENCHES[n], a) for n, a in ACCEPTANCE])
        order = run_order(args.rounds)
    except ValueError as e:
        ap.error(str(e))
    revs: dict[Side, str] = {"old": git("rev-parse", args.old), "new": git("rev-parse", args.new)}
    if args.save is not None:
        args.save.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with worktrees(revs) as trees:
        for tree in trees.values():
            check_imports(tree)
        for bench, bench_args in benches:
            runs = [run_bench(trees[side], side, bench, bench_args, args.timeout_s, args.save, i)
                    for i, side in enumerate(order)]
            summary = summarize(bench, [r.headline for r in runs if r.side == "old"],
                                [r.headline for r in runs if r.side == "new"], args.min_ratio)
            results[bench.name] = {**summary, "args": list(bench_args),
                                   "runs": [r.__dict__ for r in runs]}
            log(f"{bench.name}: new/old {summary['new_vs_old']} "
                f"({'pass' if summary['pass'] else 'MISS'})")
    ratios = [r["new_vs_old"] for r in results.values()]
    worst = min(ratios) if None not in ratios else float("nan")
    loads = [x for r in results.values() for run in r["runs"]
             for x in (run["load_before"], run["load_after"])]
    emit("old_vs_new", worst, "new/old of each benchmark's median headline (lowest)",
         f">= {args.min_ratio} each", {
             "old": revs["old"], "new": revs["new"], "order": order,
             "load_1min_min": min(loads), "load_1min_max": max(loads),
             "all_pass": all(r["pass"] for r in results.values()), "benchmarks": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
