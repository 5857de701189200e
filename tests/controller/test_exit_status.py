"""The exit-status table (controller/exit_status.py): every stop reason the runner, the PS
and the controller write maps to its class, and ``gradbed run -h`` shows the table."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from controller import exit_status as es

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("reason, status", [
    ("completed", 0), ("", 0),
    ("model became non-finite at iteration 7", 1),
    ("failed: OSError: [Errno 28] No space left on device", 1),
    ("failed: worker 1 died while the controller wrote", 1),  # the controller's own error
    (es.failed_start_reason("ps exited with status 1 before it was ready; see x"), 3),
    ("ps exited with status -9; see logs/ps.log", 4),
    ("worker 1 died: connection reset", 4), ("no active workers", 4),
    ("stage s1 lost: silent for 10 s", 4),
    (es.timeout_reason(8.0), 5), ("timeout after 900.0 s", 5),
    ("server lost: node2", 6),
    (es.signal_reason(signal.SIGHUP), 129), (es.signal_reason(signal.SIGTERM), 143),
    ("interrupted", 130), ("controller killed", 137),
])
def test_each_stop_reason_has_its_status(reason: str, status: int) -> None:
    assert es.status_for(reason) == status


def test_run_help_shows_the_table() -> None:
    p = subprocess.run([sys.executable, "-m", "controller.cli", "run", "-h"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0
    for code, meaning in es.TABLE:
        assert code in p.stdout and meaning.split("(")[0].strip() in p.stdout


def test_the_python_api_reads_the_same_table(tmp_path: Path) -> None:
    import json

    import gradbed

    (tmp_path / "summary.json").write_text(json.dumps({"stop_reason": "timeout after 8 s"}))
    assert gradbed.exit_status(tmp_path) == es.TIMED_OUT
