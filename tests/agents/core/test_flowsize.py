"""Flow-size CDFs (agents/core/flowsize.py) and the flow generator (agents/traffic/flowgen.py): the
real data-centre CDFs load with the right means, every malformed line is named, the
arrivals offer the load asked for, and real flows over loopback report their completion
times."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agents.core.bandwidth import TraceError
from agents.core.events import EventLog, read_jsonl
from agents.core.flowsize import FlowSizeCDF, flow_arrivals, load_flow_cdf
from agents.traffic.flowgen import Source
from traces.generate import pareto_flow_cdf

REPO = Path(__file__).resolve().parents[3]
SHARED = Path(os.environ.get("GRADBED_SHARED_TRACES", REPO.parent / "shared" / "traces")) / "flowsize"
needs_shared = pytest.mark.skipif(not SHARED.exists(),
                                  reason=f"{SHARED} is absent (real traces live beside the repo)")


@needs_shared
def test_real_cdfs_load_with_their_means():
    web = load_flow_cdf(SHARED / "WebSearch_distribution.txt")
    hadoop = load_flow_cdf(SHARED / "FbHdp_distribution.txt")
    # The web-search workload's flows average about 1.7 MB, Hadoop's about 120 KB.
    assert web.mean_bytes() == pytest.approx(1.711e6, rel=0.01)
    assert hadoop.mean_bytes() == pytest.approx(1.204e5, rel=0.01)
    assert web.cdf[-1] == 1.0 and web.sizes_bytes[-1] == 30_000_000


@needs_shared
def test_every_shared_flowsize_file_loads_and_says_its_mean():
    for path in sorted(SHARED.iterdir()):
        said: list[str] = []
        cdf = load_flow_cdf(path, log=said.append)
        assert cdf.mean_bytes() > 0
        assert any(f"mean {cdf.mean_bytes():,.0f} bytes" in m for m in said), said
    # HPCC's example flow list: its count line says 2 but 256 flows follow, then prose.
    said = []
    flows = load_flow_cdf(SHARED / "mix_flow_example.txt", log=said.append)
    assert flows.interpolation == "step"
    assert flows.sizes_bytes == (5e6, 1e7, 1.5e8, 2e8)
    # 60 x 5 MB, 193 x 10 MB, 1 x 150 MB, 2 x 200 MB.
    assert flows.mean_bytes() == pytest.approx((60 * 5e6 + 193 * 1e7 + 1.5e8 + 4e8) / 256)
    assert any("says 2 flows, 256 follow" in m for m in said)


LAYOUTS = {
    # name: (text, kwargs, expected sizes, expected cdf)
    "percent pairs": ("0 0\n1000 50\n3000 100\n", {}, (0, 1000, 3000), (0, 0.5, 1)),
    "fraction pairs": ("0 0\n1000 0.5\n3000 1\n", {}, (0, 1000, 3000), (0, 0.5, 1)),
    "mean line": ("1250\n0 0\n1000 0.5\n3000 1.0\n", {}, (0, 1000, 3000), (0, 0.5, 1)),
    "packets": ("1 0\n2 50\n4 100\n", {"packet_bytes": 1460}, (1460, 2920, 5840),
                (0, 0.5, 1)),
    "tcl": ("1 1 0\n2 1 0.5\n4 1 1\n", {"packet_bytes": 1460}, (1460, 2920, 5840),
            (0, 0.5, 1)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_published_layouts_are_detected(tmp_path, layout):
    text, kw, sizes, cdf = LAYOUTS[layout]
    path = tmp_path / "dist.txt"
    path.write_text(text)
    said: list[str] = []
    got = load_flow_cdf(path, log=said.append, **kw)
    assert got.sizes_bytes == sizes and got.cdf == pytest.approx(cdf)
    assert got.interpolation == ("step" if layout == "tcl" else "linear")
    assert said and "mean" in said[-1]
    if layout == "mean line":
        assert ("states a mean of 1,250 bytes; read linear (the reading that reproduces "
                "it), mean 1,250 bytes") in said[0]


def test_step_and_linear_interpolation_differ_as_published():
    lin = FlowSizeCDF((100, 1000), (0.5, 1.0))
    step = FlowSizeCDF((100, 1000), (0.5, 1.0), interpolation="step")
    assert lin.mean_bytes() == pytest.approx(0.5 * 100 + 0.5 * 550)
    assert step.mean_bytes() == pytest.approx(0.5 * 100 + 0.5 * 1000)
    rng = random.Random(1)
    draws = {step.quantile(rng.random()) for _ in range(1000)}
    assert draws == {100, 1000}  # only the listed sizes


@pytest.mark.parametrize("text,kw,words", [
    ("1250\n0 0\n1000 50\n2000 100\n", {"format": "pairs"},
     "the first line looks like a mean, not a CDF point"),
    ("0 0\n1000 50\n2000 100\n", {"format": "mean_pairs"}, "needs a first line holding"),
    ("1 1 0\n2 1 1\n", {}, "Tcl-style CDFs (ns-2) give sizes in packets"),
    ("0 0\n1000 0.5\n2000 0.9\n", {}, "the last point is 0.9, must be 1 (fraction)"),
    ("0 0 0 0\n", {}, "4 fields is no known flow-size layout"),
    ("0 0\n1 1\n", {"format": "csv"}, "format='csv'; allowed"),
    ("0 0\n1 100\n", {"interpolation": "cubic"}, "interpolation='cubic'; allowed"),
])
def test_rejections_say_why(tmp_path, text, kw, words):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(TraceError, match=re.escape(words)):
        load_flow_cdf(path, **kw)


def test_mean_is_the_mean_of_what_quantile_samples():
    rng = random.Random(3)
    cdf = FlowSizeCDF((100, 1000, 50_000, 1_000_000), (0.2, 0.5, 0.9, 1.0))
    draws = [cdf.quantile(rng.random()) for _ in range(200_000)]
    assert sum(draws) / len(draws) == pytest.approx(cdf.mean_bytes(), rel=0.01)
    assert cdf.quantile(0.1) == 100           # the mass at the first size
    assert cdf.quantile(0.7) == pytest.approx(25_500)
    assert cdf.quantile(1.0) == pytest.approx(1_000_000)


def test_shipped_pareto_cdf_matches_its_generator():
    shipped = load_flow_cdf(REPO / "traces" / "data" / "pareto_flows.cdf")
    made = pareto_flow_cdf()
    assert shipped.sizes_bytes == made.sizes_bytes
    assert shipped.cdf == pytest.approx(made.cdf, abs=1e-6)


@pytest.mark.parametrize("text,line,words", [
    ("0 0\n1000 abc\n", 2, "cdf 'abc' is not a number"),
    ("0 0\n1000 50 7\n2000 100\n", 2, "expected 'size cdf', got 3 fields"),
    ("0 0\n1000 60\n2000 50\n3000 100\n", 3, "goes below the line before it"),
    ("0 0\n1000 60\n500 80\n3000 100\n", 3, "goes below the line before it"),
    ("# sizes\n0 0\n1000 120\n", 3, "must be in [0, 100]"),
    ("0 0\n1000 50\n2000 90\n", 3, "the last point is 90 %, must be 100"),
    ("0 0\n-5 100\n", 2, "must be >= 0"),
    ("100 100\n", 1, "at least two points"),
])
def test_malformed_cdf_names_file_and_line(tmp_path, text, line, words):
    path = tmp_path / "bad.cdf"
    path.write_text(text)
    with pytest.raises(TraceError) as err:
        load_flow_cdf(path)
    assert str(err.value).startswith(f"{path}:{line}:") and words in str(err.value)


def test_empty_or_missing_cdf(tmp_path):
    (tmp_path / "empty.cdf").write_text("# nothing\n\n")
    with pytest.raises(TraceError, match="empty.cdf: no"):
        load_flow_cdf(tmp_path / "empty.cdf")
    with pytest.raises(TraceError, match="nope.cdf: cannot read"):
        load_flow_cdf(tmp_path / "nope.cdf")
    (tmp_path / "binary.cdf").write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(TraceError, match="binary.cdf:1: not a text file"):
        load_flow_cdf(tmp_path / "binary.cdf")


def test_arrivals_offer_the_load_and_repeat_with_the_seed():
    cdf = pareto_flow_cdf()
    flows = flow_arrivals(cdf, 20.0, 2000.0, seed=5)
    offered = sum(s for _, s in flows) * 8 / 2000.0 / 1e6
    assert offered == pytest.approx(20.0, rel=0.05)
    starts = [t for t, _ in flows]
    assert starts == sorted(starts) and 0 <= starts[0] and starts[-1] < 2000.0
    assert min(s for _, s in flows) >= 1
    # Poisson: the gaps' mean is 1 / rate and their coefficient of variation about 1.
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    mean_gap = sum(gaps) / len(gaps)
    assert mean_gap == pytest.approx(cdf.mean_bytes() * 8 / 20e6, rel=0.05)
    sd = (sum((g - mean_gap) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert sd / mean_gap == pytest.approx(1.0, abs=0.05)
    assert flow_arrivals(cdf, 20.0, 50.0, seed=5) == [f for f in flows if f[0] < 50.0]
    with pytest.raises(ValueError, match="load_mbps"):
        flow_arrivals(cdf, 0.0, 10.0, seed=1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_real_flows_over_loopback_report_completion_times(tmp_path):
    port = _free_port()
    sink = subprocess.Popen([sys.executable, "-m", "agents.traffic.flowgen", "sink", "--bind",
                             "127.0.0.1", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert "flowgen sink on" in (sink.stdout.readline() if sink.stdout else "")
        flows = [(0.0, 1), (0.05, 10_000), (0.1, 5_000_000), (0.1, 300)]
        log = EventLog.for_node(tmp_path, "t", "bg0")
        src = Source(flows, ("127.0.0.1", port), "127.0.0.1", log, congestion="cubic")
        th = threading.Thread(target=src.run)
        th.start()
        deadline = time.monotonic() + 20
        while src.done + src.failed < len(flows) and time.monotonic() < deadline:
            time.sleep(0.02)
        src.stop.set()
        th.join(timeout=5)
        log.close()
    finally:
        sink.kill()
        sink.wait()
    rows = read_jsonl(tmp_path / "events" / "bg0.jsonl")
    done = {r["flow"]: r for r in rows if r["event"] == "flow_done"}
    assert sorted(done) == [0, 1, 2, 3], rows
    assert all(r["fct_s"] > 0 for r in done.values())
    assert done[2]["size_bytes"] == 5_000_000
    total = [r for r in rows if r["event"] == "background"]
    assert len(total) == 1 and total[0]["bytes"] == 5_010_301 and total[0]["flows"] == 4
    assert total[0]["unfinished"] == 0 and total[0]["failed"] == 0


def test_flows_beyond_the_concurrency_cap_are_skipped_not_queued(tmp_path):
    # No sink listens: a connection to a closed port fails at once, so only the cap of
    # one running flow can make the second arrival (at the same instant) a skip.
    port = _free_port()
    log = EventLog.for_node(tmp_path, "t", "bg0")
    src = Source([(0.0, 10), (0.0, 10)], ("127.0.0.1", port), "127.0.0.1", log,
                 max_concurrent=1)
    src._running[99] = (0.0, 1)  # one flow already running
    th = threading.Thread(target=src.run)
    th.start()
    time.sleep(0.3)
    src.stop.set()
    th.join(timeout=5)
    log.close()
    events = [r["event"] for r in read_jsonl(tmp_path / "events" / "bg0.jsonl")]
    assert events.count("flow_skipped") == 2 and events[-1] == "background"


def test_gradbed_run_names_a_bad_flow_cdf(tmp_path, capsys):
    from controller import cli

    bad = tmp_path / "bad.cdf"
    bad.write_text("0 0\n1000 x\n")
    config = REPO / "configs" / "test_tiny.toml"
    rc = cli.main(["run", str(config), "--dry-run", "--set", "net.background_hosts=1",
                   "--set", 'background.kind="flows"', "--set", "background.load_mbps=5",
                   "--set", f'background.flow_cdf="{bad}"'])
    assert rc == 2
    assert (f"test_tiny.toml: background.flow_cdf: {bad}:2: cdf 'x' is not a number"
            in capsys.readouterr().err)


def test_fct_runs_until_the_sink_answers(tmp_path):
    # A sink that reads the whole flow, then waits 0.4 s before its answer: the completion
    # time must include the wait, not end when the bytes were handed to the kernel.
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def slow_sink() -> None:
        conn, _ = srv.accept()
        with conn:
            header = conn.recv(8, socket.MSG_WAITALL)
            left = int.from_bytes(header, "big")
            while left > 0:
                left -= len(conn.recv(min(left, 1 << 16)))
            time.sleep(0.4)
            conn.sendall(b"\x01")

    th_sink = threading.Thread(target=slow_sink, daemon=True)
    th_sink.start()
    log = EventLog.for_node(tmp_path, "t", "bg0")
    src = Source([(0.0, 200_000)], ("127.0.0.1", port), "127.0.0.1", log)
    th = threading.Thread(target=src.run)
    th.start()
    deadline = time.monotonic() + 10
    while src.done + src.failed < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    src.stop.set()
    th.join(timeout=5)
    log.close()
    srv.close()
    done = [r for r in read_jsonl(tmp_path / "events" / "bg0.jsonl") if r["event"] == "flow_done"]
    assert len(done) == 1 and 0.4 <= done[0]["fct_s"] < 2.0, done


def test_the_flow_generator_starts_without_importing_torch():
    """Background flows start while a short run is already training: the generator must
    not spend a second or more importing torch (a run of 20 iterations once ended before
    its flows began)."""
    import subprocess
    import sys

    code = "import sys, agents.traffic.flowgen; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
