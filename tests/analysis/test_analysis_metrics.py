"""Metrics on hand-built tables with known answers, and run loading (analysis.load)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from analysis import metrics
from analysis.load import RunLoadError, load_run, load_runs, run_labels, varied_keys
from tests.support.make_fake_run import make_fake_run

# ---------------------------------------------------------------- fairness


def test_jain_equal_shares_is_one() -> None:
    assert metrics.jain([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)


def test_jain_one_flow_takes_all_is_one_over_n() -> None:
    assert metrics.jain([1, 0, 0, 0]) == pytest.approx(0.25)


def test_jain_known_unequal_shares() -> None:
    # (1+2+3)^2 / (3 * (1+4+9)) = 36/42
    assert metrics.jain([1, 2, 3]) == pytest.approx(36 / 42)


def test_jain_degenerate_and_bad_inputs() -> None:
    assert math.isnan(metrics.jain([]))
    assert math.isnan(metrics.jain([0, 0]))
    with pytest.raises(ValueError, match="shares"):
        metrics.jain([1, -1])


def test_jain_over_windows_counts_a_silent_flow_as_zero() -> None:
    df = pd.DataFrame({"t_s": [0.1, 0.2, 1.1, 1.5, 2.5],
                       "node": ["w0", "w1", "w0", "w0", "w1"],
                       "bytes": [100.0, 100.0, 50.0, 50.0, 30.0]})
    out = metrics.jain_over_windows(df, window_s=1.0)
    assert out["t_s"].tolist() == [0.0, 1.0, 2.0]
    # window 0: equal; window 1: w1 silent -> 1/2; window 2: w0 silent -> 1/2
    assert out["jain"].tolist() == pytest.approx([1.0, 0.5, 0.5])
    assert out["total"].tolist() == [200.0, 100.0, 30.0]


# ---------------------------------------------------------------- goodput


def _events(rows: list[dict[str, object]]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    df["ts_ns"] = (df["t_s"] * 1e9).astype("int64")
    return df


def test_goodput_spreads_each_send_over_its_duration() -> None:
    # w0 sends 1000 bytes during [0.5, 1.5]: half lands in window 0, half in window 1.
    ev = _events([{"t_s": 1.5, "node": "w0", "event": "send_done", "bytes": 1000.0,
                   "send_s": 1.0},
                  {"t_s": 0.2, "node": "w1", "event": "send_done", "bytes": 400.0,
                   "send_s": 0.0}])
    gp = metrics.goodput(ev, window_s=1.0)
    w0 = gp[gp["node"] == "w0"].set_index("t_s")["bytes"]
    w1 = gp[gp["node"] == "w1"].set_index("t_s")["bytes"]
    assert w0.to_dict() == pytest.approx({0.0: 500.0, 1.0: 500.0})
    assert w1.to_dict() == pytest.approx({0.0: 400.0, 1.0: 0.0})
    assert gp.loc[(gp["node"] == "w0") & (gp["t_s"] == 0.0), "goodput_mbps"].item() == \
        pytest.approx(500 * 8 / 1e6)


def test_goodput_from_tcp_info_uses_bytes_acked_deltas_and_restarts() -> None:
    ev = _events([{"t_s": t, "node": "w0", "event": "tcp_info", "bytes_acked": b}
                  for t, b in [(0.1, 1000), (0.6, 3000), (1.2, 6000), (1.4, 500)]])
    gp = metrics.goodput(ev, window_s=1.0, source="tcp_info").set_index("t_s")["bytes"]
    # first sample is only a reference; 2000 in window 0; 3000 + 500 (restart) in window 1
    assert gp.to_dict() == pytest.approx({0.0: 2000.0, 1.0: 3500.0})


def test_goodput_rejects_unknown_source() -> None:
    ev = _events([{"t_s": 1.0, "node": "w0", "event": "x", "bytes": 1.0}])
    with pytest.raises(ValueError, match="source"):
        metrics.goodput(ev, source="x")


# ---------------------------------------------------------------- link


def _links(sent: list[float], rate: list[float], direction: str = "up",
           dev: str = "s1-eth1", dt_s: float = 0.1) -> pd.DataFrame:
    n = len(sent)
    t = np.arange(n) * dt_s
    return pd.DataFrame({"ts_ns": (t * 1e9).astype("int64"), "t_s": t, "direction": direction,
                         "dev": dev, "sent_bytes": sent, "sent_pkts": [s / 1500 for s in sent],
                         "drops": [0, 0, 1, 3, 3, 3][:n], "backlog_bytes": [0.0] * n,
                         "backlog_pkts": [0.0] * n, "rate_mbps": rate})


def test_utilization_of_a_known_byte_series() -> None:
    # 8 Mbit/s = 1e6 bytes/s = 100 kB per 0.1 s interval allowed.
    # intervals: idle, 100k, 50k, 100k, idle  -> busy span = 3 intervals -> 250k / 300k
    sent = [0, 0, 100_000, 150_000, 250_000, 250_000]
    links = _links(sent, [8.0] * 6)
    assert metrics.busy_utilization(links, "up") == pytest.approx(250 / 300)
    assert math.isnan(metrics.busy_utilization(links, "down"))


def test_utilization_uses_the_rate_in_force_per_interval() -> None:
    # rate halves at sample 2; an interval runs at the rate of its first sample, so the
    # intervals allow 100k, 100k, 50k and deliver 100k, 50k, 25k
    links = _links([0, 100_000, 150_000, 175_000], [8.0, 8.0, 4.0, 4.0])
    assert metrics.busy_utilization(links, "up") == pytest.approx(175 / 250)
    thr = metrics.link_throughput(links, "up")
    assert thr["throughput_mbps"].tolist() == pytest.approx([8.0, 4.0, 2.0])
    assert thr["rate_mbps"].tolist() == [8.0, 8.0, 4.0]


def test_drops_and_queue_series() -> None:
    links = _links([0, 1, 2, 3, 4, 5], [8.0] * 6)
    d = metrics.drops(links, "up")
    assert d["drops"].tolist() == [0, 1, 2, 0, 0]
    assert d["drops_total"].tolist() == [0, 1, 3, 3, 3]
    assert len(metrics.queue_series(links, "up")) == 6


# ---------------------------------------------------------------- iterations, accuracy


def test_iteration_breakdown_means_and_remainder() -> None:
    ev = pd.DataFrame({
        "event": ["iter_done"] * 4, "node": ["w0", "w0", "w1", "w1"], "iter": [0, 1, 0, 1],
        "iter_s": [1.0, 2.0, 1.0, 1.0], "compute_s": [0.4, 0.8, 0.5, 0.5],
        "compress_s": [0.1, 0.2, 0.1, 0.1], "send_s": [0.2, 0.4, 0.2, 0.2],
        "wait_s": [0.1, 0.2, 0.1, 0.1]})
    b = metrics.iteration_breakdown(ev)
    assert b.loc["all", "compute_s"] == pytest.approx(0.55)
    assert b.loc["all", "receive_s"] == pytest.approx((0.2 + 0.4 + 0.1 + 0.1) / 4)
    assert b.loc["all", list(metrics.ITERATION_PARTS)].sum() == pytest.approx(
        b.loc["all", "iter_s"])
    per = metrics.iteration_breakdown(ev, by="node")
    assert per.loc["w0", "iter_s"] == pytest.approx(1.5)
    warm = metrics.iteration_breakdown(ev, by="node", skip_first=1)
    assert warm.loc["w0", "compute_s"] == pytest.approx(0.8)


def test_time_to_accuracy_is_the_first_evaluation_at_target_from_training_start() -> None:
    s = 1_000_000_000
    ev = pd.DataFrame({"event": ["run_start", "ps_ready"] + ["eval"] * 4,
                       "node": ["controller", "ps", "ps", "ps", "ps", "ps"],
                       "ts_ns": [0, 5 * s, 15 * s, 25 * s, 35 * s, 45 * s],
                       "iter": [-1, -1, 9, 19, 29, 39],
                       "accuracy": [np.nan, np.nan, 0.5, 0.7, 0.9, 0.8]})
    # Measured at the evaluation (no interpolation), from ps_ready (not run_start).
    assert metrics.time_to_accuracy(ev, 0.8) == pytest.approx(30.0)
    assert metrics.iterations_to_accuracy(ev, 0.8) == 30
    assert metrics.time_to_accuracy(ev, 0.4) == pytest.approx(10.0)  # already there
    assert metrics.time_to_accuracy(ev, 0.9) == pytest.approx(30.0)
    assert math.isnan(metrics.time_to_accuracy(ev, 0.95))
    assert metrics.iterations_to_accuracy(ev, 0.95) is None
    assert math.isnan(metrics.time_to_accuracy(ev, 0.0))  # no target, no time
    # Another node's "accuracy" is not the PS's held-out evaluation.
    other = ev.assign(node=["controller", "ps", "w0", "w0", "w0", "w0"])
    assert math.isnan(metrics.time_to_accuracy(other, 0.4))


def test_bytes_per_iteration() -> None:
    ev = pd.DataFrame({"event": ["iter_done"] * 3, "node": ["w0", "w1", "w0"],
                       "iter": [0, 0, 1], "bytes_up": [100, 300, 50], "bytes_down": [10, 10, 5]})
    b = metrics.bytes_per_iteration(ev)
    assert b.loc[0, "bytes_up"] == 400 and b.loc[0, "workers"] == 2
    assert b.loc[0, "bytes_up_per_worker"] == 200
    assert b.loc[1, "bytes_down"] == 5


def test_keep_ratio_vs_bandwidth_aligns_with_the_latest_sample() -> None:
    links = _links([0, 100_000, 150_000, 175_000], [8.0, 8.0, 4.0, 4.0])
    dec = pd.DataFrame({"t_s": [0.15, 0.35], "node": ["w0", "w0"], "iter": [0, 1],
                        "keep": [1.0, 0.5], "r0_bps": [8e6, 8e6], "rt_bps": [8e6, 4e6]})
    kv = metrics.keep_ratio_vs_bandwidth(dec, links)
    assert kv["allowed_mbps"].tolist() == [8.0, 4.0]
    assert kv["measured_mbps"].tolist() == pytest.approx([8.0, 2.0])
    assert kv["rt_mbps"].tolist() == [8.0, 4.0]


def test_bubble_fraction_of_a_gpipe_schedule() -> None:
    # GPipe forward-only fill-drain, p=2 stages, m=2 micro-batches, unit ops:
    # stage 0 busy [0,2], stage 1 busy [1,3]; makespan 3 -> 1 - 4/6 = (p-1)/(m+p-1) = 1/3
    ops = pd.DataFrame({"node": ["s0", "s0", "s1", "s1"], "start_s": [0, 1, 1, 2],
                        "end_s": [1, 2, 2, 3]})
    assert metrics.bubble_fraction(ops) == pytest.approx(1 / 3)
    # overlapping operations on one stage count once
    ops2 = pd.DataFrame({"node": ["s0", "s0"], "start_s": [0.0, 0.5], "end_s": [1.0, 1.0]})
    assert metrics.bubble_fraction(ops2) == pytest.approx(0.0)


def test_percentiles() -> None:
    assert metrics.percentile([1, 2, 3, 4, float("nan")], 50) == pytest.approx(2.5)
    assert math.isnan(metrics.percentile([], 50))
    ev = pd.DataFrame({"event": ["iter_done"] * 4, "iter_s": [1.0, 2.0, 3.0, 4.0]})
    p = metrics.iteration_time_percentiles(ev, (50,))
    assert p == pytest.approx({"p50": 2.5, "mean": 2.5})


# ---------------------------------------------------------------- loading


def test_load_run_parquet(tmp_path: Path) -> None:
    run_dir = make_fake_run(tmp_path / "r", workers=3, iterations=10)
    run = load_run(run_dir)
    ev = run.events
    assert ev["ts_ns"].dtype == "int64" and ev["iter"].dtype == "int64"
    assert isinstance(ev["node"].dtype, pd.CategoricalDtype)
    assert isinstance(ev["event"].dtype, pd.CategoricalDtype)
    assert ev.loc[ev["event"] == "run_start", "t_s"].item() == 0.0
    assert (ev["t_s"] >= 0).all()
    assert run.workers == ["w0", "w1", "w2"]
    it = run.iterations()
    assert len(it) == 30 and set(it["node"]) == {"w0", "w1", "w2"}
    assert run.evals()["accuracy"].is_monotonic_increasing
    assert set(run.tcp_info["event"]) == {"tcp_info"} and "bytes_acked" in run.tcp_info
    assert len(run.decisions) == 30 and "keep" in run.decisions
    assert run.config["net"]["workers"] == 3
    assert run.summary["iterations"] == 10
    assert len(run.links) and (run.links["t_s"] >= 0).all()


def test_load_run_jsonl_only_skips_truncated_last_line(tmp_path: Path) -> None:
    run_dir = make_fake_run(tmp_path / "r", workers=2, iterations=5, jsonl_only=True)
    assert not list((run_dir / "events").glob("*.parquet"))
    w0 = run_dir / "events" / "w0.jsonl"
    full = len(w0.read_text().splitlines())
    with open(w0, "a") as fh:
        fh.write('{"ts_ns": 1, "run_id": "r", "no')  # killed mid-write
    run = load_run(run_dir)
    assert (run.events["node"] == "w0").sum() == full
    assert run.summary == {} and run.links.empty


def test_load_events_is_the_one_loader_and_allow_empty_is_for_dead_runs(tmp_path: Path) -> None:
    from analysis.load import load_events

    run_dir = make_fake_run(tmp_path / "r", workers=2, iterations=3)
    ev = load_events(run_dir)
    assert ev["ts_ns"].is_monotonic_increasing and ev["iter"].dtype == "int64"
    assert len(ev) == len(load_run(run_dir).events)
    empty = tmp_path / "dead"
    (empty / "events").mkdir(parents=True)
    with pytest.raises(RunLoadError, match="no events"):
        load_events(empty)
    got = load_events(empty, allow_empty=True)
    assert got.empty and {"ts_ns", "node", "iter", "event"} <= set(got.columns)
    assert load_events(tmp_path / "none", allow_empty=True).empty
    with pytest.raises(RunLoadError, match="missing events directory"):
        load_events(tmp_path / "none")


def test_load_run_missing_file_names_it(tmp_path: Path) -> None:
    run_dir = make_fake_run(tmp_path / "r", workers=2, iterations=3)
    (run_dir / "config.toml").unlink()
    with pytest.raises(RunLoadError, match=r"config\.toml: missing file"):
        load_run(run_dir)
    with pytest.raises(RunLoadError, match="nowhere"):
        load_run(tmp_path / "nowhere")


def test_load_run_schema_mismatch_names_the_file(tmp_path: Path) -> None:
    run_dir = make_fake_run(tmp_path / "r", workers=2, iterations=3)
    meta = json.loads((run_dir / "meta.json").read_text())
    meta["schema_version"] = 99
    (run_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(RunLoadError, match=r"meta\.json: schema_version 99"):
        load_run(run_dir)


def test_load_run_event_file_missing_columns_names_it(tmp_path: Path) -> None:
    run_dir = make_fake_run(tmp_path / "r", workers=2, iterations=3)
    bad = run_dir / "events" / "w1.parquet"
    pd.read_parquet(bad).drop(columns=["iter"]).to_parquet(bad)
    with pytest.raises(RunLoadError, match=r"w1\.parquet: event schema mismatch.*iter"):
        load_run(run_dir)


def test_load_runs_has_one_column_per_varied_key(tmp_path: Path) -> None:
    make_fake_run(tmp_path / "sweep" / "a", compressor="topk", rate_mbps=100.0)
    make_fake_run(tmp_path / "sweep" / "b", compressor="none", rate_mbps=100.0)
    make_fake_run(tmp_path / "sweep" / "c", compressor="topk", rate_mbps=50.0)
    table = load_runs(str(tmp_path / "sweep" / "*"))
    assert len(table) == 3
    assert set(varied_keys(table)) == {"compress.name", "net.bottleneck_mbps",
                                       "net.bottleneck_down_mbps"}
    assert table["compress.name"].tolist() == ["topk", "none", "topk"]
    assert "net.workers" not in table  # the same in every run
    assert {"run", "final_accuracy", "iter_time_s_p50"} <= set(table.columns)
    assert table["run"].map(lambda p: Path(p).name).tolist() == ["a", "b", "c"]
    assert run_labels(table)[1].startswith("compress.name=none")
    with pytest.raises(RunLoadError, match="no run directories"):
        load_runs(str(tmp_path / "nothing" / "*"))


def test_transport_series_converts_units_and_counts_retransmissions_across_restarts() -> None:
    rows = [{"t_s": t, "node": "w0", "event": "tcp_info", "cwnd": c, "rtt_us": r,
             "pacing_rate_bps": p, "total_retrans": x}
            for t, c, r, p, x in [(0.0, 10, 40_000, 1e8, 0), (0.1, 20, 41_000, 2e8, 3),
                                  (0.2, 15, 42_000, 1.5e8, 5),
                                  (0.3, 10, 40_500, 1e8, 1)]]  # a new connection: 1
    rows.append({"t_s": 0.05, "node": "w1", "event": "send_done", "bytes": 1})
    tr = metrics.transport_series(_events(rows))
    assert list(tr["node"]) == ["w0"] * 4
    assert list(tr["rtt_ms"]) == [40.0, 41.0, 42.0, 40.5]
    assert list(tr["pacing_rate_mbps"]) == [100.0, 200.0, 150.0, 100.0]
    assert list(tr["retrans"]) == [0, 3, 5, 5]  # the restart's 1 is not a negative step
    assert metrics.transport_series(_events([rows[-1]])).empty


def test_transport_plot_and_report_show_every_flow(tmp_path: Path) -> None:
    from analysis import plots
    from analysis.report import render_report

    run_dir = make_fake_run(tmp_path / "run", workers=3, iterations=5)
    run = load_run(run_dir)
    fig = plots.plot_transport(run.events, run.links)
    cwnd_ax = fig.axes[0]
    assert sorted(line.get_label() for line in cwnd_ax.get_lines()) == ["w0", "w1", "w2"]
    assert len(fig.axes[4].get_lines()) >= 1  # the queue beside them
    assert "cwnd, RTT, pacing rate and retransmissions" in render_report([run_dir])
