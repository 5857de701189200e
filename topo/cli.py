"""``gradbed probe``: this kernel's emulation capabilities as JSON.

``gradbed probe`` dispatches to ``probe_main`` (``gradbed cleanup`` lives in
``controller.cleanup``, which also finishes killed runs' directories). It returns a process
exit code and never raises on expected failures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

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

