"""The link-sample schema: the columns of a run's ``links.parquet``, defined once.

The controller samples each bottleneck direction's HTB leaf every 100 ms (``tc -s`` counters
over rtnetlink) and writes one row per sample; the analysis reads them back. Counters are
cumulative since the qdisc was created; a counter that goes backwards means it was re-created.
"""

from __future__ import annotations

#: Column -> meaning (units in the names). Every links.parquet row has every column.
LINK_SAMPLE_COLUMNS: dict[str, str] = {
    "ts_ns": "CLOCK_MONOTONIC time of the sample (ns), the events' clock",
    "direction": "up (workers -> PS) or down (PS -> workers)",
    "dev": "the interface whose qdisc was read",
    "sent_bytes": "bytes the qdisc has sent (Ethernet frames, headers included; cumulative)",
    "sent_pkts": "packets the qdisc has sent (cumulative)",
    "drops": "packets the qdisc has dropped (cumulative)",
    "overlimits": "times HTB had to delay a packet over its rate (cumulative)",
    "backlog_bytes": "bytes queued at the sample (instantaneous)",
    "backlog_pkts": "packets queued at the sample (instantaneous)",
    "rate_mbps": "the HTB rate in force at the sample (Mbit/s): what the link allows",
}
LINK_COLUMNS: tuple[str, ...] = tuple(LINK_SAMPLE_COLUMNS)
#: Columns a loader insists on (older runs lack ``overlimits``).
REQUIRED_LINK_COLUMNS: tuple[str, ...] = tuple(c for c in LINK_COLUMNS if c != "overlimits")
