"""Background traffic (controller/background.py): the config is checked, the iperf3
commands are what a run starts, a real iperf3 report is read, and in Mininet the flows
share the bottleneck with the training and slow it down."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

from agents.core import config as cfgmod
from controller.background import BASE_PORT, commands, read_report
from controller.run import plan_commands, shape_spec
from tests.support import real_run
from tests.support.mininet_run import events, gradbed_run, leftovers, summary
from topo.qdisc import htb_burst_bytes

TINY = Path(__file__).resolve().parents[2] / "configs" / "test_tiny.toml"


def cfg(*overrides: str) -> cfgmod.ExperimentConfig:
    return cfgmod.load(TINY, list(overrides))


def test_flows_need_background_hosts():
    with pytest.raises(cfgmod.ConfigError, match=r"background.flows = 2: needs "
                                                 r"net.background_hosts >= 1"):
        cfg("background.flows=2")


@pytest.mark.parametrize("field,value,allowed", [
    ("flows", "17", "must be in \\[0, 16\\]"),
    ("direction", '"sideways"', "must be up or down"),
    ("rate_mbps", "-1", "must be in \\[0, 10000\\]"),
    ("congestion", '"dctcp"', "must be empty"),
    ("start_s", "-2", "must be in \\[0, 86400\\]"),
])
def test_bad_background_fields_name_the_field(field, value, allowed):
    with pytest.raises(cfgmod.ConfigError, match=f"test_tiny.toml: background.{field} = .*"
                                                 f"{allowed}"):
        cfg("net.background_hosts=1", f"background.{field}={value}")


def test_commands_one_server_per_host_then_the_clients(tmp_path):
    c = cfg("net.background_hosts=2", "background.flows=3", "background.rate_mbps=5",
            "background.direction=\"down\"", "background.duration_s=4")
    cmds = commands(c, shape_spec(c), tmp_path)
    assert [x.host for x in cmds] == ["ps", "ps", "bg0", "bg1"]
    assert cmds[0].argv == ("iperf3", "-s", "-1", "-B", "10.0.0.1", "-p", str(BASE_PORT))
    bg1 = list(cmds[3].argv)
    assert bg1[bg1.index("-p") + 1] == str(BASE_PORT + 1)
    assert bg1[bg1.index("-B") + 1] == shape_spec(c).ip("bg1")
    assert bg1[bg1.index("-P") + 1] == "3" and bg1[bg1.index("-t") + 1] == "4"
    assert bg1[bg1.index("-b") + 1] == "5M" and "-R" in bg1
    assert bg1[bg1.index("-C") + 1] == "cubic"  # net.congestion when not given
    assert cmds[3].report == str(tmp_path / "background" / "bg1.json")


def test_open_ended_flows_outlast_the_run_and_are_in_the_dry_run(tmp_path):
    c = cfg("net.background_hosts=1", "background.flows=1", "background.congestion=\"bbr\"")
    argv = list(commands(c, shape_spec(c), tmp_path)[1].argv)
    assert float(argv[argv.index("-t") + 1]) > c.run.timeout_s
    assert "-b" not in argv and "-R" not in argv and argv[argv.index("-C") + 1] == "bbr"
    plan = "\n".join(plan_commands(c, {"netem": False}))
    assert "iperf3 -c 10.0.0.1" in plan and "# in bg0, role flowgen" in plan
    assert commands(cfg(), shape_spec(cfg()), tmp_path) == []


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_listening_here(port: int, timeout_s: float = 10.0) -> bool:
    """Whether a TCP socket listens on ``port`` in this namespace within ``timeout_s``
    (probing with a connection would use up a one-off iperf3 server's test)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ss = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True,
                            text=True, check=True)
        if ss.stdout.strip():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(shutil.which("iperf3") is None, reason="iperf3 is not installed")
def test_reads_a_real_iperf3_report_also_when_interrupted(tmp_path):
    port = str(_free_port())
    server = subprocess.Popen(["iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", port],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_listening_here(int(port)), "iperf3 server never listened"
        report = tmp_path / "bg0.json"
        client = subprocess.Popen(["iperf3", "-c", "127.0.0.1", "-p", port, "-t", "30",
                                   "-b", "200M", "-J", "--logfile", str(report)])
        time.sleep(1.5)
        client.send_signal(signal.SIGINT)
        client.wait(timeout=10)
    finally:
        server.kill()
        server.wait()
    r = read_report(report)
    assert 0.8 < r["seconds"] < 3.0, r
    assert 100 < r["mbps"] < 260, r  # paced at 200 Mbit/s
    assert r["bytes"] == pytest.approx(r["mbps"] * 1e6 / 8 * r["seconds"], rel=0.05)
    assert "interrupt" in r["note"]


def test_missing_or_bad_report_is_an_error_field(tmp_path):
    assert "No such file" in read_report(tmp_path / "nope.json")["error"]
    (tmp_path / "bad.json").write_text("{not json")
    assert "bad.json" in read_report(tmp_path / "bad.json")["error"]


@pytest.mark.mininet
@pytest.mark.parametrize("direction", ["up", "down"])
def test_background_flows_share_the_bottleneck(tmp_path, tmp_path_factory, direction):
    # The quiet baseline is the session's run of test_tiny.toml as shipped (the report and
    # notebook tests read it too); the busy run is the same config with the flows added.
    quiet = summary(real_run.real_run(tmp_path_factory.mktemp("real")))
    busy_dir, p1 = gradbed_run("configs/test_tiny.toml", [
        "net.background_hosts=1", "background.flows=2", f'background.direction="{direction}"'],
        tmp_path)
    assert p1.returncode == 0, p1.stderr[-3000:]
    s = summary(busy_dir)
    assert s["iterations"] == quiet["iterations"], (s, quiet)
    bg = events(busy_dir)
    bg = bg[bg["event"] == "background"]
    assert list(bg["host"]) == ["bg0"] and bg["bytes"].iloc[0] > 1_000_000
    # Two greedy flows against two workers on a 50 Mbit/s link take a real share...
    assert 5 < s["background_mbps"] < 50, (direction, s)
    # ... the link carried both (wire bytes >= payload bytes) in the flows' direction...
    links = pd.read_parquet(busy_dir / "links.parquet")
    sent = links[links["direction"] == direction]["sent_bytes"]
    training = s["bytes_up"] if direction == "up" else s["bytes_down"]
    assert sent.max() - sent.min() > 0.8 * (s["background_bytes"] + training), direction
    # ... and the training is slower for it: uploads wait behind the flows one way,
    # the weights the other.
    assert s["iter_time_s_mean"] > 1.3 * quiet["iter_time_s_mean"], (direction, s, quiet)
    assert (busy_dir / "background" / "bg0.json").exists()
    assert leftovers() == []


@pytest.mark.mininet
def test_flows_from_a_cdf_report_completion_times(tmp_path):
    run_dir, proc = gradbed_run("configs/test_tiny.toml", [
        "run.iterations=12", "run.eval_every=12", "net.background_hosts=1",
        'background.kind="flows"', "background.load_mbps=10",
        'background.flow_cdf="traces/data/pareto_flows.cdf"'], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ev = events(run_dir)
    done = ev[ev["event"] == "flow_done"]
    planned = ev[ev["event"] == "flows_planned"]
    assert len(planned) == 1 and len(done) > 50, ev["event"].value_counts()
    # No flow beats the 50 Mbit/s bottleneck: beyond the HTB bucket's burst its bytes need
    # at least (size - burst) x 8 / rate (short flows fit in the bucket and cross at once).
    burst = htb_burst_bytes(50.0)
    assert (done["fct_s"] >= (done["size_bytes"] - burst).clip(lower=0) * 8 / 50e6).all()
    assert (done["fct_s"] > 0).all()
    s = summary(run_dir)
    assert s["background_flows"] == len(done) and 0 < s["fct_s_p50"] <= s["fct_s_p99"]
    assert s["iterations"] == 12
    assert leftovers() == []
