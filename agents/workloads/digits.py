"""The digits data shared by the digits workloads (``digits_mlp.py``, ``digits_cnn.py``).

Dataset: scikit-learn's bundled ``load_digits`` (1,797 8x8 grey-scale images of the
digits 0-9, from the UCI ML hand-written digits data set; it ships inside the
scikit-learn wheel, so nothing is downloaded at run time). A fixed, seeded split
keeps 1,437 images for training and 360 held out for the PS's accuracy checks.

The data is read from the wheel's file (``sklearn/datasets/data/digits.csv.gz``) the way
``load_digits`` reads it, without importing scikit-learn: its import (scipy, pandas) cost
1-2 s of CPU in the warm process of every run, more than torch's, on the critical path
of a run whose network is up before the warm process is ready.

Models (one file each):
- ``digits_mlp``: an MLP 64 -> hidden -> hidden -> 10 with ReLU. At ``hidden=512`` it has
  300,042 parameters (1.2 MB of float32 gradient per worker per iteration), which is
  large enough that a 10-100 Mbit/s bottleneck, not the CPU, sets the pace.
- ``digits_cnn``: two 3x3 convolutions (``channels`` and ``2 x channels``, ReLU), a 2x2
  max-pool and a linear layer to the 10 classes, the small LeNet-style net convolutions
  bring to this data: its gradient is mostly the second convolution's weights, shared
  across every position of the image, where the MLP's is mostly one dense matrix. At
  ``channels=16`` it has 9,930 parameters (40 KB of gradient), at 64 it has 94,986.
"""

from __future__ import annotations

import gzip
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents.workloads.base import Batch, Workload

TRAIN_SIZE = 1437
# Where scikit-learn's wheel keeps the digits, relative to its package folder.
DIGITS_FILE = Path("datasets", "data", "digits.csv.gz")


def digits_path() -> Path:
    """scikit-learn's ``digits.csv.gz``, found without importing scikit-learn (a
    ``find_spec`` of a top-level package runs none of its code)."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        if (path := Path(folder) / DIGITS_FILE).is_file():
            return path
    raise FileNotFoundError(f"the digits data set {DIGITS_FILE} is not in scikit-learn's "
                            f"package (looked in {folders or 'no sklearn package found'}); "
                            f"install scikit-learn (pyproject.toml)")


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images as 1797 x 64 float64 pixels 0-16, labels as int), what
    ``sklearn.datasets.load_digits()`` returns as ``data`` and ``target``: the same file,
    parsed the same way (one row per image, its label last)."""
    with gzip.open(digits_path(), mode="rt", encoding="utf-8") as f:
        table = np.loadtxt(f, delimiter=",")
    return table[:, :-1], table[:, -1].astype(int, copy=False)


@lru_cache(maxsize=1)
def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pixels, labels = read_digits()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    perm = torch.tensor(np.random.default_rng(1234).permutation(len(y)))
    x, y = x[perm], y[perm]
    return x[:TRAIN_SIZE], y[:TRAIN_SIZE], x[TRAIN_SIZE:], y[TRAIN_SIZE:]


class Digits(Workload):
    """The digits data, batches and evaluation; subclasses give the model."""

    def prepare(self, model: nn.Module, worker: int, seed: int) -> None:
        """Load the data now, not inside iteration 0 on the workers and the PS's first
        evaluation."""
        _data()

    def batch(self, iteration: int, worker: int, n_workers: int, batch_size: int) -> Batch:
        xtr, ytr, _, _ = _data()
        g = torch.Generator().manual_seed(10_007 * iteration + 17)
        global_size = n_workers * batch_size
        # Sample the global batch without replacement where it fits in an epoch.
        idx = torch.randperm(len(ytr), generator=g)
        if global_size > len(ytr):
            idx = torch.randint(0, len(ytr), (global_size,), generator=g)
        mine = idx[worker * batch_size:(worker + 1) * batch_size]
        return Batch(xtr[mine], ytr[mine])

    def global_batch(self, iteration: int, n_workers: int, batch_size: int) -> Batch:
        """The concatenation of every worker's batch (for the transparency check)."""
        parts = [self.batch(iteration, k, n_workers, batch_size) for k in range(n_workers)]
        return Batch(torch.cat([p.x for p in parts]), torch.cat([p.y for p in parts]))

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch.x), batch.y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        _, _, xte, yte = _data()
        logits = model(xte)
        return {"loss": float(F.cross_entropy(logits, yte)),
                "accuracy": float((logits.argmax(1) == yte).float().mean())}

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "dataset": "sklearn load_digits (UCI handwritten digits)",
                "train": TRAIN_SIZE, "test": 1797 - TRAIN_SIZE}
