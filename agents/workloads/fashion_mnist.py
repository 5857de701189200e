"""Fashion-MNIST read straight from its IDX files, and the data side of its workloads.

Data set: Xiao, Rasul & Vollgraf, "Fashion-MNIST: a Novel Image Dataset for Benchmarking
Machine Learning Algorithms" (arXiv:1708.07747, 2017; MIT licence): 60,000 training and
10,000 test grey-scale images of 28x28 pixels in 10 classes of clothing. Debian ships it as
``dataset-fashion-mnist`` (files under ``/usr/share/datasets/fashion-mnist/``, gzipped), so
nothing is downloaded at run time. ``GRADBED_FASHION_MNIST_DIR`` points elsewhere.

IDX format (LeCun's MNIST page): a big-endian header, then the raw array.
- bytes 0-1 are zero; byte 2 is the element type (0x08 = unsigned byte, the only one these
  files use); byte 3 is the number of dimensions ``d``;
- then ``d`` big-endian uint32 sizes; then ``prod(sizes)`` elements, row-major.
So the images' magic number is 0x00000803 (2051: ubyte, 3 dimensions) and the labels'
0x00000801 (2049: ubyte, 1 dimension). :func:`read_idx` reads a file plain or gzipped (it
looks at the gzip magic, not the name), checks the magic, the sizes against the bytes
present, and names the file in every error.
"""

from __future__ import annotations

import gzip
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agents.workloads.base import Batch, Workload

DEBIAN_PACKAGE = "dataset-fashion-mnist"
DEFAULT_DIR = Path("/usr/share/datasets/fashion-mnist")
ENV_DIR = "GRADBED_FASHION_MNIST_DIR"
IMAGE_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (count, rows, cols)
LABEL_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (count)
ROWS = COLS = 28
CLASSES = 10
TRAIN_SIZE = 60_000
TEST_SIZE = 10_000
FILES = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
         "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
# The training set's pixel mean and standard deviation (of x / 255), the usual normalisation.
PIXEL_MEAN = 0.2860
PIXEL_STD = 0.3530


class IdxError(ValueError):
    """An IDX file is missing, truncated, or not the array it should be; names the file."""


def _open_bytes(path: Path) -> bytes:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":  # gzip magic: Debian ships the files compressed
        try:
            return gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise IdxError(f"{path}: not a valid gzip file: {e}") from e
    return raw


def read_idx(path: str | Path, *, magic: int, dims: tuple[int | None, ...]) -> np.ndarray:
    """The array in IDX file ``path`` (plain or gzipped), as uint8.

    ``magic`` is the expected first four bytes as a big-endian integer; ``dims`` the expected
    sizes (None: any). Raises :class:`IdxError` naming the file when the magic, the number of
    dimensions, a size, or the number of bytes present disagree."""
    path = Path(path)
    data = _open_bytes(path)
    if len(data) < 4:
        raise IdxError(f"{path}: {len(data)} bytes, too short for an IDX header")
    (got,) = struct.unpack(">I", data[:4])
    if got != magic:
        raise IdxError(f"{path}: magic number 0x{got:08x}, expected 0x{magic:08x} "
                       f"(unsigned bytes, {magic & 0xFF} dimensions)")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(data) < header:
        raise IdxError(f"{path}: {len(data)} bytes, too short for a {ndim}-dimension header")
    sizes = struct.unpack(f">{ndim}I", data[4:header])
    for i, (size, want) in enumerate(zip(sizes, dims, strict=True)):
        if want is not None and size != want:
            raise IdxError(f"{path}: dimension {i} is {size}, expected {want}")
    count = int(np.prod(sizes, dtype=np.int64))
    if len(data) - header != count:
        raise IdxError(f"{path}: header says {' x '.join(map(str, sizes))} = {count} bytes of "
                       f"data, file has {len(data) - header}")
    return np.frombuffer(data, dtype=np.uint8, count=count, offset=header).reshape(sizes)


def data_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or DEFAULT_DIR)


def find_file(directory: Path, stem: str) -> Path:
    """``stem`` or ``stem.gz`` in ``directory``; a clear error naming the package if neither."""
    for name in (stem + ".gz", stem):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(
        f"Fashion-MNIST file {directory / stem}[.gz] not found: install the Debian package "
        f"{DEBIAN_PACKAGE} (apt-get install {DEBIAN_PACKAGE}; scripts/setup.sh does) or set "
        f"{ENV_DIR} to a directory holding the four IDX files")


@dataclass(frozen=True)
class Split:
    images: torch.Tensor  # uint8, (n, 28, 28)
    labels: torch.Tensor  # int64, (n,)


def load_split(directory: Path, images_stem: str, labels_stem: str,
               size: int | None) -> Split:
    ipath, lpath = find_file(directory, images_stem), find_file(directory, labels_stem)
    images = read_idx(ipath, magic=IMAGE_MAGIC, dims=(size, ROWS, COLS))
    labels = read_idx(lpath, magic=LABEL_MAGIC, dims=(size,))
    if len(images) != len(labels):
        raise IdxError(f"{ipath} has {len(images)} images but {lpath} has {len(labels)} labels")
    if len(labels) and int(labels.max()) >= CLASSES:
        raise IdxError(f"{lpath}: label {int(labels.max())} is not a class 0..{CLASSES - 1}")
    return Split(torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64)))


@lru_cache(maxsize=4)
def load(directory: str | None = None, *, strict_sizes: bool = True) -> tuple[Split, Split]:
    """(train, test) from ``directory`` (default: :func:`data_dir`). ``strict_sizes`` checks
    the published 60,000 / 10,000 counts; tests turn it off for their small files."""
    d = Path(directory) if directory else data_dir()
    train = load_split(d, FILES["train_images"], FILES["train_labels"],
                       TRAIN_SIZE if strict_sizes else None)
    test = load_split(d, FILES["test_images"], FILES["test_labels"],
                      TEST_SIZE if strict_sizes else None)
    return train, test


def normalise(images: torch.Tensor) -> torch.Tensor:
    """uint8 (n, 28, 28) -> float32 (n, 1, 28, 28), zero mean and unit variance over the
    training set. Done per batch: keeping the set as uint8 costs 47 MB per process, as
    float32 188 MB, and every worker and the PS hold it."""
    return ((images.to(torch.float32) / 255.0 - PIXEL_MEAN) / PIXEL_STD).unsqueeze(1)


class FashionMNIST(Workload):
    """Fashion-MNIST batches and held-out evaluation; subclasses give the model.

    Sampling: the global batch of iteration i is positions ``[i G, (i + 1) G)`` of an endless
    stream of epochs, each a seeded permutation of the 60,000 training images (``G`` = workers
    x batch size), so every image is seen once per epoch. Worker k takes slice k of it, so the
    mean of the workers' mean gradients is the global batch's mean gradient."""

    def __init__(self, eval_samples: int = TEST_SIZE, directory: str | None = None,
                 strict_sizes: bool = True) -> None:
        self.eval_samples = eval_samples  # the first n test images; fewer = faster, noisier
        self.directory = directory
        self.strict_sizes = strict_sizes  # the published counts (tests use small files)
        self._perm: dict[int, torch.Tensor] = {}
        # True: evaluate in training mode (BatchNorm normalises each evaluation batch by its
        # own statistics; see fashion_resnet.py).
        self.eval_batch_statistics = False

    def data(self) -> tuple[Split, Split]:
        return load(self.directory, strict_sizes=self.strict_sizes)

    def prepare(self, model: nn.Module, worker: int, seed: int) -> None:
        """Read and decompress the files now (about 1 s), not inside iteration 0."""
        self.data()

    def _epoch_perm(self, epoch: int, n: int) -> torch.Tensor:
        if epoch not in self._perm:
            self._perm = {epoch: torch.randperm(
                n, generator=torch.Generator().manual_seed(10_007 * epoch + 29))}
        return self._perm[epoch]

    def batch(self, iteration: int, worker: int, n_workers: int, batch_size: int) -> Batch:
        train, _ = self.data()
        n = len(train.labels)
        start = (iteration * n_workers + worker) * batch_size
        pos = torch.arange(start, start + batch_size)
        idx = torch.empty(batch_size, dtype=torch.int64)
        for epoch in torch.unique(pos // n).tolist():
            sel = (pos // n) == epoch
            idx[sel] = self._epoch_perm(int(epoch), n)[pos[sel] % n]
        return Batch(normalise(train.images[idx]), train.labels[idx])

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        return F.cross_entropy(model(batch.x), batch.y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Loss and accuracy on the first ``eval_samples`` test images, in batches of 1,000
        (one pass over 10,000 would hold every activation at once)."""
        _, test = self.data()
        n = min(self.eval_samples, len(test.labels))
        was_training = model.training
        model.train(self.eval_batch_statistics)
        device = next(model.parameters()).device
        loss_sum, correct = 0.0, 0
        try:
            for s in range(0, n, 1000):
                x = normalise(test.images[s:s + 1000][: n - s]).to(device)
                y = test.labels[s:s + 1000][: n - s].to(device)
                logits = model(x)
                loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
        finally:
            model.train(was_training)
        return {"loss": loss_sum / n, "accuracy": correct / n}

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "dataset": f"Fashion-MNIST (Debian {DEBIAN_PACKAGE})",
                "train": TRAIN_SIZE, "test": self.eval_samples}
