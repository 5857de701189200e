"""The environment every agent process starts with.

glibc's malloc, left to itself, adapts its mmap threshold: the first large buffer an
agent frees (a gradient, a chunk, a serialised message) raises the threshold, so the next
iteration's buffers of that size come from the heap instead, whose pages are new and
fault in one by one; and the heap's top is trimmed back to the system whenever more than
twice the threshold is free. An agent allocates the same buffers every iteration, so the
first steady iteration paid for the allocator's learning: at 1 Gbit/s (16 workers, 20 MB
gradients) link/N's iteration 1 took 3.74-3.93 s against 2.96-3.21 s after it.

``allocator = "steady"`` fixes both thresholds before the interpreter starts (glibc reads
``GLIBC_TUNABLES`` once, at start-up; ``mallopt`` from Python would come after the
interpreter's own allocations): buffers under 64 MB come from the heap from the first
iteration on, and freed pages stay with the agent for the next. The cost is that an agent
keeps its peak heap until it exits. A ``GLIBC_TUNABLES`` the user set is left alone, and so
is the user's ``PYTHONPATH`` (gradbed's folder goes in front of it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from agents.core.config import ALLOCATORS

# Buffers up to 64 MB from the heap; the heap is never trimmed (2 GiB - 1).
STEADY_TUNABLES = "glibc.malloc.mmap_threshold=67108864:glibc.malloc.trim_threshold=2147483647"


def python_path(base: Mapping[str, str], repo_root: str) -> str:
    """gradbed's own folder first (the agents must import this gradbed, not another one on
    the path), then the user's ``PYTHONPATH``, kept: it may hold what the workloads import,
    e.g. a CUDA build of torch unpacked outside the system's site-packages."""
    mine = [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != repo_root]
    return os.pathsep.join([repo_root, *mine])


def agent_environment(base: Mapping[str, str], repo_root: str, allocator: str) -> dict[str, str]:
    """``base`` plus what every agent needs; pure, so it is tested without processes."""
    env = {**base, "PYTHONPATH": python_path(base, repo_root), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    if allocator == "steady" and "GLIBC_TUNABLES" not in base:
        env["GLIBC_TUNABLES"] = STEADY_TUNABLES
    elif allocator not in ALLOCATORS:
        raise ValueError(f"run.allocator = {allocator!r}: must be {' or '.join(ALLOCATORS)}")
    return env
