"""The sweep's side-by-side table and its verdict (controller/verdict.py,
controller.sweep.comparison): what the demo prints after its dense and compressed runs."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from analysis.metrics import GLOSSARY
from controller import sweep
from controller.verdict import ROWS, side_by_side, verdict

REPO = Path(__file__).resolve().parents[2]

DENSE = {"bytes_up_per_iter": 317_216.0, "iter_time_s_p50": 0.40, "iter_time_s_p99": 0.9,
         "bottleneck_utilization": 0.95, "final_accuracy": 0.650, "time_to_target_s": 41.5,
         "iterations": 150}
TOPK = {"bytes_up_per_iter": 6_800.0, "iter_time_s_p50": 0.12, "iter_time_s_p99": 0.3,
        "bottleneck_utilization": 0.30, "final_accuracy": 0.634, "time_to_target_s": None,
        "iterations": 150}


def test_side_by_side_has_a_column_per_run_and_a_row_per_summary_key() -> None:
    text = side_by_side([("none", DENSE), ("topk", TOPK)])
    lines = text.splitlines()
    assert lines[0].split() == ["none", "topk"]
    row = {ln.split()[0]: ln.split()[1:] for ln in lines[1:]}
    assert list(row) == [key for key, _, _ in ROWS]
    assert set(row) <= set(GLOSSARY)  # the summary's own keys
    assert row["iter_time_s_p50"] == ["0.400", "0.120", "median", "iteration", "(s)"]
    assert row["bytes_up_per_iter"][:4] == ["317", "kB", "6.8", "kB"]
    assert row["time_to_target_s"][:2] == ["41.5", "-"]
    assert row["bottleneck_utilization"][:2] == ["0.95", "0.30"]
    # aligned: every value column ends where the run's label ends
    assert {ln.index("0.120") + 5 for ln in lines if "0.120" in ln} == {len(lines[0])}


@pytest.mark.parametrize("topk,starts", [
    ({}, "verdict: topk pays on this network: topk's median iteration took 0.30x dense's and "
         "it ended 1.6 points below dense's accuracy; the dense run kept the bottleneck 0.95 "
         "busy while uploading"),
    ({"final_accuracy": 0.60}, "verdict: topk is faster but costs more than 3 points"),
    ({"iter_time_s_p50": 0.36}, "verdict: topk does not pay on this network (it saves too "
                                "little time)"),
    ({"final_accuracy": 0.66}, "verdict: topk pays on this network: topk's median iteration "
                               "took 0.30x dense's and it ended 1.0 points above"),
])
def test_verdict_says_whether_compression_pays(topk, starts) -> None:
    assert verdict(DENSE, {**TOPK, **topk}, "topk").startswith(starts)


def test_verdict_blames_an_idle_network_and_refuses_a_failed_run() -> None:
    idle = {**DENSE, "bottleneck_utilization": 0.4}
    assert "(the network is not the bottleneck here)" in verdict(
        idle, {**TOPK, "iter_time_s_p50": 0.39}, "topk")
    with pytest.raises(ValueError, match="topk run has no final_accuracy"):
        verdict(DENSE, {**TOPK, "final_accuracy": None}, "topk")


def _results(spec: sweep.SweepSpec, summaries: list[dict]) -> list[sweep.RunResult]:
    return [sweep.RunResult(c, status="ok", summary=s)
            for c, s in zip(sweep.expand(spec), summaries, strict=True)]


def test_sweep_comparison_pairs_each_compressor_with_dense_at_the_same_bandwidth() -> None:
    base = tomllib.loads((REPO / "configs" / "demo.toml").read_text())
    spec = sweep.parse_sweep(base, ["net.bottleneck_mbps=10,100", "compress.name=none,topk"])
    fast_net = {**DENSE, "iter_time_s_p50": 0.13, "bottleneck_utilization": 0.5}
    text = sweep.comparison(spec, _results(spec, [DENSE, TOPK, fast_net, TOPK]))
    verdicts = [ln for ln in text.splitlines() if ln.startswith("verdict:")]
    assert verdicts == [
        verdict(DENSE, TOPK, "net.bottleneck_mbps=10, compress.name=topk"),
        verdict(fast_net, TOPK, "net.bottleneck_mbps=100, compress.name=topk")]
    assert "pays" in verdicts[0] and "does not pay" in verdicts[1]
    assert text.splitlines()[0].split()[0] == "net.bottleneck_mbps=10,"


def test_sweep_comparison_without_dense_or_with_one_run_has_no_verdict() -> None:
    base = tomllib.loads((REPO / "configs" / "demo.toml").read_text())
    spec = sweep.parse_sweep(base, ["compress.name=topk,dgc"])
    text = sweep.comparison(spec, _results(spec, [TOPK, TOPK]))
    assert text and "verdict" not in text
    spec = sweep.parse_sweep(base, ["compress.name=none"])
    assert sweep.comparison(spec, _results(spec, [DENSE])) == ""
