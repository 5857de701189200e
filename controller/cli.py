"""The ``gradbed`` command line.

    gradbed run CONFIG.toml [--set dotted.key=value ...] [--out DIR] [--dry-run | --cli]
    gradbed torchrun CONFIG.toml [--set ...] [--python PY] -- SCRIPT.py [ARGS]
    gradbed sweep CONFIG.toml --grid key=v1,v2 [--grid ...] [--out DIR]
    gradbed probe            kernel capabilities as JSON
    gradbed cleanup          remove what a crashed or killed run left behind (idempotent)
    gradbed report RUN...    self-contained HTML report
    gradbed trace RUN        where the run's trace.json (Chrome trace timelines) is
    gradbed plan ...         3D-parallel planner (DESIGN 1.5)

Human strings are parsed here and nowhere else. Bad input at this edge (a config that is a
folder, an ``--out`` that is a file or cannot be written, a config with errors) is one clear
message and exit status 2, never a traceback; a closed stdout (``gradbed probe | head -1``)
ends the command quietly. Every exit status means one thing (``controller.exit_status``:
0 completed, 3 failed start, 4 agent lost, 5 timed out, 128+n signal n...).
"""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import signal
import sys
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from agents.core.config import ExperimentConfig
    from controller.run import Experiment
    from controller.warm import WarmStarter
    from topo.spec import NetSpec


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        print(f"gradbed {what}: needs root (Mininet creates namespaces and qdiscs); run it "
              f"with sudo", file=sys.stderr)
        raise SystemExit(2)


def run_main(argv: Sequence[str]) -> int:
    from agents.core import config as cfgmod
    from controller.exit_status import help_text
    from controller.paths import load_config

    ap = argparse.ArgumentParser(prog="gradbed run", description="Run one experiment.",
                                 epilog=help_text(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", type=Path,
                    help="experiment TOML (a path, or the name of a shipped config: demo.toml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a config field, e.g. net.workers=8")
    ap.add_argument("--out", type=Path, default=Path("runs"), help="parent of the run dir")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--no-report", action="store_true",
                    help="write no report/index.html (gradbed report RUN writes it later)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the tc commands and agent command lines; change nothing")
    ap.add_argument("--cli", action="store_true",
                    help="build the network, start no role, and open Mininet's CLI on it")
    args = ap.parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", cfgmod.ConfigDeprecation)
            cfg = load_config(args.config, args.overrides)
    except cfgmod.ConfigError as e:
        config_errors("gradbed run", e)
        return 2
    notes = [f"warning: {args.config}: {w.message}" for w in caught
             if issubclass(w.category, cfgmod.ConfigDeprecation)]
    for note in notes:
        print(f"gradbed run: {note}", file=sys.stderr)
    # The agents' warm process starts now, before the checks and the network: its torch
    # import (seconds of CPU) overlaps all of them. The run closes it at its teardown;
    # here it is closed when the command ends before that (a bad trace, a bad --out).
    # The kernel's probe (a throwaway namespace, a qdisc trial each) runs beside them too.
    warm = None
    if os.geteuid() == 0 and not (args.dry_run or args.cli):
        from controller.warm import warm_for_agents
        from topo.probe import probe_in_background

        warm = warm_for_agents(cfg.run.allocator, cfg.workload.name)
        probe_in_background()
    try:
        return _checked_run(args, argv, cfg, notes, warm)
    finally:
        if warm is not None:
            warm.close()


class _Refused(Exception):
    """A check before the run failed: the line ``gradbed run`` prints, status 2."""


def _checked_run(args: argparse.Namespace, argv: Sequence[str], cfg: ExperimentConfig,
                 notes: list[str], warm: WarmStarter | None) -> int:
    """``gradbed run`` once its config is loaded: the files it names, the shape, then the
    dry run, the CLI or the run itself (with ``warm``, the agents' warm process)."""
    try:
        spec = _checked_spec(args.config, cfg)
        if args.dry_run:
            _dry_run(cfg, spec)
            return 0
        if args.cli:
            _need_root("run")
            _open_cli(cfg, spec)
            return 0
        # Checked (and made) only now: a config or trace error leaves no folder behind.
        args.out = _checked_out(args.out)
    except _Refused as e:
        print(f"gradbed run: {e}", file=sys.stderr)
        return 2
    _need_root("run")
    from controller.run import Experiment

    exp = Experiment(cfg, out_root=args.out, argv=["gradbed", "run", *argv],
                     progress=not args.no_progress, spec=spec, report=not args.no_report,
                     notes=notes, warm=warm)
    return _run(exp)


def _checked_spec(config: Path, cfg: ExperimentConfig) -> NetSpec:
    """The config's shape, once every file it names loads: a bad trace or flow-size file
    is named (file:line) before any network is built. Raises _Refused."""
    from agents.core.bandwidth import TraceError
    from topo.shapes import shape_spec
    from topo.spec import SpecError
    from traces.pcap import pcap_summary

    files: list[tuple[str, str, Callable[[str], object]]] = [
        ("trace.up", cfg.trace.up, lambda p: _load_trace(cfg, p)),
        ("trace.down", cfg.trace.down, lambda p: _load_trace(cfg, p)),
        ("background.flow_cdf", cfg.background.flow_cdf if cfg.background.kind == "flows"
         else "", lambda p: _load_flow_cdf(cfg, p)),
        ("background.pcap", cfg.background.pcap, pcap_summary)]
    for field, path, loader in files:
        try:
            if path:
                loader(path)
        except TraceError as e:
            raise _Refused(f"{config}: {field}: {e}") from e
    try:
        spec = shape_spec(cfg)
    except SpecError as e:
        raise _Refused(f"{config}: {e}") from e
    # Every shaping point's trace, named in the error when it is bad.
    for place in spec.places():
        if place.point.trace and place.point.name not in ("up", "down"):
            try:
                _load_trace(cfg, place.point.trace)
            except TraceError as e:
                raise _Refused(f"{config}: topo.traces[{place.point.name!r}]: {e}") from e
    return spec


def _load_trace(cfg: ExperimentConfig, path: str) -> object:
    from agents.core.bandwidth import load_trace
    from topo.spec import RATE_MAX_MBPS

    return load_trace(path, granularity_s=cfg.trace.granularity_ms / 1000.0,
                      max_rate_mbps=RATE_MAX_MBPS)


def _load_flow_cdf(cfg: ExperimentConfig, path: str) -> object:
    """The background's flow sizes. Says what it loaded and the distribution's mean (and
    whether that is the mean the file states), before anything is built."""
    from agents.core.flowsize import FlowSizeMeanWarning, load_flow_cdf

    bg = cfg.background
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FlowSizeMeanWarning)
        cdf = load_flow_cdf(path, format=bg.flow_cdf_format,
                            interpolation=bg.flow_cdf_interpolation,
                            packet_bytes=bg.flow_cdf_packet_bytes,
                            log=lambda m: print(f"background.flow_cdf: {m}", file=sys.stderr))
    for w in caught:
        print(f"background.flow_cdf: warning: {w.message}", file=sys.stderr)
    return cdf


def _refusals() -> tuple[type[Exception], ...]:
    """What the roles, the kernel or the spec refuse in a dry run or as the CLI opens."""
    from controller.roles import RoleError
    from topo.qdisc import CapabilityError
    from topo.spec import SpecError

    return CapabilityError, SpecError, RoleError


def _dry_run(cfg: ExperimentConfig, spec: NetSpec) -> None:
    from controller.run import plan_commands
    from topo.probe import probe

    try:
        print("\n".join(plan_commands(cfg, probe(), spec)))
    except _refusals() as e:
        raise _Refused(str(e)) from e


def _open_cli(cfg: ExperimentConfig, spec: NetSpec) -> None:
    from controller.interactive import open_cli

    try:
        open_cli(cfg, spec)
    except _refusals() as e:
        raise _Refused(str(e)) from e


def _checked_out(out: Path) -> Path:
    """The run's parent folder, made and checked (a folder gradbed may hand over)."""
    from controller.paths import OutDirError, check_out_dir
    from controller.rundir import check_owner

    try:
        out = check_out_dir(out)
        check_owner(out)
    except (OutDirError, PermissionError) as e:
        raise _Refused(str(e)) from e
    return out


def _run(exp: Experiment) -> int:
    """Run ``exp``; print its summary and directory; its exit status."""
    from controller.exit_status import SIGNAL_BASE
    from controller.signals import Interrupted

    try:
        run_dir = exp.run()
    except Interrupted as e:  # before _run took over: the directory is finished all the same
        if exp.run_dir is not None:
            _tell(str(exp.run_dir), sys.stdout)
        return SIGNAL_BASE + e.signum
    except Exception as e:
        tell_failure("gradbed run", exp, e)
        return exp.exit_status
    summary = run_dir / "summary.json"
    if summary.exists():
        _tell(summary.read_text().strip(), sys.stderr)
    _tell(str(run_dir), sys.stdout)
    return exp.exit_status


def tell_failure(command: str, exp: Experiment, e: Exception) -> None:
    """A run that an error ended: its traceback into run.log, the error and the run
    directory on the terminal. Re-raises ``e`` when no run directory was made."""
    if exp.run_dir is None:
        raise  # the error in hand, with its own traceback
    # The run directory holds the error (summary.json) and the traceback (run.log).
    with open(exp.run_dir / "run.log", "a", encoding="utf-8") as log:
        log.write(traceback.format_exc())
    _tell(f"{command}: failed: {type(e).__name__}: {e}; see {exp.run_dir / 'run.log'}",
          sys.stderr)
    _tell(str(exp.run_dir), sys.stdout)


def _tell(line: str, stream: TextIO) -> None:
    """Print, unless the terminal is gone (SIGHUP: EIO): the run directory has it all."""
    try:
        print(line, file=stream, flush=True)
    except OSError:
        pass


def config_errors(command: str, e: Exception) -> None:
    """A config's errors on stderr: one line for one, a list for several."""
    lines = str(e).splitlines()
    if len(lines) == 1:
        print(f"{command}: config error: {lines[0]}", file=sys.stderr)
        return
    print(f"{command}: {len(lines)} config errors:", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)


#: name -> (module, function, one-line help); each command parses its own options.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "run": ("controller.cli", "run_main", "run one experiment (root)"),
    "torchrun": ("controller.torchrun.cli", "torchrun_main",
                 "run an unmodified torch.distributed script on the emulated hosts (root)"),
    "sweep": ("controller.sweep", "sweep_main", "run every combination of a grid (root)"),
    "probe": ("topo.cli", "probe_main", "this kernel's emulation capabilities as JSON"),
    "cleanup": ("controller.cleanup", "cleanup_main",
                "remove what a crashed or killed run left; finish its run directory (root)"),
    "report": ("analysis.cli", "report_main", "a self-contained HTML report of runs"),
    "trace": ("analysis.cli", "trace_main",
              "where a run's trace.json timelines are (Perfetto, chrome://tracing)"),
    "plan": ("analysis.cli", "plan_main", "the 3D-parallel planner (DESIGN 1.5)"),
}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("gradbed")
    except PackageNotFoundError:  # a checkout that was never pip-installed
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gradbed",
        description="Network emulation and congestion-control testbed for distributed deep "
                    "learning: real training over real TCP through shaped Mininet links.",
        epilog="'gradbed COMMAND -h' shows a command's options.")
    ap.add_argument("--version", action="version", version=f"gradbed {version()}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, _, help_) in COMMANDS.items():
        # add_help=False: "gradbed run -h" reaches the command's own parser.
        sub.add_parser(name, help=help_, add_help=False)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # At exit the interpreter's last garbage collections walk every object the command's
    # pandas, pyarrow and matplotlib made: 0.5-1 s of a loaded 2-core machine after a run
    # whose files are all written and closed. Frozen, they are left to the process's end;
    # the atexit handlers, flushes and module teardown still run (docs/performance.md).
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
    try:
        try:
            ns, rest = parser().parse_known_args(argv)
            module, func, _ = COMMANDS[ns.command]
            return int(_lazy(module, func)(rest) or 0)
        finally:
            sys.stdout.flush()  # a closed pipe shows here (also after -h), where it is handled
    except BrokenPipeError:
        # The reader went away (``gradbed probe | head -1``): stop quietly, as a shell tool
        # killed by SIGPIPE would, and keep Python's exit-time flush from complaining.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _lazy(module: str, func: str):  # type: ignore[no-untyped-def]
    import importlib

    return getattr(importlib.import_module(module), func)


if __name__ == "__main__":
    sys.exit(main())
