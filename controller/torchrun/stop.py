"""Stopping a host's torchrun and every process under it, wherever it runs.

torchrun starts each rank in a session of its own, so neither its process group nor the
end of an ssh session reaches the ranks: the tree is found from ``/proc``'s parent links
(:func:`controller.torchrun.busy.descendants`) and signalled process by process. On the
controller's machine :func:`stop_trees` runs in the controller; on another server
``python -m controller.torchrun.stop GRACE_S PID_FILE...`` runs there over ssh (the
pid files are written by the command that starts each torchrun), then removes the pid
files.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

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
    """SIGTERM each root and every process under it, then SIGKILL what is left after
    ``grace_s`` (a torchrun blocked in a store call handles SIGTERM only when the call
    returns). ``reap``: called while waiting, to collect the caller's own children.
    Returns the pids that were signalled."""
    tree = [q for pid in roots for q in [pid, *descendants(pid)]]
    signalled = list(tree)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            try:
                os.kill(pid, sig)
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
