"""``import gradbed``: the documented API, without root and without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import gradbed

REPO = Path(__file__).resolve().parents[2]


def test_import_gradbed_needs_no_torch_and_exports_what_it_documents():
    code = ("import sys, gradbed; assert 'torch' not in sys.modules; "
            "missing = [n for n in gradbed.__all__ if not hasattr(gradbed, n)]; "
            "assert not missing, missing")
    subprocess.run([sys.executable, "-c", code], cwd="/", check=True,
                   env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_a_shape_from_a_config_roles_placed_and_the_dry_run():
    cfg = gradbed.load_config(REPO / "configs/demo.toml", ["net.workers=2"])
    spec = gradbed.shape_spec(cfg)
    assert [h.role for h in spec.hosts] == ["ps", "worker", "worker"]
    lines = gradbed.dry_run(cfg, spec, caps={"netem": False})
    assert sum("-m agents.dp.worker" in ln for ln in lines) == 2
    # w1 idle: the dry run starts one worker, and a run refuses the mismatch with net.workers.
    idle = gradbed.place(spec, {"w1": ""})
    assert idle.host("w1").role == "" and idle.host("w1").kind == "worker"
    with pytest.raises(gradbed.SpecError, match="ranks \\[0\\]; net.workers = 2"):
        gradbed.dry_run(cfg, idle, caps={"netem": False})
    with pytest.raises(gradbed.SpecError, match="host 'w9' is not in this star"):
        gradbed.place(spec, {"w9": "worker"})
    with pytest.raises(gradbed.RoleError, match="role 'nosuchrole' is not registered"):
        gradbed.place(spec, {"w1": "nosuchrole"})


def test_a_hand_built_network_runs_the_roles_it_names():
    link = gradbed.LinkSpec(rate_mbps=20.0)
    hosts = (gradbed.HostSpec("ps", "ps", "ps", "10.0.0.1"),
             gradbed.HostSpec("w0", "worker", "worker", "10.0.0.10"))
    spec = gradbed.NetSpec("pair", hosts, (gradbed.SwitchSpec("gbsw0"),), (
        gradbed.EdgeSpec("ps", 0, "gbsw0", 1, gradbed.ShapingPoint("down", link),
                         gradbed.ShapingPoint("up", link)),
        gradbed.EdgeSpec("w0", 0, "gbsw0", 2, gradbed.ShapingPoint("w0.up", link),
                         gradbed.ShapingPoint("w0.down", link))), watch=("up",))
    cfg = gradbed.load_config(REPO / "configs/demo.toml", ["net.workers=1"])
    lines = gradbed.dry_run(cfg, spec, caps={"netem": False})
    assert any(ln.startswith("$ tc class replace dev w0-eth0") and "rate 20000000bit" in ln
               for ln in lines)
    assert any("-m agents.dp.worker" in ln and "--ps 10.0.0.1" in ln for ln in lines)
