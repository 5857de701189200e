"""The 3D planner reproduces Yuan 1.0's layout and small hand-computed cases."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from analysis.cli import plan_main
from analysis.planner import (
    Layout,
    Links,
    ModelShape,
    model_flops,
    pipeline_dp_link_bytes,
    plan,
)

YUAN = ModelShape(layers=76, hidden=16384, seq=2048)
YUAN_LAYOUT = Layout(t=8, p=38, d=7, global_batch=3360, micro_batch=1)


def test_yuan_micro_batches_and_bubbles() -> None:
    pl = plan(YUAN, YUAN_LAYOUT)
    assert YUAN_LAYOUT.gpus == 2128
    assert pl.micro_batches == 480
    assert pl.bubble_1f1b == Fraction(37, 480)
    assert float(pl.bubble_1f1b) == pytest.approx(0.0771, abs=1e-4)
    assert pl.bubble_gpipe == Fraction(37, 517)
    # 12 L h^2 = 244.8 B layer parameters (Yuan 1.0 reports 245.7 B with embeddings)
    assert YUAN.params == 12 * 76 * 16384 ** 2
    assert pl.stage_params == pytest.approx(YUAN.params / (8 * 38))


def test_yuan_volumes_by_formula() -> None:
    pl = plan(YUAN, YUAN_LAYOUT)
    act = 1 * 2048 * 16384 * 2
    assert pl.tp_bytes == pytest.approx(4 * 2 * 480 * (2 * 7 / 8) * act)
    assert pl.pp_bytes == pytest.approx(2 * 480 * act)
    assert pl.dp_bytes == pytest.approx(2 * 6 / 7 * 12 * 76 * 16384 ** 2 / 304 * 2)


def test_small_case_by_hand() -> None:
    # L=4 h=8 s=4, B=8 b=1, t=2 p=2 d=2: m = 8/(2*1) = 4, b s h = 32 elements = 64 bytes
    model = ModelShape(layers=4, hidden=8, seq=4)
    pl = plan(model, Layout(t=2, p=2, d=2, global_batch=8, micro_batch=1),
              Links(tp_gbps=1.0, pp_gbps=1.0, dp_gbps=1.0, gpu_tflops=1.0))
    assert pl.micro_batches == 4
    assert pl.bubble_1f1b == Fraction(1, 4)
    assert pl.bubble_gpipe == Fraction(1, 5)
    # TP: 4 all-reduces x 2 layers x 4 micro-batches x 2(2-1)/2 x 64 bytes = 2048
    assert pl.tp_bytes == pytest.approx(2048)
    # PP: 2 x 4 x 64 = 512
    assert pl.pp_bytes == pytest.approx(512)
    # DP: params per GPU 12*64*4/4 = 768; 2(2-1)/2 * 768 * 2 bytes = 1536
    assert pl.stage_params == pytest.approx(768)
    assert pl.dp_bytes == pytest.approx(1536)
    # FLOPs: 72 B s L h^2 (1 + s/6h) = 72*8*4*4*64*(1 + 4/48) = 638976
    assert pl.flops_step == pytest.approx(72 * 8 * 4 * 4 * 64 * (1 + 4 / 48))
    assert pl.flops_per_gpu == pytest.approx(pl.flops_step / 8)
    assert pl.compute_s == pytest.approx(pl.flops_per_gpu / 1e12)
    assert pl.comm_s["pp"] == pytest.approx(512 * 8 / 1e9)
    assert pl.compute_to_comm["pp"] == pytest.approx(pl.compute_s / pl.comm_s["pp"])
    assert pl.flops_per_byte["dp"] == pytest.approx(pl.flops_per_gpu / 1536)


def test_degenerate_axes_send_nothing() -> None:
    pl = plan(ModelShape(4, 8, 4), Layout(t=1, p=1, d=1, global_batch=4, micro_batch=2))
    assert pl.micro_batches == 2
    assert pl.tp_bytes == pl.pp_bytes == pl.dp_bytes == 0
    assert pl.bubble_1f1b == 0 and pl.bubble_gpipe == 0
    assert pl.compute_to_comm["tp"] == float("inf")
    assert pl.to_dict()["compute_to_comm"]["tp"] is None


def test_model_flops_with_vocab_and_recompute() -> None:
    m = ModelShape(layers=2, hidden=4, seq=6, vocab=100)
    # per layer fwd 24 B s h^2 + 4 B s^2 h, logits 2 B s h V, backward 2x forward
    fwd_layers = 2 * (24 * 3 * 6 * 16 + 4 * 3 * 36 * 4)
    logits = 2 * 3 * 6 * 4 * 100
    assert model_flops(m, 3) == pytest.approx(3 * (fwd_layers + logits))
    assert model_flops(m, 3, recompute=True) == pytest.approx(4 * fwd_layers + 3 * logits)


def test_invalid_layouts_name_the_field() -> None:
    with pytest.raises(ValueError, match="global_batch=10 is not a multiple"):
        Layout(t=1, p=1, d=3, global_batch=10, micro_batch=1)
    with pytest.raises(ValueError, match=r"Layout\.t must be >= 1"):
        Layout(t=0, p=1, d=1, global_batch=1, micro_batch=1)
    with pytest.raises(ValueError, match="layers=5 is not divisible by Layout.p=2"):
        plan(ModelShape(5, 8, 4), Layout(1, 2, 1, 2, 1))


def test_plan_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--layers", "76", "--hidden", "16384", "--seq", "2048", "--global-batch", "3360",
            "--micro-batch", "1", "--t", "8", "--p", "38", "--d", "7"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "m = B/(d*b) = 480" in out and "37/480" in out and "7.71%" in out
    assert "tensor-parallel all-reduce" in out and "data-parallel grad sync" in out
    assert plan_main([*args, "--json", "--link-gbps", "100"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["micro_batches"] == 480
    assert data["bubble_1f1b"]["fraction"] == "37/480"
    assert data["links"]["pp_gbps"] == 100.0
    assert plan_main([*args[:-2], "--d", "9"]) == 2  # 3360 is not a multiple of 9
    assert "not a multiple" in capsys.readouterr().err


def test_pipeline_dp_link_bytes_per_replica_stage():
    # Two chunks per stage (two-group): stage s holds positions s and s + p.
    got = pipeline_dp_link_bytes([10, 20, 30, 40], stages=2, replicas=3)
    assert got == {(r, s): v for r in range(3)
                   for s, v in ((0, 10 * 4 + 64 + 30 * 4 + 64), (1, 20 * 4 + 64 + 40 * 4 + 64))}
    assert pipeline_dp_link_bytes([10, 20], stages=2, replicas=1) == {}
    # At d = 2 a replica's link carries what plan()'s ring all-reduce sends per GPU.
    n = 1000
    assert pipeline_dp_link_bytes([n], 1, 2, header_bytes=0)[(0, 0)] == 2 * (2 - 1) / 2 * n * 4
    with pytest.raises(ValueError, match="must be >= 1"):
        pipeline_dp_link_bytes([1], stages=0, replicas=2)
