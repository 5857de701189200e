"""gradbed's DDP hooks on a real gloo group (ranks on 127.0.0.1, forks of one fresh
interpreter that imported torch: tests.support.ddp_ranks): the reduced gradient is the
mean of what each rank sent, error feedback keeps the residual, each hook's TCP bytes
equal its formula within 1 %, the adaptive ranks agree on one rate, and ``gradbed.ddp``
loads neither the controller nor Mininet."""

from __future__ import annotations

import math

import pytest
import torch

from agents.compress.base import k_for
from tests.support import ddp_ranks

ITERS = 4


def topk_ref(v: torch.Tensor, k: int) -> torch.Tensor:
    """The obvious top-k: sort by magnitude, keep the first k, zero the rest."""
    order = sorted(range(v.numel()), key=lambda i: -abs(float(v[i])))
    out = torch.zeros_like(v)
    for i in order[:k]:
        out[i] = v[i]
    return out


HOOKS = ["allreduce", "fp16", "topk", "randomk", "qsgd", "signsgd", "powersgd"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One 3-rank gloo group runs every check (a group costs a fork per rank and a
    rendezvous; the ranks share one torch import)."""
    out = tmp_path_factory.mktemp("ddp")
    return ddp_ranks.spawn(ddp_ranks.everything, 3, out, ITERS, HOOKS)


@pytest.fixture(scope="module")
def topk_run(ranks: list[dict]) -> list[dict]:
    return [r["topk"] for r in ranks]


@pytest.fixture(scope="module")
def byte_run(ranks: list[dict]) -> list[dict]:
    return [r["bytes"] for r in ranks]


def test_topk_is_the_mean_of_each_ranks_sparse_part_with_error_feedback(topk_run):
    world = len(topk_run)
    local = topk_run[0]["local"]
    residual = [torch.zeros_like(local[0][0]) for _ in range(world)]
    for it in range(ITERS):
        if it < 2:  # DDP's dense mean while the buckets are rebuilt
            want = torch.stack(local[it]).mean(0)
        else:
            sent = []
            for r in range(world):
                v = local[it][r] + residual[r]
                s = topk_ref(v, k_for(v.numel(), 0.05))
                residual[r] = v - s
                sent.append(s)
            want = torch.stack(sent).mean(0)
            for r in range(world):  # each rank's own residual: original = sent + residual
                torch.testing.assert_close(topk_run[r]["residual"][it], residual[r])
        for r in range(world):
            torch.testing.assert_close(topk_run[r]["reduced"][it], want, rtol=1e-5,
                                       atol=1e-7)
    assert topk_run[0]["residual"][ITERS - 1].abs().sum() > 0  # the check can fail


def test_fp16_is_the_dense_mean_within_half_precision(ranks):
    seen = [r["fp16"] for r in ranks]
    for r in range(len(seen)):
        for it in range(3):
            want = torch.stack(seen[0]["local"][it]).mean(0)
            # Three halves summed in half precision: a few ulps of the largest gradient.
            scale = float(want.abs().max())
            torch.testing.assert_close(seen[r]["reduced"][it], want, rtol=0,
                                       atol=4e-3 * scale)
            if it >= 2:
                assert not torch.equal(seen[r]["reduced"][it], want)  # it was compressed


def formula_bytes(name: str, world: int, bucket_numels: list[int],
                  shapes: list[tuple[int, ...]], framing: dict[str, float]) -> float:
    """docs/ddp.md's per-iteration bytes one rank sends, from the buckets' sizes (and the
    parameters' shapes for PowerSGD), independent of the hooks' own accounting, plus gloo's
    framing per collective (measured with 4 KB collectives)."""
    ring, gather = 2 * (world - 1) / world, world - 1
    buckets = len(bucket_numels)
    if name == "allreduce":
        return sum(ring * 4 * n for n in bucket_numels) + buckets * framing["allreduce"]
    if name == "fp16":
        return sum(ring * 2 * n for n in bucket_numels) + buckets * framing["allreduce"]
    per = {"topk": lambda n: 8 * k_for(n, 0.01), "randomk": lambda n: 8 * k_for(n, 0.01),
           "qsgd": lambda n: n + 4 * math.ceil(n / 512),
           "signsgd": lambda n: 4 + math.ceil(n / 8)}.get(name)
    if per is not None:
        return sum(gather * per(n) for n in bucket_numels) + buckets * framing["allgather"]
    assert name == "powersgd"  # rank 1: P (n) and Q (m) per matrix, vectors whole; per
    # bucket three all_reduces (the vectors, the Ps, the Qs)
    numel = sum(s[0] + s[1] if len(s) == 2 else s[0] for s in shapes)
    return ring * 4 * numel + 3 * buckets * framing["allreduce"]


@pytest.mark.parametrize("name", HOOKS)
def test_each_hooks_tcp_bytes_equal_its_formula_within_one_percent(byte_run, name):
    for r, seen in enumerate(byte_run):
        got = seen[name]
        numels = [raw // 4 for _, raw in got["buckets"]]
        assert len(numels) >= 2, got  # several buckets, so the sum per bucket is tested
        want = formula_bytes(name, len(byte_run), numels, got["shapes"], seen["framing"])
        assert got["sent"] == pytest.approx(want, rel=0.01), (name, r, got["sent"], want,
                                                              seen["framing"])
    for kind in ("allreduce", "allgather"):  # headers' worth, not a payload
        assert 0 < byte_run[0]["framing"][kind] < 2000, byte_run[0]["framing"]


def test_adaptive_ranks_agree_on_the_slowest_rate(ranks):
    seen = [r["agreement"] for r in ranks]
    assert [s["mine"] for s in seen] == [pytest.approx(100e6 / (r + 1)) for r in range(3)]
    assert [s["agreed"] for s in seen] == [pytest.approx(100e6 / 3)] * 3
    assert [s["keep"] for s in seen] == [pytest.approx(1 / 3)] * 3


def test_the_adaptive_hook_gives_every_bucket_of_an_iteration_one_keep_on_every_rank(ranks):
    seen = [sorted(r["adaptive"]) for r in ranks]
    assert seen[0] == seen[1] == seen[2]  # the ranks agreed (and no all_gather hung)
    by_iter: dict[int, set[float]] = {}
    for it, _, keep, collective in seen[0]:
        by_iter.setdefault(it, set()).add(keep)
        # A keep that sends every element goes dense, and a dense bucket sums on the wire.
        assert collective == ("allreduce" if keep >= 0.5 else "allgather"), (keep, collective)
    assert sorted(by_iter) == [2, 3, 4, 5] and len(seen[0]) >= 8  # several buckets each
    assert all(len(k) == 1 for k in by_iter.values()), by_iter


def test_gradbed_ddp_imports_neither_the_controller_nor_mininet(ranks):
    """Each rank is a fork of an interpreter that loaded torch and nothing of gradbed;
    it imported gradbed.ddp and ran every hook: none of them loaded the controller, the
    topology or Mininet."""
    assert [r["loaded"] for r in ranks] == [[]] * len(ranks)
    assert all("gradbed.ddp" in r["gradbed_loaded"] for r in ranks)


def test_bad_arguments_name_what_is_allowed():
    import gradbed.ddp

    with pytest.raises(ValueError, match="unknown name 'dgc'.*topk"):
        gradbed.ddp.hook("dgc")
    with pytest.raises(ValueError, match="ratio must be in"):
        gradbed.ddp.hook("topk", ratio=0.0)
    with pytest.raises(ValueError, match="policy='adaptive' needs planned_mbps"):
        gradbed.ddp.hook("topk", policy="adaptive")
    with pytest.raises(ValueError, match="policy must be one of"):
        gradbed.ddp.hook("topk", policy="fast")


def test_the_adaptive_ratio_goes_dense_where_gathered_sparse_outweighs_the_ring():
    """Per element, all_gather moves (N - 1) x r x (value + index) bytes and a dense
    all_reduce 2 (N - 1) / N x value: the hook sends sparse only below r = 1/N (float32),
    checked here on the formula the byte test holds against the kernel's counters."""
    from gradbed.ddp.adaptive import bucket_ratio, element_ratio
    from gradbed.ddp.wire import sent_bytes, sparse_breakeven_ratio

    numel = 1_000_000
    for world in (2, 4, 8):
        assert sparse_breakeven_ratio(world, 4) == pytest.approx(1 / world)
        for keep in (0.05, 0.2, 0.3, 0.45, 0.6, 0.9):
            r = bucket_ratio(keep, 4, 0.001, world)
            sparse = sent_bytes("allgather", round(element_ratio(keep, 4, 0.001) * numel) * 8,
                                world)
            dense = sent_bytes("allreduce", numel * 4, world)
            assert r == (1.0 if sparse >= dense else element_ratio(keep, 4, 0.001)), \
                (world, keep, sparse, dense)
    assert bucket_ratio(0.9, 4, 0.001, 1) == element_ratio(0.9, 4, 0.001)  # no wire
    assert bucket_ratio(1.0, 4, 0.001, 4) == 1.0
