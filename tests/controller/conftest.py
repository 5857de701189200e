"""Fixtures the controller's test files share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for an in-process reference run of a small MLP: two threads
    only fight over a shared machine (10x slower under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
