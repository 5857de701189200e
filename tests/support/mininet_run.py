"""Helpers for end-to-end tests that run ``gradbed run`` for real (root, Mininet)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

from topo.cleanup import _root_links, is_gradbed_link, leftover_processes
from topo.lock import NetLock

REPO = Path(__file__).resolve().parents[2]


def gradbed_run(config: str, overrides: list[str], out: Path, timeout_s: float = 240
                ) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Run ``gradbed run`` as a user would; returns (run_dir, completed process)."""
    argv = [sys.executable, "-m", "controller.cli", "run", str(REPO / config), "--out", str(out),
            "--no-progress"]
    for o in overrides:
        argv += ["--set", o]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"gradbed run printed nothing; stderr:\n{proc.stderr[-3000:]}"
    return Path(lines[-1]), proc


def leftovers() -> list[str]:
    """Interfaces, bridges and agent processes a run must not leave behind. Checked while
    holding the machine-wide network lock, so another run's live network never counts."""
    with NetLock(timeout_s=600):
        return _leftovers()


def _leftovers() -> list[str]:
    links = [name for name in _root_links() if is_gradbed_link(name)]
    procs = [f"pid {pid}: {cmd}" for pid, cmd in leftover_processes()]
    return links + procs


def events(run_dir: Path) -> pd.DataFrame:
    frames = [pd.read_parquet(p) for p in sorted((run_dir / "events").glob("*.parquet"))]
    return pd.concat(frames, ignore_index=True, sort=False)


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
