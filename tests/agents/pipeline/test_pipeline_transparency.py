"""Pipeline transparency over real TCP (torchgpipe's test): stages as real
processes on loopback, activations and gradients through the frame codec.

GPipe and 1F1B must reach the unsplit model's weights (plain SGD on the whole batch); the
two-group schedule must reach a one-process reference that applies the same two weight
versions (PipeDream-2BW for sub-model A). GPipe and two-group run under a step lr schedule,
so they also show the stages stepping with the scheduled lr. Each test also checks it could
fail: one extra step of the reference, or a constant lr, moves the weights far past the
tolerance, and for the two-group schedule the synchronous reference differs from the 2BW
one.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from agents.core import config as cfgmod
from controller.loopback.pipeline import (
    logs,
    pipeline_pieces,
    reference_pieces,
    reference_two_group,
    run_pipeline,
)

pytestmark = pytest.mark.loopback  # starts real agent processes on 127.0.0.1

STEPS = 3
# The lr divided by 10 from step 1 (half of 3 steps, rounded down): the stages must step
# with the scheduled lr (agents/core/lr_schedule.py), which a constant lr reference misses.
STEP_DECAY = ['workload.lr_schedule="step"', "workload.lr_decay_at=[0.5]",
              "workload.lr_decay_factor=0.1"]


def _close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def _constant_lr(cfg: cfgmod.ExperimentConfig) -> cfgmod.ExperimentConfig:
    return replace(cfg, workload=replace(cfg.workload, lr_schedule="constant"))


def _far(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-3) -> bool:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) > tol


def test_gpipe_replicas_equal_the_unsplit_model_under_a_step_lr(tmp_path):
    """GPipe, two replicas averaging through the PS, the lr divided by 10 after the first
    step: every replica ends at the unsplit model's weights with the same lr schedule, far
    from the reference at a constant lr and from one more step."""
    run_dir, cfg, rcs = run_pipeline(tmp_path, [
        "pipeline.stages=2", "pipeline.schedule='gpipe'", "pipeline.micro_batches=4",
        "pipeline.micro_batch_size=8", "pipeline.replicas=2", f"run.iterations={STEPS}",
        *STEP_DECAY])
    assert rcs == [0] * len(rcs), logs(run_dir)
    want = reference_pieces(cfg, STEPS)
    for r in range(cfg.pipeline.replicas):  # every replica ends with the same weights
        _close(pipeline_pieces(run_dir, cfg, r), want)
    assert _far(reference_pieces(cfg, STEPS + 1), want)
    assert _far(reference_pieces(_constant_lr(cfg), STEPS), want)


def test_two_group_equals_the_two_version_reference(tmp_path):
    run_dir, cfg, rcs = run_pipeline(tmp_path, [
        "pipeline.stages=2", "pipeline.schedule='two_group'", "pipeline.micro_batches=4",
        "pipeline.micro_batch_size=8", f"run.iterations={STEPS}", "pipeline.recompute=true",
        *STEP_DECAY])
    assert rcs == [0, 0], logs(run_dir)
    got = pipeline_pieces(run_dir, cfg)
    want = reference_two_group(cfg, STEPS)
    _close(got, want)
    assert _far(reference_two_group(cfg, STEPS + 1), want)
    # Each version stepped with its step's scheduled lr, not the base lr.
    assert _far(reference_two_group(_constant_lr(cfg), STEPS), want)
    # 2BW is not plain synchronous SGD (8e-5 apart at p=3 after 3 steps; tolerance 1e-6)
    assert _far(reference_pieces(cfg, STEPS), want, 1e-5)


def test_measured_link_bytes_timeline_and_bubble(tmp_path):
    """One 1F1B run: the planner's bytes per link per step equal the measured within 1 %,
    the per-host timeline shows every compute action of every stage, and the measured
    bubble and peak activation bytes come out of the same events."""
    from agents.pipeline.common import micro_batch
    from agents.pipeline.partition import balance_by_params, boundary_shapes, split
    from agents.workloads.base import make_workload
    from analysis.load import load_events, load_links
    from analysis.pipeline import pipeline_metrics
    from analysis.planner import pipeline_link_bytes
    from analysis.timeline import host_timeline

    p, m, b, steps = 3, 4, 8, 2
    run_dir, cfg, rcs = run_pipeline(tmp_path, [
        f"pipeline.stages={p}", "pipeline.schedule='1f1b'", f"pipeline.micro_batches={m}",
        f"pipeline.micro_batch_size={b}", f"run.iterations={steps}"])
    assert rcs == [0] * p, logs(run_dir)
    ev = load_events(run_dir)
    w = make_workload(cfg.workload)
    model = w.build_model(0)
    pieces = split(model, balance_by_params(model, p))
    shapes = boundary_shapes(pieces, micro_batch(w, cfg.pipeline, 0, 0).x)
    want = pipeline_link_bytes([s.numel() for s in shapes[:-1]], p, m)
    met = pipeline_metrics(ev, micro_batches=m, micro_batch_size=b, skip=0)
    got = {(int(a[1:]), int(c[1:])): v for (a, c), v in met.link_bytes_per_step.items()}
    assert set(got) == set(want) == {(0, 1), (1, 0), (1, 2), (2, 1)}
    for k, v in want.items():
        assert abs(got[k] - v) <= 0.01 * v, (k, got[k], v)
    tl = host_timeline(ev)
    comp = tl[tl["category"].isin(["forward", "backward"])]
    assert sorted(comp.groupby("node").size().tolist()) == [2 * m * steps] * p
    assert (tl["end_s"] >= tl["start_s"]).all() and set(tl["lane"]) == {"compute", "send"}
    # trace.json: one complete event per schedule action on each stage's compute thread.
    from agents.core.schedules import make
    from analysis.trace import chrome_trace

    trace = chrome_trace(ev, load_links(run_dir / "links.parquet"))["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace
             if e["name"] == "thread_name"}
    hosts = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    sch = make("1f1b", p, m, steps=steps)
    for s in range(p):
        spans = [e for e in trace if e["ph"] == "X" and hosts[e["pid"]] == f"s{s}"
                 and names[(e["pid"], e["tid"])] == "compute"]
        assert len(spans) == len(sch.actions[s]) == len(ev[(ev["event"] == "pp_action")
                                                          & (ev["node"] == f"s{s}")])
    assert 0.0 < met.bubble < 1.0 and len(met.bubble_per_stage) == p
    assert all(v > 0 for v in met.peak_act_bytes.values())


def test_fp16_both_ways_halves_the_bytes_and_stays_close(tmp_path):
    """fp16 activations and gradients: the planner's bytes at 2 bytes per element equal the
    measured, the weights stay near the exact run's but are not equal to them (the
    compression did happen)."""
    from agents.pipeline.common import micro_batch
    from agents.pipeline.partition import balance_by_params, boundary_shapes, split
    from agents.workloads.base import make_workload
    from analysis.load import load_events
    from analysis.pipeline import pipeline_metrics
    from analysis.planner import pipeline_link_bytes

    m, b = 4, 8
    run_dir, cfg, rcs = run_pipeline(tmp_path, [
        "pipeline.stages=2", "pipeline.schedule='1f1b'", f"pipeline.micro_batches={m}",
        f"pipeline.micro_batch_size={b}", f"run.iterations={STEPS}",
        "pipeline.act_compress='fp16'", "pipeline.grad_compress='fp16'"])
    assert rcs == [0, 0], logs(run_dir)
    w = make_workload(cfg.workload)
    model = w.build_model(0)
    shapes = boundary_shapes(split(model, balance_by_params(model, 2)),
                             micro_batch(w, cfg.pipeline, 0, 0).x)
    want = pipeline_link_bytes([shapes[0].numel()], 2, m, act_bytes_per_element=2,
                               grad_bytes_per_element=2)
    met = pipeline_metrics(load_events(run_dir), micro_batches=m, micro_batch_size=b, skip=0)
    assert met.link_bytes_per_step == {("s0", "s1"): want[(0, 1)], ("s1", "s0"): want[(1, 0)]}
    got, exact = pipeline_pieces(run_dir, cfg), reference_pieces(cfg, STEPS)
    for g, e in zip(got, exact, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=5e-3)
    assert _far(got, exact, 1e-7)


def test_replicas_average_through_the_ps_as_the_planner_predicts(tmp_path):
    """d = 3 pipelines of 2 stages, 1F1B recomputing its activations: the PS (agents.pipeline.stage_ps) averages every stage's
    gradient once per step; every replica ends at the unsplit model's weights on the
    combined batch, and the measured data-parallel bytes per link per step equal the
    planner's (t = 1, p, d) prediction within 1 %, both ways."""
    from agents.pipeline.partition import balance_by_params, split
    from agents.workloads.base import FlatModel, make_workload
    from analysis.load import load_events
    from analysis.pipeline import pipeline_metrics
    from analysis.planner import pipeline_dp_link_bytes

    p, d, m, b, steps = 2, 3, 2, 8, 2
    run_dir, cfg, rcs = run_pipeline(tmp_path, [
        f"pipeline.stages={p}", "pipeline.schedule='1f1b'", f"pipeline.micro_batches={m}",
        f"pipeline.micro_batch_size={b}", f"pipeline.replicas={d}", f"run.iterations={steps}",
        "pipeline.recompute=true"])
    assert rcs == [0] * (p * d + 1), logs(run_dir)
    want = reference_pieces(cfg, steps)
    for r in range(d):
        _close(pipeline_pieces(run_dir, cfg, r), want)
    assert _far(reference_pieces(cfg, steps + 1), want)
    ev = load_events(run_dir)
    means = ev[ev["event"] == "ps_slice_mean"]
    assert len(means) == steps * p and set(means["replicas"]) == {d}
    model = make_workload(cfg.workload).build_model(0)
    numels = [FlatModel(x).numel for x in split(model, balance_by_params(model, p))]
    predicted = pipeline_dp_link_bytes(numels, p, d)
    got = pipeline_metrics(ev, micro_batches=m, micro_batch_size=b, replicas=d,
                           skip=0).dp_link_bytes_per_step
    assert len(got) == 2 * p * d
    for (r, s), v in predicted.items():
        for key in ((f"r{r}s{s}", "ps"), ("ps", f"r{r}s{s}")):
            assert abs(got[key] - v) <= 0.01 * v, (key, got[key], v)
