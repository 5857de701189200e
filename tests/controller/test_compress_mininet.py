"""Top-k at 1 % with error feedback, on the emulated network, against dense.

Two real ``gradbed run`` runs of the digits workload (configs/digits.toml: digits MLP,
hidden 512, 301 k parameters, lr 0.1, momentum 0.9 at the PS) with 2 workers through the
100 Mbit/s bottleneck, 20 iterations each, seed 0: ``compress.name = "none"`` (the run
test_run_mininet.py reads too, ``real_run.digits_dense``) and ``"topk"`` with ``ratio =
0.01`` and error feedback (DESIGN 1.2).

Claims checked:
- bytes up: top-k sends at least 20x fewer bytes than dense (``summary.bytes_up``; the
  expected ratio is ~50x: 8 bytes per kept element, value + int32 index, vs 4 per element);
- the network changes nothing but time: each run's final PS weights are those of the same
  training in one process (``agents.dp.keep_response.train``: same model, batches,
  compressor, error feedback and PS step), and so is its held-out accuracy. A chunk lost,
  decoded wrong or aggregated twice on the way fails this;
- accuracy: after 80 iterations, top-k's held-out accuracy is within ``ACC_TOL`` = 0.08 of
  dense's. Synchronous training makes the accuracy independent of the network (the claim
  above), so the 80 iterations run in one process. Top-k at 1 % needs more iterations than
  dense to reach the same accuracy (the residual delays most of the gradient), so at an
  equal iteration count it trails. Measured before choosing the tolerance: dense 0.953 /
  0.939 / 0.950, top-k 0.892 / 0.886 / 0.925 for seeds 0 / 1 / 2, gaps 0.061 / 0.053 /
  0.025. 0.08 covers the worst measured gap with a small margin; a run that does not train
  (accuracy stuck near 0.1-0.6 as in the first iterations) fails it.

Not claimed here: that error feedback *helps* at this length. Measured on seed 0, top-k at
1 % without error feedback reached 0.897 at iteration 80, as good as with it (0.892): with
the PS's momentum 0.9, the residual's stale gradients make the EF run dip mid-training
(0.833 at iteration 40, 0.675 at 50) before it recovers. DGC adds momentum correction for
exactly this; the invariant ``original == sent + residual`` is tested in test_compress.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agents.core import config as cfgmod
from agents.dp.keep_response import TrainingSpec, train
from agents.workloads.base import make_workload
from tests.support import real_run
from tests.support.mininet_run import events, leftovers, summary

ACC_TOL = 0.08
MIN_BYTE_RATIO = 20.0
ACC_ITERATIONS = 80
TOPK = (*real_run.DIGITS_DENSE[:-1], "compress.name=topk", "compress.ratio=0.01",
        "compress.error_feedback=true")
RUNS = {"dense": real_run.DIGITS_DENSE, "topk": TOPK}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compress")
    return {"dense": real_run.digits_dense(root)[0],
            "topk": real_run.shared_run(root, real_run.DIGITS, TOPK)[0]}



def one_process(name: str, iterations: int) -> tuple[torch.Tensor, list[tuple[int, float]]]:
    """The PS's final weights and evaluations of run ``name``'s training in one process."""
    cfg = cfgmod.load(real_run.REPO / real_run.DIGITS, list(RUNS[name]))
    spec = TrainingSpec(workers=cfg.net.workers, batch_size=cfg.workload.batch_size,
                        lr=cfg.workload.lr, momentum=cfg.workload.momentum,
                        chunk_bytes=cfg.workload.chunk_bytes, eval_every=cfg.run.eval_every,
                        seed=cfg.run.seed, compressor=cfg.compress.name,
                        error_feedback=cfg.compress.error_feedback)
    keep = cfg.compress.ratio if cfg.compress.name == "topk" else 1.0
    return train(make_workload(cfg.workload), spec, keep, iterations)


@pytest.mark.mininet
def test_both_runs_complete(runs: dict[str, Path]) -> None:
    for name, run_dir in runs.items():
        s = summary(run_dir)
        assert s["iterations"] == cfgmod.load(run_dir / "config.toml").run.iterations, (name, s)
        assert s["stop_reason"] == "completed", (name, s)
        assert s["final_accuracy"] is not None, (name, s)


@pytest.mark.mininet
def test_topk_sends_at_least_20x_fewer_bytes(runs: dict[str, Path]) -> None:
    ratio = summary(runs["dense"])["bytes_up"] / summary(runs["topk"])["bytes_up"]
    assert ratio >= MIN_BYTE_RATIO, f"dense/topk bytes up = {ratio:.1f}"


@pytest.mark.mininet
@pytest.mark.parametrize("name", RUNS)
def test_the_network_run_computes_what_one_process_computes(runs: dict[str, Path], name: str,
                                                             one_thread: None) -> None:
    run_dir = runs[name]
    iterations = summary(run_dir)["iterations"]
    want, evals = one_process(name, iterations)
    got = torch.load(run_dir / "ps_final_weights.pt")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    ev = events(run_dir)
    acc = ev[ev["event"] == "eval"].sort_values("iter")["accuracy"].to_numpy()
    assert acc == pytest.approx([a for _, a in evals], abs=1e-6), (acc, evals)


def test_topk_accuracy_within_tolerance_of_dense(one_thread: None) -> None:
    dense = one_process("dense", ACC_ITERATIONS)[1][-1][1]
    topk = one_process("topk", ACC_ITERATIONS)[1][-1][1]
    assert dense > 0.9, f"dense baseline did not train: {dense}"
    assert topk >= dense - ACC_TOL, f"topk {topk:.3f} vs dense {dense:.3f} (tol {ACC_TOL})"


@pytest.mark.mininet
def test_no_leftovers(runs: dict[str, Path]) -> None:
    assert leftovers() == []
