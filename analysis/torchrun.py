"""A ``gradbed torchrun`` run's per-host account, as the report shows it (pure).

``summary.json``'s ``torchrun`` section holds one number per host and quantity
(``controller.torchrun.proof`` defines each of them once) and one exit code per rank; these
functions only lay them out: one row per host with its ranks, their exit codes, the TCP
payload its ranks' connections carried and its interface's counters beside them, and one
row per sampled shaping point with its busy fraction. Nothing is recomputed here.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

#: ``torchrun.bytes`` keys shown per host, in this order (each a {host: value} map).
HOST_BYTES = ("payload_sent_bytes", "payload_received_bytes", "store_sent_bytes",
              "local_bytes", "interface_tx_bytes", "interface_rx_bytes",
              "interface_over_payload", "allreduce_equivalent_bytes", "connections")


def host_table(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per training host (node rank order): ``host``, ``ip``, ``ranks``,
    ``exit_codes`` (``"rank:code"`` each; ``running`` where none was recorded) and the
    per-host numbers of ``torchrun.bytes``. Empty when the run is no torchrun run."""
    tr = summary.get("torchrun")
    if not isinstance(tr, dict) or not tr.get("hosts"):
        return pd.DataFrame()
    codes = tr.get("exit_codes") or {}
    nbytes = tr.get("bytes") or {}
    rows = []
    hosts = sorted(tr["hosts"].items(), key=lambda kv: kv[1].get("node_rank", 0))
    for host, h in hosts:
        ranks = [int(r) for r in h.get("ranks", [])]
        row: dict[str, Any] = {
            "host": host, "ip": h.get("ip", ""),
            "ranks": ", ".join(map(str, ranks)),
            "exit_codes": ", ".join(f"{r}:{_code(codes.get(str(r)))}" for r in ranks)}
        for key in HOST_BYTES:
            row[key] = (nbytes.get(key) or {}).get(host)
        rows.append(row)
    return pd.DataFrame(rows)


def points_table(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per sampled shaping point: ``point`` and its ``busy_utilization``
    (``analysis.metrics.busy_utilization``, as the run recorded it). Empty when none."""
    tr = summary.get("torchrun")
    busy = tr.get("points_busy_utilization") if isinstance(tr, dict) else None
    if not busy:
        return pd.DataFrame()
    return pd.DataFrame([{"point": p, "busy_utilization": u} for p, u in sorted(busy.items())])


def _code(code: Any) -> str:
    return "running" if code is None else str(code)
