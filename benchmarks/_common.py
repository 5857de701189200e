"""Shared output format for every benchmark (DESIGN.md section 5).

Each benchmark prints human-readable progress to stderr and, as its very last
stdout line, one JSON object: ``{"name", "headline", "unit", "target", "details"}``.
``details`` holds every measurement behind the headline so anyone can recompute it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from typing import Any

# Benchmarks import the project's packages from the repository root.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def emit(name: str, headline: float, unit: str, target: str, details: dict[str, Any]) -> None:
    details = dict(details)
    details.setdefault("machine", {"cpus": os.cpu_count(), "python": platform.python_version(),
                                   "kernel": platform.release()})
    print(json.dumps({"name": name, "headline": headline, "unit": unit, "target": target,
                      "details": details}, default=float))
