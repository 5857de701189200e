"""``gradbed torchrun``'s refusals at the command line: one line naming the file or
option, status 2, and no run directory made. No network is built; the command runs in this
process (``torchrun_main``, what ``python -m controller.cli torchrun`` calls), from the
test's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.torchrun.cli import split_script, torchrun_main

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "examples" / "torchrun_ddp" / "fabric4.toml"


def gradbed_torchrun(out: Path, capsys: pytest.CaptureFixture[str], monkeypatch:
                     pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """(status, stdout, stderr) of ``gradbed torchrun CONFIG --out OUT/runs ARGS``."""
    monkeypatch.chdir(out)
    capsys.readouterr()
    status = torchrun_main([str(CONFIG), "--out", str(out / "runs"), *args])
    got = capsys.readouterr()
    return status, got.out, got.err


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
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        script: str, content: str | None, message: str) -> None:
    if content is not None:
        (tmp_path / script).write_text(content)
    status, _, err = gradbed_torchrun(tmp_path, capsys, monkeypatch, "--", script)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_nccl_without_a_gpu_per_host_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    status, _, err = gradbed_torchrun(tmp_path, capsys, monkeypatch,
                                      "--set", "torchrun.backend='nccl'", "--", "t.py")
    if "0 GPU" not in err and status != 2:
        pytest.skip("this machine has a GPU per host")
    assert status == 2 and "one GPU per emulated host" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides,message", [
    (["shaping.method='pacing'"], "shaping.method = 'pacing' paces the sockets of gradbed's "
                                  "own agents; a torchrun script's sockets are its own"),
    (["shaping.method='tc'", "shaping.pace_guard=1.5", "topo.shape='star'",
      "topo.traces={}"], "shaping.pace_guard = 1.5 paces the sockets of gradbed's own agents"),
    (["shaping.method='tc'"], "shaping.method = 'tc' needs the shaping points 'up' and "
                              "'down' (a bottleneck); the fabric has none"),
])
def test_link_n_shaping_other_than_tc_on_a_bottleneck_is_refused_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        overrides: list[str], message: str) -> None:
    """link/N caps reach the ranks only as tc classes on a shape with a bottleneck B."""
    (tmp_path / "t.py").write_text("print(1)\n")
    sets = [a for o in overrides for a in ("--set", o)]
    for dry in ([], ["--dry-run"]):
        status, _, err = gradbed_torchrun(tmp_path, capsys, monkeypatch, *sets, *dry,
                                          "--", "t.py")
        assert status == 2, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_the_dry_run_prints_every_host_s_torchrun_with_its_variables(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "t.py").write_text("print(1)\n")
    status, out, err = gradbed_torchrun(tmp_path, capsys, monkeypatch, "--dry-run", "--",
                                        "t.py", "--steps", "3")
    assert status == 0, err
    lines = [ln for ln in out.splitlines() if "torch.distributed.run" in ln]
    assert len(lines) == 4
    assert "GLOO_SOCKET_IFNAME=gbh2-eth0" in lines[2] and "--node-rank 2" in lines[2]
    assert lines[0].split("   # ")[0].endswith("t.py --steps 3")
    assert not (tmp_path / "runs").exists()
