"""The digits data set as the digits workloads read it (agents/workloads/digits.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agents.workloads import digits

REPO = Path(__file__).resolve().parents[3]


def test_the_digits_are_what_scikit_learns_load_digits_returns():
    from sklearn.datasets import load_digits

    pixels, labels = digits.read_digits()
    ref = load_digits()
    assert pixels.dtype == ref.data.dtype and labels.dtype == ref.target.dtype
    np.testing.assert_array_equal(pixels, ref.data)
    np.testing.assert_array_equal(labels, ref.target)


def test_reading_the_digits_does_not_import_scikit_learn():
    # scikit-learn's import (scipy, pandas) is what reading the file directly saves.
    code = ("import sys; from agents.workloads.digits import read_digits; read_digits(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_scikit_learn_without_the_digits_file_is_named(tmp_path, monkeypatch):
    fake = tmp_path / "sklearn"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sklearn", raising=False)
    with pytest.raises(FileNotFoundError, match=r"datasets/data/digits\.csv\.gz.*scikit-learn"):
        digits.digits_path()
