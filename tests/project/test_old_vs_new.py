"""benchmarks/old_vs_new.py's pure parts: the order of the runs, the headline read from a
run's output, and the direction of the ratio (>= 1 always reads "new is as good as old")."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import old_vs_new as ovn  # noqa: E402


def test_runs_alternate_abbaab() -> None:
    assert ovn.run_order(3) == ["old", "new", "new", "old", "old", "new"]
    assert ovn.run_order(1) == ["old", "new"]
    assert ovn.run_order(4)[-2:] == ["new", "old"]
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        ovn.run_order(0)


def test_every_round_runs_each_side_once() -> None:
    for rounds in range(1, 6):
        order = ovn.run_order(rounds)
        assert order.count("old") == order.count("new") == rounds


def test_headline_is_the_last_json_line() -> None:
    out = "\n".join([
        "progress: 3 of 4",
        json.dumps({"name": "early", "headline": 1.0}),
        "{not json",
        json.dumps({"name": "codec", "headline": 4.2, "details": {}}),
        "",
    ])
    res = ovn.parse_result(out, "codec on old")
    assert res["name"] == "codec"
    assert ovn.headline(res, "codec on old") == 4.2


def test_output_without_a_headline_names_the_run() -> None:
    with pytest.raises(ValueError, match="codec on new: no JSON line with a headline"):
        ovn.parse_result('{"name": "x"}\nTraceback: boom\n', "codec on new")
    with pytest.raises(ValueError, match="moe on old: headline nan is not a finite number"):
        ovn.headline({"headline": float("nan")}, "moe on old")
    with pytest.raises(ValueError, match="is not a finite number"):
        ovn.headline({"headline": None}, "moe on old")


def test_ratio_reads_new_as_good_as_old_at_one_or_more() -> None:
    # Higher is better (GB/s): new faster -> above 1.
    assert ovn.ratio(old=2.0, new=3.0, higher_is_better=True) == pytest.approx(1.5)
    # Lower is better (bubble error in points): new smaller -> above 1, not below.
    assert ovn.ratio(old=20.0, new=10.0, higher_is_better=False) == pytest.approx(2.0)
    assert ovn.ratio(old=10.0, new=20.0, higher_is_better=False) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="cannot take a ratio"):
        ovn.ratio(old=0.0, new=1.0, higher_is_better=True)


def test_summary_takes_medians_and_passes_at_the_threshold() -> None:
    bubble = ovn.BENCHES["pipeline"]
    assert not bubble.higher_is_better
    s = ovn.summarize(bubble, [21.6, 18.9, 24.2], [10.2, 8.2, 14.8], 0.97)
    assert (s["old_median"], s["new_median"]) == (21.6, 10.2)
    assert s["new_vs_old"] == pytest.approx(21.6 / 10.2, abs=1e-4) and s["pass"]
    codec = ovn.BENCHES["codec"]
    s = ovn.summarize(codec, [1.0, 1.0, 1.0], [0.97, 0.96, 0.99], 0.97)
    assert s["new_vs_old"] == pytest.approx(0.97) and s["pass"]
    s = ovn.summarize(codec, [1.0, 1.0, 1.0], [0.96, 0.96, 0.99], 0.97)
    assert not s["pass"]


def test_a_failed_run_leaves_out_its_round_and_a_side_without_runs_fails() -> None:
    codec = ovn.BENCHES["codec"]
    s = ovn.summarize(codec, [1.0, None, 3.0], [2.0, 2.0, 2.0], 0.97)
    assert s["old_median"] == 2.0 and s["old"] == [1.0, None, 3.0] and s["pass"]
    s = ovn.summarize(codec, [None, None, None], [2.0, 2.0, 2.0], 0.97)
    assert s["new_vs_old"] is None and not s["pass"]


def test_every_acceptance_benchmark_is_known_and_its_script_exists() -> None:
    names = [n for n, _ in ovn.ACCEPTANCE]
    assert len(names) == 6
    for name in names:
        bench = ovn.BENCHES[name]
        assert (ovn.REPO / "benchmarks" / f"{bench.script}.py").is_file()
    with pytest.raises(ValueError, match="the name must be one of"):
        ovn.parse_bench("nosuch --quick")
    bench, args = ovn.parse_bench("pipeline --quick --parts bubble")
    assert bench.name == "pipeline" and args == ("--quick", "--parts", "bubble")


def _phase(it: int, node: str, phase: str, start_ms: float, end_ms: float) -> dict[str, object]:
    return {"iter": it, "layer": 0, "node": node, "phase": phase,
            "start_ns": int(start_ms * 1e6), "end_ns": int(end_ms * 1e6)}


def test_moe_window_runs_from_the_first_host_in_to_the_last_out_on_both_kinds_of_run() -> None:
    from agents.core.moe_metrics import dispatch_efficiency

    payload = 500_000
    # Counts in a round of their own (the old tree): e1 enters 20 ms after e0; the window
    # is e0's entry to e1's last token, 70 ms, though the benchmark's own starts at 20 ms.
    separate = {"phases": [_phase(1, "e0", "dispatch_counts", 0, 25),
                           _phase(1, "e1", "dispatch_counts", 20, 25),
                           _phase(1, "e0", "dispatch_tokens", 25, 60),
                           _phase(1, "e1", "dispatch_tokens", 25, 70)],
                "dispatch": [{"iter": 1, "layer": 0, "payload_bytes": payload}]}
    # Counts riding with the tokens (the new tree): the same entries and exits.
    merged = {"phases": [_phase(1, "e0", "dispatch_tokens", 0, 60),
                         _phase(1, "e1", "dispatch_tokens", 20, 70)],
              "dispatch": [{"iter": 1, "layer": 0, "payload_bytes": payload}]}
    expected = dispatch_efficiency(payload, 0.070, 100.0)
    assert ovn.first_entry_efficiency(separate) == pytest.approx(expected)
    assert ovn.first_entry_efficiency(merged) == pytest.approx(expected)
    with pytest.raises(ValueError, match="no dispatch"):
        ovn.first_entry_efficiency({"phases": [], "dispatch": []})


def test_worktrees_are_removed_when_the_sitting_fails() -> None:
    import subprocess

    if subprocess.run(["git", "-C", str(ovn.REPO), "rev-parse", "HEAD"],
                      capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    head = ovn.git("rev-parse", "HEAD")
    made: dict[str, Path] = {}
    with pytest.raises(RuntimeError, match="a benchmark failed"):
        with ovn.worktrees({"old": head, "new": head}) as trees:
            made.update(trees)
            assert (trees["old"] / "agents" / "__init__.py").is_file()
            ovn.check_imports(trees["new"])
            raise RuntimeError("a benchmark failed")
    assert made and not any(p.exists() for p in made.values())
    listed = ovn.git("worktree", "list", "--porcelain")
    assert not any(str(p) in listed for p in made.values())
