"""Agents forked from the warm interpreter are what ``python -m`` inside the host would
start: the host's network namespace, their own session, command line, argv, cwd,
environment and exit status; and nothing of them outlives the warm process's client."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from controller.run_as import RunAs
from controller.warm import WarmStarter, spawn

REPO = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="entering a namespace needs root")


def _show(starter: WarmStarter, tmp_path: Path, *args: str, **kw):
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}.json"
    with open(out, "wb") as f:
        proc = starter.spawn([sys.executable, "-m", "tests.support.show_self", *args],
                             cwd=REPO, stdout=f, stderr=subprocess.STDOUT, **kw)
    assert proc is not None, "the request should have been forked"
    return proc, out


@pytest.fixture(scope="module")
def starter():
    """One warm process for the tests that only fork from it (each fork is a process of its
    own, and the warm process stays as it was): its start imports torch, seconds each.
    GRADBED_HOST may differ from request to request (torchrun's agents' per-host variables)."""
    s = WarmStarter({**os.environ, "GRADBED_PROBE": "warm"}, free_env={"GRADBED_HOST"})
    yield s
    s.close()


@pytest.fixture
def other_netns():
    """A process in a network namespace of its own (an emulated host's stand-in)."""
    p = subprocess.Popen(["unshare", "--net", "sleep", "60"])
    deadline = time.monotonic() + 10
    while os.readlink(f"/proc/{p.pid}/ns/net") == os.readlink("/proc/self/ns/net"):
        assert time.monotonic() < deadline, "unshare never entered its namespace"
        time.sleep(0.01)
    yield p.pid
    p.kill()
    p.wait()


@needs_root
def test_a_fork_runs_in_the_hosts_namespace_with_its_own_command_line(starter, tmp_path,
                                                                      other_netns):
    env = {**os.environ, "GRADBED_PROBE": "warm"}
    proc, out = _show(starter, tmp_path, "--exit", "3", "--flag", env=env,
                      netns_pid=other_netns, start_new_session=True)
    assert proc.wait(timeout=30) == 3
    seen = json.loads(out.read_text())
    assert seen["netns"] == os.readlink(f"/proc/{other_netns}/ns/net")
    assert seen["netns"] != os.readlink("/proc/self/ns/net")
    assert seen["cmdline"] == [sys.executable, "-m", "tests.support.show_self", "--exit", "3",
                               "--flag"]
    assert seen["argv"] == ["--exit", "3", "--flag"]
    assert seen["sid"] == seen["pid"]  # a session of its own, as start_new_session
    assert seen["cwd"] == str(REPO) and seen["probe"] == "warm"


def test_a_different_environment_or_command_is_not_forked(starter, tmp_path):
    argv = [sys.executable, "-m", "tests.support.show_self"]
    assert starter.spawn(argv, cwd=REPO, env={**os.environ, "GRADBED_PROBE": "other"}) is None
    assert starter.spawn(["/bin/true"], cwd=REPO, env={**os.environ, "GRADBED_PROBE": "warm"}
                         ) is None
    assert starter.spawn(argv, cwd=REPO, stderr=subprocess.PIPE,
                         env={**os.environ, "GRADBED_PROBE": "warm"}) is None


def test_a_free_variable_may_differ_and_the_fork_sees_the_requests_value(starter, tmp_path):
    proc, out = _show(starter, tmp_path, env={**os.environ, "GRADBED_PROBE": "warm",
                                              "GRADBED_HOST": "gbh2"})
    assert proc.wait(timeout=30) == 0
    assert json.loads(out.read_text())["host"] == "gbh2"
    # Any other difference still gets a fresh interpreter.
    assert starter.spawn([sys.executable, "-m", "tests.support.show_self"], cwd=REPO,
                         env={**os.environ, "GRADBED_PROBE": "other", "GRADBED_HOST": "gbh2"}
                         ) is None


def test_signals_reach_the_fork_and_its_status_comes_back(starter, tmp_path):
    proc, _ = _show(starter, tmp_path, "--sleep", "30",
                    env={**os.environ, "GRADBED_PROBE": "warm"})
    time.sleep(0.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_closing_the_starter_leaves_no_fork_behind(tmp_path):
    s = WarmStarter({**os.environ, "GRADBED_PROBE": "warm"})
    proc, _ = _show(s, tmp_path, "--sleep", "60", env={**os.environ, "GRADBED_PROBE": "warm"})
    pid = proc.pid
    s.close()
    deadline = time.monotonic() + 10
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid), "a fork outlived its warm process"
    assert proc.poll() is not None
    # A clean end says nothing, and leaves no file anywhere.
    assert s.said == "" and _warm_logs() == []


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_close_before_ready_leaves_no_log():
    """A caller that gives up while torch still imports (a bad config found during the
    build) ends the warm process as cleanly as one that used it."""
    s = WarmStarter({**os.environ, "GRADBED_PROBE": "warm"})
    time.sleep(0.5)
    s.close()
    assert _warm_logs() == []


def test_close_before_ready_kills_it_at_once():
    """``gradbed run`` starts the warm process before its checks: a command that then ends
    on a bad file or folder must not wait for torch's import to finish first."""
    s = WarmStarter({**os.environ, "GRADBED_PROBE": "warm"})
    t0 = time.monotonic()
    s.close()
    # Killed, not the exit it makes once imported, and without waiting for the import
    # (2 s of CPU at best here).
    assert s.proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 1.5
    assert _warm_logs() == []


def test_a_runs_warm_process_preloads_its_agents_imports_and_not_scikit_learn(starter,
                                                                             tmp_path):
    # The digits are read from scikit-learn's file without its import (1-2 s of CPU).
    env = {**os.environ, "GRADBED_PROBE": "warm"}
    for_digits = WarmStarter(env, workload="digits_mlp")  # ``starter`` is one for no workload
    try:
        seen = []
        for s in (starter, for_digits):
            proc, out = _show(s, tmp_path, env=env)
            assert proc.wait(timeout=60) == 0
            seen.append(json.loads(out.read_text())["preloaded"])
        assert seen == [[], ["agents.net.wire", "agents.workloads.base"]]
        assert for_digits.log_text() == ""  # nothing failed
    finally:
        for_digits.close(keep_log=tmp_path / "warm.log")
    assert not (tmp_path / "warm.log").exists()  # kept only when it says something


@pytest.mark.skipif(os.environ.get("GRADBED_WARM") == "0", reason="no warm process asked for")
def test_the_loopback_warm_process_preloads_what_agents_of_any_workload_import(tmp_path):
    out = tmp_path / "seen.json"
    with open(out, "wb") as f:
        proc = spawn([sys.executable, "-m", "tests.support.show_self"], cwd=REPO, stdout=f,
                     stderr=subprocess.STDOUT)
    assert proc.wait(timeout=60) == 0
    assert json.loads(out.read_text())["preloaded"] == ["agents.net.wire",
                                                        "agents.workloads.base"]


@pytest.mark.skipif(os.environ.get("GRADBED_WARM") == "0", reason="no warm process asked for")
def test_what_an_agent_sets_for_itself_in_the_test_process_keeps_the_forks_warm(
        tmp_path, monkeypatch):
    # An agent run as a thread of the test process (MoE hosts, say) sets cuBLAS's workspace
    # for run.deterministic; the loopback agents started after it are forks still.
    def preloaded(name: str) -> list[str]:
        out = tmp_path / name
        with open(out, "wb") as f:
            proc = spawn([sys.executable, "-m", "tests.support.show_self"], cwd=REPO,
                         stdout=f, stderr=subprocess.STDOUT)
        assert proc.wait(timeout=60) == 0
        return json.loads(out.read_text())["preloaded"]

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert preloaded("before.json") != []
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert preloaded("after.json") != []


def _warm_logs(caller: int | None = None) -> list[str]:
    """Files the warm processes of ``caller`` (default: this process) left in the temporary
    folder, as main at 5c16cbd named them (none now: the log has no name)."""
    caller = os.getpid() if caller is None else caller
    return sorted(p.name for p in Path(tempfile.gettempdir()).glob(f"gradbed-warm-{caller}-*"))


def test_a_preload_failure_is_kept_in_the_run_directory_and_nowhere_else(tmp_path):
    """What a warm process says (a preload that failed) is kept where its caller says (a
    run's ``RUN/warm.log``), never in /tmp; on main at 5c16cbd every such start left
    ``/tmp/gradbed-warm-PID-*.log`` behind."""
    # A workload no module registers: its preload fails (the digits' reader imports
    # nothing that a broken package on the path could fail).
    s = WarmStarter({**os.environ}, workload="no_such_workload")
    s._wait_ready()
    assert "not a registered workload" in s.log_text()
    # The log has no name in any folder, so nothing can leave it behind.
    assert os.readlink(f"/proc/self/fd/{s.log.fileno()}").endswith(" (deleted)")
    s.close(keep_log=tmp_path / "warm.log")
    kept = (tmp_path / "warm.log").read_text()
    assert "preloading for workload 'no_such_workload' failed" in kept
    assert _warm_logs() == []


def test_a_killed_caller_leaves_no_log():
    """The caller (a controller) is SIGKILLed once its warm process is ready: the warm
    process, reading EOF, ends, and its log (which has no name) leaves nothing behind."""
    code = ("import os, sys\n"
            "from controller.warm import WarmStarter\n"
            "s = WarmStarter()\n"
            "s._wait_ready()\n"
            "print(os.getpid(), s.proc.pid, flush=True)\n"
            "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    caller, pid = out.stdout.split()
    deadline = time.monotonic() + 20
    while _running(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(int(pid)), "the warm process outlived its killed caller"
    assert _warm_logs(int(caller)) == [], "the killed caller's warm process left its log"


#: The user a ``sudo gradbed`` run acts for in the tests: nobody, who owns nothing here.
NOBODY = RunAs("nobody", 65534, 65534, "/nonexistent")
needs_root_and_setpriv = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root, and setpriv to act as another user")


@needs_root_and_setpriv
def test_a_users_warm_process_forks_what_setpriv_would_start_fresh(tmp_path, other_netns):
    """Under sudo the warm process runs as the invoking user: a fork of it, in a host's
    namespace (which that user could not enter: the client passes it), is the user with
    what a fresh ``setpriv`` start of the same command has (ids, groups, no capability,
    the user's HOME), never root, and keeps none of the CAP_SYS_ADMIN its parent holds
    to enter the namespace. A command without the user's prefix (one that would run as
    root) is not forked, and a folder the user cannot enter gets a fresh start."""
    env = {**os.environ, **NOBODY.env(), "GRADBED_PROBE": "warm"}
    s = WarmStarter(env, user=NOBODY)
    try:
        python = [sys.executable, "-m", "tests.support.show_self"]
        out = tmp_path / "forked.json"
        with open(out, "wb") as f:
            proc = s.spawn([*NOBODY.argv(), *python], cwd=REPO, stdout=f,
                           stderr=subprocess.STDOUT, env=env, netns_pid=other_netns)
        assert proc is not None, "the request should have been forked"
        assert proc.wait(timeout=60) == 0, out.read_text()
        forked = json.loads(out.read_text())
        fresh = json.loads(subprocess.run([*NOBODY.argv(), *python], cwd=REPO, env=env,
                                          capture_output=True, text=True, check=True).stdout)
        assert forked["identity"] == fresh["identity"], (forked, fresh)
        assert forked["identity"]["Uid"] == ["65534"] * 4
        assert forked["identity"]["CapEff"] == ["0000000000000000"]
        assert forked["home"] == "/nonexistent"
        assert forked["netns"] == os.readlink(f"/proc/{other_netns}/ns/net")
        # The parent itself is the user too, holding only what setns needs.
        with open(f"/proc/{s.proc.pid}/status") as f:
            parent = dict(ln.split(":", 1) for ln in f if ":" in ln)
        assert parent["Uid"].split() == ["65534"] * 4
        assert int(parent["CapEff"], 16) == 1 << 21  # CAP_SYS_ADMIN alone
        # As root, or from a folder nobody may enter: a fresh start instead.
        assert s.spawn(python, cwd=REPO, env=env) is None
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o700)
        assert s.spawn([*NOBODY.argv(), *python], cwd=locked, env=env) is None
    finally:
        s.close()
