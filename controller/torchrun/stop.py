"""Stopping a host's torchrun and every process under it, wherever it runs.

torchrun starts each rank in a session of its own, so neither its process group nor the
end of an ssh session reaches the ranks: the tree is found from ``/proc``'s parent links
(:func:`controller.torchrun.busy.descendants`) and signalled process by process. On the
controller's machine :func:`stop_trees` runs in the controller; on another server
``python -m controller.torchrun.stop GRACE_S PID_FILE...`` runs there over ssh (the
pid files are written by the command that starts each torchrun), then removes the pid
files. After a killed controller, ``gradbed cleanup`` runs :func:`stop_run` on each
server for the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from controller.torchrun.busy import descendants


def alive(pid: int) -> bool:
    """Running (a zombie is done: it only waits for its parent to read its status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def stop_trees(roots: Sequence[int], grace_s: float,
               reap: Callable[[], None] = lambda: None) -> list[int]:
    """SIGTERM (and SIGCONT) each root and every process under it, then SIGKILL what is
    left after ``grace_s`` (a torchrun blocked in a store call handles SIGTERM only when
    the call returns). ``reap``: called while waiting, to collect the caller's own children.
    Returns the pids that were signalled."""
    tree = [q for pid in roots for q in [pid, *descendants(pid)]]
    signalled = list(tree)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
                if sig == signal.SIGTERM:
                    # A stopped process (SIGSTOP: a rank a user paused, or one being
                    # traced) acts on SIGTERM only once continued; without this it would
                    # wait out the grace and die of SIGKILL, its handlers never run.
                    os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        end = time.monotonic() + grace_s
        while time.monotonic() < end and any(alive(q) for q in tree):
            reap()
            time.sleep(0.05)
        tree = [q for q in tree if alive(q)]
        if not tree:
            break
    return signalled


def read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


#: Where a server keeps its torchrun pids, in the run's directory there
#: (``controller.remote``): one file per host, written by the command that starts its
#: torchrun, removed by the stop, never gathered into the run directory.
PID_DIR = "torchrun-pids"
SAMPLER_MODULE = "controller.torchrun.host_sampler"


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def stop_run(remote_dir: str, grace_s: float) -> list[str]:
    """What a killed controller's ``gradbed torchrun`` left running on this server for
    the run whose directory here is ``remote_dir``: each host's torchrun tree (from its
    pid file, if that pid is still a torchrun: a pid the system gave to another process
    since is left alone) and the ranks' watch (``host_sampler``, whose argument names
    that directory). Without a controller nothing ends them: torchrun's stdin is no pipe
    of the controller's, and its ranks run in sessions of their own. One line per thing
    stopped; the pid files are removed."""
    if not (Path(remote_dir).is_absolute() and len(Path(remote_dir).parts) > 2):
        raise ValueError(f"stop_run: {remote_dir!r} is no run's directory")
    files = sorted(Path(remote_dir, PID_DIR).glob("*"))
    roots = {f.name: pid for f in files if (pid := read_pid(str(f))) is not None
             and alive(pid) and "torch.distributed.run" in _cmdline(pid)}
    lines = []
    if roots:
        n = len(stop_trees(list(roots.values()), grace_s))
        lines.append(f"stopped {n} process(es) of torchrun ({', '.join(sorted(roots))})")
    mark = remote_dir.rstrip("/") + "/"
    samplers = [pid for pid in _pids() if pid != os.getpid()
                and SAMPLER_MODULE in (args := _cmdline(pid)) and any(mark in a for a in args)]
    if samplers:
        stop_trees(samplers, grace_s)
        lines += [f"stopped the ranks' watch (pid {pid})" for pid in samplers]
    for f in files:
        f.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        Path(remote_dir, PID_DIR).rmdir()
    return lines


def _pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def main(argv: list[str]) -> int:
    """``GRACE_S PID_FILE...``: stop every file's tree at once (one grace for all), then
    remove the files; prints ``stopped N process(es)``."""
    grace_s = float(argv[0])
    roots = [pid for path in argv[1:] if (pid := read_pid(path)) is not None and alive(pid)]
    print(f"stopped {len(stop_trees(roots, grace_s)) if roots else 0} process(es)")
    for path in argv[1:]:
        try:
            os.unlink(path)
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
