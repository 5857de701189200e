"""``gradbed sweep``: run every combination of a parameter grid and tabulate the results.

For the GRACE-style comparison (Xu et al., "GRACE: A Compressed Communication
Framework for Distributed Machine Learning", ICDCS 2021: which compressor wins depends on
the bandwidth and the model). One sweep is::

    gradbed sweep CONFIG.toml --grid compress.name=none,topk,dgc,qsgd,powersgd \\
        --grid net.bottleneck_mbps=10,100,1000 [--set k=v ...] [--out DIR] [--repeat R]

**Sweep file format.** ``CONFIG.toml`` is an ordinary experiment config plus an optional
``[sweep]`` table, which is *not* part of :class:`agents.core.config.ExperimentConfig`; it is
read here and stripped before the config is validated::

    [sweep]
    name = "compress-bw"            # sweep directory prefix (default: run.name)
    repeat = 1                      # runs per combination; repeat r uses run.seed + r
    [sweep.grid]                    # dotted keys must be quoted in TOML
    "compress.name" = ["none", "topk"]
    "net.bottleneck_mbps" = [10, 100]

``--grid KEY=V1,V2`` on the command line adds a key or replaces the file's list for it
(values are split on commas and read as TOML literals, else bare strings, as ``--set``
does); ``--repeat`` replaces ``repeat``. The grid is the cartesian product of the lists, in
the order the keys were given (the last key varies fastest).

**What it does.** The pure part (:func:`parse_sweep`, :func:`expand`, :func:`validate`)
expands the grid and validates *every* combination before anything runs, so a config error
names the field and the combination up front. Then each combination runs sequentially as
its own ``gradbed run --no-report`` subprocess (a crash in one run cannot take the sweep down), all
under ``OUT/sweep-NAME-STAMP/``: the stripped base config (``base.toml``), one run
directory per combination, each run's console output in ``logs/``, and after every run,
atomically, ``sweep.csv`` and ``sweep.md`` (one row per run: the varied keys, bytes per
iteration, mean iteration time, accuracy at the fixed iteration count, time to the target
accuracy). A failed run is a row with its error; the sweep goes on. Ctrl-C (or SIGTERM)
stops the run in progress cleanly, keeps the table of what finished, and ends the sweep. At
the end ``report/index.html`` covers all the runs (:func:`analysis.report.write_report`; not with ``--no-report``),
and the sweep prints (and writes to ``comparison.txt``) its runs side by side, with one
verdict line per compressed run when the grid compares compressors with ``none``
(:func:`comparison`, :mod:`controller.verdict`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from agents.core import config as cfgmod
from controller.agent_env import python_path
from controller.exit_status import FAILED, SIGNAL_BASE, TIMED_OUT
from controller.paths import (
    PATH_FIELDS,
    OutDirError,
    check_out_dir,
    resolve_config_file,
    resolve_path,
)
from controller.rundir import REPO_ROOT, hand_over, write_atomic
from controller.signals import StopSignals
from controller.verdict import human_bytes, side_by_side, verdict

#: Seconds a run may take beyond its own ``run.timeout_s`` (Mininet build and teardown,
#: report) before the sweep kills it and records a timeout.
RUN_GRACE_S = 180.0


@dataclass(frozen=True)
class SweepSpec:
    """A sweep, as pure data: the base config and the grid over it."""

    name: str                                   # sweep directory prefix
    base: dict[str, Any]                        # the experiment config, [sweep] stripped
    grid: tuple[tuple[str, tuple[Any, ...]], ...]  # (dotted key, values), in order
    repeat: int = 1                             # runs per combination (seed + r)
    sets: tuple[str, ...] = ()                  # --set overrides applied to every run
    source: str = "<sweep>"                     # file name, for error messages


@dataclass(frozen=True)
class Combination:
    """One point of the grid (and one repeat of it)."""

    index: int                                  # 0-based position in the sweep
    values: tuple[tuple[str, Any], ...]         # (dotted key, value) of the grid keys
    repeat: int = 0                             # which repeat; adds to run.seed

    @property
    def label(self) -> str:
        s = " ".join(f"{k}={_fmt_value(v)}" for k, v in self.values)
        return f"{s} repeat={self.repeat}" if self.repeat else s

    def overrides(self, base_seed: int) -> list[str]:
        """``--set`` strings for this combination (seed shifted for repeats > 0)."""
        out = [f"{k}={toml_literal(v)}" for k, v in self.values]
        if self.repeat:
            out.append(f"run.seed={base_seed + self.repeat}")
        return out


@dataclass
class RunResult:
    """What one combination produced (a table row). Mutable: filled in as the run ends."""

    combo: Combination
    status: str = "pending"                     # ok, failed, interrupted, timeout
    exit_status: int | None = None              # gradbed run's (controller.exit_status)
    run_dir: Path | None = None
    error: str = ""
    wall_s: float = math.nan
    summary: dict[str, Any] = field(default_factory=dict)


# -- pure part: parse, expand, validate ---------------------------------------------------


def toml_literal(value: Any) -> str:
    """A value as the TOML literal ``--set`` reads back to the same value."""
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _fmt_value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def parse_grid_arg(text: str) -> tuple[str, tuple[Any, ...]]:
    """``compress.name=none,topk`` -> ("compress.name", ("none", "topk"))."""
    if "=" not in text:
        raise cfgmod.ConfigError(f"--grid {text!r}: expected dotted.key=v1,v2,...")
    key, raw = text.split("=", 1)
    key = key.strip()
    parts = key.split(".")
    if len(parts) < 2 or not all(parts):
        raise cfgmod.ConfigError(f"--grid {text!r}: key must be section.field "
                                 f"(e.g. net.bottleneck_mbps)")
    values = [cfgmod.parse_override(f"{key}={v.strip()}")[1] for v in raw.split(",")]
    if not raw.strip() or any(v == "" for v in values):
        raise cfgmod.ConfigError(f"--grid {text!r}: empty value in the list")
    return key, tuple(values)


def parse_sweep(data: dict[str, Any], grid_args: Sequence[str] = (), sets: Sequence[str] = (),
                repeat: int | None = None, source: str = "<sweep>") -> SweepSpec:
    """Split a raw TOML table into the base config and the ``[sweep]`` table, and merge
    the command line's ``--grid``/``--repeat`` into it. Raises ConfigError naming the key."""
    base = {k: v for k, v in data.items() if k != "sweep"}
    table = data.get("sweep", {})
    if not isinstance(table, dict):
        raise cfgmod.ConfigError(f"{source}: sweep = {table!r}: must be a table [sweep]")
    known = {"name", "repeat", "grid"}
    for k in table:
        if k not in known:
            raise cfgmod.ConfigError(f"{source}: sweep.{k}: unknown field; known fields: "
                                     f"{', '.join(sorted(known))}")
    grid: dict[str, tuple[Any, ...]] = {}
    file_grid = table.get("grid", {})
    if not isinstance(file_grid, dict):
        raise cfgmod.ConfigError(f"{source}: sweep.grid = {file_grid!r}: must be a table of "
                                 f'"section.field" = [values]')
    # Both ``"net.bottleneck_mbps" = [...]`` and ``[sweep.grid.net]`` sub-tables.
    for key, values in cfgmod.flatten(file_grid).items():
        if not isinstance(values, tuple) or not values:
            raise cfgmod.ConfigError(f"{source}: sweep.grid.\"{key}\" = {values!r}: must be a "
                                     f"non-empty list of values")
        if len(key.split(".")) < 2:
            raise cfgmod.ConfigError(f"{source}: sweep.grid.\"{key}\": key must be "
                                     f"section.field")
        grid[key] = tuple(values)
    for text in grid_args:
        key, values = parse_grid_arg(text)
        grid[key] = values
    if not grid:
        raise cfgmod.ConfigError(f"{source}: empty grid: give --grid KEY=V1,V2 or a "
                                 f"[sweep.grid] table")
    for key, values in grid.items():
        if len(set(map(repr, values))) != len(values):
            raise cfgmod.ConfigError(f"{source}: grid {key} = {list(values)!r}: repeated value")
    rep = table.get("repeat", 1) if repeat is None else repeat
    if not isinstance(rep, int) or isinstance(rep, bool) or not 1 <= rep <= 100:
        raise cfgmod.ConfigError(f"{source}: sweep.repeat = {rep!r}: must be an integer in "
                                 f"[1, 100]")
    name = table.get("name") or base.get("run", {}).get("name") or "sweep"
    if not isinstance(name, str) or "/" in name:
        raise cfgmod.ConfigError(f"{source}: sweep.name = {name!r}: must be a name without '/'")
    return SweepSpec(name=name, base=base, grid=tuple(grid.items()), repeat=rep,
                     sets=tuple(sets), source=source)


def expand(spec: SweepSpec) -> list[Combination]:
    """The cartesian product of the grid (last key fastest), times ``repeat``."""
    keys = [k for k, _ in spec.grid]
    combos: list[Combination] = []
    for values in itertools.product(*(vals for _, vals in spec.grid)):
        for r in range(spec.repeat):
            combos.append(Combination(len(combos), tuple(zip(keys, values, strict=True)), r))
    return combos


def base_seed(spec: SweepSpec) -> int:
    seed = spec.base.get("run", {}).get("seed", 0)
    return seed if isinstance(seed, int) else 0


def validate(spec: SweepSpec) -> list[cfgmod.ExperimentConfig]:
    """Build and validate the config of every combination before anything runs.

    Raises ConfigError naming the file, the combination and the field at fault."""
    try:
        cfgmod.from_dict(cfgmod.apply_overrides(spec.base, list(spec.sets)))
    except cfgmod.ConfigError as e:
        raise cfgmod.ConfigError(f"{spec.source}: {e}") from None
    cfgs = []
    seed = base_seed(spec)
    for combo in expand(spec):
        try:
            cfgs.append(cfgmod.from_dict(cfgmod.apply_overrides(
                spec.base, [*spec.sets, *combo.overrides(seed)])))
        except cfgmod.ConfigError as e:
            raise cfgmod.ConfigError(f"{spec.source}: combination {combo.index + 1} "
                                     f"({combo.label}): {e}") from None
    return cfgs


def load_sweep(path: str | Path, grid_args: Sequence[str] = (), sets: Sequence[str] = (),
               repeat: int | None = None) -> SweepSpec:
    """Read a sweep file (an experiment config with an optional ``[sweep]`` table)."""
    path = resolve_config_file(path)
    data = cfgmod.read_toml(path)
    # base.toml is re-read from the sweep's own folder: its file names must not be relative.
    base_dir = path.parent.absolute()
    for section, name in PATH_FIELDS:
        table = data.get(section)
        if isinstance(table, dict) and isinstance(table.get(name), str):
            table[name] = resolve_path(table[name], base_dir)
        elif isinstance(table, dict) and isinstance(table.get(name), dict):
            table[name] = {k: resolve_path(v, base_dir) if isinstance(v, str) else v
                           for k, v in table[name].items()}
    return parse_sweep(data, grid_args, sets, repeat, source=str(path))


# -- the table ------------------------------------------------------------------------------

#: Summary columns of the table, in order: (column, summary.json key).
TABLE_METRICS = (
    ("iterations", "iterations"),
    ("bytes_up_per_iter", "bytes_up_per_iter"),
    ("iter_time_s_mean", "iter_time_s_mean"),
    ("iter_time_s_p50", "iter_time_s_p50"),
    ("final_accuracy", "final_accuracy"),
    ("time_to_target_s", "time_to_target_s"),
    ("iterations_to_target", "iterations_to_target"),
    ("bottleneck_utilization", "bottleneck_utilization"),
    ("wall_s", "wall_s"),
)


def table_rows(spec: SweepSpec, results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """One dict per run: grid keys, (repeat), status, metrics, error, run directory."""
    rows = []
    for res in results:
        row: dict[str, Any] = dict(res.combo.values)
        if spec.repeat > 1:
            row["repeat"] = res.combo.repeat
        row["status"] = res.status
        row["exit_status"] = res.exit_status
        for col, key in TABLE_METRICS:
            v = res.summary.get(key)
            row[col] = res.wall_s if key == "wall_s" and v is None else v
            if col == "bytes_up_per_iter":
                # The sum over workers; per worker is what one access link carries.
                workers = res.summary.get("workers")
                row["bytes_up_per_worker_iter"] = v / workers if v is not None and workers \
                    else None
        row["error"] = res.error
        row["run_dir"] = res.run_dir.name if res.run_dir is not None else ""
        rows.append(row)
    return rows


def _cell(v: Any, col: str) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    if col.startswith("bytes"):
        return human_bytes(float(v))
    if isinstance(v, float):
        return f"{v:.3f}" if col in ("final_accuracy", "bottleneck_utilization") else f"{v:.3g}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def markdown(spec: SweepSpec, results: Sequence[RunResult], target: float) -> str:
    rows = table_rows(spec, results)
    if not rows:
        return "(no runs)\n"
    # wall_s includes waiting for the machine-wide network lock and building the network,
    # so it stays in the CSV only; time to target is measured from the PS being ready.
    cols = [c for c in rows[0] if c != "wall_s"]
    head = {"bytes_up_per_iter": "bytes up/iter (all workers)",
            "bytes_up_per_worker_iter": "bytes up/iter/worker",
            "iter_time_s_mean": "mean iter time (s)",
            "iter_time_s_p50": "median iter time (s)",
            "final_accuracy": "accuracy at end",
            "time_to_target_s": f"time to {target:g} acc (s)" if target else "time to target (s)",
            "iterations_to_target": "iters to target",
            "bottleneck_utilization": "bottleneck util"}
    lines = ["| " + " | ".join(head.get(c, c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r[c], c) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def csv_text(spec: SweepSpec, results: Sequence[RunResult]) -> str:
    import csv

    rows = table_rows(spec, results)
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if v is None else v for k, v in r.items()})
    return buf.getvalue()


def write_tables(sweep_dir: Path, spec: SweepSpec, results: Sequence[RunResult],
                 target: float) -> None:
    """``sweep.csv`` and ``sweep.md``, each replaced atomically."""
    write_atomic(sweep_dir / "sweep.csv", csv_text(spec, results))
    write_atomic(sweep_dir / "sweep.md", markdown(spec, results, target))


#: Runs a sweep prints side by side (more go to sweep.md only: a terminal is not that wide).
SIDE_BY_SIDE_MAX = 4


def comparison(spec: SweepSpec, results: Sequence[RunResult]) -> str:
    """What a finished sweep prints: its runs side by side (up to SIDE_BY_SIDE_MAX), then,
    when the grid varies ``compress.name`` and includes ``none``, one verdict line per
    compressed run against the dense run with the same other values and repeat
    (:func:`controller.verdict.verdict`). Empty when fewer than two runs finished."""
    ok = [r for r in results if r.status == "ok"]
    if len(ok) < 2:
        return ""
    many_keys = len(spec.grid) > 1

    def label(r: RunResult) -> str:
        s = ", ".join(_fmt_value(v) if not many_keys else f"{k}={_fmt_value(v)}"
                      for k, v in r.combo.values)
        return f"{s} (repeat {r.combo.repeat})" if r.combo.repeat else s

    parts = [side_by_side([(label(r), r.summary) for r in ok])] \
        if len(ok) <= SIDE_BY_SIDE_MAX else []

    def others(r: RunResult) -> tuple[Any, ...]:
        return (*((k, repr(v)) for k, v in r.combo.values if k != "compress.name"),
                r.combo.repeat)

    dense = {others(r): r for r in ok if dict(r.combo.values).get("compress.name") == "none"}
    for r in ok:
        base = dense.get(others(r))
        if base is not None and r is not base:
            try:
                parts.append(verdict(base.summary, r.summary, label(r)))
            except ValueError as e:
                parts.append(f"verdict: {label(r)}: none ({e})")
    return "\n".join(parts) + "\n" if parts else ""


# -- the side effects: run each combination ---------------------------------------------------


def _run_one(base_toml: Path, combo: Combination, spec: SweepSpec, sweep_dir: Path,
             cfg: cfgmod.ExperimentConfig, res: RunResult) -> None:
    """Run one combination as ``gradbed run`` in its own session (so a terminal's Ctrl-C
    reaches only the sweep, which forwards exactly one SIGINT: the run then stops cleanly).
    A config whose ``[torchrun]`` section names a script runs as ``gradbed torchrun``."""
    # No report per run: the sweep writes one for all its runs at the end, and on 2 cores
    # each report is seconds that the next run waits for.
    command = "torchrun" if cfg.torchrun.script else "run"
    argv = [sys.executable, "-m", "controller.cli", command, str(base_toml), "--out",
            str(sweep_dir), "--no-report", "--no-progress"]
    for o in [*spec.sets, *combo.overrides(base_seed(spec))]:
        argv += ["--set", o]
    log_path = sweep_dir / "logs" / f"{combo.index + 1:03d}.log"
    timeout_s = cfg.run.timeout_s + RUN_GRACE_S
    # A run that stops at its target accuracy completes with fewer iterations.
    planned = 1 if cfg.run.stop_at_target else cfg.run.iterations
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(argv) + "\n")
        log.flush()
        # In the user's folder, so a relative file name given with --set or --grid means
        # what it meant where they typed it.
        env = {**os.environ, "PYTHONPATH": python_path(os.environ, str(REPO_ROOT))}
        proc = subprocess.Popen(argv, cwd=os.getcwd(), stdout=subprocess.PIPE, stderr=log,
                                text=True, start_new_session=True, env=env)
        try:
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                # The run overran even its own hard limit: stop it the way Ctrl-C would.
                proc.send_signal(signal.SIGINT)
                out, _ = proc.communicate(timeout=120)
                res.status = "timeout"
                res.error = f"killed after {timeout_s:.0f} s"
        except KeyboardInterrupt as e:
            # The run gets the signal the sweep got, so its summary says which.
            if proc.poll() is None:
                proc.send_signal(getattr(e, "signum", signal.SIGINT))
            try:
                out, _ = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            _collect(res, proc.returncode, out, log_path, time.monotonic() - t0, planned)
            res.status = "interrupted"
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    _collect(res, proc.returncode, out, log_path, time.monotonic() - t0, planned)


def _collect(res: RunResult, rc: int | None, out: str, log_path: Path, wall_s: float,
             planned: int) -> None:
    res.wall_s = wall_s
    res.exit_status = rc
    lines = [ln for ln in (out or "").strip().splitlines() if ln.strip()]
    if lines and Path(lines[-1]).is_dir():
        res.run_dir = Path(lines[-1])
        sp = res.run_dir / "summary.json"
        if sp.exists():
            try:
                res.summary = json.loads(sp.read_text())
            except (OSError, ValueError) as e:
                res.error = f"{sp}: {e}"
    if res.status == "timeout":
        res.exit_status = TIMED_OUT  # overran the sweep's hard limit, then stopped like Ctrl-C
        return
    if rc == 0:
        reason = str(res.summary.get("stop_reason", "completed"))
        done = res.summary.get("iterations")
        res.status = "ok"
        if reason not in ("completed", ""):
            res.status, res.error = "failed", reason
        elif not res.summary:
            res.status, res.error = "failed", "no summary.json"
        elif done is not None and done < planned:
            res.status, res.error = "failed", f"stopped after {done} of {planned} iterations"
        if res.status == "ok" and res.summary.get("final_loss") is None \
                and res.summary.get("final_accuracy") is not None:
            res.error = "final loss is not finite (diverged?)"
        return
    res.status = "interrupted" if rc is not None and rc - SIGNAL_BASE in (
        signal.SIGINT, signal.SIGTERM, signal.SIGHUP) else "failed"
    if not res.error:
        res.error = _last_error(log_path, rc)


def _last_error(log_path: Path, rc: int | None) -> str:
    """The most telling line of a failed run's console output."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("$ ")]
    for ln in reversed(lines):
        if "error" in ln.lower() or "failed" in ln.lower():
            return f"exit {rc}: {ln[:300]}"
    return f"exit {rc}: {lines[-1][:300]}" if lines else f"exit {rc}"


#: Longest path a Unix socket can have on Linux (sun_path is 108 bytes, NUL included).


def run_sweep(spec: SweepSpec, out_root: Path, progress: bool = True, report: bool = True
              ) -> tuple[Path, list[RunResult], list[int]]:
    """Run every combination; returns the sweep directory, the finished runs' results
    (fewer than the combinations when a signal stopped the sweep; the tables keep them)
    and the stop signals received (the first one stopped it). ``report``: write
    ``report/index.html`` for all the runs at the end."""
    cfgs = validate(spec)
    combos = expand(spec)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    sweep_dir = Path(out_root).absolute() / f"sweep-{spec.name}-{stamp}"
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=False)
    base_toml = sweep_dir / "base.toml"
    write_atomic(base_toml, tomli_w.dumps(spec.base))
    write_atomic(sweep_dir / "sweep.json", json.dumps({
        "name": spec.name, "source": spec.source, "repeat": spec.repeat,
        "grid": {k: list(v) for k, v in spec.grid}, "sets": list(spec.sets),
        "argv": sys.argv, "combinations": len(combos)}, indent=2, default=str) + "\n")
    target = cfgs[0].run.target_accuracy
    results = [RunResult(c) for c in combos]
    t_sweep = time.monotonic()
    # SIGINT, SIGTERM and SIGHUP (a closed terminal) stop the sweep as gradbed run stops:
    # the first is raised once, and the run under way is stopped cleanly; any later one
    # is only noted, so the tables and the report are written whatever else arrives.
    stops = StopSignals()

    def say(line: str) -> None:
        if progress and not stops.hung_up:  # after SIGHUP the terminal is gone
            try:
                print(line, file=sys.stderr, flush=True)
            except OSError:
                pass

    say(f"sweep {sweep_dir.name}: {len(combos)} runs")
    with stops:
        try:
            for combo, cfg, res in zip(combos, cfgs, results, strict=True):
                _run_and_say(base_toml, combo, spec, sweep_dir, cfg, res, results, target,
                             say, len(combos))
        except KeyboardInterrupt:
            pass
        finally:
            stops.disarm()
        done = _finish(sweep_dir, spec, results, target, say, t_sweep, len(combos), report)
    return sweep_dir, done, stops.received


def _run_and_say(base_toml: Path, combo: Combination, spec: SweepSpec, sweep_dir: Path,
                 cfg: cfgmod.ExperimentConfig, res: RunResult, results: list[RunResult],
                 target: float, say: Callable[[str], None], n: int) -> None:
    """One combination, its line, and the tables rewritten with it."""
    say(f"[{combo.index + 1}/{n}] {combo.label} ...")
    try:
        _run_one(base_toml, combo, spec, sweep_dir, cfg, res)
    except KeyboardInterrupt:
        say(f"[{combo.index + 1}/{n}] interrupted: stopping the sweep")
        raise
    except OSError as e:
        res.status, res.error = "failed", f"could not start: {e}"
    finally:
        write_tables(sweep_dir, spec, [r for r in results if r.status != "pending"], target)
    say(f"[{combo.index + 1}/{n}] {combo.label}: {_brief(res)}")


def _finish(sweep_dir: Path, spec: SweepSpec, results: list[RunResult], target: float,
            say: Callable[[str], None], t_sweep: float, planned: int, report: bool
            ) -> list[RunResult]:
    """The sweep's tables, comparison and (``report``) report, from the runs that
    finished."""
    done = [r for r in results if r.status != "pending"]
    write_tables(sweep_dir, spec, done, target)
    say(f"{sum(r.status == 'ok' for r in done)}/{planned} runs ok in "
        f"{time.monotonic() - t_sweep:.0f} s; {sweep_dir / 'sweep.md'}")
    compared = comparison(spec, done)
    if compared:
        write_atomic(sweep_dir / "comparison.txt", compared)
        # The answer, before the report that takes a while: printed with --no-progress too.
        print(compared, end="", file=sys.stderr, flush=True)
    dirs = [r.run_dir for r in done if r.run_dir is not None and (r.run_dir / "meta.json").exists()]
    if dirs and report:
        say(f"writing {sweep_dir / 'report' / 'index.html'} ...")
        try:
            from analysis.report import write_report

            write_report(dirs, sweep_dir / "report")
        except Exception as e:  # the table is what must survive; the report is a convenience
            say(f"warning: sweep report not written: {e}")
    hand_over(sweep_dir)
    say(f"sweep done in {time.monotonic() - t_sweep:.0f} s")
    return done


def _brief(res: RunResult) -> str:
    s = res.summary
    if res.status != "ok":
        return f"{res.status}: {res.error}"
    acc = s.get("final_accuracy")
    tt = s.get("time_to_target_s")
    bpi = s.get("bytes_up_per_iter")
    parts = [f"{res.wall_s:.0f} s",
             f"acc {acc:.3f}" if acc is not None else "acc –",
             f"{human_bytes(bpi)}/iter up" if bpi is not None else "",
             f"target at {tt:.1f} s" if tt is not None else "target not reached"]
    return ", ".join(p for p in parts if p)


def sweep_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="gradbed sweep",
                                 description="Run every combination of a grid of config values.")
    ap.add_argument("config", type=Path, help="experiment TOML, optionally with a [sweep] table")
    ap.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2,...",
                    help="a grid axis, e.g. net.bottleneck_mbps=10,100,1000")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a config field in every run")
    ap.add_argument("--out", type=Path, default=Path("runs"), help="parent of the sweep dir")
    ap.add_argument("--repeat", type=int, default=None, help="runs per combination")
    ap.add_argument("--dry-run", action="store_true",
                    help="validate and list the combinations, run nothing")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-report", action="store_true",
                    help="write no report/index.html (gradbed report SWEEP/*/ writes it later)")
    args = ap.parse_args(list(argv))
    try:
        spec = load_sweep(args.config, args.grid, args.overrides, args.repeat)
        validate(spec)
    except cfgmod.ConfigError as e:
        print(f"gradbed sweep: config error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for c in expand(spec):
            print(f"{c.index + 1}: " + " ".join(c.overrides(base_seed(spec))))
        return 0
    try:
        args.out = check_out_dir(args.out)
    except OutDirError as e:
        print(f"gradbed sweep: {e}", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("gradbed sweep: needs root (each run builds a Mininet network); run it with sudo",
              file=sys.stderr)
        return 2
    try:
        sweep_dir, done, signals = run_sweep(spec, args.out, progress=not args.no_progress,
                                             report=not args.no_report)
    except cfgmod.ConfigError as e:
        print(f"gradbed sweep: {e}", file=sys.stderr)
        return 2
    try:
        print(sweep_dir, flush=True)
    except OSError:
        pass  # the terminal closed (SIGHUP): the sweep directory is complete all the same
    return sweep_status(done, len(expand(spec)), signals[0] if signals else signal.SIGINT)


def sweep_status(done: Sequence[RunResult], planned: int,
                 signum: int = signal.SIGINT) -> int:
    """``gradbed sweep``'s exit status: 128 + ``signum`` (the signal that stopped it) when
    it was stopped before its last run, else the first failed run's own status
    (``controller.exit_status``), 1 for a run that exited 0 yet fell short (fewer
    iterations than planned), 0 when every run completed."""
    if len(done) < planned or any(r.status == "interrupted" for r in done):
        return SIGNAL_BASE + int(signum)
    failed = [r.exit_status for r in done if r.exit_status]
    if failed and failed[0] is not None:
        return failed[0]
    return 0 if all(r.status == "ok" for r in done) else FAILED
