"""Shared output format for every benchmark (DESIGN.md section 5).

Each benchmark prints human-readable progress to stderr and, as its very last
stdout line, one JSON object: ``{"name", "headline", "unit", "target", "details"}``.
``details`` holds every measurement behind the headline so anyone can recompute it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
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
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode != 0:
        raise RuntimeError(f"gradbed run ({name}) failed:\n{res.stderr[-3000:]}")
    run_dir = Path(res.stdout.strip().splitlines()[-1])
    log(f"{name}: {run_dir} ({time.monotonic() - t0:.0f} s incl. waiting for the net lock)")
    s = json.loads((run_dir / "summary.json").read_text())
    if not s.get("iterations"):
        raise RuntimeError(f"gradbed run ({name}) did no iteration ({s.get('stop_reason')}); "
                           f"see {run_dir / 'logs'}")
    return run_dir
