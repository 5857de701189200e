"""Helpers for end-to-end tests that run ``gradbed run`` for real (root, Mininet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd

from topo.cleanup import _root_links, is_gradbed_link, leftover_processes
from topo.lock import NetLock

REPO = Path(__file__).resolve().parents[2]


def _run_argv(config: str, overrides: list[str], out: Path, report: bool) -> list[str]:
    """``gradbed run``'s command line. Without ``report`` it passes ``--no-report``: the
    page's figures cost seconds a run, and only a test that reads report/ needs them."""
    argv = [sys.executable, "-m", "controller.cli", "run", str(REPO / config), "--out", str(out),
            "--no-progress", *([] if report else ["--no-report"])]
    for o in overrides:
        argv += ["--set", o]
    return argv


def gradbed_run(config: str, overrides: list[str], out: Path, timeout_s: float = 240,
                report: bool = False) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Run ``gradbed run`` as a user would; returns (run_dir, completed process).
    ``report``: write report/index.html too (``--no-report`` otherwise)."""
    argv = _run_argv(config, overrides, out, report)
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


def start_run(config: str, overrides: list[str], out: Path,
              env: dict[str, str] | None = None, report: bool = False
              ) -> subprocess.Popen[str]:
    """``gradbed run`` in the background, as a user starts it from a terminal
    (``report``: as :func:`gradbed_run`)."""
    argv = _run_argv(config, overrides, out, report)
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_for_iterations(out: Path, proc: subprocess.Popen[str], iterations: int,
                        timeout_s: float = 600) -> Path:
    """The run directory under ``out`` once its PS logged ``iterations`` iterations (the
    network lock may be another run's for a while first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        for ps in out.glob("*/events/ps.jsonl"):
            if ps.read_text().count('"ps_iter_done"') >= iterations:
                return ps.parents[1]
        time.sleep(0.1)
    raise AssertionError(f"the run never reached {iterations} iterations (status "
                         f"{proc.poll()}): {proc.stderr.read()[-3000:] if proc.stderr else ''}")


def agent_pids(run_dir: Path, module: str) -> list[int]:
    """The processes running agent ``module`` (``agents.dp.ps``) for ``run_dir``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        text = [c.decode(errors="replace") for c in cmd]
        if module in text and any(str(run_dir) in c for c in text):
            found.append(int(pid))
    return found


def wait_for_event(out: Path, proc: subprocess.Popen[str], event: str, count: int,
                   timeout_s: float = 600) -> Path:
    """The run directory under ``out`` once its agents' event logs hold ``count`` events
    ``event`` in all (``pp_step_done``, ``moe_step``)."""
    deadline = time.monotonic() + timeout_s
    needle = f'"event": "{event}"'
    while time.monotonic() < deadline and proc.poll() is None:
        for run_dir in out.glob("*/"):
            logs = (run_dir / "events").glob("*.jsonl")
            if sum(p.read_text(errors="replace").count(needle) for p in logs) >= count:
                return run_dir
        time.sleep(0.1)
    raise AssertionError(f"the run never logged {count} {event} events (status "
                         f"{proc.poll()}): {proc.stderr.read()[-3000:] if proc.stderr else ''}")


def agent_pid(run_dir: Path, module: str, *args: str) -> int:
    """The one process running agent ``module`` for ``run_dir`` whose command line holds
    ``args`` in order (``"--stage", "1"``)."""
    found = []
    for pid in agent_pids(run_dir, module):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                text = [c.decode(errors="replace") for c in f.read().split(b"\0")]
        except OSError:
            continue
        n = len(args)
        if any(tuple(text[i:i + n]) == args for i in range(len(text) - n + 1)):
            found.append(pid)
    assert len(found) == 1, (module, args, found)
    return found[0]



def _descendants(pid: int) -> Iterator[int]:
    """Every process below ``pid`` (the kernel's children lists, no scan of /proc)."""
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                yield k
                todo.append(k)


def host_shell_pid(host: str, run: subprocess.Popen[str], timeout_s: float = 600) -> int:
    """The pid of Mininet's shell for ``host`` (its network namespace) in the network of
    the ``gradbed run`` process ``run``, within a millisecond or two of its start:
    another run's network, which may have a host of that name while ``run`` waits for
    the lock, is not below ``run``."""
    deadline = time.monotonic() + timeout_s
    want = f"mininet:{host}".encode()
    root_ns = os.stat(f"/proc/{run.pid}/ns/net").st_ino
    while time.monotonic() < deadline and run.poll() is None:
        for p in _descendants(run.pid):
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[-2:-1] != [want]:
                        continue
                # Its own namespace yet (mnexec unshares it, then runs the shell).
                if os.stat(f"/proc/{p}/ns/net").st_ino != root_ns:
                    return p
            except OSError:
                continue
        time.sleep(0.001)
    raise AssertionError(f"no Mininet shell for {host} under pid {run.pid} (status "
                         f"{run.poll()})")


@contextmanager
def flood_from(host: str, start: Callable[[], subprocess.Popen[str]],
                   target: tuple[str, int], args: list[str]
                   ) -> Iterator[tuple[subprocess.Popen[str], dict[str, int]]]:
    """``controller.loopback.flood`` against ``target`` from inside ``host`` (from its
    address, across the fabric) of the ``gradbed run`` that ``start`` starts: the flooder
    is started first and enters the host's namespace the moment the host exists, before
    the run's agents. Yields the run's process and a dict that gets what the flooder
    counted (``opened``, ``connected``, ``held_ns``) once it is stopped, on exit."""
    # At a higher priority than the run: a flooding host has cores of its own, which the
    # agents of this one machine would otherwise take from it (at a load of 7, a process
    # woken every millisecond may wait tens of them for a core).
    flooder = subprocess.Popen(
        [sys.executable, "-m", "controller.loopback.flood", f"{target[0]}:{target[1]}", "--probe",
         "--netns-pid-stdin", *args],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: os.nice(-10))
    count: dict[str, int] = {}
    run = start()
    try:
        assert flooder.stdin is not None
        flooder.stdin.write(f"{host_shell_pid(host, run)}\n")
        flooder.stdin.flush()
        yield run, count
    finally:
        flooder.terminate()
        out, err = flooder.communicate(timeout=30)
        if run.poll() is None:
            run.kill()
            run.communicate()
        assert flooder.returncode == 0 and out.strip(), err[-2000:]
        count.update(json.loads(out.strip().splitlines()[-1]))
