"""A server's warm process and its clients (``controller.warm_remote``), on this machine: the
client stands for the agent (stdio, exit code, signals, namespace), the agent is a fork of
the warm process, a client with no warm process or another environment starts the agent
cold, and nothing outlives the warm process's stdin. Real processes; root (``setns``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.warm_remote import ServerWarm

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="entering a namespace needs root")
SHOW = [sys.executable, "-m", "tests.support.show_self"]


def _env(**extra: str) -> dict[str, str]:
    """This process's environment, less what pytest's terminal sets while it runs: the
    warm process and its clients start with the same one, as on a server."""
    return {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
            **extra}


def _serve(sock: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "controller.warm_remote", "serve",
                             str(sock), "-", "-" * 4096], cwd=REPO, env=_env(),
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready", \
        proc.stderr.read() if proc.stderr else ""
    return proc


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, int]]:
    sock = tmp_path_factory.mktemp("warm") / "w.sock"
    proc = _serve(sock)
    yield sock, proc.pid
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def _client(sock: Path, *args: str, prefix: tuple[str, ...] = (),
            env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*prefix, sys.executable, "-m", "controller.warm_remote", "run",
                             str(sock), "--", *SHOW, *args], cwd=REPO, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env or _env())


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_the_agent_is_a_fork_of_the_warm_process_in_the_clients_namespace(warm) -> None:
    sock, warm_pid = warm
    # The client in a namespace of its own, as in an emulated host (unshare execs it).
    c = _client(sock, "--sleep", "30", prefix=("unshare", "-n"))
    assert c.stdout is not None
    seen = json.loads(c.stdout.readline())
    assert seen["pid"] != c.pid and _parent(seen["pid"]) == warm_pid  # forked, not exec'd
    assert seen["netns"] == os.readlink(f"/proc/{c.pid}/ns/net") \
        != os.readlink("/proc/self/ns/net")
    assert seen["cmdline"][1:3] == ["-m", "tests.support.show_self"]
    assert seen["argv"] == ["--sleep", "30"] and seen["cwd"] == str(REPO)
    # A signal to the client reaches its agent; the client dies of it as the agent did.
    c.send_signal(signal.SIGTERM)
    assert c.wait(timeout=30) == -signal.SIGTERM
    assert not Path(f"/proc/{seen['pid']}").exists() or _zombie_or_gone(seen["pid"])


def _zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_client_ends_with_its_agents_exit_code_and_output(warm) -> None:
    sock, warm_pid = warm
    # What each ssh session and its shell set for themselves does not make it cold.
    c = _client(sock, "--exit", "7", env=_env(SSH_CLIENT="10.99.0.9 5 22",
                                                   _="/usr/bin/env"))
    out, err = c.communicate(timeout=30)
    seen = json.loads(out)
    assert c.returncode == 7 and seen["pid"] != c.pid, err


def test_a_client_with_another_environment_starts_its_agent_cold(warm) -> None:
    sock, _ = warm
    # GLIBC_TUNABLES, OMP_NUM_THREADS... are read when torch loads: a fork would not have
    # what the agent was given.
    c = _client(sock, "--exit", "4", env=_env(GRADBED_PROBE="other"))
    out, _ = c.communicate(timeout=60)
    seen = json.loads(out)
    assert c.returncode == 4 and seen["pid"] == c.pid and seen["probe"] == "other"


def test_a_client_without_a_warm_process_starts_its_agent_cold(tmp_path) -> None:
    c = _client(tmp_path / "none.sock", "--exit", "3")
    out, _ = c.communicate(timeout=60)
    assert c.returncode == 3 and json.loads(out)["pid"] == c.pid  # exec'd in place


def test_the_warm_process_kills_its_agents_and_goes_when_its_stdin_closes(tmp_path) -> None:
    sock = tmp_path / "w.sock"
    proc = _serve(sock)
    c = _client(sock, "--sleep", "60")
    assert c.stdout is not None
    agent = json.loads(c.stdout.readline())["pid"]
    assert _parent(agent) == proc.pid
    assert proc.stdin is not None
    proc.stdin.close()  # the run ended, or its controller or ssh died
    assert proc.wait(timeout=30) == 0
    assert c.wait(timeout=30) == -signal.SIGKILL  # its agent was killed: so is the client
    deadline = time.monotonic() + 10
    while not _zombie_or_gone(agent) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _zombie_or_gone(agent) and not sock.exists()


def test_the_controller_wraps_an_agent_in_its_servers_client() -> None:
    w = ServerWarm(["true"], "10.99.0.2", "run-1", {"A": "1"}, "digits_mlp")
    try:
        argv = w.wrap([sys.executable, "-m", "agents.dp.ps", "--run-dir", "/x"])
        assert argv[:5] == [sys.executable, "-m", "controller.warm_remote", "run",
                            "/run/gradbed/warm/run-1.sock"]
        assert argv[5:] == ["--", sys.executable, "-m", "agents.dp.ps", "--run-dir", "/x"]
        # ``gradbed cleanup`` kills the client as the agent it stands for.
        from topo.cleanup import is_gradbed_process

        assert is_gradbed_process(argv) == "agent agents.dp.ps"
    finally:
        assert w.close() == ""
