"""Shared output format for every benchmark (DESIGN.md section 5).

Each benchmark prints human-readable progress to stderr and, as its very last
stdout line, one JSON object: ``{"name", "headline", "unit", "target", "details"}``.
``details`` holds every measurement behind the headline so anyone can recompute it.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Benchmarks import the project's packages from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def emit(name: str, headline: float, unit: str, target: str, details: dict[str, Any]) -> None:
    details = dict(details)
    details.setdefault("machine", {"cpus": os.cpu_count(), "python": platform.python_version(),
                                   "kernel": platform.release()})
    print(json.dumps({"name": name, "headline": headline, "unit": unit, "target": target,
                      "details": details}, default=float))


REPO = Path(__file__).resolve().parents[1]


def run_child(argv: list[str], *, cwd: Path, timeout_s: float,
              env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run one child (a benchmark, ``gradbed run``) and capture its output. Interrupted
    (Ctrl-C, SIGTERM, the time limit), it is stopped as Ctrl-C stops it, so that its own
    teardown (a network, its agents) runs in its ``finally`` blocks; it is killed only if
    that hangs (``subprocess.run`` would kill it at once and leave its network behind). A
    Ctrl-C at the terminal reaches it too, so after one it is given a few seconds to stop
    by itself first. Raises what interrupted it (``TimeoutExpired`` past ``timeout_s``)."""
    with subprocess.Popen(argv, cwd=cwd, env=None if env is None else dict(env),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException as e:
            own_s = 10.0 if isinstance(e, KeyboardInterrupt) else 0.0
            for stop, wait_s in ((None, own_s), (signal.SIGINT, 120.0), (signal.SIGKILL, None)):
                if stop is not None:
                    proc.send_signal(stop)
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def failed_run_logs(res: subprocess.CompletedProcess[str]) -> str:
    """The tails of the logs that name an error, of a failed ``gradbed run`` whose run
    directory (its last stdout line) exists; empty when there is none."""
    lines = res.stdout.strip().splitlines()
    tails = []
    for path in sorted((Path(lines[-1]) / "logs").glob("*.log")) if lines else []:
        text = path.read_text(errors="replace")
        if "Error" in text:
            tails.append(f"\n--- {path.name}:\n{text[-1500:]}")
    return "".join(tails)


def gradbed_run(config: Path, name: str, overrides: list[str], out: Path,
                timeout_s: float = 900, report: bool = True) -> Path:
    """Run one real experiment (``gradbed run``, Mininet) and return its run directory
    (``report``: False skips the run's report/ folder). Raises when the run fails or
    completes no iteration, pointing at its logs."""
    argv = [sys.executable, "-m", "controller.cli", "run", str(config), "--no-progress",
            "--out", str(out), "--set", f'run.name="{name}"']
    if not report:
        argv.append("--no-report")
    for o in overrides:
        argv += ["--set", o]
    t0 = time.monotonic()
    res = run_child(argv, cwd=REPO, timeout_s=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"gradbed run ({name}) failed:\n{res.stderr[-3000:]}"
                           f"{failed_run_logs(res)}")
    run_dir = Path(res.stdout.strip().splitlines()[-1])
    log(f"{name}: {run_dir} ({time.monotonic() - t0:.0f} s incl. waiting for the net lock)")
    s = json.loads((run_dir / "summary.json").read_text())
    if not s.get("iterations"):
        raise RuntimeError(f"gradbed run ({name}) did no iteration ({s.get('stop_reason')}); "
                           f"see {run_dir / 'logs'}")
    return run_dir
