"""``gradbed torchrun CONFIG [--set k=v ...] [--python PY] [--out DIR] -- SCRIPT.py [ARGS]``.

Runs the script, unedited, under real torchrun on every training host of the config's
shape (docs/torchrun.md). Without ``-- SCRIPT.py`` the config's ``[torchrun]`` section
names it. Bad input (a config error, a missing or non-Python script, NCCL without one GPU
per host) is one line and status 2 before anything is built; a run that starts prints its
run directory, and its status says how it ended (``controller.torchrun.experiment``'s
``EXIT_*``).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agents.core.config import ExperimentConfig
from controller.exit_status import FAILED_START as EXIT_FAILED_START
from controller.exit_status import USAGE as EXIT_USAGE

if TYPE_CHECKING:
    from controller.torchrun.experiment import TorchrunExperiment


def split_script(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(gradbed's own options, [SCRIPT, ARGS...]) split at the first ``--``."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def torchrun_main(argv: Sequence[str]) -> int:
    from agents.core import config as cfgmod
    from controller.cli import _need_root, config_errors
    from controller.paths import OutDirError, check_out_dir
    from controller.roles import RoleError
    from controller.roles.torchrun import TorchrunError
    from topo.qdisc import CapabilityError
    from topo.spec import SpecError

    own, script = split_script(argv)
    args = _parser().parse_args(own)
    try:
        cfg = _config(args, script)
    except cfgmod.ConfigError as e:
        config_errors("gradbed torchrun", e)
        return EXIT_USAGE
    if args.dry_run:
        return _dry_run(cfg)
    try:
        # The script, the shape and the GPUs are checked before any folder is made.
        gpus = _checked_gpus(cfg)
        args.out = check_out_dir(args.out)
    except (TorchrunError, SpecError, OutDirError) as e:
        print(f"gradbed torchrun: {e}", file=sys.stderr)
        return EXIT_USAGE
    _need_root("torchrun")
    from controller.torchrun.experiment import TorchrunExperiment

    try:
        exp = TorchrunExperiment(cfg, out_root=args.out,
                                 argv=["gradbed", "torchrun", *argv],
                                 progress=not args.no_progress, gpus=gpus,
                                 report=not args.no_report)
    except (TorchrunError, SpecError, RoleError, CapabilityError) as e:
        print(f"gradbed torchrun: {e}", file=sys.stderr)
        return EXIT_USAGE
    return _run(exp)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gradbed torchrun", usage="%(prog)s CONFIG [options] -- SCRIPT.py [ARGS]",
        description="Run an unmodified torch.distributed script with torchrun on every "
                    "training host of the config's shape.")
    ap.add_argument("config", type=Path, help="experiment TOML (a path or a shipped name)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a config field, e.g. net.delay_ms=20")
    ap.add_argument("--python", default="",
                    help="the interpreter the ranks run under (default: gradbed's)")
    ap.add_argument("--out", type=Path, default=Path("runs"), help="parent of the run dir")
    ap.add_argument("--no-progress", action="store_true", help="do not show rank 0's output")
    ap.add_argument("--no-report", action="store_true",
                    help="write no report/index.html (gradbed report RUN writes it later)")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the network's commands and each host's torchrun; change nothing")
    return ap


def _config(args: argparse.Namespace, script: list[str]) -> ExperimentConfig:
    """The config with the command line's script, its arguments and ``--python`` in its
    ``[torchrun]`` section. Raises ConfigError."""
    from agents.core import config as cfgmod
    from controller.paths import load_config

    cfg = load_config(args.config, args.overrides)
    tr = cfg.torchrun
    tr = dataclasses.replace(tr, script=script[0] if script else tr.script,
                             args=tuple(script[1:]) if script else tr.args,
                             python=args.python or tr.python)
    return cfgmod.from_dict({**cfg.to_dict(), "torchrun": dataclasses.asdict(tr)})


def _checked_gpus(cfg: ExperimentConfig) -> int:
    """The GPUs the run has (0 but for NCCL), once the script, the shaping, the shape and
    the GPUs pass their checks. Raises TorchrunError or SpecError."""
    from controller.driver import check_driver
    from controller.roles.torchrun import (
        check_gpus,
        check_script,
        check_shaping,
        torchrun_spec,
        training_hosts,
    )
    from topo.shapes import shape_spec

    check_script(cfg.torchrun.script)
    check_shaping(cfg)
    spec = torchrun_spec(shape_spec(cfg))
    check_driver(cfg, spec)
    gpus = gpu_count() if cfg.torchrun.backend == "nccl" else 0
    check_gpus(cfg, len(training_hosts(spec)), gpus)
    return gpus


def _run(exp: TorchrunExperiment) -> int:
    """Run ``exp``; print how it ended and its directory; its exit status."""
    import json

    from controller.cli import tell_failure

    try:
        run_dir = exp.run()
    except Exception as e:
        tell_failure("gradbed torchrun", exp, e)
        return EXIT_FAILED_START
    summary = json.loads((run_dir / "summary.json").read_text())
    reason = summary.get("stop_reason", "")
    if reason != "completed":
        print(f"gradbed torchrun: {reason}", file=sys.stderr)
    else:
        sent = summary["torchrun"]["bytes"]["payload_sent_bytes"]
        print(f"gradbed torchrun: completed in {summary['wall_s']:.1f} s; TCP payload sent "
              f"per host: {', '.join(f'{h} {b / 1e6:.2f} MB' for h, b in sent.items())}",
              file=sys.stderr)
    print(run_dir)
    return int(exp.exit_status)


def _dry_run(cfg: ExperimentConfig) -> int:
    from controller.roles import RoleError
    from controller.roles.torchrun import (
        TorchrunError,
        admission_rules,
        check_script,
        check_shaping,
        describe,
        rank_plans,
        torchrun_spec,
    )
    from controller.run import plan_commands
    from topo.probe import probe
    from topo.qdisc import CapabilityError
    from topo.shapes import shape_spec
    from topo.spec import SpecError

    try:
        script = check_script(cfg.torchrun.script)
        check_shaping(cfg)
        spec = torchrun_spec(shape_spec(cfg))
        lines = [line for line in plan_commands(cfg, probe(), spec)
                 if "torch.distributed.run" not in line]
        python = cfg.torchrun.python or sys.executable
        lines += [f"$ {shlex.join(c)}   # in {host}"
                  for host, cmds in admission_rules(spec, cfg.guard).items() for c in cmds]
        lines += describe(rank_plans(cfg, spec, python, script,
                                     Path("RUN/logs/ranks")))
    except (TorchrunError, SpecError, RoleError, CapabilityError) as e:
        print(f"gradbed torchrun: {e}", file=sys.stderr)
        return EXIT_USAGE
    print("\n".join(lines))
    return 0
