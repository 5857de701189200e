"""Two loopback pipeline runs with the pipeline's PS evaluating every other step, shared by
the time-to-accuracy tests and the PS's event-loop test: 1F1B with one replica (2 stage
connections) and the two-group schedule with four (8 stage connections, each stage's
slice gradients averaged through the PS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.core import config as cfgmod
from tests.support.pipeline_runs import TARGET_ACCURACY, evaluated_run

Run = tuple[Path, cfgmod.ExperimentConfig]


@pytest.fixture(scope="package")
def one_f_one_b_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return evaluated_run(tmp_path_factory.mktemp("1f1b"), [
        "pipeline.schedule='1f1b'", "pipeline.replicas=1", "workload.depth=2",
        f"run.target_accuracy={TARGET_ACCURACY}"])


@pytest.fixture(scope="package")
def two_group_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return evaluated_run(tmp_path_factory.mktemp("two_group"), [
        "pipeline.schedule='two_group'", "pipeline.replicas=4", "workload.depth=4"])
