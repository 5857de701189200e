"""The pipeline's PS serves every stage connection on one event loop (agents/net/loop.py,
loopback processes): it runs as many threads with 8 stages as with 2 (the two runs of
conftest.py: one replica of 2 stages, four of 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.loopback  # starts real agent processes on 127.0.0.1


def _connected(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in
            (run_dir / "events" / "ps.jsonl").read_text().splitlines()]
    (ev,) = [r for r in rows if r["event"] == "ps_connected"]
    return ev


def test_the_stage_ps_runs_the_same_threads_with_2_and_8_stages(one_f_one_b_run,
                                                                 two_group_run) -> None:
    two, eight = _connected(one_f_one_b_run[0]), _connected(two_group_run[0])
    assert (two["stages"], eight["stages"]) == (2, 8)
    assert two["threads"] == eight["threads"], (two, eight)
