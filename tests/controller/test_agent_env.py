"""Agents start with a steady glibc allocator (controller.agent_env).

The behavioural test runs a real interpreter with the environment an agent gets and
counts the page faults of the buffer an iteration allocates: glibc's adaptive threshold
makes the second iteration fault in a fresh 20 MB, the steady one reuses the first's pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from controller.agent_env import STEADY_TUNABLES, agent_environment

# Four "iterations", each allocating, touching and freeing one 20 MB buffer.
ITERATIONS = """
import json, resource
def faults(): return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
out = []
for _ in range(4):
    f0 = faults()
    b = bytearray(20_000_000)
    b[::4096] = bytes(len(b[::4096]))
    del b
    out.append(faults() - f0)
print(json.dumps(out))
"""
PAGES_20MB = 20_000_000 // 4096


def _faults(allocator: str) -> list[int]:
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env = agent_environment(base, "/nonexistent", allocator)
    res = subprocess.run([sys.executable, "-c", ITERATIONS], env=env, capture_output=True,
                         text=True, check=True, timeout=60)
    return list(json.loads(res.stdout))


def test_steady_reuses_the_pages_the_last_iteration_freed() -> None:
    steady, default = _faults("steady"), _faults("default")
    assert steady[0] > 0.9 * PAGES_20MB          # the first iteration faults its buffer in
    assert max(steady[1:]) < 0.05 * PAGES_20MB   # and every later one reuses it
    assert default[1] > 0.9 * PAGES_20MB         # glibc's own thresholds fault it in twice


def test_the_environment_every_agent_gets() -> None:
    env = agent_environment({"PATH": "/bin"}, "/repo", "steady")
    assert env == {"PATH": "/bin", "PYTHONPATH": "/repo", "PYTHONUNBUFFERED": "1",
                   "OMP_NUM_THREADS": "1", "GLIBC_TUNABLES": STEADY_TUNABLES}
    assert "GLIBC_TUNABLES" not in agent_environment({"PATH": "/bin"}, "/repo", "default")
    mine = agent_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}, "/r", "steady")
    assert mine["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=1"   # the user's wins
    with pytest.raises(ValueError, match="run.allocator"):
        agent_environment({}, "/r", "jemalloc")
