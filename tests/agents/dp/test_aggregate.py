"""PS-side aggregation: sparse accumulation equals the dense reference; bad payloads are
rejected with an error naming the worker, and leave the accumulator untouched."""

from __future__ import annotations

import pytest
import torch

from agents.compress import make
from agents.compress.base import Payload
from agents.compress.checks import validate_sparse
from agents.dp.aggregate import PayloadError, SparseAccumulator, aggregate


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name", ["topk", "dgc", "randomk"])
@pytest.mark.parametrize("encoding", ["int32", "delta"])
def test_sparse_aggregate_equals_dense_reference(name: str, encoding: str) -> None:
    c = make(name, index_encoding=encoding)
    grads = [torch.randn(100, 1000, generator=gen(w)) for w in range(4)]
    payloads = [c.compress(g, "w", 0.01, gen(10 + w)) for w, g in enumerate(grads)]
    ref = torch.stack([c.decompress(p) for p in payloads]).mean(0)
    got = aggregate(payloads, c)
    assert got.shape == (100, 1000)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    # Into a persistent buffer and accumulator (the PS's path), twice: same result.
    acc, buf = SparseAccumulator(100_000), torch.full((100_000,), float("nan"))
    for _ in range(2):
        into = aggregate(payloads, c, acc=acc, out=buf)
        assert into.data_ptr() == buf.data_ptr()
        torch.testing.assert_close(into, ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="out is 10 x"):
        aggregate(payloads, c, out=torch.empty(10))
    # An accumulator that sums in the output buffer itself, as the PS's do: the mean is
    # there with no pass to write it, and it stays right when reused.
    buf = torch.full((100_000,), float("nan"))
    bound = SparseAccumulator(100_000, into=buf)
    for _ in range(2):
        into = aggregate(payloads, c, acc=bound, out=buf)
        assert into.data_ptr() == buf.data_ptr()
        torch.testing.assert_close(into, ref, rtol=0, atol=1e-6)


def test_expected_contributions_are_scaled_as_added_and_corrected_when_short() -> None:
    buf = torch.full((6,), float("nan"))
    acc = SparseAccumulator(6, into=buf)
    assert torch.equal(buf, torch.zeros(6))  # zeroed when bound
    acc.expect(3)
    acc.add_sparse(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3.0, 6.0]))
    acc.add_dense(torch.full((6,), 3.0))
    assert buf[0] == pytest.approx(2.0)  # (3 + 3) / 3 already
    with pytest.raises(ValueError, match="2 contributions were added already"):
        acc.expect(2)
    # Only 2 of the 3 expected came: the mean is over 2, corrected in place.
    out = acc.result(2, out=buf)
    assert out.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf, torch.tensor([3.0, 1.5, 4.5, 1.5, 1.5, 1.5]))
    acc.reset()
    assert torch.equal(buf, torch.zeros(6))
    acc.add_sparse(torch.tensor([5]), torch.tensor([4.0]))  # reset forgets the scale
    torch.testing.assert_close(acc.result(2), torch.tensor([0, 0, 0, 0, 0, 2.0]))
    with pytest.raises(ValueError, match="contiguous 1-D"):
        SparseAccumulator(6, into=torch.zeros(12)[::2])
    with pytest.raises(ValueError, match="n must be >= 1"):
        SparseAccumulator(3).expect(0)


def test_sparse_result_of_a_scaled_accumulator() -> None:
    acc = SparseAccumulator(10)
    acc.expect(2)
    acc.add_sparse(torch.tensor([4, 1]), torch.tensor([2.0, 4.0]))
    acc.add_sparse(torch.tensor([4]), torch.tensor([6.0]))
    idx, vals = acc.result_sparse(2)
    assert idx.tolist() == [1, 4]
    torch.testing.assert_close(vals, torch.tensor([2.0, 4.0]))


def test_dense_path_for_dense_compressors_and_high_ratio() -> None:
    grads = [torch.randn(50, 20, generator=gen(w)) for w in range(3)]
    for name, ratio in (("none", 1.0), ("qsgd", 1.0), ("topk", 0.5)):
        c = make(name)
        payloads = [c.compress(g, "w", ratio, gen(w)) for w, g in enumerate(grads)]
        ref = torch.stack([c.decompress(p) for p in payloads]).mean(0)
        torch.testing.assert_close(aggregate(payloads, c), ref, rtol=0, atol=1e-6)
    c = make("none")
    mean = aggregate([c.compress(g, "w", 1.0, gen(0)) for g in grads], c)
    torch.testing.assert_close(mean, (grads[0] + grads[1] + grads[2]) / 3)


def test_accumulator_duplicates_and_sparse_result() -> None:
    acc = SparseAccumulator(10)
    acc.add_sparse(torch.tensor([1, 3, 3], dtype=torch.int32), torch.tensor([1.0, 2.0, 3.0]))
    acc.add_sparse(torch.tensor([9, 1]), torch.tensor([4.0, 5.0]))
    expect = torch.zeros(10)
    expect[1], expect[3], expect[9] = 6.0, 5.0, 4.0
    torch.testing.assert_close(acc.result(2), expect / 2)
    idx, vals = acc.result_sparse(2)
    assert idx.tolist() == [1, 3, 9]
    torch.testing.assert_close(vals, torch.tensor([3.0, 2.5, 2.0]))
    acc.add_dense(torch.ones(10))
    torch.testing.assert_close(acc.result(1), expect + 1)
    with pytest.raises(ValueError, match="dense"):
        acc.result_sparse(1)


@pytest.mark.parametrize("idx, values, match", [
    (torch.tensor([0, 10]), torch.zeros(2), "index 10 out of range"),
    (torch.tensor([-1, 2]), torch.zeros(2), "negative index -1"),
    (torch.tensor([0, 1, 2]), torch.zeros(2), "3 indices but 2 values"),
    (torch.tensor([0.0, 1.0]), torch.zeros(2), "integers"),
    (torch.zeros(2, 2, dtype=torch.int64), torch.zeros(4), "1-D"),
])
def test_validate_sparse_names_the_worker(idx, values, match) -> None:
    with pytest.raises(PayloadError, match=f"w7: .*{match}"):
        validate_sparse(idx, values, 10, who="w7")
    acc = SparseAccumulator(10)
    with pytest.raises(PayloadError, match="w7"):
        acc.add_sparse(idx, values, who="w7")
    assert torch.count_nonzero(acc.result(1)) == 0


def test_bad_payload_rejected_and_others_still_served() -> None:
    c = make("topk")
    good = [c.compress(torch.randn(1000, generator=gen(w)), "w", 0.01, gen(w))
            for w in range(3)]
    bad_idx = good[1].tensors[1].clone()
    bad_idx[0] = 5000
    bad = Payload("topk", (good[1].tensors[0], bad_idx), 1000, (1000,), torch.float32)
    with pytest.raises(PayloadError, match="w1: index 5000 out of range"):
        aggregate([good[0], bad, good[2]], c, workers=["w0", "w1", "w2"])
    with pytest.raises(PayloadError, match="topk: 9 indices but 10 values"):
        c.from_parts([good[1].tensors[0], good[1].tensors[1][:-1]], 1000, (1000,),
                     torch.float32)
    # The PS drops the bad worker's payload and aggregates the rest.
    ok = aggregate([good[0], good[2]], c, workers=["w0", "w2"])
    torch.testing.assert_close(ok, (c.decompress(good[0]) + c.decompress(good[2])) / 2)


def test_corrupt_delta_payload_names_worker() -> None:
    c = make("topk", index_encoding="delta")
    p = c.compress(torch.randn(1000, generator=gen(0)), "w", 0.01, gen(0))
    broken = Payload("topk", (p.tensors[0], p.tensors[1][:-1]), 1000, (1000,), torch.float32)
    with pytest.raises(PayloadError, match="w3: "):
        aggregate([broken], c, workers=["w3"])
    huge = Payload("topk", (p.tensors[0][:1], torch.tensor([0x8F, 0x01], dtype=torch.uint8)),
                   10, (10,), torch.float32)
    with pytest.raises(PayloadError, match="w4: index 143 out of range"):
        aggregate([huge], c, workers=["w4"])


def test_mismatched_payloads_rejected() -> None:
    c = make("topk")
    a = c.compress(torch.randn(100), "w", 0.1, gen(0))
    b = c.compress(torch.randn(101), "w", 0.1, gen(0))
    with pytest.raises(PayloadError, match="w1: payload shape"):
        aggregate([a, b], c, workers=["w0", "w1"])
    with pytest.raises(PayloadError, match="expected 'qsgd'"):
        aggregate([a], make("qsgd"))


def test_persistent_accumulator_is_reset_between_iterations() -> None:
    c = make("topk")
    acc = SparseAccumulator(1000)
    for it in range(2):
        payloads = [c.compress(torch.randn(1000, generator=gen(it * 10 + w)), "w", 0.01,
                               gen(w)) for w in range(2)]
        ref = (c.decompress(payloads[0]) + c.decompress(payloads[1])) / 2
        torch.testing.assert_close(aggregate(payloads, c, acc=acc), ref, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="accumulator"):
        aggregate(payloads, c, acc=SparseAccumulator(999))
