"""Clear errors at the edges: bad config and ``--out`` paths are one line
and exit status 2, a config's errors come all at once, every way a run ends has a
``stop_reason``, and the summary says which workers were lost and when."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from agents.core import config as cfgmod
from controller.summary import summarize
from tests.support.bad_config import BAD_IN_EVERY_SECTION, bad_config_toml

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.toml"
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def gradbed(*args: str, user: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "controller.cli", *args]
    if user is not None:  # the same command as an ordinary user
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)


def one_clear_line(p: subprocess.CompletedProcess[str], needle: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_a_config_that_is_a_directory(tmp_path: Path) -> None:
    one_clear_line(gradbed("run", str(tmp_path)), "is a directory, not a config file")
    one_clear_line(gradbed("sweep", str(tmp_path), "--grid", "net.workers=1,2"),
                   "is a directory, not a config file")


def test_out_naming_a_file_or_a_path_through_a_file(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    one_clear_line(gradbed("run", str(DEMO), "--out", str(f)), "is a file, not a directory")
    one_clear_line(gradbed("run", str(DEMO), "--out", str(f / "runs")),
                   f"{f} is a file, not a directory")
    one_clear_line(gradbed("sweep", str(DEMO), "--grid", "net.workers=1,2", "--out", str(f)),
                   "is a file, not a directory")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to act as an ordinary user")
def test_out_the_user_cannot_write(tmp_path: Path) -> None:
    # pytest's tmp_path sits in a folder only root may enter: that is one case, and a folder
    # the user may enter but not write is the other.
    one_clear_line(gradbed("run", str(DEMO), "--out", str(tmp_path), user="65534"),
                   "cannot reach it: permission denied")
    shared = Path("/tmp") / f"gradbed-test-{os.getpid()}"
    shared.mkdir(mode=0o555)
    try:
        one_clear_line(gradbed("run", str(DEMO), "--out", str(shared), user="65534"),
                       "not writable: permission denied")
        one_clear_line(gradbed("run", str(DEMO), "--out", str(shared / "new"), user="65534"),
                       "cannot create it: permission denied")
    finally:
        shared.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting needs root")
def test_out_on_a_read_only_file_system(tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)],
                      capture_output=True).returncode != 0:
        pytest.skip("this container cannot mount a tmpfs")
    try:
        one_clear_line(gradbed("run", str(DEMO), "--out", str(ro)),
                       "not writable: read-only file system")
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_every_error_of_a_config_at_once(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[net]\nworkers = 0\nbogus = 1\nbottleneck_mbps = 'fast'\n"
                   "[compress]\nratio = 2\n[nett]\nx = 1\n")
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(bad)
    errors = e.value.errors
    assert len(errors) == 5, errors
    for needle in ("net.workers = 0", "net.bogus: unknown field", "net.bottleneck_mbps = 'fast'",
                   "compress.ratio = 2.0", "nett: unknown section"):
        assert any(needle in m and m.startswith(f"{bad}: ") for m in errors), (needle, errors)
    p = gradbed("run", str(bad), "--dry-run")
    assert p.returncode == 2 and "gradbed run: 5 config errors:" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    # One error reads as it always did; outside a load, a check still raises at once.
    with pytest.raises(cfgmod.ConfigError, match=r"^.*demo.toml: net.workers = 0: must be"):
        cfgmod.load(DEMO, ["net.workers=0"])
    with pytest.raises(cfgmod.ConfigError, match="run.iterations"):
        cfgmod.RunConfig(iterations=0).validate("run")


def test_one_bad_value_in_every_section_through_the_cli(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(bad_config_toml())
    p = gradbed("run", str(bad), "--dry-run")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    for section, (name, _) in BAD_IN_EVERY_SECTION.items():
        assert f"{bad}: {section}.{name}" in p.stderr, (section, p.stderr)
    for name in ("guard.handshake_timeout_s", "pipeline.ratio"):
        assert f"{bad}: {name} = " in p.stderr, (name, p.stderr)


def test_an_old_field_name_runs_with_a_warning_naming_the_new_one() -> None:
    p = gradbed("run", str(DEMO), "--set", "net.ps_port=5200", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert (f"{DEMO}: warning: net.ps_port is deprecated: it is now net.port "
            "(read as net.port = 5200)") in p.stderr, p.stderr
    assert "--port 5200" in p.stdout


def _events(rows: list[dict[str, object]]) -> pd.DataFrame:
    base = {"run_id": "r", "iter": -1}
    return pd.DataFrame([{**base, **r} for r in rows])


def test_the_summary_lists_the_workers_lost_and_when() -> None:
    s0 = 7_000_000_000
    ev = _events([
        {"ts_ns": s0, "node": "controller", "event": "run_start"},
        {"ts_ns": s0 + 2_500_000_000, "node": "ps", "iter": 4, "event": "worker_lost",
         "worker": 2, "reason": "connection closed"},
        {"ts_ns": s0 + 3_000_000_000, "node": "ps", "iter": 5, "event": "worker_left",
         "worker": 1, "reason": "left (BYE)"},
        {"ts_ns": s0 + 4_000_000_000, "node": "ps", "iter": 7, "event": "worker_lost",
         "worker": 0, "reason": "frame error: bad checksum"},
        {"ts_ns": s0 + 4_500_000_000, "node": "controller", "event": "agent_lost",
         "host": "bg0", "role": "flowgen", "reason": "bg0 exited with status -9",
         "action": "peers decide"},
    ])
    cfg = {"run": {}, "net": {"workers": 3}}
    s = summarize(ev, pd.DataFrame(), cfg, 5.0, False, "completed")
    assert s["workers_lost"] == [
        {"worker": 2, "iter": 4, "t_s": 2.5, "reason": "connection closed"},
        {"worker": 0, "iter": 7, "t_s": 4.0, "reason": "frame error: bad checksum"}]
    assert s["agents_lost"] == [{"host": "bg0", "role": "flowgen", "t_s": 4.5,
                                 "reason": "bg0 exited with status -9",
                                 "action": "peers decide"}]
    assert summarize(ev.iloc[:1], pd.DataFrame(), cfg, 1.0, False, "x")["workers_lost"] == []
    assert summarize(ev.iloc[:1], pd.DataFrame(), cfg, 1.0, False, "x")["agents_lost"] == []
