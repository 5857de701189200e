"""Every measured quantity of a run, defined once: plain functions of DataFrames whose
docstrings give the formula. ``summary.json`` (``controller/summary.py``), the HTML report,
the plots and the notebooks all call these functions; :data:`GLOSSARY` is the one-line
meaning of every column they print.

Definitions follow the literature the testbed is compared with:
- Jain's fairness index (Jain, Chiu, Hawe 1984, DEC-TR-301);
- bottleneck utilisation and queue/drops as Mininet-HiFi and Mahimahi report them;
- time-to-accuracy as in DAWNBench (Coleman et al. 2017) and the adaptive-compression
  papers (Accordion, DC2) the adaptive-ratio target is measured against;
- pipeline bubble fraction as in GPipe (Huang et al. 2019) and Megatron-LM (Narayanan et al.
  2021), measured here from per-stage busy intervals.

Inputs are the tables of :class:`analysis.load.Run` (``events`` with ``t_s``, ``links``,
``decisions``); the functions do no I/O.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from agents.core.nodes import PS_NODE, is_worker_node

ITERATION_PARTS = ("compute_s", "compress_s", "send_s", "wait_s", "receive_s")


def jain(shares: Iterable[float]) -> float:
    """Jain's fairness index ``J = (sum x)^2 / (n * sum x^2)`` over n shares.

    1 when all shares are equal, ``1/n`` when one flow takes everything. NaN for no shares or
    when every share is zero (fairness of nothing is undefined). Negative shares raise.
    """
    x = np.asarray(list(shares), dtype=float)
    if x.size == 0:
        return float("nan")
    if np.any(x < 0) or np.any(~np.isfinite(x)):
        raise ValueError(f"jain: shares must be finite and >= 0, got {x.tolist()}")
    sq = float(np.sum(x * x))
    if sq == 0.0:
        return float("nan")
    return float(np.sum(x)) ** 2 / (x.size * sq)


def _window_index(t_s: pd.Series, window_s: float, origin_s: float = 0.0) -> pd.Series:
    if window_s <= 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    return np.floor((t_s - origin_s) / window_s).astype("int64")


def _spread(starts: np.ndarray, ends: np.ndarray, amounts: np.ndarray, edges: np.ndarray
            ) -> np.ndarray:
    """Spread each amount uniformly over [start, end] and return its share per window
    [edges[i], edges[i+1]). A zero-length interval puts its whole amount in its window."""
    lo = np.maximum(starts[:, None], edges[None, :-1])
    hi = np.minimum(ends[:, None], edges[None, 1:])
    dur = ends - starts
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.clip(hi - lo, 0.0, None) / dur[:, None]
    point = dur <= 0
    if point.any():
        idx = np.clip(np.searchsorted(edges, ends[point], side="right") - 1, 0, len(edges) - 2)
        frac[point] = 0.0
        frac[np.nonzero(point)[0], idx] = 1.0
    return np.asarray((frac * amounts[:, None]).sum(axis=0))


def goodput(events: pd.DataFrame, by: str = "node", window_s: float = 1.0,
            source: str = "send_done") -> pd.DataFrame:
    """Goodput per ``by`` group (a worker, i.e. its one TCP flow to the PS) over time windows.

    Returns a long table ``t_s`` (window start), ``by``, ``bytes``, ``goodput_mbps`` =
    ``bytes * 8 / window_s / 1e6``, with a row for every group in every window (0 when idle).

    ``source="send_done"``: application bytes handed to the socket, each transfer's ``bytes``
    spread uniformly over ``[t_s - send_s, t_s]`` (the send it measured).
    ``source="tcp_info"``: bytes the peer acknowledged, from deltas of the cumulative
    ``tcpi_bytes_acked`` between consecutive samples of a group, credited at the later sample.
    A negative delta (a new connection restarts the counter) counts the new value.
    """
    df = events[events["event"] == source]
    cols = ["t_s", by, "bytes", "goodput_mbps"]
    if df.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    groups = sorted(df[by].astype(str).unique())
    if source == "send_done":
        end = df["t_s"].to_numpy(float)
        start = end - df["send_s"].fillna(0.0).to_numpy(float)
        amount = df["bytes"].to_numpy(float)
    elif source == "tcp_info":
        df = df.sort_values("ts_ns", kind="stable")
        acked = df["bytes_acked"].astype(float)
        delta = acked.groupby(df[by].astype(str), observed=True).diff()
        delta = delta.where(delta >= 0, acked)  # counter restarted: count the new value
        # The first sample of a group has no earlier reference: it bounds nothing.
        first = df.groupby(df[by].astype(str), observed=True).cumcount() == 0
        delta[first] = 0.0
        end = df["t_s"].to_numpy(float)
        start = end
        amount = delta.to_numpy(float)
    else:
        raise ValueError(f"goodput: source must be 'send_done' or 'tcp_info', got {source!r}")
    t0 = float(np.floor(np.min(start) / window_s) * window_s)
    n_win = int(np.floor((np.max(end) - t0) / window_s)) + 1
    edges = t0 + window_s * np.arange(n_win + 1)
    keys = df[by].astype(str).to_numpy()
    rows = []
    for g in groups:
        m = keys == g
        per_win = _spread(start[m], end[m], amount[m], edges)
        rows.append(pd.DataFrame({"t_s": edges[:-1], by: g, "bytes": per_win}))
    out = pd.concat(rows, ignore_index=True)
    out["goodput_mbps"] = out["bytes"] * 8 / window_s / 1e6
    return out[cols]


def jain_over_windows(df: pd.DataFrame, window_s: float = 1.0, by: str = "node",
                      value: str = "bytes") -> pd.DataFrame:
    """Jain's index per time window over the groups' summed ``value``.

    ``df`` has ``t_s``, ``by`` and ``value`` (for example :func:`goodput` output or raw
    ``send_done`` events). Every group seen anywhere in ``df`` counts in every window, with 0
    where it sent nothing, so a starved flow lowers the index. Windows in which nobody sent
    are left out. Returns ``t_s`` (window start), ``jain``, ``total``.
    """
    if df.empty:
        return pd.DataFrame({"t_s": pd.Series(dtype=float), "jain": pd.Series(dtype=float),
                             "total": pd.Series(dtype=float)})
    win = _window_index(df["t_s"].astype(float), window_s)
    table = (df.assign(_w=win, _g=df[by].astype(str))
             .pivot_table(index="_w", columns="_g", values=value, aggfunc="sum", fill_value=0.0))
    totals = table.sum(axis=1)
    table = table[totals > 0]
    return pd.DataFrame({"t_s": table.index.to_numpy(float) * window_s,
                         "jain": [jain(r) for r in table.to_numpy(float)],
                         "total": table.sum(axis=1).to_numpy(float)}).reset_index(drop=True)


def _link_deltas(links: pd.DataFrame, direction: str) -> pd.DataFrame:
    """Per-interval deltas of one direction's cumulative ``tc -s`` counters, one block per dev.

    Interval i runs from sample i-1 to sample i; its allowed rate is the HTB rate in force at
    sample i-1 (the rate the interval started with; a trace step inside a 100 ms interval is
    attributed to the next one). A counter that goes backwards (qdisc re-created) counts its
    new value.
    """
    df = links[links["direction"] == direction].sort_values(["dev", "ts_ns"], kind="stable")
    parts = []
    for dev, d in df.groupby("dev", sort=True):
        d = d.reset_index(drop=True)
        if len(d) < 2:
            continue
        out = pd.DataFrame({"dev": dev, "t_s": d["t_s"].to_numpy(float)[1:],
                            "dt_s": np.diff(d["t_s"].to_numpy(float))})
        for col in ("sent_bytes", "sent_pkts", "drops"):
            v = d[col].to_numpy(float)
            dv = np.diff(v)
            out[col] = np.where(dv >= 0, dv, v[1:])
        out["rate_mbps"] = d["rate_mbps"].to_numpy(float)[:-1]
        out["backlog_bytes"] = d["backlog_bytes"].to_numpy(float)[1:]
        out["backlog_pkts"] = d["backlog_pkts"].to_numpy(float)[1:]
        parts.append(out)
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in
                             ("dev", "t_s", "dt_s", "sent_bytes", "sent_pkts", "drops",
                              "rate_mbps", "backlog_bytes", "backlog_pkts")})
    return pd.concat(parts, ignore_index=True)


def link_throughput(links: pd.DataFrame, direction: str = "up") -> pd.DataFrame:
    """Delivered rate of the bottleneck per sample interval.

    ``throughput_mbps = delta(sent_bytes) * 8 / dt / 1e6`` (tc counts bytes on the wire, headers
    included, the same bytes the HTB rate limits), beside ``rate_mbps`` (what the trace allowed
    in that interval), ``backlog_bytes`` and ``drops`` (drops in the interval). Columns ``t_s``
    (interval end), ``dev``, ``throughput_mbps``, ``rate_mbps``, ``backlog_bytes``, ``drops``.
    """
    d = _link_deltas(links, direction)
    with np.errstate(invalid="ignore", divide="ignore"):
        thr = d["sent_bytes"].to_numpy(float) * 8 / d["dt_s"].to_numpy(float) / 1e6
    return pd.DataFrame({"t_s": d["t_s"].to_numpy(float), "dev": d["dev"].to_numpy(),
                         "throughput_mbps": thr, "rate_mbps": d["rate_mbps"].to_numpy(float),
                         "backlog_bytes": d["backlog_bytes"].to_numpy(float),
                         "drops": d["drops"].to_numpy(float)})


def busy_utilization(links: pd.DataFrame, direction: str = "up") -> float:
    """Busy-span utilisation = bytes delivered / bytes the link allowed, from the first to
    the last sample interval that delivered anything (compute phases in between count as
    idle). Compare :func:`bottleneck_utilization`, which counts only the upload windows.

    Allowed bytes of an interval = ``rate_mbps * 1e6 / 8 * dt`` (the HTB rate in force, i.e. what
    the trace allowed). The busy interval of a dev runs from its first to its last sample
    interval that delivered any bytes (idle time before the first send and after the last one
    is not counted against the link; idle gaps in between are). With several devs in the
    direction, delivered and allowed bytes are summed over them. NaN when nothing was sent.
    """
    d = _link_deltas(links, direction)
    delivered = 0.0
    allowed = 0.0
    for _, g in d.groupby("dev", sort=True):
        busy = np.nonzero(g["sent_bytes"].to_numpy(float) > 0)[0]
        if busy.size == 0:
            continue
        g = g.iloc[busy[0]: busy[-1] + 1]
        delivered += float(g["sent_bytes"].sum())
        allowed += float((g["rate_mbps"] * 1e6 / 8 * g["dt_s"]).sum())
    if allowed <= 0:
        return float("nan")
    return delivered / allowed


def queue_series(links: pd.DataFrame, direction: str = "up") -> pd.DataFrame:
    """The bottleneck queue over time, as sampled: ``t_s``, ``dev``, ``backlog_bytes``,
    ``backlog_pkts`` (instantaneous occupancy of the bfifo leaf at each ``tc -s`` sample)."""
    df = links[links["direction"] == direction].sort_values(["dev", "ts_ns"], kind="stable")
    return df[["t_s", "dev", "backlog_bytes", "backlog_pkts"]].reset_index(drop=True)


TRANSPORT_COLUMNS = ("cwnd", "rtt_us", "pacing_rate_bps", "total_retrans")


def transport_series(events: pd.DataFrame) -> pd.DataFrame:
    """Each flow's transport state over time from the workers' ``tcp_info`` samples (one
    flow per worker: its connection to the PS). Columns ``t_s``, ``node``, ``cwnd``
    (segments), ``rtt_ms`` (the kernel's smoothed RTT, ``tcpi_rtt / 1000``),
    ``pacing_rate_mbps`` (``tcpi_pacing_rate * 8 / 1e6``) and ``retrans`` (segments
    retransmitted since the node's first sample: the running sum of the positive steps of
    ``tcpi_total_retrans``, so a new connection's counter starting over adds nothing
    negative)."""
    cols = ["t_s", "node", "cwnd", "rtt_ms", "pacing_rate_mbps", "retrans"]
    if events.empty or "event" not in events.columns:
        return pd.DataFrame(columns=cols)
    df = events[events["event"] == "tcp_info"]
    if df.empty or not set(TRANSPORT_COLUMNS) <= set(df.columns):
        return pd.DataFrame(columns=cols)
    df = df.sort_values(["node", "ts_ns"], kind="stable")
    out = pd.DataFrame({
        "t_s": df["t_s"].astype(float), "node": df["node"].astype(str),
        "cwnd": pd.to_numeric(df["cwnd"], errors="coerce"),
        "rtt_ms": pd.to_numeric(df["rtt_us"], errors="coerce") / 1000,
        "pacing_rate_mbps": pd.to_numeric(df["pacing_rate_bps"], errors="coerce") / 1e6})
    total = pd.to_numeric(df["total_retrans"], errors="coerce").fillna(0.0)
    step = total.groupby(out["node"], sort=False).diff().fillna(0.0).clip(lower=0.0)
    out["retrans"] = step.groupby(out["node"], sort=False).cumsum()
    return out.reset_index(drop=True)


CONNECTION_COLUMNS = ("t_s", "host", "conn", "sent_mbps", "received_mbps", "cwnd",
                      "rtt_ms")


def _plain_ip(addr: object) -> str:
    """An IPv4 address mapped into IPv6 (``::ffff:a00:a``, how a dual-stack socket
    reports it) as the IPv4 address it is (``10.0.0.10``); any other address as given."""
    try:
        ip = ipaddress.ip_address(str(addr))
    except ValueError:
        return str(addr)
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return str(mapped or ip)


def connection_series(tcp: pd.DataFrame) -> pd.DataFrame:
    """Each TCP connection's rates and state over time from a torchrun run's sock_diag
    samples (``tcp.parquet``, :func:`analysis.load.load_tcp`, with ``t_s``). Connections a
    host opened to itself (loopback, ``local``) are left out: no shaped link carried them.

    One row per sample after a connection's first: ``host`` (whose socket), ``conn``
    (``src:sport>dst:dport``, as that socket sees it, an IPv4 address mapped into IPv6
    written as IPv4), ``sent_mbps`` and
    ``received_mbps`` (the steps of ``tcpi_bytes_acked`` and ``tcpi_bytes_received`` over
    the time between two samples, in Mbit/s: payload the peer acknowledged, payload that
    arrived), ``cwnd`` (segments) and ``rtt_ms`` (smoothed RTT). Two rows of one socket
    at one instant (a dump and its destroy message) count once, the later one."""
    if tcp.empty or "t_s" not in tcp.columns:
        return pd.DataFrame(columns=list(CONNECTION_COLUMNS))
    df = tcp[~tcp["local"].astype(bool)]
    if "state" in df.columns:  # a listening socket is no connection
        df = df[df["state"] != "LISTEN"]
    df = df.sort_values(["host", "cookie", "ts_ns"], kind="stable")
    df = df.drop_duplicates(["host", "cookie", "ts_ns"], keep="last")
    key = [df["host"], df["cookie"]]
    dt_s = df["ts_ns"].astype("int64").groupby(key).diff() / 1e9

    def rate(col: str) -> pd.Series:
        step = pd.to_numeric(df[col], errors="coerce").groupby(key).diff()
        return (step * 8 / 1e6 / dt_s).where(dt_s > 0)

    out = pd.DataFrame({
        "t_s": df["t_s"].astype(float), "host": df["host"].astype(str),
        "conn": (df["src"].map(_plain_ip) + ":" + df["sport"].astype(str) + ">"
                 + df["dst"].map(_plain_ip) + ":" + df["dport"].astype(str)),
        "sent_mbps": rate("bytes_acked"), "received_mbps": rate("bytes_received"),
        "cwnd": pd.to_numeric(df["snd_cwnd_pkts"], errors="coerce"),
        "rtt_ms": pd.to_numeric(df["rtt_us"], errors="coerce") / 1000})
    return out[out["sent_mbps"].notna()].reset_index(drop=True)


def drops(links: pd.DataFrame, direction: str = "up") -> pd.DataFrame:
    """Drops at the bottleneck queue: per interval (``drops``) and cumulative since the first
    sample (``drops_total``), per dev. Columns ``t_s``, ``dev``, ``drops``, ``drops_total``."""
    d = _link_deltas(links, direction)
    out = d[["t_s", "dev", "drops"]].copy()
    out["drops_total"] = out.groupby("dev", sort=False)["drops"].cumsum()
    return out.reset_index(drop=True)


def iteration_breakdown(events: pd.DataFrame, by: str | None = None,
                        skip_first: int = 0) -> pd.DataFrame:
    """Mean seconds per iteration spent in each phase of the workers' iterations.

    - ``compute_s``  forward + backward;
    - ``compress_s`` compression with error feedback;
    - ``send_s``     pushing the payload into the socket until written (and, where the
      policy times the upload, until it drained);
    - ``wait_s``     waiting for the PS: from the end of the send to the reply's first byte;
    - ``receive_s``  the rest of the iteration: receiving and applying the reply;
    - ``iter_s``     the whole iteration; the parts sum to it.

    Where the workers logged their phase events (``compute_done`` ... ``recv_done``), the
    parts are the durations of the intervals that partition each iteration on the per-host
    timeline (:func:`analysis.timeline.host_timeline`, the same spans ``trace.json`` and the
    report's timeline draw). Otherwise they come from ``iter_done``'s fields, ``receive_s``
    being ``iter_s`` minus the others, clipped at 0.

    ``skip_first`` drops each worker's first iterations (warm-up). ``by=None`` gives one row
    indexed ``"all"``; ``by="node"`` one row per worker.
    """
    df = events[events["event"] == "iter_done"]
    if df.empty:
        cols = [*ITERATION_PARTS, "iter_s"]
        return pd.DataFrame([[np.nan] * len(cols)], index=["all"], columns=cols) if by is None \
            else pd.DataFrame(columns=cols)
    if skip_first:
        df = df[df["iter"] >= df.groupby("node", observed=True)["iter"].transform("min") + skip_first]
    parts = _timeline_parts(events, df)
    if parts is None:
        parts = df[["iter_s", "compute_s", "compress_s", "send_s", "wait_s"]].astype(float).fillna(0.0)
        parts["receive_s"] = (parts["iter_s"] - parts[["compute_s", "compress_s", "send_s",
                                                       "wait_s"]].sum(axis=1)).clip(lower=0.0)
    parts = parts[[*ITERATION_PARTS, "iter_s"]]
    if by is None:
        return parts.mean().to_frame("all").T
    parts[by] = df[by].astype(str).to_numpy()
    return parts.groupby(by, sort=True).mean()


def _timeline_parts(events: pd.DataFrame, done: pd.DataFrame) -> pd.DataFrame | None:
    """Per ``iter_done`` row (same order), the seconds of each phase on the timeline; None
    when the workers logged no phase events to partition their iterations with."""
    from analysis.timeline import host_timeline

    if not (events["event"] == "send_done").any():
        return None
    tl = host_timeline(events[events["event"].isin(
        ["compute_done", "compress_done", "send_done", "recv_done", "iter_done"])])
    tl = tl[tl["lane"] == "main"]
    dur = (tl["end_ns"] - tl["start_ns"]) / 1e9
    sums = dur.groupby([tl["node"], tl["iter"], tl["activity"]]).sum().unstack()
    keys = pd.MultiIndex.from_arrays([done["node"].astype(str).to_numpy(),
                                      done["iter"].astype(int).to_numpy()])
    out = pd.DataFrame({f"{a}_s": sums[a].reindex(keys).to_numpy(float) if a in sums else 0.0
                        for a in ("compute", "compress", "send", "wait", "receive")})
    out = out.fillna(0.0)
    out["iter_s"] = done["iter_s"].astype(float).to_numpy()
    return out


def training_start_ns(events: pd.DataFrame) -> int | None:
    """When training starts: the PS's ``ps_ready`` (model built, listening for the workers);
    without one, its first ``ps_iter_done``. None when the run has neither."""
    for name in ("ps_ready", "ps_iter_done"):
        ts = events.loc[events["event"] == name, "ts_ns"]
        if len(ts):
            return int(ts.min())
    return None


def evaluations(events: pd.DataFrame) -> pd.DataFrame:
    """The PS's held-out evaluations (``eval`` and ``final_eval``) in time order, with
    ``train_s`` = seconds since :func:`training_start_ns`."""
    df = events[events["event"].isin(["eval", "final_eval"])
                & (events["node"].astype(str) == PS_NODE)]
    df = df.sort_values("ts_ns", kind="stable").copy()
    start = training_start_ns(events)
    df["train_s"] = (df["ts_ns"] - start) / 1e9 if start is not None else np.nan
    return df.reset_index(drop=True)


def _first_hit(events: pd.DataFrame, target: float) -> pd.Series | None:
    ev = evaluations(events)
    if target <= 0 or "accuracy" not in ev or ev.empty:
        return None
    hit = ev[ev["accuracy"].astype(float) >= target]
    return hit.iloc[0] if len(hit) else None


def time_to_accuracy(events: pd.DataFrame, target: float) -> float:
    """Time to accuracy (DAWNBench's rule): seconds from the start of training
    (:func:`training_start_ns`) to the first PS evaluation whose held-out accuracy is
    ``>= target``, as measured (no interpolation between evaluations, so it is a multiple
    of the evaluation period's iterations). NaN when never reached, when the workload
    reports no accuracy, or when ``target <= 0``."""
    hit = _first_hit(events, target)
    return float(hit["train_s"]) if hit is not None else float("nan")


def iterations_to_accuracy(events: pd.DataFrame, target: float) -> int | None:
    """Optimizer steps taken when :func:`time_to_accuracy`'s evaluation ran: its ``iter``
    + 1. None when never reached."""
    hit = _first_hit(events, target)
    return int(hit["iter"]) + 1 if hit is not None else None


def bytes_per_iteration(events: pd.DataFrame) -> pd.DataFrame:
    """Bytes on the wire per iteration, from ``iter_done``: ``bytes_up`` and ``bytes_down``
    summed over the workers that finished that iteration, ``workers`` (how many), and
    ``bytes_up_per_worker`` (their mean). Indexed by ``iter``."""
    df = events[events["event"] == "iter_done"]
    if df.empty:
        return pd.DataFrame(columns=["bytes_up", "bytes_down", "workers", "bytes_up_per_worker"])
    g = df.groupby("iter", sort=True)
    out = pd.DataFrame({"bytes_up": g["bytes_up"].sum().astype(float),
                        "bytes_down": g["bytes_down"].sum().astype(float),
                        "workers": g["node"].nunique()})
    out["bytes_up_per_worker"] = out["bytes_up"] / out["workers"]
    return out


def keep_ratio_vs_bandwidth(decisions: pd.DataFrame, links: pd.DataFrame,
                            direction: str = "up") -> pd.DataFrame:
    """Each adaptive-ratio decision beside the bandwidth in force when it was taken.

    Columns: ``t_s``, ``node``, ``iter``, ``keep``, ``r0_mbps`` and ``rt_mbps`` (the worker's
    measured initial and target rates), ``allowed_mbps`` (the bottleneck's HTB rate at the
    latest link sample at or before the decision) and ``measured_mbps`` (the bottleneck's
    delivered rate over the sample interval ending at or before the decision). NaN where no
    link sample precedes the decision.
    """
    cols = ["t_s", "node", "iter", "keep", "r0_mbps", "rt_mbps", "allowed_mbps", "measured_mbps"]
    if decisions.empty:
        return pd.DataFrame({c: pd.Series(dtype=float) for c in cols})
    d = pd.DataFrame({"t_s": decisions["t_s"].astype(float).to_numpy(),
                      "node": decisions["node"].astype(str).to_numpy(),
                      "iter": decisions["iter"].to_numpy(),
                      "keep": decisions["keep"].astype(float).to_numpy(),
                      "r0_mbps": decisions["r0_bps"].astype(float).to_numpy() / 1e6,
                      "rt_mbps": decisions["rt_bps"].astype(float).to_numpy() / 1e6})
    d = d.sort_values("t_s", kind="stable").reset_index(drop=True)
    thr = link_throughput(links, direction)
    if thr.empty:
        d["allowed_mbps"] = np.nan
        d["measured_mbps"] = np.nan
        return d[cols]
    # Several devs in one direction: the bottleneck carries their sum.
    lk = (thr.groupby("t_s", sort=True)[["throughput_mbps", "rate_mbps"]].sum().reset_index()
          .rename(columns={"throughput_mbps": "measured_mbps", "rate_mbps": "allowed_mbps"}))
    out = pd.merge_asof(d, lk, on="t_s", direction="backward")
    return out[cols]


def _merge_intervals(starts: np.ndarray, ends: np.ndarray) -> float:
    order = np.argsort(starts, kind="stable")
    total = 0.0
    cur_s = cur_e = None
    for s, e in zip(starts[order], ends[order], strict=True):
        if cur_e is None or s > cur_e:
            if cur_e is not None and cur_s is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None and cur_s is not None:
        total += cur_e - cur_s
    return float(total)


def bubble_fraction(stage_events: pd.DataFrame, stage: str = "node", start: str = "start_s",
                    end: str = "end_s") -> float:
    """Measured pipeline bubble: ``1 - busy / (stages * makespan)``.

    ``stage_events`` holds one row per operation a stage ran (forward, backward, recompute),
    with its ``stage`` and busy interval ``[start, end]`` in seconds. ``busy`` sums, over the
    stages, the union of each stage's intervals (overlapping operations count once);
    ``makespan`` runs from the earliest start to the latest end over all stages. This is the
    idle share of the stage-time rectangle, the quantity GPipe's ``(p-1)/(m+p-1)`` and 1F1B's
    ``(p-1)/m`` predict (the latter relative to the ideal time, see analysis.planner).
    """
    if stage_events.empty:
        return float("nan")
    s_all = stage_events[start].astype(float)
    e_all = stage_events[end].astype(float)
    if (e_all < s_all).any():
        raise ValueError("bubble_fraction: an operation ends before it starts")
    makespan = float(e_all.max() - s_all.min())
    if makespan <= 0:
        return float("nan")
    busy = 0.0
    n = 0
    for _, g in stage_events.groupby(stage, observed=True, sort=True):
        busy += _merge_intervals(g[start].to_numpy(float), g[end].to_numpy(float))
        n += 1
    return 1.0 - busy / (n * makespan)


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics
    (numpy's default), ignoring NaN. NaN for no values."""
    x = np.asarray(list(values), dtype=float)
    x = x[~np.isnan(x)]
    if x.size == 0:
        return float("nan")
    return float(np.percentile(x, q))


def _iter_s(events: pd.DataFrame) -> pd.Series:
    if "iter_s" not in events:
        return pd.Series(dtype=float)  # no worker finished an iteration
    return events.loc[events["event"] == "iter_done", "iter_s"].astype(float)


def iteration_time_percentiles(events: pd.DataFrame, qs: Sequence[float] = (50, 95, 99)
                               ) -> dict[str, float]:
    """Percentiles of ``iter_s`` over every worker's ``iter_done``: ``{"p50": ..., ...}``
    plus ``mean``."""
    it = _iter_s(events)
    out = {f"p{q:g}": percentile(it, q) for q in qs}
    out["mean"] = float(it.mean()) if len(it) else float("nan")
    return out


def iteration_times(events: pd.DataFrame) -> pd.Series:
    """Every worker's own ``iter_s`` from ``iter_done``, sorted ascending (ready for a CDF).
    Per-worker times show the stragglers that the PS's step time would hide."""
    it = _iter_s(events).dropna()
    return it.sort_values(kind="stable").reset_index(drop=True)


def upload_windows(events: pd.DataFrame) -> list[tuple[int, int, int]]:
    """``(iteration, start_ns, end_ns)`` of every complete upload window: from the start of
    the earliest worker's transfer (``send_done.start_ns``) to the moment the PS has every
    gradient of the iteration (``grads_in``)."""
    sends = events[events["event"] == "send_done"]
    ins = events[events["event"] == "grads_in"]
    if sends.empty or ins.empty or "start_ns" not in sends:
        return []
    starts = sends["start_ns"].groupby(sends["iter"]).min()
    ends = ins.groupby("iter")["ts_ns"].max()
    both = pd.concat({"start": starts, "end": ends}, axis=1).dropna()
    it = both.index.to_numpy(dtype=np.int64)
    st = both["start"].to_numpy(dtype=np.int64)
    en = both["end"].to_numpy(dtype=np.int64)
    return [(int(i), int(s), int(e)) for i, s, e in zip(it, st, en, strict=True) if e > s]


def upload_window_utilization(links: pd.DataFrame, windows: Sequence[tuple[int, int, int]],
                              direction: str = "up") -> float:
    """``sum(delivered) / sum(allowed)`` over ``windows`` (see :func:`upload_windows`).

    Delivered bytes come from the bottleneck's ``tc -s`` byte counter (Ethernet frames, the
    unit HTB shapes), interpolated linearly at the window edges; allowed bytes integrate the
    HTB rate in force (``rate_mbps`` of the latest sample) over the window. A window outside
    the sampled span is left out. NaN with no usable window.
    """
    delivered, allowed = _window_bytes(_point_samples(links, direction), windows)
    return delivered / allowed if allowed > 0 else float("nan")


def _point_samples(links: pd.DataFrame, point: str) -> pd.DataFrame:
    return links[links["direction"] == point].sort_values("ts_ns") if len(links) else links


def _window_bytes(lk: pd.DataFrame, windows: Sequence[tuple[int, int, int]]
                  ) -> tuple[float, float]:
    """(delivered, allowed) bytes of one point's samples ``lk`` (sorted) over ``windows``,
    as :func:`upload_window_utilization` defines them."""
    if lk.empty or not windows:
        return 0.0, 0.0
    ts = lk["ts_ns"].to_numpy(dtype=np.float64)
    sent = lk["sent_bytes"].to_numpy(dtype=np.float64)
    rate = lk["rate_mbps"].to_numpy(dtype=np.float64)
    delivered = allowed = 0.0
    for _, s, e in windows:
        if s < ts[0] or e > ts[-1]:
            continue  # outside the sampled span: no honest answer for this window
        delivered += float(np.interp(e, ts, sent) - np.interp(s, ts, sent))
        # Integrate the (piecewise-constant) rate over the window on a fine grid.
        grid = np.linspace(s, e, 200)
        r = rate[np.clip(np.searchsorted(ts, grid, side="right") - 1, 0, len(ts) - 1)]
        allowed += float(np.mean(r) * 1e6 / 8 * (e - s) / 1e9)
    return delivered, allowed


def busiest_point_windows(links: pd.DataFrame, windows: Sequence[tuple[int, int, int]]
                          ) -> dict[str, list[tuple[int, int, int]]]:
    """Each window given to the shaped point that let out the most bytes in it
    (``sent_bytes`` interpolated at its ends, as :func:`upload_window_utilization`):
    the link whose pace bounds a transfer that crosses several (an MoE dispatch, a
    pipeline stage's sends on a fabric whose every access link is shaped). A window no
    point's samples cover is left out. ``links`` holds every point's samples, the point
    in ``direction`` (``links.parquet``'s columns; ``classes.parquet``'s ``point``)."""
    points = {str(p): g.sort_values("ts_ns") for p, g in links.groupby("direction")} \
        if len(links) else {}
    out: dict[str, list[tuple[int, int, int]]] = {}
    for w in windows:
        best, most = None, -1.0
        for p, g in points.items():
            ts = g["ts_ns"].to_numpy(dtype=np.float64)
            if w[1] < ts[0] or w[2] > ts[-1]:
                continue
            sent = g["sent_bytes"].to_numpy(dtype=np.float64)
            b = float(np.interp(w[2], ts, sent) - np.interp(w[1], ts, sent))
            if b > most:
                best, most = p, b
        if best is not None:
            out.setdefault(best, []).append(w)
    return out


def merge_windows(intervals: Iterable[tuple[str, int, int, int]]
                  ) -> list[tuple[int, int, int]]:
    """``(iteration, start_ns, end_ns)`` windows from ``(key, iteration, start_ns,
    end_ns)`` intervals (a key per sender), each key's overlapping or touching intervals
    merged into one whose iteration is its first interval's; in start order, empty ones
    left out."""
    by_key: dict[str, list[tuple[int, int, int]]] = {}
    for key, it, s, e in intervals:
        by_key.setdefault(key, []).append((s, e, it))
    out: list[tuple[int, int, int]] = []
    for spans in by_key.values():
        cur: list[int] | None = None
        for s, e, it in sorted(spans):
            if cur is not None and s <= cur[2]:
                cur[2] = max(cur[2], e)
                continue
            if cur is not None:
                out.append((cur[0], cur[1], cur[2]))
            cur = [it, s, e]
        if cur is not None:
            out.append((cur[0], cur[1], cur[2]))
    return [w for w in sorted(out, key=lambda w: w[1]) if w[2] > w[1]]


#: Below this busy fraction of the upload windows, with no queue at the shaper, the run's
#: figures measure the agents rather than the network (:func:`agent_limited`).
AGENT_LIMITED_BUSY = 0.9
#: "No queue at the shaper": the median backlog of the samples inside the windows is at
#: most one full-size Ethernet frame (1500 B MTU + 14 B header).
AGENT_LIMITED_QUEUE_BYTES = 1514


def agent_limited(links: pd.DataFrame, windows: Sequence[tuple[int, int, int]],
                  direction: str = "up") -> tuple[bool | None, str]:
    """Whether the shaped link sat idle while data waited in the agents, and why, in words:
    :func:`agent_limited_points` with every window on the one point ``direction``."""
    return agent_limited_points(links, {direction: windows})


def agent_limited_points(links: pd.DataFrame,
                         windows: Mapping[str, Sequence[tuple[int, int, int]]],
                         agents: str = "the agents", measured: str = "gradbed"
                         ) -> tuple[bool | None, str]:
    """Whether the shaped links sat idle while data waited in the agents, and why, in words.

    ``windows`` maps a shaping point (``links.direction``) to the transfer windows it
    carried. ``busy = sum(delivered) / sum(allowed)`` over every point's windows (each as
    :func:`upload_window_utilization`); ``queue`` = the median ``backlog_bytes`` of the
    points' samples taken inside their windows (the sample nearest each window's end when
    none falls inside). Agent-limited when ``busy < AGENT_LIMITED_BUSY`` (0.9) and
    ``queue <= AGENT_LIMITED_QUEUE_BYTES`` (one frame): the shapers had nothing to send
    although the agents had not finished, so the run's times measure the agents (CPU,
    copies, scheduling), not the emulated network. A TCP stall (a retransmission timeout)
    looks the same from the shaper; the transport events tell the two apart.
    ``(None, reason)`` without a window inside the samples. ``agents`` and ``measured``
    name, in the reason, who held the data and what the times then measure (a torchrun
    run's ranks rather than gradbed's agents).
    """
    points = [p for p, w in windows.items() if w]
    where = (f"the {points[0]} link was" if len(points) == 1 else
             f"the links ({', '.join(sorted(points)[:4])}{', ...' if len(points) > 4 else ''})"
             " were")
    delivered = allowed = 0.0
    inside: list[float] = []
    for p in points:
        lk = _point_samples(links, p)
        d, a = _window_bytes(lk, windows[p])
        delivered, allowed = delivered + d, allowed + a
        if a > 0 and "backlog_bytes" in lk:
            inside.extend(_backlog_inside(lk, windows[p]))
    if allowed <= 0:
        names = " ".join(points) or "no"
        return None, (f"no {names} link samples cover a transfer window, so whether the "
                      "agents or the network set the pace is unknown")
    if not inside:
        return None, "the link samples lack the shaper's backlog (backlog_bytes)"
    busy = delivered / allowed
    queue = float(np.median(inside))
    limited = busy < AGENT_LIMITED_BUSY and queue <= AGENT_LIMITED_QUEUE_BYTES
    if limited:
        why = (f"agent-limited: {where} busy {busy:.2f} of the transfer "
               f"windows (< {AGENT_LIMITED_BUSY}) with no queue at the shaper (median "
               f"backlog {queue:.0f} B): data waited in {agents}, not in the network, so "
               f"the times measure {measured} on this machine")
    elif busy < AGENT_LIMITED_BUSY:
        why = (f"network-limited: {where} busy {busy:.2f} of the transfer "
               f"windows, but its shaper held a queue (median backlog {queue:.0f} B)")
    else:
        why = (f"network-limited: {where} busy {busy:.2f} of the transfer "
               f"windows (>= {AGENT_LIMITED_BUSY})")
    return limited, why


def _backlog_inside(lk: pd.DataFrame, windows: Sequence[tuple[int, int, int]]) -> list[float]:
    ts = lk["ts_ns"].to_numpy(dtype=np.int64)
    backlog = lk["backlog_bytes"].to_numpy(dtype=np.float64)
    inside: list[float] = []
    for _, s, e in windows:
        sel = (ts >= s) & (ts <= e)
        if sel.any():
            inside.extend(backlog[sel].tolist())
        else:
            inside.append(float(backlog[int(np.argmin(np.abs(ts - e)))]))
    return inside


def bottleneck_utilization(events: pd.DataFrame, links: pd.DataFrame, direction: str = "up",
                           warmup_iterations: int = 0) -> float:
    """Bottleneck utilisation while gradients are in flight:
    :func:`upload_window_utilization` over the upload windows of iterations
    ``>= warmup_iterations``. Compute phases, when the link is idle by design, are left out:
    it measures whether the agents keep the wire busy (1.0 = at its rate all the time)."""
    windows = [w for w in upload_windows(events) if w[0] >= warmup_iterations]
    return upload_window_utilization(links, windows, direction)


def jain_fairness(events: pd.DataFrame) -> float:
    """Jain's index over workers of their mean sending rate: for each worker,
    ``sum(send_done.bytes) / sum(send_done.send_s)``, then :func:`jain` over the workers
    that spent any time sending."""
    sends = events[events["event"] == "send_done"]
    if sends.empty:
        return float("nan")
    per = sends.groupby(sends["node"].astype(str)).agg(b=("bytes", "sum"), s=("send_s", "sum"))
    per = per[per["s"] > 0]
    return jain((per["b"] / per["s"]).tolist()) if len(per) else float("nan")


def jain_mean_over_windows(events: pd.DataFrame, window_s: float = 1.0) -> float:
    """The mean over ``window_s`` windows of Jain's index of the workers' goodput
    (:func:`goodput` from ``send_done``, :func:`jain_over_windows`): short-term fairness,
    where :func:`jain_fairness` is over the whole run. NaN with no worker traffic."""
    gp = goodput(events, window_s=window_s)
    gp = gp[gp["node"].astype(str).map(is_worker_node)]
    if gp.empty:
        return float("nan")
    jw = jain_over_windows(gp, window_s)
    return float(jw["jain"].mean()) if len(jw) else float("nan")


def headline(events: pd.DataFrame, links: pd.DataFrame, *, warmup_iterations: int = 0,
             target_accuracy: float = 0.0) -> dict[str, float | int | None]:
    """The headline numbers of one run, as ``summary.json`` and the report print them (each
    key's meaning is in :data:`GLOSSARY`; NaN or None where the run has no data for it)."""
    ev = events
    it = ev[ev["event"] == "iter_done"]
    psi = ev[ev["event"] == "ps_iter_done"]
    steady = it[it["iter"] >= warmup_iterations]
    iter_s = steady["iter_s"].dropna().to_numpy(float) if "iter_s" in steady else np.array([])
    out: dict[str, float | int | None] = {
        "iterations": int(len(psi)),
        "iter_time_s_p50": percentile(iter_s, 50),
        "iter_time_s_p99": percentile(iter_s, 99),
        "iter_time_s_mean": float(np.mean(iter_s)) if len(iter_s) else float("nan"),
        "bytes_up": int(it["bytes_up"].sum()) if "bytes_up" in it else 0,
        "bytes_down": int(it["bytes_down"].sum()) if "bytes_down" in it else 0,
        "final_loss": float("nan"),
        "final_accuracy": float("nan"),
        "bottleneck_utilization": float("nan"),
        "jain_fairness": jain_fairness(ev),
    }
    if len(psi):
        out["bytes_up_per_iter"] = int(out["bytes_up"] or 0) / len(psi)
    evals = evaluations(ev)
    if len(evals) and "accuracy" in evals:
        last = evals.iloc[-1]
        out["final_accuracy"] = float(last["accuracy"])
        out["final_loss"] = float(last["loss"])
    elif "loss" in it and it["loss"].notna().any():
        out["final_loss"] = float(it.sort_values("ts_ns")["loss"].dropna().iloc[-1])
    if not links.empty:
        out["bottleneck_utilization"] = bottleneck_utilization(ev, links, "up",
                                                               warmup_iterations)
        up = links[links["direction"] == "up"]
        if len(up):
            out["drops_up"] = int(up["drops"].max() - up["drops"].min())
    if target_accuracy > 0:
        tta = time_to_accuracy(ev, target_accuracy)
        if np.isfinite(tta):
            out["time_to_target_s"] = tta
            out["iterations_to_target"] = iterations_to_accuracy(ev, target_accuracy)
    bg = ev[ev["event"] == "background"]
    if len(bg) and "bytes" in bg:
        out["background_bytes"] = int(bg["bytes"].fillna(0).sum())
        out["background_mbps"] = float(bg["mbps"].fillna(0).sum())
    fl = ev[ev["event"] == "flow_done"]
    if len(fl) and "fct_s" in fl:
        fct = fl["fct_s"].to_numpy(dtype=float)
        out["background_flows"] = int(len(fl))
        out["fct_s_p50"] = percentile(fct, 50)
        out["fct_s_p99"] = percentile(fct, 99)
    return out



def workers_lost(events: pd.DataFrame) -> list[dict[str, Any]]:
    """Every worker the PS lost (its ``worker_lost`` events), in order, each
    ``{"worker", "iter", "t_s", "reason"}``; ``t_s`` counts from the controller's
    ``run_start`` (else the first event). Empty when none was lost; a worker that left by
    the membership schedule (BYE) is not lost."""
    if events.empty:
        return []
    lost = events[events["event"] == "worker_lost"].sort_values("ts_ns")
    if lost.empty:
        return []
    starts = events.loc[events["event"] == "run_start", "ts_ns"]
    t0 = int(starts.min()) if len(starts) else int(events["ts_ns"].min())
    return [{"worker": int(r["worker"]), "iter": int(r["iter"]),
             "t_s": round((int(r["ts_ns"]) - t0) / 1e9, 3), "reason": str(r.get("reason", ""))}
            for _, r in lost.iterrows()]


def agents_lost(events: pd.DataFrame) -> list[dict[str, Any]]:
    """Every agent the controller declared lost (its ``agent_lost`` events), in order, each
    ``{"host", "role", "t_s", "reason", "action"}``: a process that died or went silent
    for ``run.stall_timeout_s``, whatever its role (a flow generator source, a stage, a
    worker); ``action`` is what followed (``stop``, or ``peers decide``: the run went on
    unless the agent's peers stopped it). ``t_s`` counts as in :func:`workers_lost`."""
    if events.empty:
        return []
    lost = events[events["event"] == "agent_lost"].sort_values("ts_ns")
    if lost.empty:
        return []
    starts = events.loc[events["event"] == "run_start", "ts_ns"]
    t0 = int(starts.min()) if len(starts) else int(events["ts_ns"].min())
    return [{"host": str(r["host"]), "role": str(r["role"]),
             "t_s": round((int(r["ts_ns"]) - t0) / 1e9, 3), "reason": str(r["reason"]),
             "action": str(r["action"])} for _, r in lost.iterrows()]


#: One line per column the summary and the report print: what it is, with its unit. The
#: formula is in the docstring of the function named in brackets.
GLOSSARY: dict[str, str] = {
    "workers": "worker processes (net.workers)",
    "iterations": "optimizer steps the PS took (ps_iter_done events)",
    "wall_s": "the run's wall time, network set-up to teardown (s)",
    "warmup_iterations": "first iterations left out of the iteration times and utilisation",
    "iter_time_s_p50": "median of every worker's iteration time after warm-up (s) [headline]",
    "iter_time_s_p95": "95th percentile of every worker's iteration time (s) "
                       "[iteration_time_percentiles]",
    "iter_time_s_p99": "99th percentile of every worker's iteration time after warm-up (s)",
    "iter_time_s_mean": "mean iteration time after warm-up (s)",
    "bytes_up": "wire bytes the workers sent, all iterations (frames' payload + headers)",
    "bytes_down": "wire bytes the workers received",
    "bytes_up_per_iter": "bytes_up / iterations",
    "final_loss": "held-out loss of the last PS evaluation",
    "final_accuracy": "held-out accuracy of the last PS evaluation (fraction)",
    "bottleneck_utilization": "delivered / allowed bytes of the up bottleneck during upload "
                              "windows only [bottleneck_utilization]",
    "busy_utilization_up": "delivered / allowed bytes of the up bottleneck from its first to "
                           "last busy sample, compute gaps included [busy_utilization]",
    "busy_utilization_down": "the same for the down bottleneck [busy_utilization]",
    "jain_fairness": "Jain's index of the workers' mean sending rates over the run "
                     "[jain_fairness]",
    "jain_mean_1s": "mean over 1 s windows of Jain's index of the workers' goodput "
                    "[jain_mean_over_windows]",
    "drops_up": "packets the up bottleneck's queue dropped",
    "agent_limited": "the shaped link idle while data waited in the agents: busy < 0.9 of "
                     "the transfer windows (PS uploads; pipeline messages and MoE "
                     "dispatches on their busiest access link) with no queue at the "
                     "shaper; null when unknown [agent_limited_points]",
    "agent_limited_why": "agent_limited in words, with the busy fraction and the backlog",
    "time_to_target_s": "from training start to the first evaluation at run.target_accuracy "
                        "(s) [time_to_accuracy]",
    "iterations_to_target": "optimizer steps at that evaluation [iterations_to_accuracy]",
    "background_bytes": "payload bytes the background hosts moved",
    "background_mbps": "their rate, summed over hosts (Mbit/s)",
    "background_flows": "background flows completed",
    "fct_s_p50": "median background flow completion time (s)",
    "fct_s_p99": "99th percentile background flow completion time (s)",
    "workers_lost": "workers the PS lost (connection failed or sent garbage; not a scheduled "
                    "leave): worker, iter, t_s since run start, reason",
    "agents_lost": "agents the controller declared lost (died, or silent for "
                   "run.stall_timeout_s), any role: host, role, t_s, reason, action "
                   "[agents_lost]",
    "interrupted": "the run was interrupted (Ctrl-C, SIGTERM)",
    "stop_reason": "why the run ended",
    "error": "the error that ended the run, when one did (a failed start, a crash)",
}
