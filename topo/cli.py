"""``gradbed probe`` and ``gradbed cleanup``: kernel capabilities as JSON, leftovers removed.

``gradbed probe`` dispatches to ``probe_main``; ``gradbed cleanup`` runs
``controller.cleanup.cleanup_main``, which adds finishing killed runs' directories to the
network cleanup that ``cleanup_main`` here does alone. Both return a process exit code and
never raise on expected failures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from topo.cleanup import cleanup
from topo.lock import LockTimeout, NetLock
from topo.probe import probe


def probe_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradbed probe",
                                     description="Print this kernel's emulation capabilities "
                                                 "as JSON (netem, fq, congestion controls...)")
    parser.parse_args(list(argv) if argv is not None else None)
    caps = probe()
    print(json.dumps(caps, indent=2, sort_keys=True))
    for tool, consequence in caps.get("unchecked", {}).items():
        print(f"gradbed probe: {tool} not found: {consequence}", file=sys.stderr)
    # Without root the qdisc trials cannot run: say so through the exit code too.
    return 0 if "qdisc_probe_error" not in caps else 2


def cleanup_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gradbed cleanup",
                                     description="Remove gradbed's leftover agents, Mininet "
                                                 "host shells, bridges and veths (idempotent)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing")
    parser.add_argument("--wait-s", type=float, default=30.0,
                        help="how long to wait for a run in progress to release the network")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        # Under the network lock: a run in progress owns its network; wait for it
        # rather than pull its hosts away.
        with NetLock(timeout_s=args.wait_s):
            removed = cleanup()
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
