"""The cluster builder's pure parts (``topo.cluster``): the ssh command, the config it
comes from, and what it refuses before anything is built. No root, no server."""

from __future__ import annotations

import pytest

from agents.core import config as cfgmod
from topo.shapes import shape_spec
from topo.spec import SpecError

cluster = pytest.importorskip("topo.cluster")  # Mininet Cluster Edition (Debian's mininet)

TWO = '["10.99.0.1", "10.99.0.2"]'


def cfg(*overrides: str) -> cfgmod.ExperimentConfig:
    return cfgmod.load("configs/demo.toml", ["trace.up=\"\"", f"cluster.servers={TWO}",
                                             *overrides])


def test_the_ssh_command_carries_the_configs_user_key_and_options():
    c = cfgmod.from_dict({"cluster": {"servers": ["10.99.0.1"], "user": "root",
                                      "key_path": "/k/id", "ssh_config": "/k/cfg"}})
    access = cluster.SshAccess.from_config(c.cluster)
    argv = access.argv("10.99.0.1", tty=True)
    assert argv[0] == "ssh" and argv[-2:] == ["-tt", "root@10.99.0.1"]
    assert argv[argv.index("-F") + 1] == "/k/cfg" and argv[argv.index("-i") + 1] == "/k/id"
    assert "BatchMode=yes" in argv and "sudo" not in argv
    shared = cluster.SshAccess(control_dir="/run/x").argv("10.99.0.2")
    assert "ControlPath=/run/x/%C" in shared and "-tt" not in shared


def test_class_counters_on_another_server_are_refused_by_name():
    # A trace's rate changes are tc commands run there; class counters go over netlink.
    traced = shape_spec(cfg('topo.traces={"w1.up"="traces/data/cellular_like.trace"}'))
    c = cluster.Cluster(traced, cluster.SshAccess())
    with pytest.raises(SpecError, match=r"w1-eth0 on 10.99.0.1: class counters over netlink"):
        c.require_here("w1", "w1-eth0")


def test_a_spec_placed_elsewhere_needs_the_servers_access():
    from topo.build import Network

    spec = shape_spec(cfg())
    with pytest.raises(SpecError, match=r"placement='10.99.0.1'.*Cluster Edition"):
        Network(spec, lock_path="/nonexistent/lock")
    net = Network(spec, lock_path="/nonexistent/lock", access=cluster.SshAccess())
    assert net.cluster is not None and net.cluster.servers == ["10.99.0.1"]


def test_servers_with_other_versions_are_named_with_both_versions():
    here = cluster.local_versions()
    assert set(here) == {"gradbed", "mininet", "torch"} and here["mininet"]
    assert cluster.version_mismatches("10.99.0.2", here, dict(here)) == []
    there = {**here, "torch": "1.0.0", "gradbed": None}
    assert cluster.version_mismatches("10.99.0.2", here, there) == [
        f"cluster server 10.99.0.2: gradbed missing there, {here['gradbed']} here",
        f"cluster server 10.99.0.2: torch 1.0.0 there, {here['torch']} here"]
    # The probe the servers run prints what this machine reads.
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", cluster.VERSION_PROBE], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == here
