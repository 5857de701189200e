"""Top-k at 1 % with error feedback, on the emulated network, against dense.

Two real ``gradbed run`` runs of the demo workload (configs/digits.toml: digits MLP, hidden
512, 301 k parameters, lr 0.1, momentum 0.9 at the PS) with 2 workers through the 100 Mbit/s
bottleneck, 80 iterations each, seed 0: ``compress.name = "none"`` and ``"topk"`` with
``ratio = 0.01`` and error feedback (DESIGN 1.2). Each run takes about 40-50 s.

Claims checked:
- bytes up: top-k sends at least 20x fewer bytes than dense (``summary.bytes_up``; the
  expected ratio is ~50x: 8 bytes per kept element, value + int32 index, vs 4 per element);
- accuracy: top-k's held-out accuracy after the 80 iterations is within ``ACC_TOL`` = 0.08
  of dense's. Top-k at 1 % needs more iterations than dense to reach the same accuracy
  (the residual delays most of the gradient), so at an equal iteration count it trails.
  Measured before choosing the tolerance (loopback, same agents, same seeds; synchronous
  training makes the accuracy independent of the network): dense 0.953 / 0.939 / 0.950,
  top-k 0.892 / 0.886 / 0.925 for seeds 0 / 1 / 2, gaps 0.061 / 0.053 / 0.025. 0.08 covers
  the worst measured gap with a small margin; a run that does not train (accuracy stuck
  near 0.1-0.6 as in the first iterations) fails it.

Not claimed here: that error feedback *helps* at this length. Measured on seed 0, top-k at
1 % without error feedback reached 0.897 at iteration 80, as good as with it (0.892): with
the PS's momentum 0.9, the residual's stale gradients make the EF run dip mid-training
(0.833 at iteration 40, 0.675 at 50) before it recovers. DGC adds momentum correction for
exactly this; the invariant ``original == sent + residual`` is tested in test_compress.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.mininet_run import gradbed_run, leftovers, summary

pytestmark = pytest.mark.mininet

ITERATIONS = 80
ACC_TOL = 0.08
MIN_BYTE_RATIO = 20.0
COMMON = ["net.workers=2", f"run.iterations={ITERATIONS}", "run.eval_every=10", "run.seed=0",
          "run.timeout_s=240"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("compress")
    result = {}
    for name, extra in (("dense", ["compress.name=none"]),
                        ("topk", ["compress.name=topk", "compress.ratio=0.01",
                                  "compress.error_feedback=true"])):
        run_dir, proc = gradbed_run("configs/digits.toml", [*COMMON, *extra], out, timeout_s=400)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        result[name] = summary(Path(run_dir))
    return result


def test_both_runs_complete(runs: dict[str, dict]) -> None:
    for name, s in runs.items():
        assert s["iterations"] == ITERATIONS, (name, s)
        assert s["stop_reason"] == "completed", (name, s)
        assert s["final_accuracy"] is not None, (name, s)


def test_topk_sends_at_least_20x_fewer_bytes(runs: dict[str, dict]) -> None:
    ratio = runs["dense"]["bytes_up"] / runs["topk"]["bytes_up"]
    assert ratio >= MIN_BYTE_RATIO, f"dense/topk bytes up = {ratio:.1f}"


def test_topk_accuracy_within_tolerance_of_dense(runs: dict[str, dict]) -> None:
    dense, topk = runs["dense"]["final_accuracy"], runs["topk"]["final_accuracy"]
    assert dense > 0.9, f"dense baseline did not train: {dense}"
    assert topk >= dense - ACC_TOL, f"topk {topk:.3f} vs dense {dense:.3f} (tol {ACC_TOL})"


def test_no_leftovers(runs: dict[str, dict]) -> None:
    assert leftovers() == []
