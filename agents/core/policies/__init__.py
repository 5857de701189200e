"""Rate and ratio policies (DESIGN.md section 1.1): pure functions of reports, built by name.

Ratio policies (``make_ratio_policy``, or ``ratio_policy_from_config`` in a worker):
``fixed``, ``adaptive``, ``oracle``. Rate (cap) policies (``make_rate_policy``): ``linkn``,
``none``. Adding one is a new file in this package with a ``register_ratio_policy`` or
``register_rate_policy`` decorator (``agents/core/registry.py``); nothing here lists them.
"""

from __future__ import annotations

from typing import Any

from agents.core.config import AdaptiveConfig, ExperimentConfig
from agents.core.policies.adaptive import (
    AdaptiveRatio,
    chunk_keep,
    keep_ratio,
    overall_keep,
)
from agents.core.policies.base import (
    RATE_POLICIES,
    RATIO_POLICIES,
    CapChange,
    Decision,
    RatePolicy,
    RateReport,
    RatioContext,
    RatioPolicy,
)
from agents.core.policies.fixed import FixedRatio
from agents.core.policies.linkn import LinkNShaper, NoShaper, linkn_caps, membership_at
from agents.core.policies.oracle import OracleRatio, oracle_keep


def make_ratio_policy(name: str, **params: Any) -> RatioPolicy:
    """Build a ratio policy by its config name with its parameters."""
    policy: RatioPolicy = RATIO_POLICIES.build(name, **params)
    return policy


def ratio_policy_class(name: str) -> Any:
    """The class registered as ratio policy ``name`` (its ``decides_in_flight`` and
    ``follows_bandwidth`` say how a worker must drive it)."""
    return RATIO_POLICIES.get(name, "adaptive.policy")


def ratio_policy_from_config(cfg: ExperimentConfig, ctx: RatioContext) -> RatioPolicy:
    """The ratio policy ``adaptive.policy`` names, built from the config and ``ctx``."""
    policy: RatioPolicy = ratio_policy_class(cfg.adaptive.policy).from_config(cfg, ctx)
    return policy


def make_rate_policy(name: str, **params: Any) -> RatePolicy:
    """Build a rate (cap) policy by its config name with its parameters."""
    policy: RatePolicy = RATE_POLICIES.build(name, **params)
    return policy


__all__ = [
    "AdaptiveConfig", "AdaptiveRatio", "CapChange", "Decision", "FixedRatio", "LinkNShaper",
    "NoShaper", "OracleRatio", "RatePolicy", "RateReport", "RatioContext", "RatioPolicy",
    "chunk_keep", "keep_ratio", "linkn_caps", "make_rate_policy", "make_ratio_policy",
    "membership_at", "oracle_keep", "overall_keep", "ratio_policy_class",
    "ratio_policy_from_config",
]
