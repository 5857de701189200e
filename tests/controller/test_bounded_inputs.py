"""Every input is bounded in time and memory, and refused with one line naming the file,
the field and the limit, before anything is expanded (``gradbed run --dry-run``: nothing is
built): a trace spanning 10^12 ms, a file that is one endless line, TOML nested past 32
levels (in a file and in ``--set``), an unusable ``run.name``, a time field of 1e12 s or
inf. Under sudo, a trace error quotes nothing of a file its user may not read."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.loopback.hostile import endless_fifo

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "test_tiny.toml"


def dry_run(*sets: str, config: Path = TINY, env: dict[str, str] | None = None,
            timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "controller.cli", "run", str(config), "--dry-run"]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def refused(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_a_trace_spanning_10_to_the_12_ms_is_refused_at_once(tmp_path: Path) -> None:
    trace = tmp_path / "long.trace"
    trace.write_text("0\n5\n1000000000000\n")
    refused(dry_run(f"trace.up='{trace}'", timeout_s=30), f"{trace}:3", "a week")
    log = tmp_path / "long.log"
    log.write_text("0 10\n1e12 20\n")
    refused(dry_run(f"trace.up='{log}'", timeout_s=30), f"{log}:2", "a week")


def test_a_file_that_is_one_endless_line_fails_fast(tmp_path: Path) -> None:
    # A FIFO whose writer never stops: only a reader that reads in bounded pieces ends.
    with endless_fifo(tmp_path / "endless.trace") as fifo:
        refused(dry_run(f"trace.up='{fifo}'", timeout_s=30), f"{fifo}:1", "65536 bytes")


def test_toml_nested_past_32_levels(tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text(TINY.read_text() + "\n[topo]\ntraces = { x = " + "[" * 5000 + "]" * 5000
                    + " }\n")
    refused(dry_run(config=deep), str(deep), "nested deeper than 32 levels")
    refused(dry_run("run.x=" + "[" * 5000 + "]" * 5000), "--set run.x", "32 levels")
    refused(dry_run(".".join(["a"] * 200) + "=1"), "32 levels")


@pytest.mark.parametrize("name, needle", [("a" * 250, "1 to 64 characters"),
                                          ('"a\\u0000b"', "1 to 64 characters"),
                                          ('"../x"', "1 to 64 characters")])
def test_an_unusable_run_name(name: str, needle: str) -> None:
    refused(dry_run(f"run.name={name}"), "run.name", needle)


@pytest.mark.parametrize("value, needle", [("1e12", "at most 604800 (a week)"),
                                           ("inf", "must be a finite number"),
                                           ("nan", "must be a finite number")])
def test_a_time_field_past_a_week_or_not_finite(value: str, needle: str) -> None:
    refused(dry_run(f"run.timeout_s={value}"), "run.timeout_s", needle)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as sudo would")
def test_under_sudo_a_trace_error_quotes_nothing_the_user_may_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "shadow.log"
    secret.write_text("0 10\nSECRET-LINE-OF-ROOT 20\n")
    secret.chmod(0o600)  # root's alone
    sudo = {"SUDO_UID": "65534", "SUDO_GID": "65534"}
    line = refused(dry_run(f"trace.up='{secret}'", env=sudo), f"{secret}:2", "time_s")
    assert "SECRET" not in line
    # A file the user may read is quoted, so they see what is wrong with it.
    secret.chmod(0o644)
    assert "SECRET" in refused(dry_run(f"trace.up='{secret}'", env=sudo), f"{secret}:2")


def test_the_old_name_of_on_agent_death_is_read_with_a_deprecation_line() -> None:
    p = dry_run("run.on_worker_death='stop'")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "run.on_worker_death is deprecated: it is now run.on_agent_death" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_flow_size_cdf_with_a_line_past_64_kib(tmp_path: Path) -> None:
    cdf = tmp_path / "big.cdf"
    cdf.write_text("1 " * 40000 + "\n")
    refused(dry_run("background.kind='flows'", f"background.flow_cdf='{cdf}'",
                    "net.background_hosts=1"), "background.flow_cdf", f"{cdf}:1", "65536")
