"""The MoE classifier the expert hosts train, and its data (real images, as tokens).

An image is a sequence of tokens, one per pixel row (the digits: 8 tokens of 8 pixels;
Fashion-MNIST: 28 tokens of 28 pixels). The model embeds each token, adds a learned
position embedding, runs ``layers`` pre-norm MoE blocks ``h = h + MoE(LayerNorm(h))``,
mean-pools the tokens and classifies: a token-wise MLP with MoE layers in the style of
Switch Transformer's FFN replacement (arXiv:2101.03961) without attention, so that all
the traffic between hosts is the MoE all-to-alls and the shared parameters' ZeRO
collectives.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from agents.moe.layer import MoELayer

N_CLASSES = 10
_BUILD_LOCK = threading.Lock()


@dataclass(frozen=True)
class TokenData:
    """Images as tokens: ``x`` [N, tokens, width] (float in [0, 1], or uint8 pixels that
    :meth:`floats` scales per batch, so 60,000 images cost 47 MB, not 188), ``y`` [N]."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @staticmethod
    def floats(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32) / 255.0 if x.dtype == torch.uint8 else x

    @property
    def tokens(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def width(self) -> int:
        return int(self.x_train.shape[2])


@lru_cache(maxsize=2)
def load_data(name: str) -> TokenData:
    """``digits`` (scikit-learn's bundled UCI digits) or ``fashion_mnist`` (Debian's
    dataset-fashion-mnist IDX files, read by agents.workloads.fashion_mnist)."""
    if name == "digits":
        from agents.workloads.digits import _data

        xtr, ytr, xte, yte = _data()
        return TokenData(name, xtr.reshape(-1, 8, 8), ytr, xte.reshape(-1, 8, 8), yte)
    if name == "fashion_mnist":
        from agents.workloads.fashion_mnist import load

        train, test = load()
        return TokenData(name, train.images, train.labels, test.images, test.labels)
    raise ValueError(f"moe.dataset: {name!r} must be digits or fashion_mnist")


def global_batch(data: TokenData, step: int, hosts: int, batch_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, ``hosts x batch_size`` images; host h takes slice h."""
    g = torch.Generator().manual_seed(10_007 * step + 29)
    idx = torch.randint(0, len(data.y_train), (hosts * batch_size,), generator=g)
    return data.floats(data.x_train[idx]), data.y_train[idx]


def host_batch(data: TokenData, step: int, hosts: int, batch_size: int, h: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(data, step, hosts, batch_size)
    sl = slice(h * batch_size, (h + 1) * batch_size)
    return x[sl], y[sl]


class MoEClassifier(nn.Module):
    """tokens [B, S, w] -> logits [B, 10]; ``aux_loss`` sums the layers' after a forward."""

    def __init__(self, *, tokens: int, width: int, d_model: int, d_hidden: int,
                 experts: int, layers: int, k: int, capacity_factor: float,
                 min_capacity: int, drop_policy: str, normalize: bool, residual: bool,
                 groups: int) -> None:
        super().__init__()
        self.embed = nn.Linear(width, d_model)
        self.pos = nn.Parameter(torch.zeros(tokens, d_model))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.moe = nn.ModuleList(
            MoELayer(d_model, d_hidden, experts, k=k, capacity_factor=capacity_factor,
                     min_capacity=min_capacity, drop_policy=drop_policy,
                     normalize=normalize, residual=residual, groups=groups)
            for _ in range(layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, N_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.embed(x) + self.pos
        for norm, moe in zip(self.norms, self.moe, strict=True):
            h = h + moe(norm(h).reshape(b * s, -1)).reshape(b, s, -1)
        return self.head(self.final_norm(h).mean(dim=1))

    @property
    def aux_loss(self) -> torch.Tensor:
        return torch.stack([cast(MoELayer, m).aux_loss for m in self.moe]).sum()


def build_model(cfg: object, data: TokenData, *, groups: int, seed: int) -> MoEClassifier:
    """The same initial weights on every host and in the one-process reference."""
    from agents.core.moe_config import MoEConfig

    assert isinstance(cfg, MoEConfig)
    # The global generator is process-wide: hosts run as threads (tests) must not
    # interleave their draws.
    with _BUILD_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        return MoEClassifier(tokens=data.tokens, width=data.width, d_model=cfg.d_model,
                             d_hidden=cfg.d_hidden, experts=cfg.experts,
                             layers=cfg.layers, k=cfg.top_k,
                             capacity_factor=cfg.capacity_factor,
                             min_capacity=cfg.min_capacity, drop_policy=cfg.drop_policy,
                             normalize=cfg.normalize_gates, residual=cfg.residual,
                             groups=groups)


def loss_fn(model: MoEClassifier, logits: torch.Tensor, y: torch.Tensor, aux_coef: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(training loss = cross entropy + aux_coef x the layers' aux loss, the cross
    entropy alone), for the logits of the forward that just ran."""
    ce = F.cross_entropy(logits, y)
    return ce + aux_coef * model.aux_loss, ce
