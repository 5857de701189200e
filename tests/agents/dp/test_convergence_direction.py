"""The direction of the compression results benchmarks/convergence.py measures over the
network, checked in one process with the project's compressors, error feedback and PS step
(agents.dp.keep_response): top-k at 1 % without error feedback loses clearly against dense
(GRACE, Xu et al. 2021), and error feedback with DGC's momentum correction (Lin et al.
2018) wins that loss back at the same ratio. The digits MLP (hidden 64) keeps it fast:
100 iterations of 4 workers x 32."""

from __future__ import annotations

import pytest

from agents.dp.keep_response import TrainingSpec, train
from agents.workloads.digits_mlp import DigitsMLP


def final_accuracy(keep: float, **kw: object) -> float:
    spec = TrainingSpec(workers=4, batch_size=32, lr=0.1, momentum=0.9, eval_every=100,
                        **kw)  # type: ignore[arg-type]
    _, evals = train(DigitsMLP(hidden=64), spec, keep, 100)
    return evals[-1][1]


@pytest.fixture(scope="module")
def results() -> dict[str, float]:
    return {"dense": final_accuracy(1.0, compressor="none"),
            "topk_1pct_no_ef": final_accuracy(0.01, error_feedback=False),
            "topk_1pct_ef_mc": final_accuracy(0.01, momentum_correction=True)}


def test_topk_without_error_feedback_loses_at_least_a_point(results: dict[str, float]) -> None:
    assert results["dense"] - results["topk_1pct_no_ef"] >= 0.01, results


def test_error_feedback_with_momentum_correction_recovers(results: dict[str, float]) -> None:
    assert results["topk_1pct_ef_mc"] > results["topk_1pct_no_ef"] + 0.01, results
