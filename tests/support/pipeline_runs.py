"""The loopback pipeline runs (stages and the pipeline's PS as real processes on 127.0.0.1)
that several pipeline tests read; tests/agents/pipeline/conftest.py makes each once."""

from __future__ import annotations

from pathlib import Path

from agents.core import config as cfgmod
from controller.loopback.pipeline import logs, run_pipeline

# Four steps, the PS evaluating after steps 2 and 4.
STEPS, EVAL_EVERY = 4, 2
# Between the 1F1B run's first evaluation (0.17) and its second (0.31).
TARGET_ACCURACY = 0.25


def evaluated_run(tmp: Path, overrides: list[str]) -> tuple[Path, cfgmod.ExperimentConfig]:
    """A 2-stage pipeline of ``STEPS`` steps whose PS evaluates every ``EVAL_EVERY``."""
    run_dir, cfg, rcs = run_pipeline(tmp, [
        "pipeline.stages=2", "pipeline.micro_batches=4", "pipeline.micro_batch_size=16",
        "workload.hidden=64", "workload.lr=0.1", f"run.iterations={STEPS}",
        f"run.eval_every={EVAL_EVERY}", *overrides], timeout_s=300, ps=True)
    assert rcs == [0] * len(rcs), logs(run_dir)
    return run_dir, cfg
