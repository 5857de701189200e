"""Runs a PS and workers as real processes over loopback TCP (no Mininet, no root).

Used by the transparency and robustness tests and by ``benchmarks/robustness.py``: the
agents are the same programs the controller starts inside Mininet hosts, talking real TCP
through the kernel.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from agents.core import config as cfgmod
from agents.net import auth, codec, protocol, wire
from controller import warm

# An agent process: a child of the warm interpreter, or a fresh one (controller.warm.spawn).
Agent = subprocess.Popen[bytes] | warm.WarmProcess

REPO = Path(__file__).resolve().parents[2]
# Each test run's master key stays in this process, as the controller's does.
MASTERS: dict[Path, bytes] = {}


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
                      [f"net.port={free_port()}", *overrides])
    (run_dir / "config.toml").write_text(cfgmod.dumps(cfg))
    MASTERS[run_dir] = auth.new_master()
    return run_dir, cfg


def worker_key(run_dir: Path, k: int) -> bytes:
    return auth.node_key(MASTERS[run_dir], f"w{k}")


def _start(run_dir: Path, node: str, argv: list[str]) -> Agent:
    """Start an agent as the controller does: its key bundle down its stdin, the pipe
    kept open (closing it ends the agent). A fork of the warm interpreter (controller.warm)."""
    p = warm.spawn([sys.executable, *argv], cwd=REPO, stdin=subprocess.PIPE,
                   stdout=open(run_dir / f"{node}.log", "wb"), stderr=subprocess.STDOUT)
    assert p.stdin is not None
    p.stdin.write(auth.bundle_for(MASTERS[run_dir], node).encode())
    p.stdin.flush()
    return p


def start_ps(run_dir: Path, expect: tuple[str, ...] = ()) -> Agent:
    """``expect``: the workers' source addresses (an admission slot each, ``--expect``)."""
    p = _start(run_dir, "ps", ["-m", "agents.dp.ps", "--run-dir", str(run_dir),
                               "--host", "127.0.0.1", *[a for e in expect for a in ("--expect", e)]])
    time.sleep(0.05)
    return p


def start_worker(run_dir: Path, k: int, port: int) -> Agent:
    return _start(run_dir, f"w{k}", ["-m", "agents.dp.worker", "--run-dir", str(run_dir),
                                     "--worker", str(k), "--ps", "127.0.0.1",
                                     "--port", str(port)])


def public_tag(run_dir: Path) -> int:
    return codec.run_tag(run_dir.name, codec.PUBLIC_SECRET)


def prove(sock: socket.socket, run_dir: Path, worker: int, key: bytes | None = None,
          join_at: int = 0) -> tuple[wire.FrameReader, protocol.Dialer]:
    """A worker's HELLO and PROOF on ``sock`` (with worker ``worker``'s real key unless
    ``key`` is given); :func:`welcome` then waits for the PS to admit it. Driven step by
    step, not through ``agents.net.handshake``, so a test can stop between the two."""
    tag = public_tag(run_dir)
    hs = protocol.Dialer(run_dir.name, "worker", worker,
                         key if key is not None else worker_key(run_dir, worker),
                         bytes(range(16)))
    wire.send_bytes(sock, hs.hello(join_at), msg_type=codec.MsgType.HELLO, run_tag=tag,
                    worker=worker, iteration=join_at)
    reader = wire.FrameReader(sock, expect_tag=tag, max_payload_bytes=codec.MAX_HELLO_BYTES)
    h, payload = reader.read_frame()
    wire.send_bytes(sock, hs.receive_challenge(h, payload), msg_type=codec.MsgType.PROOF,
                    run_tag=tag, worker=worker, iteration=join_at)
    return reader, hs


def welcome(reader: wire.FrameReader, hs: protocol.Dialer) -> protocol.Session:
    """Wait for WELCOME (raises :class:`protocol.Rejected` on an ERROR); afterwards the
    reader checks the PS's MAC, and ``session.up`` seals what we send."""
    reader.expect_tag = None
    h, payload = reader.read_frame()
    hs.receive_welcome(reader.last_header, h, payload)
    assert hs.session is not None
    reader.mac = hs.session.down
    reader.max_payload_bytes = codec.DEFAULT_MAX_PAYLOAD_BYTES
    return hs.session


def handshake(sock: socket.socket, run_dir: Path, worker: int, key: bytes | None = None,
              join_at: int = 0) -> tuple[wire.FrameReader, protocol.Session]:
    """:func:`prove` then :func:`welcome`."""
    reader, hs = prove(sock, run_dir, worker, key, join_at)
    return reader, welcome(reader, hs)


def run_loopback(tmp: Path, overrides: list[str], timeout_s: float = 120) -> tuple[Path, int]:
    """Run a whole experiment over loopback; returns (run_dir, PS exit status)."""
    run_dir, cfg = make_run_dir(tmp, overrides)
    ps = start_ps(run_dir)
    workers = [start_worker(run_dir, k, cfg.net.port) for k in range(cfg.net.workers)]
    rc, _ = wait_agents(ps, workers, timeout_s, 30)
    return run_dir, rc


def wait_agents(ps: Agent, workers: list[Agent], ps_timeout_s: float,
                worker_timeout_s: float) -> tuple[int, list[int]]:
    """The PS's exit status and then each worker's; whoever is still running after its
    wait (or when a wait fails) is killed."""
    try:
        rc = ps.wait(timeout=ps_timeout_s)
        return rc, [w.wait(timeout=worker_timeout_s) for w in workers]
    finally:
        for p in [ps, *workers]:
            if p.poll() is None:
                p.kill()


def ps_keys(run_dir: Path) -> auth.KeyBundle:
    """The PS's key bundle, for tests that build a ParameterServer in this process."""
    return auth.bundle_for(MASTERS[run_dir], "ps")


def any_session(run_dir: Path, worker: int) -> protocol.Session:
    """A session as a handshake would make it (fixed nonces), for a hand-built _Conn."""
    return protocol.session(worker_key(run_dir, worker), worker, 0, b"p" * 16, b"w" * 16)
