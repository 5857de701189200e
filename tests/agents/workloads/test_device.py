"""Where an agent's tensors live and ``run.deterministic``: the settings reach torch, a
bad value names its field, and a pipeline stage's compute keeps device tensors inside
(what crosses to the links and the PS is on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from agents.core import config as cfgmod
from agents.core.checks import ConfigError
from agents.pipeline.common import build_schedule
from agents.pipeline.compute import StageCompute
from agents.workloads.device import pick_device

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

_PROBE = """
import os, torch
from agents.workloads.device import make_deterministic
make_deterministic({on})
print(torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.allow_tf32,
      torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
"""


@pytest.mark.parametrize("on, want", [
    (True, "True False False :4096:8"),
    (False, "False True False None"),  # torch's own defaults, untouched
])
def test_deterministic_sets_torch_or_leaves_it(on: bool, want: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", _PROBE.format(on=on)], capture_output=True,
                         text=True, check=True, env=env).stdout.split()
    assert " ".join(out) == want


def test_deterministic_is_a_checked_bool() -> None:
    assert cfgmod.load("configs/pipeline.toml").run.deterministic is True
    assert cfgmod.load("configs/pipeline.toml", ["run.deterministic=false"]).run.deterministic \
        is False
    with pytest.raises(ConfigError, match=r"run\.deterministic"):
        cfgmod.load("configs/pipeline.toml", ['run.deterministic="yes"'])


def test_auto_picks_what_this_process_sees() -> None:
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_device("cpu") == torch.device("cpu")


def _one_step(device: str) -> tuple[list[torch.Tensor], torch.Tensor | None, StageCompute]:
    """Stage 1 of 2 (the last position) of configs/pipeline.toml's model: a forward of one
    micro-batch from a fixed activation, its backward, and the optimizer."""
    cfg = cfgmod.load("configs/pipeline.toml", [f"run.device='{device}'", "pipeline.stages=2",
                                                "topo.hosts=3"])
    schedule = build_schedule(cfg.pipeline, cfg.run.iterations)
    sc = StageCompute(cfg, schedule, stage=1, replica=0)
    x = torch.randn(cfg.pipeline.micro_batch_size, *sc.in_shape[0][1:],
                    generator=torch.Generator().manual_seed(0))
    loss = sc.forward(0, 0, x, grad=True)
    g_in = sc.backward(0, 0, None)
    sc.optimizer(0, 0, None)
    return [loss, sc.final_params(0), *sc.fresh_weights(0).values()], g_in, sc


def test_what_leaves_a_stage_is_on_the_cpu() -> None:
    out, g_in, sc = _one_step("cpu")
    assert sc.device.type == "cpu"
    assert g_in is not None and g_in.device.type == "cpu"
    assert all(t.device.type == "cpu" for t in out)


@CUDA
def test_a_cuda_stage_equals_the_cpu_stage() -> None:
    cpu, g_cpu, _ = _one_step("cpu")
    cuda, g_cuda, sc = _one_step("cuda")
    assert sc.versions[0][0].flat_params.is_cuda
    assert g_cpu is not None and g_cuda is not None and g_cuda.device.type == "cpu"
    for a, b in zip([*cpu, g_cpu], [*cuda, g_cuda], strict=True):
        assert b.device.type == "cpu"
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
