"""Fixed-threshold sparsification: send every element with ``|g| > T1``.

The threshold variant of DESIGN 1.2 / seeds/000 ("select by |G| > T1"), as in Strom,
"Scalable Distributed DNN Training Using Commodity GPU Cloud Computing", Interspeech 2015.
``T1`` is the constructor's ``threshold``. The ``ratio`` is a cap, so wire bytes never grow
as the ratio falls: at most ``k_for(numel, ratio)`` elements are sent, and when more exceed
T1 the largest of them are kept. ``ratio = 1.0`` is the pure threshold rule. The count may
be zero (nothing above T1): the payload is then two empty parts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agents.compress.base import k_for, register
from agents.compress.sparse import SparseCompressor, indices_above, largest_of


@register
class ThresholdCompressor(SparseCompressor):
    sends_k = False  # the count follows T1; the ratio only caps it
    name = "threshold"

    def __init__(self, threshold: float = 1e-3, index_encoding: str = "int32") -> None:
        super().__init__(index_encoding)
        # Higher threshold: fewer elements sent, more left in the residual.
        if not threshold >= 0.0:
            raise ValueError(f"threshold.threshold must be >= 0, got {threshold}")
        self.threshold = float(threshold)

    def select(self, flat: Tensor, ratio: float, rng: torch.Generator) -> Tensor:
        cand = indices_above(flat, self.threshold, strict=True)
        return largest_of(flat, cand, k_for(flat.numel(), ratio))
