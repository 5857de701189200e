"""summary.json from synthetic events, link and class samples: the upload-window
utilisation, agent_limited of PS, pipeline, MoE and torchrun runs, and the warm-up
iterations left out of the iteration-time percentiles and utilisation."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from agents.core import config as cfgmod
from analysis.metrics import upload_window_utilization, upload_windows
from controller.class_sampler import FABRIC_CLASS_SAMPLE_MS, class_sample_ms
from controller.summary import (
    UNINSTRUMENTED_WHY,
    read_classes,
    summarize,
    torchrun_agent_limited,
)

S = 1_000_000_000  # ns


def _run(iter_s: list[float], busy: list[float]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Two workers; iteration i's upload window is [10 i, 10 i + 1] s, during which the
    100 Mbit/s up link delivers busy[i] of what it allows."""
    rows = []
    for i, t in enumerate(iter_s):
        start = 10 * i * S
        for w in (0, 1):
            rows.append({"event": "send_done", "node": f"w{w}", "iter": i, "ts_ns": start + S,
                         "start_ns": start, "bytes": 1000, "send_s": 0.5})
            rows.append({"event": "iter_done", "node": f"w{w}", "iter": i, "ts_ns": start + S,
                         "iter_s": t})
        rows.append({"event": "grads_in", "node": "ps", "iter": i, "ts_ns": start + S})
        rows.append({"event": "ps_iter_done", "node": "ps", "iter": i, "ts_ns": start + S})
    ev = pd.DataFrame(rows).sort_values("ts_ns", kind="stable").reset_index(drop=True)
    sent = 0.0
    links = [{"direction": "up", "dev": "s1-eth0", "ts_ns": -S, "sent_bytes": 0.0,
              "rate_mbps": 100.0, "drops": 0}]
    for i, b in enumerate(busy):
        start = 10 * i * S
        links.append({"direction": "up", "dev": "s1-eth0", "ts_ns": start, "sent_bytes": sent,
                      "rate_mbps": 100.0, "drops": 0})
        sent += b * 100e6 / 8
        links.append({"direction": "up", "dev": "s1-eth0", "ts_ns": start + S,
                      "sent_bytes": sent, "rate_mbps": 100.0, "drops": 0})
    return ev, pd.DataFrame(links)


def _cfg(warmup: int) -> dict:
    return {"net": {"workers": 2}, "run": {"warmup_iterations": warmup}}


def test_upload_windows_and_their_utilisation() -> None:
    ev, links = _run([1.0, 1.0, 1.0], [0.5, 1.0, 0.9])
    windows = upload_windows(ev)
    assert windows == [(i, 10 * i * S, (10 * i + 1) * S) for i in range(3)]
    assert upload_window_utilization(links, windows[1:2]) == pytest.approx(1.0)
    assert upload_window_utilization(links, windows) == pytest.approx((0.5 + 1.0 + 0.9) / 3)


@pytest.mark.parametrize("warmup", [0, 1, 2])
def test_warmup_iterations_are_left_out_of_times_and_utilisation(warmup) -> None:
    iter_s = [9.0, 3.0, 2.0, 2.0]
    busy = [0.3, 0.9, 1.0, 1.0]
    ev, links = _run(iter_s, busy)
    s = summarize(ev, links, _cfg(warmup), wall_s=40.0, interrupted=False,
                  stop_reason="completed")
    kept = iter_s[warmup:]
    assert s["warmup_iterations"] == warmup
    assert s["iterations"] == 4  # every iteration still counts as run
    assert s["iter_time_s_mean"] == pytest.approx(sum(kept) / len(kept))
    assert s["iter_time_s_p99"] == pytest.approx(max(kept), rel=0.05)
    assert s["bottleneck_utilization"] == pytest.approx(sum(busy[warmup:]) / len(kept))


def test_a_run_config_rejects_warmup_at_or_past_its_iterations() -> None:
    from agents.core import config as cfgmod
    with pytest.raises(cfgmod.ConfigError, match="run.warmup_iterations"):
        cfgmod.from_dict({"run": {"iterations": 3, "warmup_iterations": 3}})


def test_the_summary_and_the_report_agree_on_one_run_directory(tmp_path) -> None:
    """The controller's summary.json and the report's numbers come from one definition
    (analysis.metrics), so on the same run directory they are equal, key by key."""
    import json
    import math
    import tomllib

    import tomli_w

    from analysis.load import load_events, load_run
    from analysis.metrics import GLOSSARY
    from analysis.report import glossary, render_report, run_metrics
    from tests.support.make_fake_run import make_fake_run

    run_dir = make_fake_run(tmp_path / "fake", workers=3, iterations=30)
    cfg = tomllib.loads((run_dir / "config.toml").read_text())
    cfg["run"].update(target_accuracy=0.8, warmup_iterations=2)
    (run_dir / "config.toml").write_text(tomli_w.dumps(cfg))
    # What the controller does when a run ends (controller/record.py write_record).
    summary = summarize(load_events(run_dir), pd.read_parquet(run_dir / "links.parquet"),
                        cfg, wall_s=12.0, interrupted=False, stop_reason="completed")
    (run_dir / "summary.json").write_text(json.dumps(summary))

    computed = run_metrics(load_run(run_dir))
    shared = sorted(set(summary) & set(computed))
    for key in ("bottleneck_utilization", "jain_fairness", "time_to_target_s",
                "iterations_to_target", "iter_time_s_p50", "final_accuracy", "bytes_up"):
        assert key in shared, key
        assert summary[key] is not None, key  # the fake run has data for every one
    for key in shared:
        a, b = summary[key], computed[key]
        if a is None:
            assert b is None or math.isnan(b), key
        else:
            assert b == pytest.approx(a, rel=1e-12), key
    # Two utilisations with two names, both defined, and genuinely different here.
    assert computed["busy_utilization_up"] != pytest.approx(summary["bottleneck_utilization"])
    page = render_report([run_dir])
    for key in ("bottleneck_utilization", "busy_utilization_up", "jain_fairness",
                "jain_mean_1s", "time_to_target_s"):
        assert f"<dt><code>{key}</code></dt><dd>" in page, key
    # Every key the summary writes has a glossary line.
    assert set(summary) <= set(GLOSSARY), set(summary) - set(GLOSSARY)
    assert glossary(["no_such_column"]) == ""


def test_agent_limited_follows_the_upload_windows_busy_fraction() -> None:
    ev, links = _run([1.0, 1.0], [0.4, 0.5])
    links["backlog_bytes"] = 0
    s = summarize(ev, links, _cfg(0), 3.0, False, "done")
    assert s["agent_limited"] is True and s["agent_limited_why"].startswith("agent-limited")
    ev, links = _run([1.0, 1.0], [0.99, 0.98])
    links["backlog_bytes"] = 0
    s = summarize(ev, links, _cfg(0), 3.0, False, "done")
    assert s["agent_limited"] is False
    pipeline = {**_cfg(0), "pipeline": {"stages": 2}}
    s = summarize(ev, links, pipeline, 3.0, False, "done")
    assert s["agent_limited"] is None and "pipeline" in s["agent_limited_why"]
    s = summarize(ev.iloc[:0], links, _cfg(0), 3.0, False, "done")
    assert s["agent_limited"] is None and s["agent_limited_why"]


def _fabric_classes(busy: float, backlog_bytes: int = 0) -> pd.DataFrame:
    """HTB class samples every 5 ms of two 100 Mbit/s access links over 2 s: ``gbh0.up``
    delivers ``busy`` of its rate from 0.5 s to 1.5 s and nothing else, ``gbh1.up`` a
    tenth of that (its acknowledgements)."""
    rows = []
    for point, share in (("gbh0.up", 1.0), ("gbh1.up", 0.1)):
        for k in range(401):
            t = k * 5_000_000
            on_s = min(max(t / S - 0.5, 0.0), 1.0)
            rows.append({"ts_ns": t, "point": point, "dev": point.replace(".up", "-eth0"),
                         "sent_bytes": int(on_s * busy * share * 100e6 / 8),
                         "backlog_bytes": backlog_bytes if 0.5 * S <= t <= 1.5 * S else 0,
                         "rate_mbps": 100.0})
    return pd.DataFrame(rows)


def _fabric_events(role: str) -> tuple[pd.DataFrame, dict]:
    """One step's transfers from 0.5 s to 1.5 s: a pipeline stage's two activations back to
    back, each from its send to its arrival, or two MoE hosts' dispatch (counts, then
    tokens)."""
    cfg = {"net": {"workers": 2, "worker_link_mbps": 100.0}, "run": {"warmup_iterations": 0},
           "topo": {"role": role}}
    if role == "stage":
        cfg["pipeline"] = {"stages": 2}
        rows = [{"event": "pp_send", "node": "s0", "iter": 0, "ts_ns": S // 2 + 1000,
                 "kind": "SA", "mb": mb, "chunk": 0, "to": 1, "start_ns": s,
                 "end_ns": s + 1000} for mb, s in ((0, S // 2), (1, S))]
        rows += [{"event": "pp_recv", "node": "s1", "iter": 0, "ts_ns": e, "kind": "RA",
                  "mb": mb, "chunk": 0, "from_stage": 0, "arrived_ns": e}
                 for mb, e in ((0, S), (1, 3 * S // 2))]
        return pd.DataFrame(rows), cfg
    rows = []
    for h in ("e0", "e1"):
        for phase, s, e in (("dispatch_counts", S // 2, 6 * S // 10),
                            ("dispatch_tokens", 6 * S // 10, 3 * S // 2)):
            rows.append({"event": "moe_phase", "node": h, "iter": 0, "ts_ns": e, "layer": 0,
                         "phase": phase, "start_ns": s, "end_ns": e, "dur_s": (e - s) / S,
                         "bytes_up": 1000, "bytes_down": 1000, "payload_up": 900,
                         "payload_down": 900})
    return pd.DataFrame(rows), cfg


@pytest.mark.parametrize("role", ["stage", "expert"])
def test_fabric_runs_are_judged_on_the_busiest_access_link(role) -> None:
    ev, cfg = _fabric_events(role)
    links = pd.DataFrame(columns=["ts_ns", "direction", "sent_bytes", "rate_mbps"])
    s = summarize(ev, links, cfg, 2.0, False, "done", _fabric_classes(0.5))
    assert s["agent_limited"] is True, s["agent_limited_why"]
    assert "gbh0.up" in s["agent_limited_why"] and "0.50" in s["agent_limited_why"]
    s = summarize(ev, links, cfg, 2.0, False, "done", _fabric_classes(0.97))
    assert s["agent_limited"] is False and "0.97" in s["agent_limited_why"]
    s = summarize(ev, links, cfg, 2.0, False, "done", _fabric_classes(0.5, 100_000))
    assert s["agent_limited"] is False and "queue" in s["agent_limited_why"]
    s = summarize(ev, links, cfg, 2.0, False, "done", None)
    assert s["agent_limited"] is None and "class samples" in s["agent_limited_why"]


def test_a_pipeline_message_late_by_the_paths_delay_is_not_the_agents() -> None:
    ev, cfg = _fabric_events("stage")
    late = ev["event"] == "pp_recv"
    ev.loc[late, "arrived_ns"] = ev.loc[late, "arrived_ns"] + S // 5  # 200 ms after
    links = pd.DataFrame(columns=["ts_ns", "direction", "sent_bytes", "rate_mbps"])
    s = summarize(ev, links, cfg, 2.0, False, "done", _fabric_classes(0.97))
    assert s["agent_limited"] is True and "0.81" in s["agent_limited_why"]
    cfg["net"]["delay_ms"] = 200.0
    s = summarize(ev, links, cfg, 2.0, False, "done", _fabric_classes(0.97))
    assert s["agent_limited"] is False and "0.97" in s["agent_limited_why"]


def test_moe_and_pipeline_runs_sample_the_classes_unless_told_or_remote() -> None:
    configs = Path(__file__).resolve().parents[2] / "configs"
    for name in ("moe.toml", "pipeline.toml"):
        cfg = cfgmod.load(configs / name)
        assert class_sample_ms(cfg, remote=False) == FABRIC_CLASS_SAMPLE_MS
        assert class_sample_ms(cfg, remote=True) == 0.0
        told = cfgmod.load(configs / name, ["topo.class_sample_ms=2"])
        assert class_sample_ms(told, remote=False) == 2.0
    assert class_sample_ms(cfgmod.load(configs / "wire_utilization.toml"), remote=False) == 0.0


def test_unreadable_class_samples_leave_the_summary_to_say_unknown(tmp_path) -> None:
    assert read_classes(tmp_path / "classes.parquet") is None
    (tmp_path / "classes.parquet").write_bytes(b"PAR1 cut short")
    assert read_classes(tmp_path / "classes.parquet") is None
    _fabric_classes(0.5).to_parquet(tmp_path / "classes.parquet")
    got = read_classes(tmp_path / "classes.parquet")
    assert got is not None and len(got) == 802


def test_an_moe_runs_combine_is_judged_beside_its_dispatch() -> None:
    """Two hosts' dispatch from 0.5 s to 1.0 s keeps gbh0.up 0.97 busy; their combine from
    1.1 s to 1.6 s (after the experts ran) sends the outputs back on gbh1.up, which it keeps
    only 0.31 busy with no queue: over both windows the links were busy 0.64,
    agent-limited, where the dispatch alone reads network-limited."""
    cfg = {"net": {"workers": 2, "worker_link_mbps": 100.0}, "run": {"warmup_iterations": 0},
           "topo": {"role": "expert"}}
    rows = []
    for h in ("e0", "e1"):
        for phase, s, e in (("dispatch_counts", S // 2, 6 * S // 10),
                            ("dispatch_tokens", 6 * S // 10, S),
                            ("combine", 11 * S // 10, 16 * S // 10)):
            rows.append({"event": "moe_phase", "node": h, "iter": 0, "ts_ns": e, "layer": 0,
                         "phase": phase, "start_ns": s, "end_ns": e, "dur_s": (e - s) / S,
                         "bytes_up": 1000, "bytes_down": 1000, "payload_up": 900,
                         "payload_down": 900})
    ev = pd.DataFrame(rows)

    def on_s(t: int, a: float, b: float) -> float:
        return min(max(t / S - a, 0.0), b - a)

    classes = pd.DataFrame(
        [{"ts_ns": t, "point": p, "dev": p.replace(".up", "-eth0"),
          "sent_bytes": int(f(t) * 100e6 / 8), "backlog_bytes": 0, "rate_mbps": 100.0}
         for t in range(0, 2 * S + 1, 5_000_000)
         for p, f in (("gbh0.up", lambda t: 0.97 * on_s(t, 0.5, 1.0)),
                      ("gbh1.up", lambda t: 0.31 * on_s(t, 1.1, 1.6)))])
    links = pd.DataFrame(columns=["ts_ns", "direction", "sent_bytes", "rate_mbps"])
    s = summarize(ev, links, cfg, 2.0, False, "done", classes)
    assert s["agent_limited"] is True, s["agent_limited_why"]
    assert "gbh0.up, gbh1.up" in s["agent_limited_why"] and "0.64" in s["agent_limited_why"]
    dispatch_only = ev[ev["phase"] != "combine"]
    s = summarize(dispatch_only, links, cfg, 2.0, False, "done", classes)
    assert s["agent_limited"] is False and "0.97" in s["agent_limited_why"]


def _ddp_buckets(world: int = 2) -> pd.DataFrame:
    """An instrumented torchrun run's buckets (gradbed.ddp.instrument): on each of two
    ranks, two all_reduce buckets back to back, launched at 0.5 s and 1.0 s after 10 ms of
    compression, each ending 0.5 s after its launch."""
    rows = []
    for node in ("gbh0", "gbh1")[:world]:
        for b, launched in ((0, S // 2), (1, S)):
            rows.append({"event": "ddp_bucket", "node": node, "iter": 0, "ts_ns": launched,
                         "bucket": b, "collective": "allreduce", "start_ns": launched - S // 100,
                         "end_ns": launched + S // 2, "comm_s": 0.5, "compress_s": 0.01})
    return pd.DataFrame(rows)


def test_a_torchrun_run_is_judged_over_its_ranks_bucket_windows() -> None:
    ev = _ddp_buckets()
    got = torchrun_agent_limited(ev, _fabric_classes(0.5), 2, 0.0)
    assert got[0] is True and "gbh0.up" in got[1] and "0.50" in got[1], got
    assert "the ranks" in got[1] and "DDP buckets" in got[1] and "gradbed on" not in got[1]
    got = torchrun_agent_limited(ev, _fabric_classes(0.97), 2, 0.0)
    assert got[0] is False and "0.97" in got[1], got
    got = torchrun_agent_limited(ev, _fabric_classes(0.5, 100_000), 2, 0.0)
    assert got[0] is False and "queue" in got[1], got
    # The windows start at the collective's launch (end_ns - comm_s): 100 ms earlier,
    # with the link idle, they read 0.45.
    ev.loc[:, "comm_s"] = 0.6
    assert "0.45" in torchrun_agent_limited(ev, _fabric_classes(0.5), 2, 0.0)[1]


def test_a_torchrun_rings_latency_floor_is_the_networks_time() -> None:
    """Buckets that end 100 ms after the link went quiet: a 4-rank ring's 6 hops of 20 ms
    (its floor, 120 ms) cover that, so the link was busy through what is left."""
    ev = _ddp_buckets()
    ev.loc[:, "end_ns"] = ev["end_ns"] + S // 10
    ev.loc[:, "comm_s"] = 0.6
    assert torchrun_agent_limited(ev, _fabric_classes(0.97), 4, 0.0)[0] is True
    got = torchrun_agent_limited(ev, _fabric_classes(0.97), 4, 20.0)
    assert got[0] is False and "0.97" in got[1], got
    # A bucket no longer than its floor is left out; none left: unknown, and why.
    got = torchrun_agent_limited(ev, _fabric_classes(0.97), 4, 200.0)
    assert got[0] is None and "latency floor" in got[1], got


def test_an_uninstrumented_torchrun_run_says_why_its_regime_is_unknown() -> None:
    for ev in (pd.DataFrame(), _ddp_buckets().assign(event="ddp_iter")):
        got = torchrun_agent_limited(ev, _fabric_classes(0.5), 2, 0.0)
        assert got == (None, UNINSTRUMENTED_WHY)
    assert "gradbed.ddp.instrument" in UNINSTRUMENTED_WHY
    got = torchrun_agent_limited(_ddp_buckets(), None, 2, 0.0)
    assert got[0] is None and "class samples" in got[1]


def test_torchrun_runs_sample_the_classes() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "torchrun_ddp" / "fabric4.toml"
    assert class_sample_ms(cfgmod.load(example, ["torchrun.script='train.py'"]),
                           remote=False) == FABRIC_CLASS_SAMPLE_MS
