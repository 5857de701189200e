"""MoE measurements (agents/core/moe_metrics.py) and their tables (analysis/moe.py)."""

from __future__ import annotations

import math

import pytest

from agents.core.moe_metrics import dispatch_efficiency, drop_fraction, load_imbalance
from analysis import moe as amoe


def test_metrics() -> None:
    assert load_imbalance([4, 4, 4, 4]) == 1.0
    assert load_imbalance([16, 0, 0, 0]) == 4.0
    assert load_imbalance([0, 0]) == 0.0
    assert drop_fraction([3, 3], [1, 1]) == 0.25
    # 100 Mbit/s for 1 s carries 12.5 MB x 1448/1514 of TCP payload.
    assert math.isclose(dispatch_efficiency(int(12.5e6 * 1448 / 1514), 1.0, 100.0), 1.0,
                        rel_tol=1e-6)
    with pytest.raises(ValueError):
        dispatch_efficiency(1, 0.0, 100.0)


def phase(node: str, it: int, name: str, start_s: float, end_s: float, up: int, down: int,
          pay_up: int = 0, pay_down: int = 0) -> dict:
    return {"event": "moe_phase", "node": node, "iter": it, "layer": 0, "phase": name,
            "dur_s": end_s - start_s, "bytes_up": up, "bytes_down": down,
            "payload_up": pay_up, "payload_down": pay_down, "start_ns": int(start_s * 1e9),
            "end_ns": int(end_s * 1e9)}


def test_tables() -> None:
    rows = [phase("e0", 1, "dispatch_counts", 1.00, 1.01, 200, 200),
            phase("e0", 1, "dispatch_tokens", 1.01, 1.10, 1_000_192, 500_192, 1_000_000,
                  500_000),
            # e1 enters 50 ms later and ends later: the dispatch spans 1.05 - 1.15 s.
            phase("e1", 1, "dispatch_counts", 1.05, 1.06, 200, 200),
            phase("e1", 1, "dispatch_tokens", 1.06, 1.15, 600_192, 700_192, 600_000,
                  700_000),
            phase("e0", 1, "combine", 2.0, 7.0, 9, 9),  # not part of the dispatch
            {"event": "moe_route", "node": "e0", "iter": 1, "layer": 0,
             "kept": [3, 1], "dropped": [1, 0]},
            {"event": "moe_route", "node": "e1", "iter": 1, "layer": 0,
             "kept": [1, 3], "dropped": [0, 0]}]
    (d,) = amoe.dispatch_table(rows, 100.0)
    assert d["phase_s"] == pytest.approx(0.10)
    assert d["arrival_spread_s"] == pytest.approx(0.05)
    assert d["payload_bytes"] == 1_000_000 and d["frame_bytes"] == 1_000_392
    assert d["efficiency"] == pytest.approx(dispatch_efficiency(1_000_000, 0.10, 100.0))
    assert d["utilisation"] == pytest.approx(dispatch_efficiency(1_000_392, 0.10, 100.0))
    (r,) = amoe.route_table(rows)
    assert r["kept"] == [4, 4] and r["dropped"] == [1, 0] and r["hosts"] == 2
    assert r["imbalance"] == 1.0 and r["drop_fraction"] == pytest.approx(1 / 9)
