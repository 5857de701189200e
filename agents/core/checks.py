"""The one config error and the one check every config section uses.

Its own module so that a section kept in a file of its own (agents/core/*_config.py) and
``agents.core.config``, which gathers the sections, can both use it without an import cycle.
"""

from __future__ import annotations

import contextvars
import math
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


# -- bounds every input is held to ------------------------------------------------------------
# A value past these is a mistake or an attack, never an experiment: a run, a trace or a
# timeout longer than a week; a count past what an int64 column holds; a table nested
# deeper than any config needs (Python's parsers recurse, and a deep one is a traceback).

#: The longest duration any time field may hold (``run.timeout_s``, a trace's span).
MAX_DURATION_S = 7 * 24 * 3600.0
#: The largest value any integer field may hold: what an int64 event column keeps.
MAX_COUNT = 2**63 - 1
#: The deepest nesting of tables and arrays a config may have, in a file or in ``--set``.
MAX_NESTING = 32
#: The longest config file read (bytes): a config is a page, not a data set.
MAX_CONFIG_BYTES = 1 << 20
# A field's unit, from its name's suffix (units live in names), in seconds.
_TIME_UNITS_S = {"_s": 1.0, "_ms": 1e-3, "_us": 1e-6, "_ns": 1e-9}


def check_number(path: str, value: float) -> None:
    """Every number in a config is finite; an integer is at most :data:`MAX_COUNT` in size
    (a float may be larger: ``guard.max_abs_grad = 1e30`` is a bound, not a count); a time
    field (``*_s``, ``*_ms``, ``*_us``, ``*_ns``) spans at most a week."""
    if not math.isfinite(value):
        fail(f"{path} = {value!r}: must be a finite number")
        return
    if isinstance(value, int) and abs(value) > MAX_COUNT:
        fail(f"{path} = {value!r}: must be at most {MAX_COUNT} in size")
        return
    name = path.rsplit(".", 1)[-1].split("[", 1)[0]
    for suffix, unit_s in _TIME_UNITS_S.items():
        if name.endswith(suffix):
            limit = MAX_DURATION_S / unit_s
            check(abs(value) <= limit, path, value, f"must be at most {limit:g} (a week)")
            return


def nesting_depth(value: object) -> int:
    """How deep tables and arrays nest in ``value`` (a scalar: 0), without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        v, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth > MAX_NESTING:
            break  # deep enough to refuse; walking on would only cost time
        if isinstance(v, dict):
            todo.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list | tuple):
            todo.extend((x, depth + 1) for x in v)
    return deepest
