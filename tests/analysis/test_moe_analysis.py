"""MoE measurements (agents/core/moe_metrics.py) and their tables (analysis/moe.py)."""

from __future__ import annotations

import math

import pytest

from agents.core.moe_metrics import (
    dispatch_efficiency,
    dispatch_link_efficiency,
    drop_fraction,
    load_imbalance,
)
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
    # Counts: the window's start (e1 in at 1.05 s) to the last host holding them (1.06 s).
    assert d["counts_window_s"] == pytest.approx(0.01)
    assert d["combine_hosts_in_window"] == 0  # e0's combine began at 2.0 s, after 1.15 s
    # The counts in the token message (no counts round): e0 sends its tokens as soon as
    # it enters at 1.01 s, so the window opens there, not when e1 enters at 1.06 s.
    merged = [r for r in rows if r.get("phase") != "dispatch_counts"]
    (m,) = amoe.dispatch_table(merged, 100.0)
    assert m["phase_s"] == pytest.approx(0.14) and m["start_ns"] == int(1.01e9)
    assert m["arrival_spread_s"] == pytest.approx(0.05) and m["counts_window_s"] == 0
    assert m["efficiency"] == pytest.approx(dispatch_efficiency(1_000_000, 0.14, 100.0))
    (d2,) = amoe.dispatch_table([*rows, phase("e1", 1, "combine", 1.12, 1.3, 9, 9)], 100.0)
    assert d2["combine_hosts_in_window"] == 1  # e1's began at 1.12 s, inside the window
    (r,) = amoe.route_table(rows)
    assert r["kept"] == [4, 4] and r["dropped"] == [1, 0] and r["hosts"] == 2
    assert r["imbalance"] == 1.0 and r["drop_fraction"] == pytest.approx(1 / 9)
    # The same window measured by the links' HTB class samples (2 ms apart, 10 ms here
    # for brevity): gbh1.down sends 1.25 MB/s (10 Mbit/s) from 1.03 s on, gbh0.up half.
    import pandas as pd

    ts = [int(t * 1e9) for t in (1.00, 1.04, 1.06, 1.10, 1.14, 1.16, 1.20)]

    def cum(rate_bps: float, t0: float) -> list[int]:
        return [int(max(0.0, t / 1e9 - t0) * rate_bps) for t in ts]
    samples = pd.DataFrame(
        [{"ts_ns": t, "point": p, "sent_bytes": b, "data_bytes": b * 0.98}
         for p, series in (("gbh1.down", cum(1.25e6, 1.03)), ("gbh0.up", cum(0.625e6, 1.03)))
         for t, b in zip(ts, series, strict=True)])
    (lk,) = amoe.dispatch_link_table([d], samples, 10.0, burst_bytes=12_500)
    assert lk["busiest_point"] == "gbh1.down"
    # 1.05-1.15 s at 1.25 MB/s; the ends interpolated inside 1.04-1.06 and 1.14-1.16,
    # where the counter is linear, so exactly.
    assert lk["link_bytes"] == pytest.approx(125_000, rel=0.01)
    assert lk["link_data_bytes"] == pytest.approx(0.98 * 125_000, rel=0.01)
    assert lk["link_efficiency"] == pytest.approx(1.0, rel=0.01)
    assert lk["link_efficiency_burst_allowed"] == pytest.approx(125_000 / 137_500, rel=0.01)
    assert lk["sample_gap_ms"] == pytest.approx(20, rel=0.01)
    # No interpolation: samples inside (1.06-1.14 s) and outside (1.04-1.16 s).
    assert lk["link_bytes_inner"] == pytest.approx(100_000, rel=0.001)
    assert lk["link_bytes_outer"] == pytest.approx(150_000, rel=0.001)
    assert lk["link_efficiency_burst_allowed_inner"] == pytest.approx(100_000 / 137_500,
                                                                      rel=0.01)
    assert dispatch_link_efficiency(1.25e6, 1.0, 10.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="not the window"):
        amoe.bytes_between(ts[2:], [0] * 5, d["start_ns"], d["end_ns"])


def test_the_transfer_windows_are_every_exchange_of_rows() -> None:
    def ns(t: float) -> int:
        return int(t * 1e9)
    rows = [phase("e0", 1, "dispatch_counts", 1.00, 1.01, 200, 200),
            phase("e0", 1, "dispatch_tokens", 1.01, 1.10, 9, 9),
            phase("e1", 1, "dispatch_counts", 1.05, 1.06, 200, 200),
            phase("e1", 1, "dispatch_tokens", 1.06, 1.15, 9, 9),
            phase("e0", 1, "expert", 1.15, 1.20, 0, 0),       # compute: not a transfer
            # The combine, from the first host in (e1, 1.21 s) to the last out (1.40 s).
            phase("e0", 1, "combine", 1.22, 1.30, 9, 9),
            phase("e1", 1, "combine", 1.21, 1.40, 9, 9),
            phase("e0", 1, "combine_grad", 2.00, 2.10, 9, 9),
            phase("e1", 1, "combine_grad", 2.05, 2.12, 9, 9),
            phase("e0", 1, "tokens_grad", 2.50, 2.60, 9, 9),
            phase("e1", 1, "tokens_grad", 2.50, 2.55, 9, 9),
            phase("e0", 2, "combine", 3.0, 3.1, 9, 9)]            # e1's is missing
    assert amoe.exchange_windows(rows, "combine") == [(1, ns(1.21), ns(1.40))]
    assert amoe.transfer_windows(rows) == [
        (1, ns(1.05), ns(1.15)), (1, ns(1.21), ns(1.40)), (1, ns(2.00), ns(2.12)),
        (1, ns(2.50), ns(2.60))]
    # A combine that does not wait for the whole dispatch overlaps it: one window, so
    # the link's bytes in the overlap count once.
    early = [r for r in rows if r["phase"] != "combine"]
    early += [phase("e0", 1, "combine", 1.11, 1.30, 9, 9),
              phase("e1", 1, "combine", 1.12, 1.40, 9, 9)]
    assert amoe.transfer_windows(early)[0] == (1, ns(1.05), ns(1.40))
