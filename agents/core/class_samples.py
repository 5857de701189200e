"""The HTB-class sample schema: the columns of a run's ``classes.parquet``, defined once.

With ``topo.class_sample_ms`` > 0 the controller reads the HTB class (``1:1``) of every
shaped point of the network over rtnetlink (``controller/class_sampler.py``) that often
and writes one row per point and sample. Where ``links.parquet`` samples the queue of
a few watched points every 100 ms, this is fine enough to integrate a link's bytes over
one all-to-all phase of tens of milliseconds (analysis/moe.py). Counters are cumulative.
"""

from __future__ import annotations

#: Column -> meaning (units in the names).
CLASS_SAMPLE_COLUMNS: dict[str, str] = {
    "ts_ns": "CLOCK_MONOTONIC time right after the read (ns), the events' clock",
    "point": "the shaping point (e.g. gbh0.up, gbh0.down)",
    "dev": "the interface whose HTB class was read",
    "sent_bytes": "bytes the class let out (Ethernet frames, headers included, ACKs too; "
                  "cumulative)",
    "data_bytes": "bytes of those that were not pure ACKs (ack_first's data class 1:11, "
                  "on a host's own egress; where ACKs are not split, e.g. a switch port, "
                  "= sent_bytes; cumulative)",
    "sent_pkts": "packets the class let out (cumulative)",
    "drops": "the class's drops (cumulative)",
    "overlimits": "times the class was throttled (cumulative)",
    "backlog_bytes": "bytes in its leaf queue at the read",
    "rate_mbps": "the class's rate at the read (Mbit/s)",
}
CLASS_COLUMNS: tuple[str, ...] = tuple(CLASS_SAMPLE_COLUMNS)
