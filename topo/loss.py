"""Seeded random loss: which packets of a link are dropped, as a pure function of the seed.

Why a seeded loss: the kernel's ``statistic --mode random`` match draws from
``get_random_u32()``, which cannot be seeded: two runs with the same config lose different
packets. Here the decision is a counter-based PRNG (as in Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011, with BLAKE2b as the keyed function): the n-th packet
of a link is dropped when

    u(seed, link, n) = BLAKE2b-64(n as 8 little-endian bytes, key = BLAKE2b-256(seed, link))
    drop  <=>  u < round(loss_pct / 100 x 2^64)

so each decision is independent of every other (Bernoulli with probability loss_pct / 100),
the same ``(seed, link, n)`` always gives the same answer, and a different seed or a
different link gives an unrelated sequence. ``n`` is the kernel's NFQUEUE packet id, which
counts from 1 in every newly bound queue, one per packet the rule hands to it (not the
order the notices are read in: a notice lost to a full socket buffer does not shift the
sequence). The delay line (``topo.delayline``) asks ``LossDraw.drops`` for every notice
and gives a dropped packet an ``NF_DROP`` verdict on the receiving host, so the sender sees
it lost on the wire.

The link name is ``Impairment.loss_key``: the receiving host's interface and the sources
its rule matches; ``run.seed`` is the seed (``net.loss_model = "seeded"``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

SCALE = 1 << 64
SEED_MIN, SEED_MAX = 0, (1 << 63) - 1


class LossError(ValueError):
    """A bad seed, link name or loss percentage; the message names which."""


def link_key(seed: int, link: str) -> bytes:
    """The 32-byte BLAKE2b key of one link's sequence: a hash of the seed and the name."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
        raise LossError(f"loss seed={seed!r}; allowed an integer {SEED_MIN}..{SEED_MAX}")
    if not isinstance(link, str) or not link:
        raise LossError(f"loss link name={link!r}; must be a non-empty string")
    return hashlib.blake2b(seed.to_bytes(8, "little") + link.encode(), digest_size=32,
                           person=b"gradbed-loss").digest()


def threshold(loss_pct: float) -> int:
    """``round(loss_pct / 100 x 2^64)``: a draw below it is a drop."""
    if not 0.0 <= loss_pct <= 100.0:
        raise LossError(f"loss_pct={loss_pct!r}; allowed 0..100 %")
    return round(loss_pct / 100 * SCALE)


def uniform_u64(key: bytes, index: int) -> int:
    """The ``index``-th 64-bit draw of the sequence ``key`` names."""
    return int.from_bytes(hashlib.blake2b(index.to_bytes(8, "little"), key=key,
                                          digest_size=8).digest(), "little")


def drops(seed: int, link: str, index: int, loss_pct: float) -> bool:
    """Whether the ``index``-th packet of ``link`` is lost at ``loss_pct`` under ``seed``
    (the module docstring's formula). Pure: the same arguments, the same answer."""
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < SCALE:
        raise LossError(f"packet index={index!r}; allowed 0..2^64-1")
    return uniform_u64(link_key(seed, link), index) < threshold(loss_pct)


@dataclass(frozen=True)
class LossDraw:
    """``drops`` with the key and threshold computed once, for the per-packet path."""

    seed: int
    link: str
    loss_pct: float
    _key: bytes = field(init=False, repr=False)
    _threshold: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", link_key(self.seed, self.link))
        object.__setattr__(self, "_threshold", threshold(self.loss_pct))

    def drops(self, index: int) -> bool:
        return uniform_u64(self._key, index) < self._threshold
