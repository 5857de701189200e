"""``gradbed torchrun``'s refusals at the command line: one line naming the file or
option, status 2, and no run directory made. No network is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.torchrun.cli import split_script

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "torchrun_ddp" / "fabric4.toml"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def gradbed_torchrun(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controller.cli", "torchrun", str(CONFIG),
                           "--out", str(out / "runs"), *args], cwd=out, env=ENV,
                          capture_output=True, text=True, timeout=120)


def test_the_script_and_its_arguments_follow_the_double_dash() -> None:
    assert split_script(["c.toml", "--set", "a=1", "--", "t.py", "--lr", "1", "--", "x"]) == (
        ["c.toml", "--set", "a=1"], ["t.py", "--lr", "1", "--", "x"])
    assert split_script(["c.toml"]) == (["c.toml"], [])


@pytest.mark.parametrize("script,content,message", [
    ("missing.py", None, "missing.py: no such file"),
    ("train.sh", "echo hi\n", "torchrun.script = 'train.sh': must name a Python script"),
    ("broken.py", "def (:\n", "broken.py: not valid Python"),
])
def test_a_bad_script_is_one_line_status_2_and_no_run_directory(
        tmp_path: Path, script: str, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / script).write_text(content)
    proc = gradbed_torchrun(tmp_path, "--", script)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "runs").exists()


def test_nccl_without_a_gpu_per_host_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    proc = gradbed_torchrun(tmp_path, "--set", "torchrun.backend='nccl'", "--", "t.py")
    if "0 GPU" not in proc.stderr and proc.returncode != 2:
        pytest.skip("this machine has a GPU per host")
    assert proc.returncode == 2 and "one GPU per emulated host" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_the_dry_run_prints_every_host_s_torchrun_with_its_variables(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    proc = gradbed_torchrun(tmp_path, "--dry-run", "--", "t.py", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if "torch.distributed.run" in ln]
    assert len(lines) == 4
    assert "GLOO_SOCKET_IFNAME=gbh2-eth0" in lines[2] and "--node-rank 2" in lines[2]
    assert lines[0].split("   # ")[0].endswith("t.py --steps 3")
    assert not (tmp_path / "runs").exists()
