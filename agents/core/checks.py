"""The one config error and the one check every config section uses.

Its own module so that a section kept in a file of its own (agents/core/*_config.py) and
``agents.core.config``, which gathers the sections, can both use it without an import cycle.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or out of range."""


def check(cond: bool, path: str, value: Any, allowed: str) -> None:
    """Raise ``ConfigError('path = value: allowed')`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(f"{path} = {value!r}: {allowed}")
