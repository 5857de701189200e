"""The one config error and the one check every config section uses.

Its own module so that a section kept in a file of its own (agents/core/*_config.py) and
``agents.core.config``, which gathers the sections, can both use it without an import cycle.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agents.core.registry import RegistryKind


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or out of range. ``errors`` lists every
    error found (a config is checked whole, so its author fixes all of them in one go); the
    message is those errors, one per line."""

    def __init__(self, message: str | list[str]) -> None:
        self.errors = [message] if isinstance(message, str) else list(message)
        super().__init__("\n".join(self.errors))


# While a config is checked (agents.core.config.from_dict), every failed check lands in this
# list instead of raising, so one ConfigError reports them all; outside it, check raises.
_errors: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("config_errors",
                                                                          default=None)


def check(cond: bool, path: str, value: Any, allowed: str) -> None:
    """``ConfigError('path = value: allowed')`` unless ``cond`` holds: raised at once, or
    collected while :func:`collect` is active."""
    if not cond:
        fail(f"{path} = {value!r}: {allowed}")


def check_registered(kind: RegistryKind, path: str, value: str) -> None:
    """``value`` must be a name some module of ``kind``'s package registers (read from their
    source, agents/core/registry.py: nothing is imported and no list of names is kept)."""
    known = kind.declared()
    check(value in known, path, value, f"must be a registered {kind.label}: one of "
          f"{', '.join(known)}")


def fail(message: str) -> None:
    """Report one config error: raise it, or add it to the active collection."""
    errors = _errors.get()
    if errors is None:
        raise ConfigError(message)
    errors.append(message)


def collecting() -> list[str] | None:
    """The active collection of errors, or None when checks raise at once."""
    return _errors.get()


@contextmanager
def collect() -> Iterator[list[str]]:
    """Within this block, failed checks are collected into the list it yields."""
    errors: list[str] = []
    token = _errors.set(errors)
    try:
        yield errors
    finally:
        _errors.reset(token)
