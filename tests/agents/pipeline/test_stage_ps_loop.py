"""The pipeline's PS serves every stage connection on one event loop (agents/net/loop.py,
loopback processes): it runs as many threads with 8 stages as with 2."""

from __future__ import annotations

import json
from pathlib import Path

from controller.loopback.pipeline import logs, run_pipeline


def test_the_stage_ps_runs_the_same_threads_with_2_and_8_stages(tmp_path: Path) -> None:
    threads = {}
    for replicas in (1, 4):  # 2 stages each: 2 and 8 stage connections
        run_dir, cfg, rcs = run_pipeline(tmp_path / f"d{replicas}", [
            "pipeline.stages=2", f"pipeline.replicas={replicas}", "pipeline.micro_batches=2",
            "pipeline.micro_batch_size=8", "run.iterations=2"], ps=True)
        assert rcs == [0] * len(rcs), logs(run_dir)
        rows = [json.loads(line) for line in
                (run_dir / "events" / "ps.jsonl").read_text().splitlines()]
        (ev,) = [r for r in rows if r["event"] == "ps_connected"]
        assert ev["stages"] == 2 * replicas
        threads[ev["stages"]] = ev["threads"]
    assert threads[2] == threads[8], threads
