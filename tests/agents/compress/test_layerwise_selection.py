"""DGC's layer-wise selection (Lin et al. 2018, as synxlin/deep-gradient-compression does it):
``[feedback] per_layer`` runs top-k in each parameter tensor, ``dense_1d`` sends the 1-D
parameters whole with their momentum unmasked (agents/compress/sparse.py, feedback.py).
Each test pins what the option changes, so it fails with the option ignored."""

from __future__ import annotations

import pytest
import torch

from agents.compress import ErrorFeedback, make
from agents.compress.base import FRAME_HEADER_BYTES
from agents.compress.sparse import SparseCompressor
from agents.core import config as cfgmod
from agents.dp.keep_response import TrainingSpec, train
from agents.workloads.base import chunk_layer_dims, chunk_layers
from agents.workloads.digits_mlp import DigitsMLP
from controller.loopback.dp import run_loopback

# A weight (4 x 25 = 100 elements) with large gradients, its bias (4), and a weight
# (2 x 50 = 100) with small ones, laid out flat as a worker packs them.
SHAPES = [(4, 25), (4,), (2, 50)]


def layered(per_layer: bool, dense_1d: bool, name: str = "topk") -> SparseCompressor:
    c = make(name)
    assert isinstance(c, SparseCompressor)
    c.select_by_layer(per_layer=per_layer, dense_1d=dense_1d)
    c.set_layers("c0", SHAPES, chunk_layer_dims(SHAPES, 0, 204))
    return c


def gradient() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(204, generator=gen)
    g[:100] *= 100.0  # the first layer dominates any selection over the whole chunk
    return g


def sent_indices(c: SparseCompressor, g: torch.Tensor, ratio: float) -> set[int]:
    sparse = c.decompress_sparse(c.compress(g, "c0", ratio, torch.Generator()))
    assert sparse is not None
    return {int(i) for i in sparse[0]}


def test_per_layer_selects_in_every_layer() -> None:
    g = gradient()
    # One selection over the chunk: k_for(204, 0.05) = 11, all from the large layer.
    flat = make("topk")
    assert all(i < 100 for i in sent_indices(flat, g, 0.05))  # type: ignore[arg-type]
    got = sent_indices(layered(True, False), g, 0.05)
    # Per layer: ceil(0.05 * 100) = 5, ceil(0.05 * 4) = 1, 5; each the layer's own top-k.
    assert len(got) == 11
    assert {i for i in got if i < 100} == set(torch.topk(g[:100].abs(), 5).indices.tolist())
    assert len([i for i in got if 100 <= i < 104]) == 1
    assert {i for i in got if i >= 104} == {104 + i for i in
                                            torch.topk(g[104:].abs(), 5).indices.tolist()}


def test_dense_1d_sends_the_bias_whole_and_counts_its_bytes() -> None:
    g = gradient()
    c = layered(False, True)
    payload = c.compress(g, "c0", 0.05, torch.Generator())
    got = sent_indices(c, g, 0.05)
    assert {100, 101, 102, 103} <= got
    # The other 200 elements: one selection over both weights, k_for(200, 0.05) = 10.
    assert len(got) == 14 and all(i < 100 for i in got - {100, 101, 102, 103})
    assert payload.wire_bytes() == 14 * (4 + 4) + 2 * FRAME_HEADER_BYTES
    whole = c.whole_indices("c0")
    assert whole is not None and whole.tolist() == [100, 101, 102, 103]
    # Both together: the bias whole, then 5 and 5 from the two weights.
    assert len(sent_indices(layered(True, True), g, 0.05)) == 14
    # The same applies to the other k-keeping sparse compressors.
    assert {100, 101, 102, 103} <= sent_indices(layered(True, True, "randomk"), g, 0.05)


def test_partial_rows_of_a_cut_matrix_are_not_sent_whole() -> None:
    """A chunk boundary inside a 2-D parameter leaves 1-D partial rows; they belong to a
    2-D parameter, so ``dense_1d`` must still sparsify them."""
    pieces = chunk_layers(SHAPES, 10, 160)
    assert pieces == [(15,), (3, 25), (4,), (1, 50), (6,)]
    assert chunk_layer_dims(SHAPES, 10, 160) == [2, 2, 1, 2, 2]
    c = make("topk")
    assert isinstance(c, SparseCompressor)
    c.select_by_layer(per_layer=False, dense_1d=True)
    c.set_layers("c0", pieces, chunk_layer_dims(SHAPES, 10, 160))
    whole = c.whole_indices("c0")
    assert whole is not None and whole.tolist() == [90, 91, 92, 93]  # the bias only


def test_momentum_of_whole_coordinates_is_not_masked() -> None:
    """With masking, a sent coordinate's velocity is zeroed; the whole-sent bias keeps
    ``u = m u + g``, so for it momentum correction is exactly momentum SGD."""
    c = layered(True, True)
    ef = ErrorFeedback(c, momentum=0.9, masking=True)
    gen = torch.Generator().manual_seed(2)
    ref_u = torch.zeros(4, dtype=torch.float64)
    for step in range(5):
        g = torch.randn(204, generator=gen, dtype=torch.float64)
        payload, _ = ef.step(g, "c0", 0.05, torch.Generator())
        ref_u = 0.9 * ref_u + g[100:104]
        sent = c.decompress(payload)
        # The bias goes out as the velocity itself, every step (its residual stays 0).
        torch.testing.assert_close(sent[100:104], ref_u, msg=f"step {step}")
        u = ef.velocity("c0")
        assert u is not None
        torch.testing.assert_close(u[100:104], ref_u)
        sparse = c.decompress_sparse(payload)
        assert sparse is not None
        masked = [int(i) for i in sparse[0] if not 100 <= int(i) < 104]
        assert masked and bool((u[masked] == 0).all())  # the sparsified ones are masked


def test_layer_pieces_must_cover_the_tensor() -> None:
    c = layered(True, False)
    with pytest.raises(ValueError, match="layer pieces add up to 204"):
        c.compress(torch.zeros(200), "c0", 0.05, torch.Generator())
    with pytest.raises(ValueError, match="2 parameter dims for 3 layer pieces"):
        c.set_layers("c1", SHAPES, [2, 1])


def test_config_needs_a_k_keeping_sparse_compressor() -> None:
    cfg = cfgmod.from_dict({"compress": {"name": "topk", "ratio": 0.001},
                            "feedback": {"per_layer": True, "dense_1d": True}})
    assert cfg.feedback.per_layer and cfg.feedback.dense_1d
    assert not cfgmod.from_dict({}).feedback.per_layer  # off by default
    for name in ("none", "powersgd", "threshold"):
        for opt in ("per_layer", "dense_1d"):
            with pytest.raises(cfgmod.ConfigError, match=f"feedback.{opt}.*needs compress"):
                cfgmod.from_dict({"compress": {"name": name}, "feedback": {opt: True}})


@pytest.mark.loopback
def test_workers_over_tcp_match_the_one_process_run(tmp_path) -> None:
    """The workers wire the options (and the warm-up) as ``agents.dp.keep_response`` does:
    two real worker processes over loopback end at its weights. 8 KB chunks cut the
    64 x 64 layer, so partial rows and whole biases both occur."""
    n, iters = 2, 6
    sets = [f"net.workers={n}", f"run.iterations={iters}", "workload.hidden=64",
            "workload.lr=0.2", "workload.momentum=0.9", "workload.chunk_bytes=8192",
            "compress.name='topk'", "compress.ratio=0.01", "feedback.momentum_correction=true",
            "feedback.per_layer=true", "feedback.dense_1d=true", "feedback.warmup_iterations=4"]
    run_dir, rc = run_loopback(tmp_path, sets)
    assert rc == 0, (run_dir / "ps.log").read_text()
    got = torch.load(run_dir / "ps_final_weights.pt")
    spec = TrainingSpec(workers=n, batch_size=32, lr=0.2, momentum=0.9, chunk_bytes=8192,
                        eval_every=iters, momentum_correction=True, per_layer=True,
                        dense_1d=True, warmup_iterations=4)
    want, _ = train(DigitsMLP(64), spec, 0.01, iters)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # Without the layer-wise selection the run ends elsewhere, so the comparison can fail.
    plain = TrainingSpec(workers=n, batch_size=32, lr=0.2, momentum=0.9, chunk_bytes=8192,
                         eval_every=iters, momentum_correction=True, warmup_iterations=4)
    other, _ = train(DigitsMLP(64), plain, 0.01, iters)
    assert (other - want).abs().max() > 1e-3
