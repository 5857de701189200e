"""The controller's own process imports neither torch nor matplotlib, and pandas only for
the run's tables: each costs seconds of CPU at every run's start, on the same two cores
as the warm process that imports torch for the agents (docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What ``gradbed run`` does in its own process before its tables are written: load and
# check the config, shape the network, plan the roles' commands, and talk to an agent over
# the control socket (the run's handshake reads and writes frames through the codec).
_RUN_PATH = """
import sys, tempfile, threading, time
from pathlib import Path
import controller.cli, controller.run
from agents.net import auth
from agents.net.control import ControlClient, control_path
from controller.control import ControlServer
from controller.paths import load_config
from controller.rundir import versions
from topo.shapes import shape_spec

cfg = load_config(Path("configs/digits.toml"), ["net.workers=2"])
spec = shape_spec(cfg)
lines = controller.run.plan_commands(cfg, {"netem": False}, spec)
assert sum("-m agents.dp.worker" in ln for ln in lines) == 2, lines
versions()
master = auth.new_master()
got = []
done = threading.Event()
def on_report(msg):
    got.append(msg)
    if msg.get("type") == "iter_done":
        done.set()
with tempfile.TemporaryDirectory() as d:
    server = ControlServer(control_path(d), on_report, lambda n: auth.node_key(master, n))
    client = ControlClient(control_path(d), "ps", auth.node_key(master, "ps"),
                           heartbeat_s=None)
    assert client.connected
    client.send("iter_done", iter=0)
    assert done.wait(10), got
    client.close()
    server.close()
heavy = sorted(m for m in ("torch", "matplotlib", "pandas") if m in sys.modules)
assert not heavy, f"the controller's run path imported {heavy}"
"""


def test_the_run_path_and_the_control_handshake_import_no_torch_pandas_or_matplotlib():
    proc = subprocess.run([sys.executable, "-c", _RUN_PATH], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
