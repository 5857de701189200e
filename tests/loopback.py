"""Runs a PS and workers as real processes over loopback TCP (no Mininet, no root).

Used by the transparency and robustness tests: the agents are the same programs
the controller starts inside Mininet hosts, talking real TCP through the kernel.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from agents.core import config as cfgmod

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connect(port: int, timeout_s: float = 30.0) -> socket.socket:
    """A client socket to the loopback PS, retrying while it starts listening."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
            s.settimeout(timeout_s)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def make_run_dir(tmp: Path, overrides: list[str], name: str = "run") -> tuple[Path, cfgmod.ExperimentConfig]:
    run_dir = tmp / name
    (run_dir / "events").mkdir(parents=True)
    cfg = cfgmod.load(REPO / "configs" / "digits.toml",
                      [f"net.ps_port={free_port()}", *overrides])
    (run_dir / "config.toml").write_text(cfgmod.dumps(cfg))
    (run_dir / "secret").write_bytes(b"s3cret-for-tests-only-0123456789")
    return run_dir, cfg


def start_ps(run_dir: Path) -> subprocess.Popen[bytes]:
    p = subprocess.Popen([sys.executable, "-m", "agents.ps", "--run-dir", str(run_dir),
                          "--host", "127.0.0.1"], cwd=REPO,
                         stdout=open(run_dir / "ps.log", "wb"), stderr=subprocess.STDOUT)
    time.sleep(0.05)
    return p


def start_worker(run_dir: Path, k: int, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "agents.worker", "--run-dir", str(run_dir),
                             "--worker", str(k), "--ps", "127.0.0.1", "--port", str(port)],
                            cwd=REPO, stdout=open(run_dir / f"w{k}.log", "wb"),
                            stderr=subprocess.STDOUT)


def run_loopback(tmp: Path, overrides: list[str], timeout_s: float = 120) -> tuple[Path, int]:
    """Run a whole experiment over loopback; returns (run_dir, PS exit status)."""
    run_dir, cfg = make_run_dir(tmp, overrides)
    ps = start_ps(run_dir)
    workers = [start_worker(run_dir, k, cfg.net.ps_port) for k in range(cfg.net.workers)]
    try:
        rc = ps.wait(timeout=timeout_s)
        for w in workers:
            w.wait(timeout=30)
    finally:
        for p in [ps, *workers]:
            if p.poll() is None:
                p.kill()
    return run_dir, rc
