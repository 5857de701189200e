"""3D-parallel (tensor x pipeline x data) planner for transformer training (DESIGN.md 1.5).

Implements the layout arithmetic of Yuan 1.0 (seeds/003; Wu et al. 2021, "Yuan 1.0:
Large-Scale Pre-trained Language Model in Zero-Shot and Few-Shot Learning"), which follows
Megatron-LM (Shoeybi et al. 2019; Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21). For a model and a layout (t, p, d) it
predicts, per training step (one global batch):

- micro-batches per pipeline ``m = global_batch / (d * micro_batch)``;
- bubble fractions: 1F1B ``(p - 1) / m`` (idle time relative to the ideal compute time,
  Narayanan et al. eq. 1) and GPipe ``(p - 1) / (m + p - 1)`` (idle share of the fill-drain
  schedule's makespan, Huang et al. 2019);
- communication bytes per GPU per step for each link type (formulas on :func:`plan`);
- model FLOPs per step (Narayanan et al. 2021, appendix, eq. for ``F``), and compute-to-
  communication ratios: FLOPs per byte, and compute time over transfer time for the given
  per-GPU link bandwidths and sustained GPU throughput.

Pure arithmetic: no I/O. :func:`analysis.cli.plan_main` is the command line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style decoder stack."""

    layers: int  # L, transformer layers
    hidden: int  # h, hidden size
    seq: int  # s, sequence length in tokens
    vocab: int = 0  # V, vocabulary size; 0 leaves the logit layer out of the FLOPs

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab < 0:
            raise ValueError(f"ModelShape.vocab must be >= 0, got {self.vocab}")

    @property
    def params(self) -> int:
        """Transformer-layer parameters ``12 * L * h^2`` (attention 4h^2 + MLP 8h^2; biases,
        layer norms and embeddings left out, as in Narayanan et al.)."""
        return 12 * self.layers * self.hidden ** 2


@dataclass(frozen=True)
class Layout:
    """How the GPUs split the work. ``t * p * d`` GPUs in all."""

    t: int  # tensor-parallel ranks per layer (within a node, over NVLink)
    p: int  # pipeline stages
    d: int  # data-parallel replicas
    global_batch: int  # B, sequences per optimizer step
    micro_batch: int  # b, sequences per micro-batch

    def __post_init__(self) -> None:
        for name in ("t", "p", "d", "global_batch", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch % (self.d * self.micro_batch):
            raise ValueError(
                f"Layout.global_batch={self.global_batch} is not a multiple of "
                f"d * micro_batch = {self.d} * {self.micro_batch}")

    @property
    def gpus(self) -> int:
        return self.t * self.p * self.d

    @property
    def micro_batches(self) -> int:
        """m = B / (d * b): micro-batches each pipeline runs per step."""
        return self.global_batch // (self.d * self.micro_batch)


@dataclass(frozen=True)
class Links:
    """Per-GPU bandwidth of each link type, Gbit/s, and the GPU's sustained throughput.

    Defaults are a DGX-A100-class cluster: NVLink 300 GB/s per GPU for tensor parallelism,
    one 200 Gbit/s HDR InfiniBand NIC per GPU for pipeline and data parallelism, and 150
    TFLOP/s sustained (about half of the A100's 312 TFLOP/s fp16 peak, what Megatron reports).
    """

    tp_gbps: float = 2400.0
    pp_gbps: float = 200.0
    dp_gbps: float = 200.0
    gpu_tflops: float = 150.0

    def __post_init__(self) -> None:
        for name, v in asdict(self).items():
            if not v > 0:
                raise ValueError(f"Links.{name} must be > 0, got {v}")


@dataclass(frozen=True)
class Plan:
    """Per-step predictions for one GPU of the layout (all GPUs are alike, up to the pipeline's
    first and last stage, which send activations or gradients in one direction only)."""

    model: ModelShape
    layout: Layout
    links: Links
    micro_batches: int
    bubble_1f1b: Fraction
    bubble_gpipe: Fraction
    tp_bytes: float  # tensor-parallel all-reduce bytes sent per GPU per step
    pp_bytes: float  # pipeline activations + gradients sent per GPU (interior stage) per step
    dp_bytes: float  # data-parallel gradient all-reduce bytes sent per GPU per step
    stage_params: float  # parameters held by one GPU: 12 h^2 L / (t p)
    flops_step: float  # model FLOPs of one step, all GPUs together
    flops_per_gpu: float
    compute_s: float  # flops_per_gpu / gpu throughput (no bubble)
    comm_s: dict[str, float]  # link type -> bytes * 8 / bandwidth
    flops_per_byte: dict[str, float]  # link type -> flops_per_gpu / bytes (inf when no bytes)
    compute_to_comm: dict[str, float]  # link type -> compute_s / comm_s (inf when no bytes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data; an infinite ratio (a link type with no traffic) is None."""
        d = asdict(self)
        for k in ("flops_per_byte", "compute_to_comm"):
            d[k] = {n: (v if math.isfinite(v) else None) for n, v in d[k].items()}
        for k in ("bubble_1f1b", "bubble_gpipe"):
            f: Fraction = getattr(self, k)
            d[k] = {"fraction": f"{f.numerator}/{f.denominator}", "value": float(f)}
        return d


def model_flops(model: ModelShape, global_batch: int, recompute: bool = False) -> float:
    """FLOPs of one training step (forward + backward) for ``B = global_batch`` sequences.

    Narayanan et al. 2021 (appendix): a layer's forward costs ``24 B s h^2 + 4 B s^2 h`` (the
    matrix multiplies), the logit layer ``2 B s h V``; backward costs twice the forward. So

        F = 72 B s L h^2 (1 + s/(6h) + V/(12 L h))                      (no recomputation)
        F = 96 B s L h^2 (1 + s/(6h) + V/(16 L h))   (activation recomputation: one more forward)
    """
    b, s, h, L, V = global_batch, model.seq, model.hidden, model.layers, model.vocab
    if recompute:
        return 96.0 * b * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72.0 * b * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def plan(model: ModelShape, layout: Layout, links: Links | None = None,
         bytes_per_element: int = 2, recompute: bool = False) -> Plan:
    """Predict one step of ``model`` on ``layout``. ``bytes_per_element``: 2 for fp16/bf16
    activations and gradients (the default), 4 for fp32.

    Bytes are what one GPU sends per step (a ring all-reduce of N bytes over k ranks sends
    ``2 (k-1)/k * N`` bytes per rank: reduce-scatter plus all-gather, Patarasuk & Yuan 2009):

    - tensor parallel: each transformer layer does 4 all-reduces of the ``b s h`` activation
      per micro-batch (2 in the forward: after attention and after the MLP; 2 in the backward),
      Shoeybi et al. 2019. A GPU holds ``L / p`` layers and runs ``m`` micro-batches:
      ``tp = 4 * (L/p) * m * 2 (t-1)/t * b s h * bytes``;
    - pipeline: per micro-batch, a stage sends its ``b s h`` output activation forward and the
      ``b s h`` gradient of its input backward, over each stage boundary; an interior stage
      sends ``pp = 2 * m * b s h * bytes`` (every tensor rank sends the full tensor, without
      Megatron's scatter/gather optimisation); 0 when ``p = 1``;
    - data parallel: after the step the ``12 h^2 L / (t p)`` gradients of a GPU's shard are
      all-reduced over the ``d`` replicas: ``dp = 2 (d-1)/d * 12 h^2 L / (t p) * bytes``.

    Compute: ``F / (t p d)`` FLOPs per GPU (:func:`model_flops`), taking
    ``flops_per_gpu / (gpu_tflops * 1e12)`` seconds. Compute-to-communication ratio of a link
    type = compute seconds / that link type's seconds (``bytes * 8 / (gbps * 1e9)``): above 1
    the transfers can hide behind compute if overlapped.
    """
    links = links or Links()
    if bytes_per_element < 1:
        raise ValueError(f"bytes_per_element must be >= 1, got {bytes_per_element}")
    if model.layers % layout.p:
        raise ValueError(f"ModelShape.layers={model.layers} is not divisible by Layout.p="
                         f"{layout.p} (each stage holds whole layers)")
    t, p, d = layout.t, layout.p, layout.d
    m = layout.micro_batches
    act = layout.micro_batch * model.seq * model.hidden * bytes_per_element  # b s h, in bytes
    layers_per_stage = model.layers // p
    tp_bytes = 4 * layers_per_stage * m * (2 * (t - 1) / t) * act
    pp_bytes = 2 * m * act if p > 1 else 0.0
    stage_params = model.params / (t * p)
    dp_bytes = 2 * (d - 1) / d * stage_params * bytes_per_element
    flops = model_flops(model, layout.global_batch, recompute)
    flops_gpu = flops / layout.gpus
    compute_s = flops_gpu / (links.gpu_tflops * 1e12)
    by_type = {"tp": (tp_bytes, links.tp_gbps), "pp": (pp_bytes, links.pp_gbps),
               "dp": (dp_bytes, links.dp_gbps)}
    comm_s = {k: v * 8 / (g * 1e9) for k, (v, g) in by_type.items()}
    fpb = {k: (flops_gpu / v if v > 0 else float("inf")) for k, (v, _) in by_type.items()}
    c2c = {k: (compute_s / s_ if s_ > 0 else float("inf")) for k, s_ in comm_s.items()}
    return Plan(model=model, layout=layout, links=links, micro_batches=m,
                bubble_1f1b=Fraction(p - 1, m), bubble_gpipe=Fraction(p - 1, m + p - 1),
                tp_bytes=float(tp_bytes), pp_bytes=float(pp_bytes), dp_bytes=float(dp_bytes),
                stage_params=float(stage_params), flops_step=flops, flops_per_gpu=flops_gpu,
                compute_s=compute_s, comm_s=comm_s, flops_per_byte=fpb, compute_to_comm=c2c)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return f"{n:.3g} TB"


def format_plan(pl: Plan) -> str:
    """A readable table of the plan (what ``gradbed plan`` prints)."""
    lay, mod = pl.layout, pl.model
    lines = [
        f"model   L={mod.layers} h={mod.hidden} s={mod.seq} V={mod.vocab}  "
        f"({mod.params / 1e9:.4g} B layer params)",
        f"layout  t={lay.t} p={lay.p} d={lay.d}  GPUs={lay.gpus}  global batch={lay.global_batch}"
        f"  micro-batch={lay.micro_batch}",
        f"micro-batches per pipeline m = B/(d*b) = {pl.micro_batches}",
        f"bubble 1F1B  (p-1)/m       = {pl.bubble_1f1b.numerator}/{pl.bubble_1f1b.denominator}"
        f" = {float(pl.bubble_1f1b):.2%}",
        f"bubble GPipe (p-1)/(m+p-1) = {pl.bubble_gpipe.numerator}/{pl.bubble_gpipe.denominator}"
        f" = {float(pl.bubble_gpipe):.2%}",
        f"compute per GPU per step   = {pl.flops_per_gpu:.4g} FLOP = {pl.compute_s:.4g} s at "
        f"{pl.links.gpu_tflops:g} TFLOP/s  (step total {pl.flops_step:.4g} FLOP)",
        "",
        f"{'link':<26}{'bytes/GPU/step':>16}{'Gbit/s':>10}{'time (s)':>12}{'FLOP/byte':>12}"
        f"{'compute/comm':>14}",
    ]
    names = {"tp": "tensor-parallel all-reduce", "pp": "pipeline act+grad",
             "dp": "data-parallel grad sync"}
    gbps = {"tp": pl.links.tp_gbps, "pp": pl.links.pp_gbps, "dp": pl.links.dp_gbps}
    vols = {"tp": pl.tp_bytes, "pp": pl.pp_bytes, "dp": pl.dp_bytes}
    for k, label in names.items():
        lines.append(f"{label:<26}{_human_bytes(vols[k]):>16}{gbps[k]:>10g}"
                     f"{pl.comm_s[k]:>12.4g}{pl.flops_per_byte[k]:>12.4g}"
                     f"{pl.compute_to_comm[k]:>14.4g}")
    return "\n".join(lines)


def pipeline_link_bytes(boundary_numels: list[int], stages: int, micro_batches: int, *,
                        act_bytes_per_element: int = 4, grad_bytes_per_element: int = 4,
                        header_bytes: int = 64) -> dict[tuple[int, int], float]:
    """Bytes per step on each directed stage-to-stage link of a pipeline with dense
    activations and gradients (no compression), as gradbed's stages send them.

    ``boundary_numels[i]`` is the element count of one micro-batch's activation leaving
    pipeline position ``i`` (``positions - 1`` boundaries; position ``i`` sits on stage
    ``i % stages``, so two chunks per stage go round the stages twice). Per step, boundary
    ``i`` carries ``m`` activations forward, ``m * (numel * act_bytes + header)`` bytes
    from stage ``i % p`` to stage ``(i + 1) % p``, and ``m`` gradients back,
    ``m * (numel * grad_bytes + header)`` the other way; ``header`` is the frame codec's
    per-message header (one part per dense tensor). Returns ``{(src, dst): bytes}``.
    """
    out: dict[tuple[int, int], float] = {}
    for i, numel in enumerate(boundary_numels):
        a, b = i % stages, (i + 1) % stages
        out[(a, b)] = out.get((a, b), 0.0) + micro_batches * (numel * act_bytes_per_element
                                                             + header_bytes)
        out[(b, a)] = out.get((b, a), 0.0) + micro_batches * (numel * grad_bytes_per_element
                                                             + header_bytes)
    return out


def pipeline_dp_link_bytes(piece_numels: list[int], stages: int, replicas: int, *,
                           bytes_per_element: int = 4, header_bytes: int = 64
                           ) -> dict[tuple[int, int], float]:
    """Data-parallel bytes per step, each way, on the link of stage ``s`` of every replica
    of a (t = 1, p, d) pipeline whose stage gradients the PS averages
    (:mod:`agents.pipeline.stage_ps`).

    ``piece_numels[i]`` is the parameter count of pipeline position ``i`` (position ``i``
    sits on stage ``i % stages``). Once per step every replica's stage sends each of its
    pieces' gradients to the PS and receives the mean, one message each way per piece:
    ``dp(s) = sum over its pieces of (numel * bytes + header)`` up, and the same down;
    0 when ``d = 1`` (nothing to average). Returns ``{(replica, stage): dp(s)}``; the PS's
    own link carries the sum over all of them, each way.

    Against :func:`plan`'s ring all-reduce, ``2 (d-1)/d * N`` per GPU: the PS sends each
    replica ``N`` (the slice) and takes ``N``, equal to the ring's at ``d = 2`` and below
    it by ``(d-2)/d * N`` for larger ``d``, at the price of the PS's link carrying ``d N``.
    """
    if replicas < 1 or stages < 1:
        raise ValueError(f"stages={stages} and replicas={replicas} must be >= 1")
    if replicas == 1:
        return {}
    per_stage = [0.0] * stages
    for i, n in enumerate(piece_numels):
        per_stage[i % stages] += n * bytes_per_element + header_bytes
    return {(r, s): per_stage[s] for r in range(replicas) for s in range(stages)}
