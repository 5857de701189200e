"""``gradbed cleanup``: remove what a crashed or killed run left, and finish its directory.

A controller killed with SIGKILL runs no ``finally``: its network (bridge, veths, qdiscs,
host shells), its agents, the run's secret and control socket stay behind, and the run
directory has no ``summary.json``. This command removes the network and the processes
(:func:`topo.cleanup.cleanup`: gradbed's own names only, never another emulation's), on
this machine and, for a run placed over several servers, on each of them over ssh first
(:func:`clean_servers`), then finishes every run whose controller is gone
(:func:`controller.rundir.orphaned_runs`, or the directories given on the command line): secret and socket removed, events converted, and a
``summary.json`` computed from the agents' events with ``stop_reason: "controller killed"``
where none exists, so the directory loads and explains itself. Idempotent.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from controller import rundir
from topo.cleanup import cleanup, stale_ssh_dirs
from topo.lock import LockTimeout, NetLock

KILLED = "controller killed"


def clean_servers(run_dirs: Sequence[Path] = (), wait_s: float = 30.0) -> list[str]:
    """The other servers of every killed run placed over several (the record its
    controller kept in root's ``/run/gradbed/clusters``, never one read from the run
    directory): gradbed's agents, shells and links there removed over ssh under each
    server's own network lock (waited for up to ``wait_s``; a server whose lock another
    run holds is named and left alone), and the run's directory there gathered into the
    run's own (``controller.remote``)."""
    from controller.remote import RECORD_DIR, cleanup_run, registered

    lines: list[str] = []
    if not RECORD_DIR.is_dir():
        return lines
    dirs = [Path(d).absolute() for d in run_dirs] + [d for _, d in rundir.orphaned_runs()]
    for run_dir in dict.fromkeys(dirs):
        record = registered(run_dir)
        if record is None:
            continue
        done = cleanup_run(run_dir, record, wait_s)
        lines += [f"{run_dir}: {line}" for line in done]
        if not any(": not cleaned" in line for line in done):  # else kept for a rerun
            (RECORD_DIR / f"{run_dir.name}.json").unlink(missing_ok=True)
    return lines


def finish_orphans(run_dirs: Sequence[Path] = ()) -> list[str]:
    """Finish the run directories whose controller is gone; one line per thing done."""
    lines: list[str] = []
    # A run named on the command line that is also registered: its entry goes too.
    registered = {d: e for e, d in rundir.orphaned_runs()}
    targets = [(registered.pop(Path(d).absolute(), None), Path(d).absolute())
               for d in run_dirs] + [(e, d) for d, e in registered.items()]
    seen: set[Path] = set()
    for entry, run_dir in targets:
        if run_dir in seen:
            continue
        seen.add(run_dir)
        if entry is None:  # named on the command line: maybe by a user steering root
            why = rundir.not_a_run_dir(run_dir)
            if why:
                lines.append(f"{run_dir}: not finished: {why}")
                continue
        if run_dir.is_dir():
            lines += [f"{run_dir}: {line}" for line in rundir.finish(run_dir, KILLED)]
        if entry is not None:
            entry.unlink(missing_ok=True)
    return lines


def cleanup_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gradbed cleanup",
        description="Remove gradbed's leftover agents, Mininet host shells, bridges and veths, "
                    "and finish the run directories of killed controllers (idempotent)")
    parser.add_argument("run_dirs", nargs="*", type=Path, metavar="RUN_DIR",
                        help="run directories to finish as well (found by themselves when "
                             "their controller registered them under /run/gradbed/runs)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    parser.add_argument("--wait-s", type=float, default=30.0,
                        help="how long to wait for a run in progress to release the network")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        # The other servers first, each under its own network lock and one at a time:
        # holding this machine's lock meanwhile could deadlock with a run that takes
        # the servers' locks in address order (topo.server_lock).
        removed = clean_servers(args.run_dirs, args.wait_s)
        # Under the network lock: a run in progress owns its network; wait for it
        # rather than pull its hosts away. Processes go first, so the events are final.
        with NetLock(timeout_s=args.wait_s):
            removed += cleanup()
            removed += finish_orphans(args.run_dirs)
        # The servers are cleaned by now: the dead controllers' ssh connections can go.
        removed += stale_ssh_dirs()
    except LockTimeout as exc:
        print(f"gradbed cleanup: {exc}", file=sys.stderr)
        return 1
    except PermissionError as exc:
        print(f"gradbed cleanup: {exc} (run as root)", file=sys.stderr)
        return 1
    if not args.quiet:
        for line in removed:
            print(line)
        print(f"removed {len(removed)} item(s)" if removed else "nothing to clean up")
    return 0
