"""Shared fixtures: skip real-Mininet tests with a clear reason when they cannot run."""

from __future__ import annotations

import os

import pytest

# Every event a test makes (here, and in the agents and controllers the tests start, which
# inherit the environment) must be declared in agents/core/events.py.
os.environ["GRADBED_STRICT_EVENTS"] = "1"


def mininet_unavailable_reason() -> str | None:
    """Why tests marked ``mininet`` cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root: Mininet creates namespaces, veths and qdiscs"
    try:
        import mininet.net  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable"
        return f"mininet is not importable ({exc}); install the Debian package 'mininet'"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = mininet_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "mininet" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def root_mininet() -> None:
    """Request this fixture (or mark the test ``mininet``) to skip without root/Mininet."""
    reason = mininet_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
