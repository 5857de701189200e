"""``trace.json``: the Chrome Trace Event Format's rules, and its content.

The content checks: a worker's compute, compress, send, wait and receive spans partition
each of its iterations (sum to ``iter_s`` within 1 %, in order, without overlap); MoE and
any role added later appear; the controller and ``gradbed cleanup`` write the file; and
``gradbed trace`` says where it is. Run on a synthetic run and, marked ``mininet``, the real
controller run the report tests make; the real loopback runs of the data-parallel, pipeline
and MoE transparency tests check their traces too.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from analysis.cli import trace_main
from analysis.load import load_events
from analysis.trace import TRACE_FILE, chrome_trace, write_trace
from tests.support import real_run
from tests.support.chrome_trace import (
    check_worker_partition,
    format_problems,
    load_trace,
    spans_by_host,
)
from tests.support.make_fake_run import fake_tcp_samples, make_fake_run


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
    # The controller hands over the events it loaded for the summary: the same file.
    first = (run / TRACE_FILE).read_bytes()
    write_trace(run, events)
    assert (run / TRACE_FILE).read_bytes() == first


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


def test_a_torchrun_runs_connections_are_counter_tracks_of_their_host(tmp_path: Path) -> None:
    run = make_fake_run(tmp_path / "run", workers=2, iterations=3)
    base = int(load_events(run)["ts_ns"].min())
    fake_tcp_samples(base).to_parquet(run / "tcp.parquet", index=False)
    trace = load_trace(write_trace(run))
    evs = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    conn = "10.0.0.10:40000>10.0.0.11:29500"
    rate = [e for e in evs if e["ph"] == "C" and e["name"] == f"tcp {conn} (Mbit/s)"]
    assert {names[e["pid"]] for e in rate} == {"gbh0"}
    assert [(e["ts"], e["args"]) for e in rate] == [
        (1e6, {"sent": 10.0, "received": 5.0}), (2e6, {"sent": 10.0, "received": 5.0})]
    cwnd = [e["args"]["cwnd"] for e in evs if e["name"] == f"tcp {conn} cwnd (segments)"]
    rtt = [e["args"]["rtt_ms"] for e in evs if e["name"] == f"tcp {conn} RTT (ms)"]
    assert cwnd == [20.0, 30.0] and rtt == [11.0, 12.0]
    # No shaped link carried the loopback connection: it is no track; nor is a listening
    # socket. A dual-stack socket's addresses read as IPv4.
    tracks = {e["name"] for e in evs if e["ph"] == "C" and e["name"].startswith("tcp ")}
    assert {t.rsplit(" ", 1)[0].removesuffix(" cwnd").removesuffix(" RTT") for t in tracks} == {
        f"tcp {conn}", "tcp 10.0.0.11:51000>10.0.0.10:29500"}, tracks


def test_a_tcp_file_without_a_column_is_named(tmp_path: Path) -> None:
    from analysis.load import RunLoadError, load_tcp

    path = tmp_path / "tcp.parquet"
    fake_tcp_samples(0).drop(columns=["bytes_acked"]).to_parquet(path, index=False)
    with pytest.raises(RunLoadError, match=r"tcp\.parquet.*bytes_acked"):
        load_tcp(path)
    assert load_tcp(tmp_path / "none.parquet").empty


SPEEDSCOPE = Path(sys.prefix) / "share" / "speedscope" / "node_modules" / "speedscope" / \
    "dist" / "release"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _speedscope_title(trace_path: Path, tmp: Path) -> str:
    """What speedscope, an offline trace viewer, shows in its toolbar once headless Chromium
    has loaded ``trace_path`` into it (served from 127.0.0.1: a page may not fetch file:
    URLs): ``NAME (1/K)`` with K the threads it found spans on, or the error it raised."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    site = tmp / "site"
    shutil.copytree(SPEEDSCOPE, site)
    shutil.copy(trace_path, site / "trace.json")
    # speedscope reports a file it cannot read with alert(), which would hold headless
    # Chromium forever: in this copy of the page the message goes into the title instead.
    page = site / "index.html"
    page.write_text(page.read_text().replace(
        "<head>", "<head><script>window.alert = function (m) { document.title = "
                  "'ALERT ' + m; };</script>", 1))

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        dom = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--virtual-time-budget=15000", "--dump-dom",
             f"{url}/index.html#profileURL={url}/trace.json&title=gradbed"],
            capture_output=True, text=True, timeout=120).stdout
    finally:
        server.shutdown()
        server.server_close()
    m = re.search(r"<span>gradbed <span[^>]*>\((\d+)/(\d+)\)</span>", dom)
    if m:
        return f"gradbed ({m.group(1)}/{m.group(2)})"
    alert = re.search(r"<title>ALERT ([^<]*)</title>", dom)
    return alert.group(1) if alert else "nothing shown"


@pytest.mark.skipif(not (SPEEDSCOPE / "index.html").exists() or not Path(CHROMIUM).exists(),
                    reason="speedscope and chromium come with GRADBED_WITH_CHROMIUM=1 "
                           "scripts/setup.sh")
def test_trace_json_opens_in_a_trace_viewer(tmp_path: Path) -> None:
    """A real viewer, offline, in a real browser: speedscope in headless Chromium reads the
    run's trace.json and finds one timeline per host thread with spans; the same file
    truncated is refused (the check can fail)."""
    run = make_fake_run(tmp_path / "run", workers=2, iterations=4)
    trace = load_trace(write_trace(run))
    threads = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert _speedscope_title(run / TRACE_FILE, tmp_path / "good") == \
        f"gradbed (1/{len(threads)})"
    broken = tmp_path / "broken.json"
    broken.write_text((run / TRACE_FILE).read_text()[:-200])
    assert _speedscope_title(broken, tmp_path / "bad").startswith("Unrecognized format")


@pytest.mark.mininet
def test_the_controller_writes_the_trace_of_a_real_run(tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    run_dir = real_run.real_run(tmp_path_factory.mktemp("real"))
    trace = load_trace(run_dir / TRACE_FILE)
    assert check_worker_partition(trace, load_events(run_dir), need_receive=True) > 0
    assert any(e["ph"] == "C" and "queue" in e["name"] for e in trace["traceEvents"])


def test_an_iteration_written_late_keeps_its_send_wait_and_receive() -> None:
    """A worker descheduled between measuring an iteration and writing ``iter_done`` (a
    busy machine): the iteration spans ``start_ns`` to ``start_ns + iter_s``, not the 50 ms
    late write minus ``iter_s``, which put the compute past the send and the wait (the
    intermittent partition failure of the dense transparency test)."""
    from analysis.timeline import host_timeline

    t0, ms = 10**12, 10**6
    rows = [("compute_done", t0 + 2 * ms, {"compute_s": 0.002}),
            ("compress_done", t0 + 3 * ms, {"key": "c0", "compress_s": 0.0005}),
            ("send_done", t0 + 3 * ms, {}),
            ("recv_done", t0 + 5 * ms, {"first_ns": t0 + 4 * ms}),
            ("iter_done", t0 + 55 * ms, {"iter_s": 0.005, "compute_s": 0.002,
                                         "start_ns": t0})]
    ev = pd.DataFrame([{"event": e, "ts_ns": ts, "node": "w0", "iter": 0, **f}
                       for e, ts, f in rows])
    tl = host_timeline(ev)
    spans = tl[(tl["node"] == "w0") & (tl["lane"] == "main")].sort_values("start_ns")
    assert spans["category"].tolist() == ["compute", "compress", "send", "wait", "receive"]
    assert spans["start_ns"].iloc[0] == t0 and spans["end_ns"].iloc[-1] == t0 + 5 * ms
