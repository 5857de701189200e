"""Time to accuracy for pipeline runs: the pipeline's PS (agents.pipeline.stage_ps)
evaluates the weights the stages send after every ``run.eval_every`` steps and after the
last, with the data-parallel PS's ``eval``/``final_eval`` events, so the summary reports
``final_accuracy`` and ``time_to_target_s`` for pipeline runs too. Stages and PS as real
processes over loopback TCP (the two runs in conftest.py).

For the two-group schedule the PS assembles ``2p`` slices held two per stage (slice
``c * p + s`` on stage ``s``) and the stale chunk has two weight versions: its evaluations
must be the one-process 2BW reference's with the freshest version (``V_{k+2}`` after step
``k``), and they are told apart from the stale version's and from plain SGD's."""

from __future__ import annotations

import math
import tomllib
from dataclasses import replace

import pytest

from agents.workloads.factory import make_workload
from analysis.load import load_events
from controller.loopback.pipeline import reference_evals, reference_pieces
from controller.summary import summarize
from tests.support.pipeline_runs import STEPS, TARGET_ACCURACY

pytestmark = pytest.mark.loopback  # starts real agent processes on 127.0.0.1


def _reference_eval(cfg, steps: int) -> dict[str, float]:
    """The unsplit model after ``steps`` steps of plain SGD, evaluated in this process."""
    from agents.pipeline.partition import balance_by_params, split
    from agents.workloads.base import FlatModel

    w = make_workload(cfg.workload)
    model = w.build_model(cfg.run.seed)
    pieces = split(model, balance_by_params(model, cfg.pipeline.stages))
    for piece, want in zip(pieces, reference_pieces(cfg, steps), strict=True):
        FlatModel(piece).flat_params.copy_(want)
    return w.evaluate(model)


def test_the_ps_evaluates_and_the_summary_has_time_to_accuracy(one_f_one_b_run) -> None:
    run_dir, cfg = one_f_one_b_run
    ev = load_events(run_dir)
    evals = ev[(ev["event"] == "eval") & (ev["node"] == "ps")].sort_values("iter")
    assert evals["iter"].tolist() == [1, 3]  # after steps 2 and 4
    # The PS evaluated the weights the stages hold: the unsplit reference's, evaluated here.
    for step, row in zip((2, 4), evals.to_dict("records"), strict=True):
        want = _reference_eval(cfg, step)
        assert row["accuracy"] == want["accuracy"]
        assert math.isclose(row["loss"], want["loss"], rel_tol=1e-5)
    cfg_dict = tomllib.loads((run_dir / "config.toml").read_text())
    s = summarize(ev, ev.iloc[:0], cfg_dict, wall_s=1.0, interrupted=False, stop_reason="")
    # The first evaluation is below the target, the second above it: time to accuracy is
    # the second's.
    assert evals["accuracy"].iloc[0] < TARGET_ACCURACY <= evals["accuracy"].iloc[1], evals
    assert s["final_accuracy"] == evals["accuracy"].iloc[-1]
    first_hit = evals.iloc[1]
    start = int(ev.loc[(ev["event"] == "ps_ready"), "ts_ns"].min())
    assert s["time_to_target_s"] == pytest.approx((first_hit["ts_ns"] - start) / 1e9)
    assert s["pipeline"]["steps"] == STEPS


def test_the_ps_evaluates_the_two_group_model_at_its_freshest_version(two_group_run) -> None:
    """Four replicas: the PS averages each stage's two slices and evaluates replica 0's."""
    run_dir, cfg = two_group_run
    ev = load_events(run_dir)
    evals = ev[(ev["event"] == "eval") & (ev["node"] == "ps")].sort_values("iter")
    assert evals["iter"].tolist() == [1, 3]
    want = reference_evals(cfg)
    stale = reference_evals(cfg, fresh=False)
    sync = reference_evals(replace(cfg, pipeline=replace(cfg.pipeline, schedule="1f1b")))
    for row in evals.to_dict("records"):
        k = row["iter"]
        assert row["accuracy"] == want[k]["accuracy"]
        assert math.isclose(row["loss"], want[k]["loss"], rel_tol=1e-5)
        # Could fail: sub-model A's other version, or plain SGD, evaluates 1e-3 or more apart.
        for other in (stale, sync):
            assert not math.isclose(row["loss"], other[k]["loss"], rel_tol=1e-3)
    final = ev[(ev["event"] == "final_eval") & (ev["node"] == "ps")]
    assert final["accuracy"].tolist() == [want[STEPS - 1]["accuracy"]]
