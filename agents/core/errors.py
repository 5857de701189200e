"""The config error every section raises, in a module of its own so that the section
modules (``agents/core/*_config.py``) and ``agents.core.config`` can all import it without
importing each other (the acyclic contract in ``.importlinter``)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or out of range."""
