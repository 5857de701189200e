"""Random-k sparsification: send k elements chosen uniformly at random.

Follows Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (rand-k with
error feedback), as in GRACE's ``randomk``. Values are sent unscaled (no ``n/k`` factor):
with error feedback the unsent mass is carried in the residual instead. ``k`` comes from
:func:`agents.compress.base.k_for`; the k indices are distinct and drawn only from the
generator passed in, so a seeded generator reproduces the selection.

For speed on large tensors it draws ~1.25 k indices with replacement, removes duplicates and
keeps a uniformly random k of the distinct ones (redrawing in the rare case of too few).
Because the procedure is symmetric in the indices, every k-subset is equally likely, as
with a full permutation, at a fraction of ``randperm(n)``'s cost.
"""

from __future__ import annotations

import torch
from torch import Tensor

from agents.compress.base import k_for, register
from agents.compress.sparse import SparseCompressor


def random_subset(n: int, k: int, rng: torch.Generator) -> Tensor:
    """``k`` distinct indices in ``[0, n)``, uniformly random, int64 (CPU)."""
    if k >= n:
        return torch.arange(n)
    if 4 * k > n:
        return torch.randperm(n, generator=rng)[:k]
    draw = k + k // 4 + 16
    while True:
        uniq = torch.unique(torch.randint(0, n, (draw,), generator=rng))
        if uniq.numel() >= k:
            return uniq[torch.randperm(uniq.numel(), generator=rng)[:k]]
        draw *= 2


@register
class RandomKCompressor(SparseCompressor):
    name = "randomk"

    def select(self, flat: Tensor, ratio: float, rng: torch.Generator) -> Tensor:
        # Drawn on the host (a set of k indices, not the tensor), then moved to the device.
        return random_subset(flat.numel(), k_for(flat.numel(), ratio), rng).to(flat.device)
