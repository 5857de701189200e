"""What every example shares: the repository root (for its configs and traces, and on
``sys.path`` when gradbed is not installed) and the command line every example takes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout: `sudo python examples/NAME.py`
    sys.path.insert(0, str(ROOT))


def parse_args(doc: str, iterations: int) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--iterations", type=int, default=iterations,
                    help=f"training iterations (default {iterations})")
    ap.add_argument("--out", type=Path, default=Path("runs"), help="parent of the run dir")
    ap.add_argument("--quiet", action="store_true", help="no progress bar or status lines")
    ap.add_argument("--no-report", action="store_true",
                    help="write no report/index.html (gradbed report RUN writes it later)")
    return ap.parse_args()
