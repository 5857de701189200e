"""analysis.metrics.agent_limited on hand-built link samples with known answers: a link
busy half the window with an empty shaper is agent-limited; with a queue, or busy, it is
not; no sample inside the windows says unknown."""

from __future__ import annotations

import pandas as pd

from analysis import metrics
from analysis import pipeline as analysis_pipeline

RATE_MBPS = 100.0
BYTES_PER_S = RATE_MBPS * 1e6 / 8


def samples(busy: float, backlog_bytes: int, seconds: int = 4) -> pd.DataFrame:
    """Samples every 100 ms of an up link that delivers ``busy`` of its rate."""
    n = seconds * 10 + 1
    return pd.DataFrame({
        "ts_ns": [i * 100_000_000 for i in range(n)], "direction": "up", "dev": "s1-eth1",
        "sent_bytes": [int(i * 0.1 * BYTES_PER_S * busy) for i in range(n)],
        "sent_pkts": 0, "drops": 0, "overlimits": 0, "backlog_bytes": backlog_bytes,
        "backlog_pkts": backlog_bytes // 1514, "rate_mbps": RATE_MBPS})


WINDOW = [(0, 500_000_000, 3_500_000_000)]


def test_idle_link_with_an_empty_shaper_is_agent_limited() -> None:
    limited, why = metrics.agent_limited(samples(0.5, 0), WINDOW)
    assert limited is True
    assert why.startswith("agent-limited") and "0.50" in why


def test_a_queue_at_the_shaper_is_not_the_agents() -> None:
    limited, why = metrics.agent_limited(samples(0.5, 200_000), WINDOW)
    assert limited is False and "queue" in why


def test_a_busy_link_is_network_limited() -> None:
    limited, why = metrics.agent_limited(samples(0.97, 0), WINDOW)
    assert limited is False and why.startswith("network-limited")


def test_the_threshold_is_the_defined_one() -> None:
    below = metrics.AGENT_LIMITED_BUSY - 0.02
    above = metrics.AGENT_LIMITED_BUSY + 0.02
    assert metrics.agent_limited(samples(below, 0), WINDOW)[0] is True
    assert metrics.agent_limited(samples(above, 0), WINDOW)[0] is False


def test_windows_outside_the_samples_are_unknown() -> None:
    limited, why = metrics.agent_limited(samples(0.5, 0), [(0, 9_000_000_000,
                                                             9_500_000_000)])
    assert limited is None and "unknown" in why
    empty = samples(0.5, 0).iloc[:0]
    assert metrics.agent_limited(empty, WINDOW)[0] is None


def two_points(busy: float, backlog_bytes: int = 0) -> pd.DataFrame:
    """Samples of two access links: ``a.up`` delivers ``busy`` of its rate, ``b.up`` a
    tenth of that (the acknowledgements of what ``a`` sends)."""
    a = samples(busy, backlog_bytes).assign(direction="a.up")
    b = samples(busy / 10, 0).assign(direction="b.up")
    return pd.concat([a, b], ignore_index=True)


def test_each_window_goes_to_the_link_that_carried_most() -> None:
    links = two_points(0.5)
    got = metrics.busiest_point_windows(links, WINDOW + [(1, 9_000_000_000, 9_100_000_000)])
    assert got == {"a.up": WINDOW}  # the window past the samples is left out
    limited, why = metrics.agent_limited_points(links, got)
    assert limited is True and "a.up" in why and "0.50" in why
    assert metrics.agent_limited_points(two_points(0.95), got)[0] is False
    assert metrics.agent_limited_points(two_points(0.5, 200_000), got)[0] is False
    # The busy fraction is pooled over every point's windows: 0.5 and 0.05 of the rate.
    both = metrics.agent_limited_points(links, {"a.up": WINDOW, "b.up": WINDOW})
    assert both[0] is True and "0.28" in both[1]


def test_a_senders_overlapping_windows_merge_into_one() -> None:
    got = metrics.merge_windows([("s0", 0, 100, 200), ("s0", 0, 150, 300), ("s1", 0, 120, 130),
                                 ("s0", 1, 400, 500), ("s0", 1, 300, 350), ("s1", 2, 7, 7)])
    assert got == [(0, 100, 350), (0, 120, 130), (1, 400, 500)]


def test_a_pipeline_message_lasts_from_its_send_to_its_arrival() -> None:
    ev = pd.DataFrame([
        # r0s0 -> r0s1 activation, r0s1 -> r0s0 gradient, and replica 1's activation.
        {"event": "pp_send", "node": "r0s0", "iter": 0, "kind": "SA", "mb": 1, "chunk": 0,
         "to": 1, "start_ns": 100, "end_ns": 110},
        {"event": "pp_recv", "node": "r0s1", "iter": 0, "kind": "RA", "mb": 1, "chunk": 0,
         "from_stage": 0, "arrived_ns": 180},
        {"event": "pp_send", "node": "r0s1", "iter": 0, "kind": "SG", "mb": 1, "chunk": 0,
         "to": 0, "start_ns": 200, "end_ns": 205},
        {"event": "pp_recv", "node": "r0s0", "iter": 0, "kind": "RG", "mb": 1, "chunk": 0,
         "from_stage": 1, "arrived_ns": 260},
        {"event": "pp_send", "node": "r1s0", "iter": 1, "kind": "SA", "mb": 5, "chunk": 0,
         "to": 1, "start_ns": 300, "end_ns": 301},
        # The same micro-batch's activation reached replica 0's stage 1 too late to match
        # replica 1's send: only r1s1's arrival counts.
        {"event": "pp_recv", "node": "r1s1", "iter": 1, "kind": "RA", "mb": 5, "chunk": 0,
         "from_stage": 0, "arrived_ns": 390},
        {"event": "pp_recv", "node": "r0s1", "iter": 1, "kind": "RA", "mb": 5, "chunk": 0,
         "from_stage": 0, "arrived_ns": 999},
    ])
    assert analysis_pipeline.transfer_windows(ev) == [(0, 100, 180), (0, 200, 260),
                                                     (1, 300, 390)]
    assert analysis_pipeline.transfer_windows(ev[ev["event"] == "pp_send"]) == []
