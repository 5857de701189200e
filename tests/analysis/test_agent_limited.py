"""analysis.metrics.agent_limited on hand-built link samples with known answers: a link
busy half the window with an empty shaper is agent-limited; with a queue, or busy, it is
not; no sample inside the windows says unknown."""

from __future__ import annotations

import pandas as pd

from analysis import metrics

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
