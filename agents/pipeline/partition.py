"""Cut an ``nn.Sequential`` into pipeline pieces (torchgpipe's ``balance`` convention).

``balance[i]`` is the number of consecutive layers (top-level children) in piece ``i``
(Kim et al., "torchgpipe: On-the-fly Pipeline Parallelism for Training Giant Models",
2020). Without a balance, :func:`balance_by_params` cuts the layers into pieces of about
equal parameter count (the prefix-sum split torchgpipe's ``balance_by_size`` approximates),
each piece at least one layer.
"""

from __future__ import annotations

import torch
from torch import nn


def _layers(model: nn.Module) -> list[nn.Module]:
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"pipeline: the workload's model is a {type(model).__name__}; a "
                         "pipeline needs an nn.Sequential to cut into pieces")
    return list(model.children())


def balance_by_params(model: nn.Module, pieces: int) -> list[int]:
    """Layers per piece so each piece's parameter count is close to ``total / pieces``:
    piece ``i`` ends at the first layer where the running count reaches
    ``(i + 1) * total / pieces``, keeping at least one layer for every later piece."""
    layers = _layers(model)
    n = len(layers)
    if pieces > n:
        raise ValueError(f"pipeline: {pieces} pieces but the model has only {n} layers")
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = sum(sizes) or 1
    cuts: list[int] = []
    run = 0
    start = 0
    for i, size in enumerate(sizes):
        run += size
        pieces_left = pieces - len(cuts) - 1
        if len(cuts) < pieces - 1 and (run >= (len(cuts) + 1) * total / pieces
                                       or n - (i + 1) == pieces_left):
            cuts.append(i + 1 - start)
            start = i + 1
    cuts.append(n - start)
    assert len(cuts) == pieces and all(c >= 1 for c in cuts), cuts
    return cuts


def split(model: nn.Module, balance: list[int] | tuple[int, ...]) -> list[nn.Sequential]:
    """The pieces, in order; they share the model's parameter tensors."""
    layers = _layers(model)
    if sum(balance) != len(layers) or any(b < 1 for b in balance):
        raise ValueError(f"pipeline.balance = {list(balance)}: must be positive layer counts "
                         f"summing to the model's {len(layers)} layers")
    out, i = [], 0
    for b in balance:
        out.append(nn.Sequential(*layers[i:i + b]))
        i += b
    return out


@torch.no_grad()
def boundary_shapes(pieces: list[nn.Sequential], sample: torch.Tensor) -> list[torch.Size]:
    """Output shape of each piece for an input like ``sample`` (a micro-batch): what the
    next piece must receive, and the shape of the gradient coming back."""
    shapes = []
    x = sample
    for piece in pieces:
        x = piece(x)
        shapes.append(x.shape)
    return shapes
