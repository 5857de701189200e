"""``trace.json``: the Chrome Trace Event Format's rules, and its content.

The content checks: a worker's compute, compress, send, wait and receive spans partition
each of its iterations (sum to ``iter_s`` within 1 %, in order, without overlap); MoE and
any role added later appear; the controller and ``gradbed cleanup`` write the file; and
``gradbed trace`` says where it is. Run on a synthetic run, a real loopback run (real
processes, real TCP) and, marked ``mininet``, the real controller run the report tests make.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from analysis import metrics
from analysis.cli import trace_main
from analysis.load import load_events
from analysis.trace import TRACE_FILE, chrome_trace, write_trace
from tests.support import real_run
from tests.support.loopback import run_loopback
from tests.support.make_fake_run import make_fake_run

PHASES = ("compute", "compress", "send", "wait", "receive")


def format_problems(trace: Any) -> list[str]:
    """What breaks the Trace Event Format's rules (empty when nothing does)."""
    bad: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    evs = trace["traceEvents"]
    procs = {e.get("pid") for e in evs if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e.get("pid"), e.get("tid")) for e in evs
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    for i, e in enumerate(evs):
        missing = [k for k in ("name", "ph", "pid", "tid") if k not in e]
        if e.get("ph") != "M" and "ts" not in e:
            missing.append("ts")
        if missing:
            bad.append(f"event {i}: no {missing}")
            continue
        ph = e["ph"]
        if ph == "X" and not (isinstance(e.get("dur"), int | float) and e["dur"] >= 0):
            bad.append(f"event {i}: X without a dur >= 0")
        if ph == "C" and not (e.get("args") and all(
                isinstance(v, int | float) and math.isfinite(v) for v in e["args"].values())):
            bad.append(f"event {i}: C whose args are not all finite numbers")
        if ph != "M" and not isinstance(e["ts"], int | float):
            bad.append(f"event {i}: ts is not a number")
        if e["pid"] not in procs:
            bad.append(f"event {i}: pid {e['pid']} has no process_name")
        if ph in ("X", "i") and (e["pid"], e["tid"]) not in threads:
            bad.append(f"event {i}: pid/tid {e['pid']}/{e['tid']} has no thread_name")
    return bad


def load_trace(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))  # strict JSON: no NaN
    assert format_problems(data) == []
    return data


def spans_by_host(trace: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """(host, thread) -> its X events, in time order."""
    evs = trace["traceEvents"]
    hosts = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    lanes = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    out: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for e in evs:
        if e["ph"] == "X":
            out[(hosts[e["pid"]], lanes[(e["pid"], e["tid"])])].append(e)
    for v in out.values():
        v.sort(key=lambda e: e["ts"])
    return out


def check_worker_partition(trace: dict[str, Any], events: pd.DataFrame,
                           need_receive: bool) -> int:
    """Each worker iteration's five phases sum to its iter_s within 1 %, follow each other
    without overlap, and the compute span is the measured compute_s. Returns how many
    iterations were checked."""
    spans = spans_by_host(trace)
    done = events[events["event"] == "iter_done"]
    checked = 0
    for r in done.to_dict("records"):
        mine = [e for e in spans[(str(r["node"]), "main")] if e["args"]["iter"] == r["iter"]]
        assert {e["cat"] for e in mine} <= set(PHASES)
        total_us = sum(e["dur"] for e in mine)
        want_us = float(r["iter_s"]) * 1e6
        assert abs(total_us - want_us) <= 0.01 * want_us, (r["node"], r["iter"], total_us,
                                                           want_us)
        for a, b in zip(mine, mine[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 0.002, (a, b)  # rounding to the ns
        assert mine[0]["cat"] == "compute"
        assert abs(mine[0]["dur"] - float(r["compute_s"]) * 1e6) <= 0.01 * want_us
        cats = [e["cat"] for e in mine]
        assert "send" in cats and ("wait" in cats or "receive" in cats)
        if need_receive:
            assert cats[-1] == "receive", cats
        checked += 1
    return checked


def test_synthetic_run_follows_the_format_and_partitions_iterations(tmp_path: Path) -> None:
    run = make_fake_run(tmp_path / "run", workers=3, iterations=6)
    trace = load_trace(write_trace(run))
    events = load_events(run)
    assert check_worker_partition(trace, events, need_receive=False) == 18
    evs = trace["traceEvents"]
    hosts = {e["args"]["name"] for e in evs if e["name"] == "process_name"}
    assert {"ps", "w0", "w1", "w2", "network", "controller"} <= hosts
    counters = {e["name"] for e in evs if e["ph"] == "C"}
    # Each shaping point's rate, queue and drops (links.parquet), each flow's cwnd and RTT.
    assert counters == {f"{point} {what}" for point in ("s1-eth1 up", "s1-eth2 down")
                        for what in ("rate (Mbit/s)", "queue", "drops")} | {
        "cwnd (segments)", "RTT (ms)"}, counters
    # On the run's clock: the controller's run_start is time zero.
    start = [e for e in evs if e["ph"] == "i" and e["name"] == "run_start"]
    assert len(start) == 1 and start[0]["ts"] == 0
    assert not list(run.glob(".*.tmp"))  # written atomically


def test_format_check_catches_broken_traces(tmp_path: Path) -> None:
    run = make_fake_run(tmp_path / "run", iterations=3)
    good = chrome_trace(load_events(run), pd.DataFrame(
        columns=["ts_ns", "direction", "dev"]))
    assert format_problems(good) == []
    x = next(i for i, e in enumerate(good["traceEvents"]) if e["ph"] == "X")
    for mutate, what in [(lambda e: e.pop("dur"), "dur"), (lambda e: e.update(dur=-1.0), "dur"),
                         (lambda e: e.update(tid=99), "thread_name"),
                         (lambda e: e.pop("ts"), "ts"), (lambda e: e.update(pid=77), "pid")]:
        broken = json.loads(json.dumps(good))
        mutate(broken["traceEvents"][x])
        assert any(what in p for p in format_problems(broken)), what
    broken = json.loads(json.dumps(good))
    broken["traceEvents"].append({"name": "q", "ph": "C", "ts": 1.0, "pid": 1, "tid": 0,
                                  "args": {"q": "high"}})
    assert any("C whose args" in p for p in format_problems(broken))


def test_moe_phases_and_a_role_added_later_appear() -> None:
    base = 10_000_000_000
    rows = [{"ts_ns": base, "node": "controller", "iter": -1, "event": "run_start"}]
    for h in range(2):
        t = base + 1000 * h
        for name, layer, a, b in [("forward", -1, 0, 500), ("dispatch_tokens", 0, 100, 200),
                                  ("expert", 0, 200, 300), ("backward", -1, 500, 900)]:
            rows.append({"ts_ns": t + b, "node": f"e{h}", "iter": 0, "event": "moe_phase",
                         "phase": name, "layer": layer, "start_ns": t + a, "end_ns": t + b})
    rows.append({"ts_ns": base + 5000, "node": "q0", "iter": 3, "event": "quantum_hop",
                 "kind": "teleport", "start_ns": base + 4000})
    trace = chrome_trace(pd.DataFrame(rows), pd.DataFrame(columns=["ts_ns", "direction", "dev"]))
    assert format_problems(trace) == []
    spans = spans_by_host(trace)
    assert [e["name"] for e in spans[("e1", "step")]] == ["forward", "backward"]
    assert [(e["name"], e["cat"]) for e in spans[("e0", "layers")]] == [
        ("dispatch_tokens L0", "exchange"), ("expert L0", "compute")]
    new = spans[("q0", "quantum_hop")]
    assert [(e["name"], e["ts"], e["dur"], e["args"]["iter"]) for e in new] == [
        ("teleport", 4.0, 1.0, 3)]


def test_loopback_run_partitions_every_iteration(tmp_path: Path) -> None:
    """Real PS and worker processes over loopback TCP, several chunks per iteration."""
    run_dir, rc = run_loopback(tmp_path, ["net.workers=2", "run.iterations=3",
                                          "workload.hidden=64", "compress.name='topk'",
                                          "compress.ratio=0.1", "workload.chunk_bytes=8192"])
    assert rc == 0, (run_dir / "ps.log").read_text()
    trace = load_trace(write_trace(run_dir))
    events = load_events(run_dir)
    assert check_worker_partition(trace, events, need_receive=True) == 6
    spans = spans_by_host(trace)
    chunks = events[(events["event"] == "compress_done") & (events["node"] == "w0")
                    & (events["iter"] == 1)]
    assert len(chunks) > 1
    w0 = [e for e in spans[("w0", "main")] if e["args"]["iter"] == 1]
    assert sum(e["cat"] == "compress" for e in w0) == len(chunks)
    # The report's iteration breakdown is these spans' mean per phase: one definition.
    b = metrics.iteration_breakdown(events, by="node")
    for node in ("w0", "w1"):
        mine = spans[(node, "main")]
        for phase in PHASES:
            mean_s = sum(e["dur"] for e in mine if e["cat"] == phase) / 3 / 1e6
            assert b.loc[node, f"{phase}_s"] == pytest.approx(mean_s, abs=1e-6), (node, phase)
        # The PS: receive the gradients, then aggregate, every iteration after the first (whose
    # receive has no previous end to start from).
    ps = [e["args"]["category"] for e in spans[("ps", "main")] if e["args"]["iter"] == 2]
    assert ps == ["receive", "aggregate"], ps


def test_gradbed_trace_builds_a_missing_file_and_says_how_to_open_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_fake_run(tmp_path / "run", iterations=3)
    assert not (run / TRACE_FILE).exists()
    assert trace_main([str(run)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str((run / TRACE_FILE).resolve())
    assert "ui.perfetto.dev" in err and "chrome://tracing" in err
    load_trace(run / TRACE_FILE)
    assert trace_main([str(tmp_path / "nothing")]) == 2
    assert "nothing" in capsys.readouterr().err


def test_cleanup_finalisation_writes_the_trace_of_a_killed_run(tmp_path: Path) -> None:
    from controller import rundir

    run = make_fake_run(tmp_path / "run", iterations=3, jsonl_only=True)  # killed: no parquet
    done = rundir.finish(run, "controller killed")
    assert "wrote trace.json" in done
    check_worker_partition(load_trace(run / TRACE_FILE), load_events(run), need_receive=False)


@pytest.mark.mininet
def test_the_controller_writes_the_trace_of_a_real_run(tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    run_dir = real_run.real_run(tmp_path_factory.mktemp("real"))
    trace = load_trace(run_dir / TRACE_FILE)
    assert check_worker_partition(trace, load_events(run_dir), need_receive=True) > 0
    assert any(e["ph"] == "C" and "queue" in e["name"] for e in trace["traceEvents"])
