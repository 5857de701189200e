"""The PS's chunk work (agents.dp.chunk_work) on its thread: the same weights as the serial
arithmetic, bit for bit; a refused payload adds nothing and skips its connection's later
chunks; a non-finite step is reported; a bug surfaces on the owner's thread."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import agents.compress  # noqa: F401  (registers every compressor)
from agents.compress.base import make
from agents.dp.aggregate import SparseAccumulator
from agents.dp.chunk_work import Added, AddJob, ChunkWork, Outcome, StepJob, Stepped
from agents.net import codec
from agents.workloads.base import FlatModel, chunk_ranges, sgd_step_

NUMEL = 10_000


def _model() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(nn.Linear(NUMEL // 100 - 1, 100))  # 99 x 100 + 100 = 10,000


def _header(worker: int, chunk: int, numel: int) -> codec.FrameHeader:
    return codec.FrameHeader(msg_type=codec.MsgType.GRAD, run_tag=0, worker=worker,
                             iteration=0, chunk=chunk, dtype=codec.DType.FLOAT32,
                             numel=numel, payload_len=4 * numel)


def _work(model: FlatModel, compressor: str = "none", **kw: object) -> ChunkWork:
    chunks = chunk_ranges(model.numel, 4 * 3000)
    args: dict = dict(momentum=0.9, shadow=None, max_abs_grad=1e6) | kw
    return ChunkWork(model, chunks, make(compressor), **args)


def _run(work: ChunkWork, jobs: list[AddJob | StepJob]) -> list[Outcome]:
    """Submit every job, wait for every outcome (in order)."""
    ready = threading.Event()
    work.start(ready.set)
    try:
        for j in jobs:
            work.submit(j)
        out: list[Outcome] = []
        while len(out) < len(jobs):
            ready.wait(10)
            ready.clear()
            out += work.outcomes()
    finally:
        work.stop()
    return out


def test_the_thread_steps_to_the_serial_weights_bit_for_bit() -> None:
    """Three workers' chunks added in arrival order (``run.sum_order = "arrival"``) and
    stepped twice (momentum 0.9): the weights equal, exactly, the serial PS's arithmetic
    in the same order."""
    gen = torch.Generator().manual_seed(1)
    model, ref = _model(), _model()
    work = _work(model, rank_order=False)
    grads = [[torch.randn(NUMEL, generator=gen) for _ in range(3)] for _ in range(2)]
    jobs: list[AddJob | StepJob] = []
    for it in range(2):
        for c, (s, e) in enumerate(work.chunks):
            for w in (2, 0, 1):  # arrival order, not worker order
                jobs.append(AddJob(f"conn{w}", w, _header(w, c, e - s),
                                   [grads[it][w][s:e].clone()], 3))
            jobs.append(StepJob(c, it, 0.1))
    outs = _run(work, jobs)
    assert all(o.error is None for o in outs if isinstance(o, Added))
    steps = [o for o in outs if isinstance(o, Stepped)]
    assert [o.job.chunk for o in steps] == [0, 1, 2, 3] * 2
    assert all(o.finite and o.msg_type == codec.MsgType.WEIGHTS for o in steps)
    # The serial PS's arithmetic, by hand.
    mom = torch.zeros(NUMEL)
    for it in range(2):
        for s, e in work.chunks:
            acc = SparseAccumulator(e - s, into=ref.flat_grad[s:e])
            acc.expect(3)
            for w in (2, 0, 1):
                acc.add_dense(grads[it][w][s:e])
            acc.result(mean_over=3, out=ref.flat_grad[s:e])
            sgd_step_(ref.flat_params[s:e], ref.flat_grad[s:e], mom[s:e], lr=0.1,
                      momentum=0.9, first=it == 0)
    assert torch.equal(model.flat_params, ref.flat_params)
    # The downlink message is a view of the stepped weights, with their CRC.
    last = steps[-1]
    s, e = work.chunks[last.job.chunk]
    assert last.tensors[0].data_ptr() == model.flat_params[s:e].data_ptr()
    assert last.crcs == [codec.payload_crc32(codec.tensor_view(last.tensors[0]))]


def _stepped_after(order: tuple[int, ...], compressor: str, rank_order: bool) -> torch.Tensor:
    """The weights after one step of four workers' chunks arriving in ``order``."""
    gen = torch.Generator().manual_seed(3)
    # Magnitudes six decades apart: a float sum of them depends on its order.
    grads = [torch.randn(NUMEL, generator=gen) * 10.0 ** (2 * w - 3) for w in range(4)]
    model = _model()
    work = _work(model, compressor, rank_order=rank_order)
    codec_ = make(compressor)
    jobs: list[AddJob | StepJob] = []
    for c, (s, e) in enumerate(work.chunks):
        for w in order:
            payload = codec_.compress(grads[w][s:e].clone(), f"c{c}", 0.5,
                                      torch.Generator().manual_seed(w))
            jobs.append(AddJob(f"conn{w}", w, _header(w, c, e - s), list(payload.tensors), 4))
        jobs.append(StepJob(c, 0, 0.1))
    outs = _run(work, jobs)
    assert all(o.error is None for o in outs if isinstance(o, Added))
    return model.flat_params.clone()


@pytest.mark.parametrize("compressor", ["none", "topk"])
def test_in_rank_order_the_weights_do_not_depend_on_the_arrival_order(compressor: str) -> None:
    """``run.sum_order = "rank"`` (the default): four workers' chunks arriving in two
    different orders step to the same bits; added as they arrive, they do not (so the
    test can fail)."""
    a = _stepped_after((3, 1, 0, 2), compressor, rank_order=True)
    b = _stepped_after((0, 2, 3, 1), compressor, rank_order=True)
    assert torch.equal(a, b)
    c = _stepped_after((3, 1, 0, 2), compressor, rank_order=False)
    d = _stepped_after((0, 2, 3, 1), compressor, rank_order=False)
    assert not torch.equal(c, d)
    assert torch.allclose(a, c, rtol=1e-5, atol=1e-6)  # the same sum, in another order


def test_a_refused_payload_adds_nothing_and_its_connection_is_skipped() -> None:
    """Worker 1's chunk 0 holds a NaN: refused, naming it; its chunk 1, already queued,
    is skipped; the step of chunk 0 is the mean of worker 0's chunk alone."""
    model = _model()
    before = model.flat_params.clone()
    work = _work(model, momentum=0.0)
    (s0, e0), (s1, e1) = work.chunks[:2]
    bad = torch.ones(e0 - s0)
    bad[17] = float("nan")
    g0 = torch.full((e0 - s0,), 2.0)
    outs = _run(work, [
        AddJob("a", 0, _header(0, 0, e0 - s0), [g0], 2),
        AddJob("b", 1, _header(1, 0, e0 - s0), [bad], 2),
        AddJob("b", 1, _header(1, 1, e1 - s1), [torch.ones(e1 - s1)], 2),
        StepJob(0, 0, 0.5),
    ])
    added = [o for o in outs if isinstance(o, Added)]
    assert added[0].error is None and added[0].dense
    assert added[1].error is not None and "worker 1 chunk 0" in added[1].error
    assert "non-finite" in added[1].error
    assert added[2].skipped and added[2].error is None
    assert work.acc[1].added == 0  # nothing of the skipped chunk
    # One contribution: its mean is itself (the 1/2 scale of the first add undone).
    want = before[s0:e0] - 0.5 * g0
    assert torch.equal(model.flat_params[s0:e0], want)


def test_an_oversized_value_is_refused_and_a_non_finite_step_is_reported() -> None:
    model = _model()
    work = _work(model, momentum=0.0, max_abs_grad=0.0)  # no bound: let it overflow
    s, e = work.chunks[0]
    huge = torch.full((e - s,), 3e38)
    outs = _run(work, [AddJob("a", 0, _header(0, 0, e - s), [huge], 1), StepJob(0, 0, -10.0)])
    step = outs[-1]
    assert isinstance(step, Stepped) and not step.finite
    work = _work(_model(), max_abs_grad=1e3)
    outs = _run(work, [AddJob("a", 0, _header(0, 0, e - s), [torch.full((e - s,), 2e3)], 1)])
    assert isinstance(outs[0], Added) and "guard.max_abs_grad" in str(outs[0].error)


def test_a_sparse_payload_with_a_duplicate_index_is_refused() -> None:
    work = _work(_model(), compressor="topk")
    s, e = work.chunks[0]
    idx = torch.tensor([3, 5, 3], dtype=torch.int32)
    outs = _run(work, [AddJob("a", 0, _header(0, 0, e - s), [torch.ones(3), idx], 1)])
    assert isinstance(outs[0], Added) and "duplicate" in str(outs[0].error)
    assert work.acc[0].added == 0


def test_a_bug_in_a_job_surfaces_on_the_owners_thread() -> None:
    work = _work(_model())
    ready = threading.Event()
    work.start(ready.set)
    try:
        work.submit(StepJob(99, 0, 0.1))  # no such chunk: an IndexError on the thread
        assert ready.wait(10)
        with pytest.raises(RuntimeError, match="chunk work failed"):
            work.outcomes()
    finally:
        work.stop()
