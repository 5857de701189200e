"""scikit-learn's digits for the example scripts: 1,797 8x8 grey-scale images of the digits
0-9 (the UCI hand-written digits), read from the file the scikit-learn wheel ships.

These are the arrays of ``sklearn.datasets.load_digits()``, without importing scikit-learn:
that import (with scipy) costs each rank about as much CPU as importing torch, far more than
a few steps of this MLP, and every rank of every host pays it at once. No gradbed import.
"""

import importlib.util
from pathlib import Path

import numpy as np
import torch


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The images as float32 in [0, 1] (1797 x 64) and their labels (int64)."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the digits come with scikit-learn: pip install scikit-learn")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    data = np.loadtxt(path, delimiter=",")  # 64 pixel columns (0-16), then the label
    return (torch.tensor(data[:, :-1], dtype=torch.float32) / 16.0,
            torch.tensor(data[:, -1], dtype=torch.long))
