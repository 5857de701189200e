"""Write a synthetic but realistic run directory (DESIGN.md section 2) without Mininet.

It stands in for a controller run in the analysis tests that must not need root: the same
files, the same event names and fields (agents/core/events.py), and numbers that behave like a
shaped star topology -- N workers share a bottleneck whose trace steps from ``rate_mbps`` to
``rate_mbps / 2`` halfway through, an adaptive policy lowers the keep ratio when the rate
drops, the PS evaluates every few iterations. Everything is computed here independently of
``analysis`` so the analysis code is checked against numbers it did not produce.

Run as a script to write one: ``python tests/support/make_fake_run.py OUT_DIR``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import tomli_w

SCHEMA_VERSION = 1
BASE_NS = 5_000_000_000_000  # CLOCK_MONOTONIC is arbitrary; start far from zero like a real host
GOODPUT_SHARE = 0.95  # TCP payload share of the HTB rate (DESIGN.md section 3)


def fake_tcp_samples(base_ns: int) -> pd.DataFrame:
    """tcp.parquet as ``gradbed torchrun`` writes it: gbh0's connection to gbh1 sends
    1.25 MB per second for two seconds (10 Mbit/s) and receives half that, its last
    counters once more from the destroy message; a loopback connection beside it, a
    dual-stack one and a listening socket."""
    conn = {"host": "gbh0", "family": 2, "state": "ESTABLISHED", "src": "10.0.0.10",
            "sport": 40000, "dst": "10.0.0.11", "dport": 29500, "bytes_retrans": 0,
            "total_retrans": 0, "delivery_rate_bps": 0.0}
    rows = []
    for i, (acked, cwnd, final) in enumerate([(0, 10, False), (1_250_000, 20, False),
                                              (2_500_000, 30, False)]):
        rows.append({**conn, "ts_ns": base_ns + i * 1_000_000_000, "local": False,
                     "cookie": 1, "bytes_acked": acked, "bytes_received": acked // 2,
                     "snd_cwnd_pkts": cwnd, "rtt_us": 10_000 + 1000 * i, "final": final})
    rows.append({**rows[-1], "final": True})  # the destroy message, same instant
    # A dual-stack socket (the c10d store's) reports IPv4 mapped into IPv6; a listening
    # socket is no connection.
    for i in range(2):
        rows.append({**conn, "ts_ns": base_ns + i * 1_000_000_000, "local": False,
                     "cookie": 3, "src": "::ffff:a00:b", "sport": 51000, "dst": "::ffff:a00:a",
                     "dport": 29500, "bytes_acked": 1000 * i, "bytes_received": 0,
                     "snd_cwnd_pkts": 10, "rtt_us": 10_000, "final": False})
        rows.append({**conn, "ts_ns": base_ns + i * 1_000_000_000, "local": False,
                     "cookie": 4, "state": "LISTEN", "dst": "0.0.0.0", "dport": 0,
                     "bytes_acked": 0, "bytes_received": 0, "snd_cwnd_pkts": 10,
                     "rtt_us": 0, "final": False})
    for i in range(3):
        rows.append({**conn, "ts_ns": base_ns + i * 1_000_000_000, "local": True,
                     "cookie": 2, "src": "127.0.0.1", "dst": "127.0.0.1",
                     "bytes_acked": 10**9 * i, "bytes_received": 0, "snd_cwnd_pkts": 10,
                     "rtt_us": 50, "final": False})
    return pd.DataFrame(rows)


def make_fake_run(run_dir: str | Path, *, workers: int = 4, iterations: int = 30,
                  rate_mbps: float = 100.0, compressor: str = "topk", keep: float = 0.1,
                  adaptive: bool = True, seed: int = 0, jsonl_only: bool = False,
                  name: str = "fake") -> Path:
    """Write the run directory and return its path."""
    rng = np.random.default_rng(seed)
    run = Path(run_dir)
    (run / "events").mkdir(parents=True, exist_ok=True)
    run_id = run.name
    raw_bytes = 4 * 1_000_000  # a 1M-parameter fp32 gradient
    rows: dict[str, list[dict[str, Any]]] = {f"w{i}": [] for i in range(workers)}
    rows["ps"] = []
    rows["controller"] = []

    def emit(node: str, t_s: float, event: str, it: int = -1, **fields: Any) -> None:
        rows[node].append({"ts_ns": BASE_NS + int(round(t_s * 1e9)), "run_id": run_id,
                           "node": node, "iter": it, "event": event, **fields})

    def rate_at(t_s: float, t_step: float) -> float:
        return rate_mbps if t_s < t_step else rate_mbps / 2

    emit("controller", 0.0, "run_start")
    emit("controller", 0.0, "trace_step", direction="up", rate_mbps=rate_mbps)
    for i in range(workers):
        emit("controller", 0.001, "shape", worker=i, rate_mbps=rate_mbps / workers,
             method="tc")

    emit("ps", 0.15, "ps_ready", numel=raw_bytes // 4, chunks=1, compressor=compressor)
    t = 0.2
    busy: list[tuple[float, float, float]] = []  # (start, end, rate_mbps) of the shared uplink
    busy_down: list[tuple[float, float]] = []
    t_step = math.inf
    acked = [0] * workers
    for it in range(iterations):
        if it == iterations // 2:
            t_step = t
            emit("controller", t, "trace_step", direction="up", rate_mbps=rate_mbps / 2)
        rate = rate_at(t, t_step)
        compute = [0.05 + 0.005 * float(rng.random()) for _ in range(workers)]
        compress = 0.004
        if compressor == "none":
            k = 1.0
        elif adaptive:
            k = min(1.0, keep * rate / rate_mbps)  # halve the keep ratio when the rate halves
        else:
            k = keep
        wire = int(raw_bytes * k * (2 if compressor != "none" else 1))  # values + indices
        t_send0 = t + max(compute) + compress
        send_s = wire * workers * 8 / (rate * 1e6 * GOODPUT_SHARE)
        t_send1 = t_send0 + send_s
        busy.append((t_send0, t_send1, rate))
        agg_s = 0.003
        down_bytes = wire * workers
        recv_s = down_bytes * 8 / (rate_mbps * 1e6 * GOODPUT_SHARE)
        busy_down.append((t_send1 + agg_s, t_send1 + agg_s + recv_s))
        t_end = t_send1 + agg_s + recv_s + 0.002
        for w in range(workers):
            node = f"w{w}"
            loss = 2.3 * math.exp(-it / 12) + 0.05 * float(rng.random())
            emit(node, t + compute[w], "compute_done", it, compute_s=compute[w], loss=loss)
            emit(node, t + compute[w] + compress, "compress_done", it, key="all", ratio=k,
                 raw_bytes=raw_bytes, wire_bytes=wire, residual_norm=1.0 - k,
                 compress_s=compress)
            if adaptive:
                emit(node, t_send0, "decision", it, r0_bps=rate_mbps / workers * 1e6,
                     rt_bps=rate / workers * 1e6, sent_bytes=0, remaining_bytes=raw_bytes,
                     keep=k, reason="stable")
            for j in range(1, 5):
                ts = t_send0 + send_s * j / 4
                acked[w] += wire // 4
                emit(node, ts, "tcp_info", it, bytes_acked=acked[w],
                     delivery_rate_bps=rate / workers * 1e6 * GOODPUT_SHARE, rtt_us=2000 + j,
                     cwnd=10 + j, pacing_rate_bps=rate / workers * 1e6, total_retrans=0)
            emit(node, t_send1, "send_done", it, bytes=wire, send_s=send_s,
                 start_ns=BASE_NS + int(round((t_send0 - compress) * 1e9)))
            wait_s = t_end - 0.002 - recv_s - t_send1
            emit(node, t_end - 0.001, "recv_done", it, bytes=down_bytes, wait_s=wait_s)
            emit(node, t_end, "iter_done", it, iter_s=t_end - t, compute_s=compute[w],
                 compress_s=compress, send_s=send_s + (max(compute) - compute[w]),
                 wait_s=wait_s, bytes_up=wire, bytes_down=down_bytes, loss=loss)
        emit("ps", t_send1, "grads_in", it, workers=workers)
        emit("ps", t_send1 + agg_s, "ps_iter_done", it, agg_s=agg_s, bytes_in=wire * workers,
             bytes_out=down_bytes, workers=workers)
        if it % 5 == 4 or it == iterations - 1:
            acc = 0.95 - 0.85 * math.exp(-(it + 1) / 10)
            emit("ps", t_end, "eval", it, loss=2.3 * math.exp(-it / 12), accuracy=acc)
        t = t_end
    emit("ps", t + 0.05, "final_eval", iterations, loss=2.3 * math.exp(-iterations / 12),
         accuracy=0.95 - 0.85 * math.exp(-iterations / 10))
    t_stop = t + 0.2
    emit("controller", t_stop, "run_end", reason="done")

    for node, node_rows in rows.items():
        path = run / "events" / f"{node}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for r in node_rows:
                fh.write(json.dumps(r) + "\n")
        if not jsonl_only:
            df = pd.DataFrame(node_rows)
            df.to_parquet(path.with_suffix(".parquet"), index=False)

    # tc -s samples every 100 ms: cumulative counters of the bottleneck in both directions.
    sample_t = np.arange(0.0, t_stop + 0.1, 0.1)
    link_rows = []
    for direction, spans in (("up", [(a, b, r) for a, b, r in busy]),
                             ("down", [(a, b, rate_mbps) for a, b in busy_down])):
        sent = 0.0
        drops = 0
        prev = 0.0
        for ts in sample_t:
            carried = 0.0
            for a, b, span_mbps in spans:
                ov = max(0.0, min(b, ts) - max(a, prev))
                # tc counts wire bytes: the HTB rate itself while the link is busy.
                carried += ov * span_mbps * 1e6 / 8
            sent += carried
            in_busy = carried > 0
            if in_busy and direction == "up":
                drops += int(rng.integers(0, 3))
            allowed = rate_mbps if direction == "down" else rate_at(ts, t_step)
            link_rows.append({"ts_ns": BASE_NS + int(round(ts * 1e9)), "direction": direction,
                              "dev": "s1-eth1" if direction == "up" else "s1-eth2",
                              "sent_bytes": int(sent), "sent_pkts": int(sent / 1514),
                              "drops": drops,
                              "backlog_bytes": int(rng.integers(20_000, 90_000)) if in_busy else 0,
                              "backlog_pkts": int(rng.integers(14, 60)) if in_busy else 0,
                              "rate_mbps": allowed})
            prev = ts
    if not jsonl_only:
        pd.DataFrame(link_rows).to_parquet(run / "links.parquet", index=False)

    config = {
        "run": {"name": name, "iterations": iterations, "seed": seed},
        "net": {"workers": workers, "bottleneck_mbps": rate_mbps,
                "bottleneck_down_mbps": rate_mbps, "worker_link_mbps": 1000.0,
                "queue_bytes": 150_000, "congestion": "cubic"},
        "workload": {"name": "mlp", "batch_size": 32},
        "compress": {"name": compressor, "ratio": keep, "error_feedback": True},
        "shaping": {"method": "tc"},
        "adaptive": {"enabled": adaptive, "eps": 0.1},
        "trace": {"up": "step", "down": ""},
    }
    (run / "config.toml").write_text(tomli_w.dumps(config), encoding="utf-8")
    meta = {"schema_version": SCHEMA_VERSION, "git_sha": "0" * 40,
            "command": ["gradbed", "run", "fake"], "versions": {"python": sys.version.split()[0]},
            "kernel": {"netem": False, "fq": False, "congestion": ["reno", "cubic", "bbr"]},
            "run_id": run_id, "started_ns": BASE_NS, "ended_ns": BASE_NS + int(t_stop * 1e9)}
    (run / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    if not jsonl_only:
        iters = [r["iter_s"] for n in rows if n.startswith("w") for r in rows[n]
                 if r["event"] == "iter_done"]
        evals = [r for r in rows["ps"] if r["event"] == "eval"]
        summary = {"workers": workers, "iterations": iterations, "wall_s": t_stop,
                   "iter_time_s_p50": float(np.percentile(iters, 50)),
                   "iter_time_s_p99": float(np.percentile(iters, 99)),
                   "bytes_up": sum(r["bytes_up"] for n in rows if n.startswith("w")
                                   for r in rows[n] if r["event"] == "iter_done"),
                   "bytes_down": sum(r["bytes_down"] for n in rows if n.startswith("w")
                                     for r in rows[n] if r["event"] == "iter_done"),
                   "final_loss": evals[-1]["loss"], "final_accuracy": evals[-1]["accuracy"],
                   "bottleneck_utilization": GOODPUT_SHARE, "jain_fairness": 1.0}
        (run / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    return run


if __name__ == "__main__":
    print(make_fake_run(sys.argv[1] if len(sys.argv) > 1 else "fake_run"))
