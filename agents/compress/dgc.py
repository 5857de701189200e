"""Sampled-threshold top-k, the selection of Deep Gradient Compression.

Follows Lin et al., "Deep Gradient Compression: Reducing the Communication Bandwidth for
Distributed Training", ICLR 2018 (and its reference code's ``sparsify``): instead of sorting
the whole tensor, sample a small fraction of ``|x|``, take the threshold that keeps the
wanted fraction of the sample, and select ``|x| >= threshold`` in one scan. The count is
checked against ``[0.8 k, 1.3 k]`` (``k`` from :func:`agents.compress.base.k_for`):

- more than 1.3 k candidates: exact top-k among the candidates, so exactly k are sent;
- fewer than 0.8 k: the threshold is re-estimated from the same sample at a proportionally
  larger rank (aiming 10 % above k, since surplus is cheap to trim) and the scan repeats,
  up to ``max_rounds`` scans; if the count is still short, exact top-k on the whole tensor.

So the number sent always lies in ``[0.8 k, 1.3 k]``, and the elements sent are the true
largest: every element left out has ``|x|`` at most the smallest ``|x|`` sent. Momentum
correction and local clipping are DGC's other parts; clipping lives in error feedback
(DESIGN 1.2), momentum in the optimizer.

Randomness (the sample) comes only from the generator passed to ``compress``. Small tensors
(``numel < exact_below``) and high ratios (``k > numel / 4``) use exact top-k: there the
sample buys nothing.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from agents.compress.base import device_generator, k_for, register
from agents.compress.sparse import SparseCompressor, indices_above, largest_of
from agents.compress.topk import topk_indices

LOW_FACTOR = 0.8  # DGC's accepted band for the selected count, as a fraction of k
HIGH_FACTOR = 1.3


@register
class DGCCompressor(SparseCompressor):
    name = "dgc"

    def __init__(self, sample_ratio: float = 0.01, min_sample: int = 10_000,
                 max_rounds: int = 3, exact_below: int = 65_536,
                 index_encoding: str = "int32") -> None:
        super().__init__(index_encoding)
        # Larger sample: better threshold estimate (fewer re-scans), slower sampling.
        if not 0.0 < sample_ratio <= 1.0:
            raise ValueError(f"dgc.sample_ratio must be in (0, 1], got {sample_ratio}")
        if min_sample < 1 or max_rounds < 1 or exact_below < 0:
            raise ValueError(f"dgc: min_sample={min_sample} and max_rounds={max_rounds} "
                             f"must be >= 1, exact_below={exact_below} >= 0")
        self.sample_ratio = sample_ratio
        self.min_sample = min_sample
        self.max_rounds = max_rounds
        self.exact_below = exact_below
        self.last_rounds = 0  # scans used by the last call (diagnostics, benchmarks)

    def select(self, flat: Tensor, ratio: float, rng: torch.Generator) -> Tensor:
        n = flat.numel()
        k = k_for(n, ratio)
        self.last_rounds = 0
        if n < self.exact_below or 4 * k > n:
            return topk_indices(flat, k)
        s = min(n, max(self.min_sample, math.ceil(self.sample_ratio * n)))
        pick = torch.randint(0, n, (s,), generator=device_generator(rng, flat.device),
                             device=flat.device)
        sample_abs = flat[pick].abs()
        lo, hi = math.ceil(LOW_FACTOR * k), math.floor(HIGH_FACTOR * k)
        rank = max(1, round(s * k / n))  # 1-based rank in the sample that maps to k
        for _ in range(self.max_rounds):
            self.last_rounds += 1
            thr = float(torch.topk(sample_abs, min(rank, s), sorted=False).values.min())
            cand = indices_above(flat, thr)
            c = cand.numel()
            if c > hi:
                return largest_of(flat, cand, k)
            if c >= lo:
                return cand
            if rank >= s:
                break  # the threshold is already the sample's minimum
            rank = min(s, max(rank + 1, math.ceil(rank * 1.1 * k / max(c, 1))))
        return topk_indices(flat, k)
