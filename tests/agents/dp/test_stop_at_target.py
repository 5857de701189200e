"""``run.stop_at_target``: the PS ends a data-parallel run, completed, at its first
evaluation that reaches ``run.target_accuracy``, and every agent exits cleanly, the
workers' uploads of the next iteration, begun before BYE reached them, included."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.core import config as cfgmod
from analysis.load import load_events
from controller.loopback.dp import make_run_dir, start_ps, start_worker

REPO = Path(__file__).resolve().parents[3]
TARGET = 0.6


@pytest.mark.parametrize("overrides, field, needle", [
    (["run.stop_at_target=true", "run.target_accuracy=0"], "run.stop_at_target", "needs run.target_accuracy > 0"),
    (["run.stop_at_target=true", "run.target_accuracy=0.5", "topo.shape='fabric'",
      "topo.role='stage'"], "run.stop_at_target", "data-parallel PS only"),
])
def test_a_config_that_cannot_stop_at_its_target_is_refused(
        overrides: list[str], field: str, needle: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(REPO / "configs" / "digits.toml", overrides)
    assert field in str(e.value) and needle in str(e.value), str(e.value)


def test_the_ps_stops_at_the_first_evaluation_reaching_the_target(tmp_path: Path) -> None:
    iterations = 200
    run_dir, cfg = make_run_dir(tmp_path, [
        "net.workers=3", f"run.iterations={iterations}", "run.eval_every=2",
        f"run.target_accuracy={TARGET}", "run.stop_at_target=true"])
    ps = start_ps(run_dir)
    workers = [start_worker(run_dir, k, cfg.net.port) for k in range(cfg.net.workers)]
    try:
        rc = ps.wait(timeout=120)
        worker_rcs = [w.wait(timeout=60) for w in workers]
    finally:
        for p in [ps, *workers]:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((run_dir / f"{n}.log").read_text() for n in ("ps", "w0", "w1", "w2"))
    assert rc == 0 and worker_rcs == [0, 0, 0], logs
    ev = load_events(run_dir)
    evals = ev[ev["event"] == "eval"].sort_values("iter")
    acc = evals["accuracy"].to_list()
    assert acc[-1] >= TARGET and all(a < TARGET for a in acc[:-1]), acc
    done = ev[ev["event"] == "ps_done"].iloc[0]
    assert done["reason"] == "completed" and bool(done["at_target"]), done.to_dict()
    last = int(evals["iter"].iloc[-1])
    assert last + 1 < iterations, "the run did not stop early"
    assert int(ev[ev["event"] == "ps_iter_done"]["iter"].max()) == last
    # Every worker finished the iterations the PS stepped, and no further.
    assert set(ev[ev["event"] == "iter_done"].groupby("node")["iter"].max()) == {last}
    assert not (ev["event"] == "worker_error").any()
