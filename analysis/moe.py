"""MoE runs: dispatch efficiency, link utilisation, tokens, drops and imbalance per
expert, bytes per parameter class, and the per-host timeline (DESIGN.md 1.4).

Reads the expert hosts' events (``events/eN.jsonl`` or ``.parquet``; see
:mod:`agents.moe.expert`). Every number comes from :mod:`agents.core.moe_metrics`.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agents.core.moe_metrics import (
    dispatch_efficiency,
    dispatch_link_efficiency,
    drop_fraction,
    load_imbalance,
)

Row = dict[str, Any]


def load_events(run_dir: Path) -> list[Row]:
    """Every expert host's events (Parquet where the run converted them, else JSONL)."""
    rows: list[Row] = []
    for node in sorted({p.stem for p in (run_dir / "events").glob("e*.*")}):
        pq = run_dir / "events" / f"{node}.parquet"
        if pq.exists():
            import pandas as pd

            df = pd.read_parquet(pq)
            rows += [{str(k): _plain(v) for k, v in r.items()} for r in df.to_dict("records")]
        else:
            from agents.core.events import read_jsonl

            rows += read_jsonl(run_dir / "events" / f"{node}.jsonl")
    return rows


def _plain(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def dispatch_table(rows: Iterable[Row], rate_mbps: float) -> list[Row]:
    """One row per (step, layer): the dispatch over all hosts, from the moment a token
    may first move to the last host leaving ``dispatch_tokens`` (see
    :func:`~agents.core.moe_metrics.dispatch_efficiency`): the first host entering the
    dispatch where the counts ride in the token message, the last host entering its
    ``dispatch_counts`` round where a run sent them in a round of their own (no host
    sent a token before it held every host's counts); then the
    busiest link's payload and frame bytes, the dispatch efficiency (payload) and the
    link utilisation during dispatch (every frame byte, counts included, same formula);
    ``arrival_spread_s``: last minus first host entering (waiting on the previous
    phase's stragglers); ``counts_s``/``tokens_s`` are the hosts' medians;
    ``counts_window_s``: the window's start to the last host holding every count (the
    counts phase's share of the window, pure latency; 0 where the counts ride with the
    tokens); ``combine_hosts_in_window``: how
    many hosts began the same layer's combine before the window ended (their outputs
    then share links with the dispatch; 0 with ``moe.combine_after_dispatch``)."""
    acc: dict[tuple[int, int], dict[str, Row]] = defaultdict(dict)
    combine_start: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in rows:
        if r.get("event") == "moe_phase" and r["phase"] == "combine":
            combine_start[(int(r["iter"]), int(r["layer"]))].append(int(r["start_ns"]))
        if r.get("event") != "moe_phase" or r["phase"] not in ("dispatch_counts",
                                                                "dispatch_tokens"):
            continue
        host = acc[(int(r["iter"]), int(r["layer"]))].setdefault(
            r["node"], {"start_ns": None, "end_ns": 0, "counts_s": 0.0, "tokens_s": 0.0,
                        "payload": 0, "frames_up": 0, "frames_down": 0, "counts_end_ns": 0})
        if r["phase"] == "dispatch_counts":
            host["start_ns"] = int(r["start_ns"])
            host["counts_end_ns"] = int(r["end_ns"])
            host["counts_s"] = float(r["dur_s"])
        else:
            if host["start_ns"] is None:  # the counts rode with the tokens
                host["start_ns"] = host["counts_end_ns"] = int(r["start_ns"])
            host["end_ns"] = int(r["end_ns"])
            host["tokens_s"] = float(r["dur_s"])
            host["payload"] = max(int(r["payload_up"]), int(r["payload_down"]))
        host["frames_up"] += int(r["bytes_up"])
        host["frames_down"] += int(r["bytes_down"])
    out = []
    for (it, layer), hosts in sorted(acc.items()):
        hs = [h for h in hosts.values() if h["start_ns"] is not None and h["end_ns"]]
        if len(hs) != len(hosts) or not hs:
            continue  # a host's phases are missing (a run cut short)
        # With its own counts round no host sends a token before the last host entered;
        # with the counts in the token message the first host to enter sends at once.
        merged = all(h["counts_s"] == 0.0 and h["counts_end_ns"] == h["start_ns"] for h in hs)
        last_in = (min if merged else max)(h["start_ns"] for h in hs)
        phase_s = (max(h["end_ns"] for h in hs) - last_in) / 1e9
        spread_s = (max(h["start_ns"] for h in hs) - min(h["start_ns"] for h in hs)) / 1e9
        payload = max(h["payload"] for h in hs)
        frames = max(max(h["frames_up"], h["frames_down"]) for h in hs)
        end = max(h["end_ns"] for h in hs)
        out.append({"iter": it, "layer": layer, "hosts": len(hs), "phase_s": phase_s,
                    "counts_window_s": 0.0 if merged else
                    (max(h["counts_end_ns"] for h in hs) - last_in) / 1e9,
                    "combine_hosts_in_window": sum(t < end for t in
                                                   combine_start[(it, layer)]),
                    "start_ns": last_in, "end_ns": max(h["end_ns"] for h in hs),
                    "arrival_spread_s": spread_s,
                    "counts_s": statistics.median(h["counts_s"] for h in hs),
                    "tokens_s": statistics.median(h["tokens_s"] for h in hs),
                    "payload_bytes": payload, "frame_bytes": frames,
                    "efficiency": dispatch_efficiency(payload, phase_s, rate_mbps),
                    "utilisation": dispatch_efficiency(frames, phase_s, rate_mbps)})
    return out


#: The exchanges of token rows besides the dispatch, each one phase on every host: the
#: combine (the experts' outputs going back) and, in the backward, the gradients of both
#: (``combine_grad`` back to the experts, ``tokens_grad`` back to the tokens' hosts).
ROW_EXCHANGES = ("combine", "combine_grad", "tokens_grad")


def exchange_windows(rows: Iterable[Row], phase: str) -> list[tuple[int, int, int]]:
    """``(step, start_ns, end_ns)`` of each (step, layer) ``phase`` exchange that every
    host ran (hosts: those with any ``moe_phase`` row), from the first host entering it
    (its rows leave at once) to the last host leaving it: a straggler still computing
    while the others wait for its rows is the agents' time, as in :func:`dispatch_table`'s
    window where the counts ride with the tokens; in step order."""
    hosts: set[str] = set()
    acc: dict[tuple[int, int], dict[str, tuple[int, int]]] = defaultdict(dict)
    for r in rows:
        if r.get("event") != "moe_phase":
            continue
        hosts.add(str(r["node"]))
        if r["phase"] == phase:
            acc[(int(r["iter"]), int(r["layer"]))][str(r["node"])] = (int(r["start_ns"]),
                                                                      int(r["end_ns"]))
    out = []
    for (it, _layer), spans in sorted(acc.items()):
        if set(spans) != hosts:
            continue  # a host's phase is missing (a run cut short)
        out.append((it, min(s for s, _ in spans.values()), max(e for _, e in spans.values())))
    return out


def transfer_windows(rows: Iterable[Row]) -> list[tuple[int, int, int]]:
    """``(step, start_ns, end_ns)``: the windows in which an MoE run's token rows cross the
    mesh, the ones :func:`analysis.metrics.agent_limited_points` judges. Each dispatch, its
    counts included (:func:`dispatch_table`'s window, that of the dispatch efficiency), and
    each exchange of :data:`ROW_EXCHANGES` (:func:`exchange_windows`); windows that overlap
    (a combine that does not wait for the whole dispatch, ``moe.combine_after_dispatch =
    false``) merged into one (:func:`analysis.metrics.merge_windows`), so no link's bytes
    count twice. Raises ValueError for a dispatch of no duration."""
    from analysis.metrics import merge_windows

    rows = list(rows)
    # The rate scales only the efficiency columns, not the window.
    spans = [(d["iter"], d["start_ns"], d["end_ns"]) for d in dispatch_table(rows, 1.0)]
    for phase in ROW_EXCHANGES:
        spans += exchange_windows(rows, phase)
    return merge_windows(("mesh", int(it), int(s), int(e)) for it, s, e in spans)


def load_class_samples(run_dir: Path) -> Any:
    """The run's HTB class samples (``classes.parquet``; :mod:`agents.core.class_samples`)
    as a DataFrame, or None when the run did not sample them (``topo.class_sample_ms``)."""
    path = run_dir / "classes.parquet"
    if not path.exists():
        return None
    import pandas as pd

    return pd.read_parquet(path)


def bytes_between(ts_ns: Any, sent_bytes: Any, start_ns: int, end_ns: int) -> float:
    """A cumulative counter's growth from ``start_ns`` to ``end_ns``, each end linearly
    interpolated between the samples around it. Raises ValueError when the samples do
    not cover the window (nothing to interpolate from)."""
    import numpy as np

    ts = np.asarray(ts_ns, dtype=np.float64)
    cum = np.asarray(sent_bytes, dtype=np.float64)
    if len(ts) < 2 or ts[0] > start_ns or ts[-1] < end_ns:
        raise ValueError(f"class samples cover [{ts[0] if len(ts) else None}, "
                         f"{ts[-1] if len(ts) else None}] ns, not the window "
                         f"[{start_ns}, {end_ns}]")
    a, b = np.interp([start_ns, end_ns], ts, cum)
    return float(b - a)


def dispatch_link_table(dispatch: list[Row], samples: Any, rate_mbps: float,
                        burst_bytes: int = 0) -> list[Row]:
    """Per dispatch (rows of :func:`dispatch_table`): the bytes every shaped point's HTB
    class let out over the dispatch window, the busiest point (and its bytes without
    pure ACKs where the point queues them apart, ``link_data_bytes``) and its
    :func:`~agents.core.moe_metrics.dispatch_link_efficiency`; with ``burst_bytes``
    also ``link_efficiency_burst_allowed`` = bytes / (phase x rate + burst), the bound
    that counts a full HTB bucket as capacity. ``sample_gap_ms``: the widest spacing of
    the samples around the window's two ends (the interpolation's resolution);
    ``link_bytes_inner``/``link_bytes_outer``: the busiest point's bytes between the
    samples just inside and just outside the window, which bound its true bytes from
    below and above without interpolating, and
    ``link_efficiency_burst_allowed_inner`` = inner / (phase x rate + burst), a lower
    bound on the link's efficiency whatever the bucket held and however the samples
    fell."""
    import numpy as np

    by_point = {str(p): g.sort_values("ts_ns") for p, g in samples.groupby("point")}
    out = []
    for d in dispatch:
        start, end = int(d["start_ns"]), int(d["end_ns"])
        per_point = {p: bytes_between(g["ts_ns"].to_numpy(), g["sent_bytes"].to_numpy(),
                                      start, end) for p, g in by_point.items()}
        busiest = max(per_point, key=lambda p: per_point[p])
        g = by_point[busiest]
        data_bytes = bytes_between(g["ts_ns"].to_numpy(), g["data_bytes"].to_numpy(), start,
                                   end)
        ts = by_point[busiest]["ts_ns"].to_numpy()
        cum = by_point[busiest]["sent_bytes"].to_numpy()
        gaps = []
        for t in (start, end):
            i = int(np.searchsorted(ts, t))
            gaps.append((ts[min(i, len(ts) - 1)] - ts[max(i - 1, 0)]) / 1e6)
        # Bounds that need no interpolation: between the samples just inside the window
        # (at most what it carried) and just outside it (at least).
        i0 = int(np.searchsorted(ts, start, "left"))
        i1 = int(np.searchsorted(ts, end, "right")) - 1
        o0 = max(int(np.searchsorted(ts, start, "right")) - 1, 0)
        o1 = min(int(np.searchsorted(ts, end, "left")), len(ts) - 1)
        inner = float(cum[i1] - cum[i0]) if i1 > i0 else 0.0
        outer = float(cum[o1] - cum[o0])
        link_bytes = per_point[busiest]
        phase_s = float(d["phase_s"])
        out.append({"iter": d["iter"], "layer": d["layer"], "phase_s": phase_s,
                    "busiest_point": busiest, "link_bytes": link_bytes,
                    "link_data_bytes": data_bytes,
                    "payload_bytes": d["payload_bytes"],
                    "link_efficiency": dispatch_link_efficiency(link_bytes, phase_s,
                                                                rate_mbps),
                    "link_efficiency_burst_allowed":
                        link_bytes / (phase_s * rate_mbps * 1e6 / 8 + burst_bytes),
                    "link_bytes_inner": inner, "link_bytes_outer": outer,
                    "link_efficiency_burst_allowed_inner":
                        inner / (phase_s * rate_mbps * 1e6 / 8 + burst_bytes),
                    "formula_efficiency": d["efficiency"],
                    "sample_gap_ms": float(max(gaps))})
    return out


def route_table(rows: Iterable[Row]) -> list[Row]:
    """One row per (step, layer), summed over hosts: tokens kept and dropped per expert,
    the load imbalance over experts and the drop fraction."""
    acc: dict[tuple[int, int], Row] = {}
    for r in rows:
        if r.get("event") != "moe_route":
            continue
        key = (int(r["iter"]), int(r["layer"]))
        a = acc.setdefault(key, {"kept": [0] * len(r["kept"]),
                                 "dropped": [0] * len(r["dropped"]), "hosts": 0})
        a["kept"] = [x + int(y) for x, y in zip(a["kept"], r["kept"], strict=True)]
        a["dropped"] = [x + int(y) for x, y in zip(a["dropped"], r["dropped"], strict=True)]
        a["hosts"] += 1
    return [{"iter": it, "layer": layer, **a, "imbalance": load_imbalance(a["kept"]),
             "drop_fraction": drop_fraction(a["kept"], a["dropped"])}
            for (it, layer), a in sorted(acc.items())]


def class_bytes_table(rows: Iterable[Row]) -> list[Row]:
    return [{k: r[k] for k in r if k.endswith("_bytes") or k in ("node", "iter")}
            for r in rows if r.get("event") == "moe_class_bytes"]


def plot_timeline(rows: Iterable[Row], path: Path, steps: tuple[int, int]) -> None:
    """Per-host Gantt chart of the phases of steps [a, b): compute (forward, backward,
    experts), dispatch, combine, their backward exchanges, ZeRO collectives; white is
    idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"forward": "#4c72b0", "backward": "#8172b2", "expert": "#64b5cd",
               "dispatch_counts": "#c44e52", "dispatch_tokens": "#dd8452",
               "dispatch_done": "#f0e0a0", "combine": "#55a868", "combine_grad": "#937860", "tokens_grad": "#da8bc3",
               "all_gather_zero3": "#8c8c8c", "all_gather_zero3_bwd": "#5c5c5c",
               "reduce_scatter_and_update": "#ccb974"}
    ph = [r for r in rows if r.get("event") == "moe_phase" and steps[0] <= r["iter"] < steps[1]]
    if not ph:
        return
    nodes = sorted({r["node"] for r in ph})
    t0 = min(r["start_ns"] for r in ph)
    fig, ax = plt.subplots(figsize=(11, 0.6 + 0.55 * len(nodes)))
    # Containers (forward/backward) first, the exchanges inside them drawn on top.
    order = sorted(ph, key=lambda r: r["phase"] not in ("forward", "backward"))
    for r in order:
        y = nodes.index(r["node"])
        inner = r["phase"] not in ("forward", "backward")
        ax.barh(y, (r["end_ns"] - r["start_ns"]) / 1e6, left=(r["start_ns"] - t0) / 1e6,
                height=0.7 if inner else 0.35, color=colours.get(r["phase"], "k"))
    ax.set_yticks(range(len(nodes)), nodes)
    ax.set_xlabel("ms")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()],
              labels=list(colours), fontsize=7, ncol=5, loc="upper center",
              bbox_to_anchor=(0.5, -0.25))
    ax.set_title(f"expert hosts, steps {steps[0]}-{steps[1] - 1} (white = idle)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_routing(route: list[Row], path: Path) -> None:
    """Drop fraction and load imbalance over training, one line per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.2))
    for layer in sorted({r["layer"] for r in route}):
        rs = [r for r in route if r["layer"] == layer]
        a1.plot([r["iter"] for r in rs], [r["drop_fraction"] for r in rs], label=f"layer {layer}")
        a2.plot([r["iter"] for r in rs], [r["imbalance"] for r in rs], label=f"layer {layer}")
    a1.set_xlabel("step")
    a1.set_ylabel("dropped / (tokens x k)")
    a2.set_xlabel("step")
    a2.set_ylabel("max / mean tokens per expert")
    a1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(run_dir: Path, rate_mbps: float) -> dict[str, Any]:
    rows = load_events(run_dir)
    disp = dispatch_table(rows, rate_mbps)
    route = route_table(rows)
    losses = [(r["iter"], r["ce"]) for r in rows if r.get("event") == "moe_step"
              and r["node"] == "e0"]
    return {"dispatch": disp, "route": route, "loss_e0": losses,
            "eval": [r for r in rows if r.get("event") == "eval"]}


def dump_summary(run_dir: Path, rate_mbps: float, out: Path) -> None:
    out.write_text(json.dumps(summary(run_dir, rate_mbps), indent=1))
