"""Event log shared by every process of a run.

Every process (worker, PS, controller) appends one JSON object per line to
``RUN_DIR/events/NODE.jsonl``. Each line is flushed as it is written, so a run
killed at any moment leaves every event up to that moment on disk. When the run
ends (or is interrupted) the controller converts each JSONL file into
``events/NODE.parquet`` (see :func:`jsonl_to_parquet`).

Columns common to every event (the schema, version :data:`SCHEMA_VERSION`):

- ``ts_ns``  -- ``time.clock_gettime_ns(CLOCK_MONOTONIC)``; Mininet hosts share
  the kernel, so all nodes share this clock.
- ``run_id`` -- the run's id (the run directory's name).
- ``node``   -- ``ps``, ``w0`` .. ``wN-1``, or ``controller``.
- ``iter``   -- training iteration, ``-1`` when not tied to one.
- ``event``  -- one of the names below; the remaining keys are its fields.

Event names and their fields (units in the names):

worker  ``compute_done``  compute_s, loss
        ``compress_done`` key, ratio, raw_bytes, wire_bytes, residual_norm, compress_s
        ``send_done``     bytes, send_s, start_ns (when the first chunk's compression began)
        ``tcp_info``      bytes_acked, delivery_rate_bps, rtt_us, cwnd, pacing_rate_bps,
                          total_retrans
        ``decision``      r0_bps, rt_bps, sent_bytes, remaining_bytes, keep, reason
        ``recv_done``     bytes, wait_s
        ``iter_done``     iter_s, compute_s, compress_s, send_s, wait_s, bytes_up,
                          bytes_down, loss
ps      ``ps_iter_done``  agg_s, bytes_in, bytes_out, workers
        ``eval``          loss, accuracy
        ``frame_error``   peer, error
        ``worker_lost``   worker, reason
expert  ``moe_start``       hosts, experts, owned, expert_numel, zero3_numel, zero2_numel,
        (eN, agents.expert)     max_frame_bytes
        ``moe_phase``       phase (forward, backward, dispatch_counts, dispatch_tokens,
                            expert, combine, combine_grad, tokens_grad, all_gather_zero3,
                            reduce_scatter_and_update), layer, start_ns, end_ns, dur_s,
                            bytes_up, bytes_down (frames), payload_up, payload_down
        ``moe_route``       layer, capacity, tokens, kept, dropped (lists per expert, this
                            host's tokens), imbalance
        ``moe_class_bytes`` expert_bytes, zero3_bytes, zero2_bytes (uplink, this step) and
                            zero3_formula_bytes, zero2_formula_bytes
        ``moe_step``        loss, ce, aux, step_s, expert_uses ("layer.expert", in order)
        ``moe_done``; ``eval`` (host 0: loss, accuracy)
ctrl    ``run_start``, ``run_end`` (reason), ``trace_step`` (direction, rate_mbps),
        ``shape`` (worker, rate_mbps, method), ``tc`` (cmd)
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import IO, Any

SCHEMA_VERSION = 1


def now_ns() -> int:
    """CLOCK_MONOTONIC in nanoseconds: the one clock every node of a run shares."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class EventLog:
    """Append-only JSONL event writer for one node. Not thread-safe across processes:
    each node owns its own file."""

    def __init__(self, path: str | os.PathLike[str], run_id: str, node: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id
        self.node = node
        self._fh: IO[str] | None = open(self.path, "a", buffering=1, encoding="utf-8")

    @classmethod
    def for_node(cls, run_dir: str | os.PathLike[str], run_id: str, node: str) -> EventLog:
        return cls(Path(run_dir) / "events" / f"{node}.jsonl", run_id, node)

    def emit(self, event: str, iter: int = -1, **fields: Any) -> None:
        if self._fh is None:
            return
        row = {"ts_ns": now_ns(), "run_id": self.run_id, "node": self.node,
               "iter": int(iter), "event": event}
        row.update(fields)
        self._fh.write(json.dumps(row, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read a JSONL event file. A truncated last line (a process killed mid-write)
    is skipped; any other bad line raises with the file and line number."""
    rows: list[dict[str, Any]] = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if lineno == len(lines):
                break
            raise ValueError(f"{path}:{lineno}: bad event line: {e}") from e
    return rows


def jsonl_to_parquet(jsonl: str | os.PathLike[str]) -> Path:
    """Convert one node's JSONL events into Parquet beside it, atomically
    (write to a temporary name, then rename). Returns the Parquet path."""
    import pandas as pd

    src = Path(jsonl)
    dst = src.with_suffix(".parquet")
    rows = read_jsonl(src)
    df = pd.DataFrame(rows)
    for col in ("ts_ns", "iter"):
        if col in df:
            df[col] = df[col].astype("int64")
    # Mixed-type object columns (a field that is sometimes str, sometimes number)
    # cannot go to Arrow as-is; store them as strings.
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col].dropna()}
            if len(kinds) > 1:
                df[col] = df[col].map(lambda v: None if v is None else str(v))
    tmp = dst.with_suffix(".parquet.tmp")
    df.to_parquet(tmp, index=False)
    os.replace(tmp, dst)
    return dst
