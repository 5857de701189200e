"""Transparency (torchgpipe-style): distributing must not change the mathematics.

With the ``none`` compressor, N workers that each send the mean gradient of their
shard, averaged at the PS and stepped with SGD, must end at the weights one process
reaches training on the concatenated batch -- over real TCP, real processes. The same run's
``trace.json`` partitions every worker iteration into its phases.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agents.core.events import now_ns
from agents.workloads.base import FlatModel, Workload
from agents.workloads.digits_cnn import DigitsCNN
from agents.workloads.digits_mlp import DigitsMLP
from analysis import metrics
from analysis.load import load_events
from analysis.trace import write_trace
from controller.loopback.dp import run_loopback
from tests.support.chrome_trace import (
    PHASES,
    check_worker_partition,
    load_trace,
    spans_by_host,
)

pytestmark = pytest.mark.loopback  # starts real agent processes on 127.0.0.1


def reference_weights(n_workers: int, iterations: int, lr: float, momentum: float,
                      hidden: int, batch: int, workload: Workload | None = None,
                      ) -> torch.Tensor:
    """One process training ``workload`` (the digits MLP at ``hidden`` by default) on
    the concatenated batch of every worker: the weights a transparent run must reach."""
    w = workload if workload is not None else DigitsMLP(hidden)
    model = w.build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    for i in range(iterations):
        opt.zero_grad()
        w.loss(model, w.global_batch(i, n_workers, batch)).backward()
        opt.step()
    return FlatModel(model).flat_params


def test_dense_workers_match_single_process(tmp_path):
    n, iters = 3, 6
    # A long refusal-report interval: the PS's accepting thread sleeps that long in accept()
    # unless the PS's end wakes it, and the PS waits for that thread before it exits.
    run_dir, rc = run_loopback(tmp_path, [f"net.workers={n}", f"run.iterations={iters}",
                                          "workload.hidden=64", "workload.lr=0.2",
                                          "workload.momentum=0.9", "workload.chunk_bytes=8192",
                                          "guard.refusal_report_interval_s=60"])
    ended_ns = now_ns()
    assert rc == 0, (run_dir / "ps.log").read_text()
    done = load_events(run_dir).query("event == 'ps_done'")["ts_ns"].iloc[0]
    assert (ended_ns - done) / 1e9 < 30, "the PS's exit waited for its accepting thread"
    got = torch.load(run_dir / "ps_final_weights.pt")
    want = reference_weights(n, iters, 0.2, 0.9, 64, 32)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # And the test can fail: one extra step moves the weights well past the tolerance.
    moved = reference_weights(n, iters + 1, 0.2, 0.9, 64, 32)
    assert (moved - want).abs().max() > 1e-3
    # The data loads before the workers connect (Workload.prepare), not in iteration 0:
    # scikit-learn's import and the data set made iteration 0's compute 2 s.
    ev = load_events(run_dir)
    first = ev[(ev["event"] == "compute_done") & (ev["iter"] == 0)]
    assert len(first) == n and first["compute_s"].max() < 0.5, first
    check_trace(run_dir, n, iters)


def check_trace(run_dir: Path, n: int, iters: int) -> None:
    """The run's trace.json: each worker's compute, compress (one per chunk), send, wait and
    receive spans partition every iteration; the report's iteration breakdown is their mean
    per phase (one definition); the PS receives, then aggregates."""
    trace = load_trace(write_trace(run_dir))
    events = load_events(run_dir)
    assert check_worker_partition(trace, events, need_receive=True) == n * iters
    spans = spans_by_host(trace)
    chunks = events[(events["event"] == "compress_done") & (events["node"] == "w0")
                    & (events["iter"] == 1)]
    assert len(chunks) > 1
    assert sum(e["cat"] == "compress" for e in spans[("w0", "main")]
               if e["args"]["iter"] == 1) == len(chunks)
    b = metrics.iteration_breakdown(events, by="node")
    for k in range(n):
        mine = spans[(f"w{k}", "main")]
        for phase in PHASES:
            mean_s = sum(e["dur"] for e in mine if e["cat"] == phase) / iters / 1e6
            assert b.loc[f"w{k}", f"{phase}_s"] == pytest.approx(mean_s, abs=1e-6), (k, phase)
    # After the first iteration (whose receive has no previous end to start from).
    ps = [e["args"]["category"] for e in spans[("ps", "main")] if e["args"]["iter"] == 2]
    assert ps == ["receive", "aggregate"], ps
    # Each worker's weight send is a span of the PS's own, one per iteration, that starts
    # after that worker's iteration began, and carries the weights' bytes.
    out = events[events["event"] == "ps_iter_done"].set_index("iter")["bytes_out"]
    sent = events[events["event"] == "weights_sent"]
    for k in range(n):
        sends = spans[("ps", f"send w{k}")]
        assert [e["args"]["iter"] for e in sends] == list(range(iters))
        assert all(e["cat"] == "send" and e["dur"] >= 0 for e in sends)
        starts = {e["args"]["iter"]: e["ts"] for e in spans[(f"w{k}", "main")]
                  if e["cat"] == "compute"}
        assert all(e["ts"] >= starts[e["args"]["iter"]] for e in sends)
        mine = sent[sent["worker"] == k].set_index("iter")["bytes"]
        assert all(mine[i] * n == out[i] for i in range(iters)), (mine, out)


def test_sparse_delta_downlink_keeps_workers_identical(tmp_path):
    """With downlink=update the workers hold the PS's shadow copy bit for bit, which
    equals the dense-downlink weights up to float rounding of the deltas."""
    n, iters = 2, 5
    run_dir, rc = run_loopback(tmp_path, [f"net.workers={n}", f"run.iterations={iters}",
                                          "workload.hidden=64", "workload.momentum=0.0",
                                          "compress.downlink='update'"])
    assert rc == 0, (run_dir / "ps.log").read_text()
    got = torch.load(run_dir / "ps_final_weights.pt")
    want = reference_weights(n, iters, 0.1, 0.0, 64, 32)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_dense_cnn_workers_match_single_process(tmp_path):
    """The convolutional workload through the same agents: chunks cut across its conv
    and linear parameters, reassembled and stepped at the PS."""
    n, iters = 2, 5
    run_dir, rc = run_loopback(tmp_path, [f"net.workers={n}", f"run.iterations={iters}",
                                          "workload.name='digits_cnn'", "workload.channels=8",
                                          "workload.lr=0.2", "workload.momentum=0.9",
                                          "workload.chunk_bytes=4096"])
    assert rc == 0, (run_dir / "ps.log").read_text()
    got = torch.load(run_dir / "ps_final_weights.pt")
    want = reference_weights(n, iters, 0.2, 0.9, 0, 32, DigitsCNN(8))
    assert got.shape == want.shape == (3818,)  # 80 + 1168 conv, 2570 linear
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_powersgd_per_layer_workers_match_the_one_process_run(tmp_path, monkeypatch):
    """PowerSGD over real processes (workers compress each layer of their chunks as its own
    matrix, the PS rebuilds them from the layered wire format) ends at the weights of the
    one-process run with the same compressor, error feedback and PS step
    (``agents.dp.keep_response``). Chunks of 8 KB cut the 64 x 64 layers across chunks."""
    from agents.compress.powersgd import PowerSGDCompressor
    from agents.dp.keep_response import TrainingSpec, train
    n, iters = 2, 5
    run_dir, rc = run_loopback(tmp_path, [f"net.workers={n}", f"run.iterations={iters}",
                                          "workload.hidden=64", "workload.lr=0.2",
                                          "workload.momentum=0.9", "workload.chunk_bytes=8192",
                                          "compress.name='powersgd'"])
    assert rc == 0, (run_dir / "ps.log").read_text()
    got = torch.load(run_dir / "ps_final_weights.pt")
    spec = TrainingSpec(workers=n, batch_size=32, lr=0.2, momentum=0.9, chunk_bytes=8192,
                        eval_every=iters, compressor="powersgd")
    want, _ = train(DigitsMLP(64), spec, 1.0, iters)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The flat-bucket PowerSGD (no layers: these 2,048-element chunks would go dense)
    # ends elsewhere, so the comparison can fail.
    monkeypatch.setattr(PowerSGDCompressor, "set_layers", lambda self, key, shapes, dims=None: None)
    flat, _ = train(DigitsMLP(64), spec, 1.0, iters)
    assert (flat - want).abs().max() > 1e-3
