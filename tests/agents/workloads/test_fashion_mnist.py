"""The Fashion-MNIST IDX reader: the real Debian files (skipped when the package is absent),
and small IDX files written here, plain and gzipped, well-formed and corrupt."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from agents.workloads import fashion_mnist as fm

REAL = fm.DEFAULT_DIR
HAVE_REAL = all((REAL / (stem + ".gz")).exists() or (REAL / stem).exists()
                for stem in fm.FILES.values())


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    a = np.ascontiguousarray(array, dtype=np.uint8)
    m = magic if magic is not None else 0x0800 | a.ndim
    return struct.pack(">I", m) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def write_set(d: Path, n_train: int = 6, n_test: int = 4, *, gz: bool = True) -> None:
    rng = np.random.default_rng(0)
    arrays = {"train_images": rng.integers(0, 256, (n_train, 28, 28)),
              "train_labels": rng.integers(0, 10, n_train),
              "test_images": rng.integers(0, 256, (n_test, 28, 28)),
              "test_labels": rng.integers(0, 10, n_test)}
    for key, stem in fm.FILES.items():
        data = idx_bytes(arrays[key])
        if gz:
            (d / (stem + ".gz")).write_bytes(gzip.compress(data))
        else:
            (d / stem).write_bytes(data)


@pytest.mark.skipif(not HAVE_REAL, reason=f"{REAL} absent: the Debian package "
                    f"{fm.DEBIAN_PACKAGE} is not installed")
def test_real_files() -> None:
    train, test = fm.load(str(REAL))
    assert train.images.shape == (60_000, 28, 28) and train.images.dtype == torch.uint8
    assert test.images.shape == (10_000, 28, 28)
    # Every class appears exactly 6,000 / 1,000 times (the published balance).
    assert torch.bincount(train.labels).tolist() == [6000] * 10
    assert torch.bincount(test.labels).tolist() == [1000] * 10
    x = fm.normalise(train.images[:10_000])
    assert abs(float(x.mean())) < 0.02 and abs(float(x.std()) - 1.0) < 0.02


@pytest.mark.parametrize("gz", [True, False])
def test_small_set_round_trips(tmp_path: Path, gz: bool) -> None:
    write_set(tmp_path, gz=gz)
    train, test = fm.load(str(tmp_path), strict_sizes=False)
    assert train.images.shape == (6, 28, 28) and test.labels.shape == (4,)
    raw = fm.read_idx(tmp_path / (fm.FILES["test_labels"] + (".gz" if gz else "")),
                      magic=fm.LABEL_MAGIC, dims=(None,))
    assert raw.tolist() == test.labels.tolist()


def test_missing_files_name_the_package(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=fm.DEBIAN_PACKAGE):
        fm.load(str(tmp_path), strict_sizes=False)


def test_strict_sizes_reject_a_small_set(tmp_path: Path) -> None:
    write_set(tmp_path)
    with pytest.raises(fm.IdxError, match="train-images-idx3-ubyte.gz: dimension 0 is 6, "
                                          "expected 60000"):
        fm.load(str(tmp_path))


@pytest.mark.parametrize("data,match", [
    (idx_bytes(np.zeros((2, 28, 28)), magic=0x0801), "magic number 0x00000801, expected "
                                                      "0x00000803"),
    (idx_bytes(np.zeros((2, 28, 28)))[:-1], "28 = 1568 bytes of data, file has 1567"),
    (idx_bytes(np.zeros((2, 28, 28))) + b"\0", "file has 1569"),
    (idx_bytes(np.zeros((2, 28, 27))), "dimension 2 is 27, expected 28"),
    (b"\0\0\x08", "too short for an IDX header"),
    (struct.pack(">I", 0x0803) + b"\0\0\0\2", "too short for a 3-dimension header"),
    (b"\x1f\x8b" + b"garbage", "not a valid gzip file"),
])
def test_corrupt_image_files(tmp_path: Path, data: bytes, match: str) -> None:
    p = tmp_path / "imgs"
    p.write_bytes(data)
    with pytest.raises(fm.IdxError, match=match) as err:
        fm.read_idx(p, magic=fm.IMAGE_MAGIC, dims=(None, 28, 28))
    assert str(p) in str(err.value)


def test_labels_out_of_range_and_count_mismatch(tmp_path: Path) -> None:
    write_set(tmp_path)
    stem = fm.FILES["train_labels"] + ".gz"
    (tmp_path / stem).write_bytes(gzip.compress(idx_bytes(np.array([1, 2, 3, 4, 5, 10]))))
    with pytest.raises(fm.IdxError, match=f"{stem}: label 10 is not a class 0..9"):
        fm.load_split(tmp_path, fm.FILES["train_images"], fm.FILES["train_labels"], None)
    (tmp_path / stem).write_bytes(gzip.compress(idx_bytes(np.array([1, 2]))))
    with pytest.raises(fm.IdxError, match="has 6 images but .* has 2 labels"):
        fm.load_split(tmp_path, fm.FILES["train_images"], fm.FILES["train_labels"], None)


def test_batches_cover_an_epoch_without_repeats(tmp_path: Path) -> None:
    write_set(tmp_path, n_train=12)
    class Linear(fm.FashionMNIST):
        def build_model(self, seed: int) -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))

    wl = Linear(eval_samples=4, directory=str(tmp_path), strict_sizes=False)
    # 2 workers x 3 = 6 per iteration: iterations 0 and 1 are one epoch of 12 images.
    b = wl.batch(0, 1, 2, 3)
    assert b.x.shape == (3, 1, 28, 28) and b.x.dtype == torch.float32
    train, _ = wl.data()
    # The same images, in some order: compare the multisets of pixel sums.
    imgs = torch.cat([wl.batch(it, w, 2, 3).x for it in range(2) for w in range(2)])
    want = fm.normalise(train.images)
    assert sorted(imgs.sum((1, 2, 3)).tolist()) == pytest.approx(
        sorted(want.sum((1, 2, 3)).tolist()), rel=1e-5)
    # Iteration 2 starts the next epoch, in another order.
    assert not torch.equal(wl.batch(2, 0, 2, 3).x, wl.batch(0, 0, 2, 3).x)
    m = wl.evaluate(wl.build_model(0))
    assert 0.0 <= m["accuracy"] <= 1.0 and m["loss"] > 0
