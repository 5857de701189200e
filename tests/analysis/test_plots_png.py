"""The report's PNGs (``analysis.plots.png_bytes``): the pixels ``savefig`` makes, drawn once
rather than twice (with a constrained layout, savefig first draws once only to lay out)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from matplotlib.image import imread

from analysis import plots


def _figure() -> Any:
    fig, axes = plots._figure(nrows=2)
    x = np.linspace(0.0, 10.0, 200)
    axes[0].plot(x, np.sin(x), label="sin")
    axes[0].set_ylabel("rate (Mbit/s)")
    axes[0].legend()
    axes[1].plot(x, np.cos(x))
    axes[1].set_xlabel("time since start (s)")
    return fig


def test_png_bytes_draws_once_the_pixels_savefig_draws():
    fig = _figure()
    draws: list[int] = []
    draw = fig.draw
    fig.draw = lambda renderer: (draws.append(1), draw(renderer))[1]  # type: ignore[method-assign]
    png = plots.png_bytes(fig)
    assert len(draws) == 1
    ref = io.BytesIO()
    _figure().savefig(ref, format="png")
    ours, theirs = imread(io.BytesIO(png)), imread(io.BytesIO(ref.getvalue()))
    assert ours.shape == theirs.shape and np.array_equal(ours, theirs)
