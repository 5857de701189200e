"""The learning-rate schedule (agents/core/lr_schedule.py): the pure lr-at-iteration function
against hand-computed values, the config's checks naming the field, and a real ``agents.dp.ps``
process (loopback, no Mininet) stepping with the scheduled lr at each iteration. Real
pipeline stages (GPipe, two-group) match their one-process references under a step schedule
in tests/agents/pipeline/test_pipeline_transparency.py, whose runs use one."""

from __future__ import annotations

import math

import pytest
import torch

from agents.core import config as cfgmod
from agents.core.lr_schedule import decay_iterations, lr_at
from agents.net import codec, wire
from agents.workloads.base import FlatModel, chunk_ranges
from agents.workloads.factory import make_workload
from controller.loopback.dp import connect, make_run_dir, prove, start_ps, welcome


def test_constant_is_the_base_lr_everywhere() -> None:
    assert [lr_at(0.1, i, 100) for i in (0, 1, 50, 99, 150)] == [0.1] * 5


def test_step_divides_at_each_fraction_of_the_run() -> None:
    # DGC / ResNet recipe at 3,000 iterations: /10 at 1,500 and at 2,250.
    assert decay_iterations((0.5, 0.75), 3000) == [1500, 2250]
    got = {i: lr_at(0.1, i, 3000, "step", (0.5, 0.75), 0.1)
           for i in (0, 1499, 1500, 2249, 2250, 2999, 5000)}
    want = {0: 0.1, 1499: 0.1, 1500: 0.01, 2249: 0.01, 2250: 0.001, 2999: 0.001,
            5000: 0.001}
    assert got.keys() == want.keys()
    for i, lr in want.items():
        assert got[i] == pytest.approx(lr, rel=1e-12), i
    # A fraction that lands between iterations rounds down: 0.5 x 5 = 2.5 -> iteration 2.
    assert [lr_at(1.0, i, 5, "step", (0.5,), 0.5) for i in range(5)] == [1, 1, 0.5, 0.5, 0.5]


def test_cosine_runs_from_lr_to_zero() -> None:
    assert lr_at(0.2, 0, 100, "cosine") == pytest.approx(0.2)
    assert lr_at(0.2, 50, 100, "cosine") == pytest.approx(0.1)
    assert lr_at(0.2, 25, 100, "cosine") == pytest.approx(0.1 * (1 + math.cos(math.pi / 4)))
    assert lr_at(0.2, 100, 100, "cosine") == pytest.approx(0.0, abs=1e-15)
    assert lr_at(0.2, 400, 100, "cosine") == pytest.approx(0.0, abs=1e-15)
    lrs = [lr_at(0.2, i, 100, "cosine") for i in range(101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_unknown_schedule_raises() -> None:
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        lr_at(0.1, 0, 10, "linear")


def test_default_config_is_constant() -> None:
    wl = cfgmod.from_dict({}).workload
    assert wl.lr_schedule == "constant"


@pytest.mark.parametrize(("override", "field", "why"), [
    ('workload.lr_schedule="linear"', "workload.lr_schedule", "must be one of constant"),
    ("workload.lr_decay_at=[0.5, 1.0]", "workload.lr_decay_at", "must be in (0, 1)"),
    ("workload.lr_decay_at=[0.75, 0.5]", "workload.lr_decay_at", "strictly increasing"),
    ("workload.lr_decay_factor=0", "workload.lr_decay_factor", "must be in (0, 1]"),
    ("workload.lr_decay_factor=2.0", "workload.lr_decay_factor", "must be in (0, 1]"),
])
def test_bad_schedule_config_names_the_field(override: str, field: str, why: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as err:
        cfgmod.from_dict(cfgmod.apply_overrides({}, [override]))
    assert f"{field} = " in str(err.value)
    assert why in str(err.value)


def test_step_schedule_without_fractions_is_refused() -> None:
    with pytest.raises(cfgmod.ConfigError, match=r"workload.lr_decay_at = \[\]: lr_schedule"):
        cfgmod.from_dict({"workload": {"lr_schedule": "step", "lr_decay_at": []}})


@pytest.mark.loopback
def test_ps_steps_with_the_scheduled_lr(tmp_path) -> None:
    # One worker, no momentum, 4 iterations, lr 0.4 halved at 50 %: the weights after
    # iteration i are the previous ones minus lr_at(i) x the gradient sent.
    lr, iters = 0.4, 4
    run_dir, cfg = make_run_dir(tmp_path, [
        "net.workers=1", "workload.hidden=16", "workload.chunk_bytes=4000000",
        f"run.iterations={iters}", "run.eval_every=100", "compress.name=none",
        f"workload.lr={lr}", "workload.momentum=0.0", 'workload.lr_schedule="step"',
        "workload.lr_decay_at=[0.5]", "workload.lr_decay_factor=0.5", "run.timeout_s=60"])
    model = FlatModel(make_workload(cfg.workload).build_model(cfg.run.seed))
    assert len(chunk_ranges(model.numel, cfg.workload.chunk_bytes)) == 1
    ps = start_ps(run_dir)
    try:
        sock = connect(cfg.net.port)
        reader, hs = prove(sock, run_dir, 0)
        mac = welcome(reader, hs).up
        params = reader.read_message()[0][1]
        g = torch.full((model.numel,), 0.5)
        for it in range(iters):
            wire.send_message(sock, [g], msg_type=codec.MsgType.GRAD, run_tag=0, worker=0,
                              iteration=it, chunk=0, mac=mac)
            (h, got), = reader.read_message()
            assert (h.msg_type, h.iteration) == (codec.MsgType.WEIGHTS, it)
            want = lr if it < 2 else lr * 0.5
            torch.testing.assert_close(got, params - want * g, rtol=0, atol=1e-6)
            params = got
        assert ps.wait(timeout=60) == 0
    finally:
        if ps.poll() is None:
            ps.kill()
