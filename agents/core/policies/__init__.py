"""Rate and ratio policies (DESIGN.md section 1.1): pure functions of reports, built by name.

Ratio policies (``make_ratio_policy``): ``fixed``, ``adaptive``, ``oracle``.
Rate (cap) policies (``make_rate_policy``): ``linkn``, ``none``.
Adding one is a new file with a ``register_*_policy`` decorator, imported below.
"""

from __future__ import annotations

from typing import Any

from agents.core.policies import adaptive, fixed, linkn, oracle  # noqa: F401  (registration)
from agents.core.policies.adaptive import (
    AdaptiveConfig,
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
    RatioPolicy,
    build,
)
from agents.core.policies.fixed import FixedRatio
from agents.core.policies.linkn import LinkNShaper, NoShaper, linkn_caps, membership_at
from agents.core.policies.oracle import OracleRatio, oracle_keep


def make_ratio_policy(name: str, **params: Any) -> RatioPolicy:
    """Build a ratio policy by its config name with its parameters."""
    policy: RatioPolicy = build(RATIO_POLICIES, "ratio policy", name, **params)
    return policy


def make_rate_policy(name: str, **params: Any) -> RatePolicy:
    """Build a rate (cap) policy by its config name with its parameters."""
    policy: RatePolicy = build(RATE_POLICIES, "rate policy", name, **params)
    return policy


__all__ = [
    "AdaptiveConfig", "AdaptiveRatio", "CapChange", "Decision", "FixedRatio", "LinkNShaper",
    "NoShaper", "OracleRatio", "RatePolicy", "RateReport", "RatioPolicy", "chunk_keep",
    "keep_ratio", "linkn_caps", "make_rate_policy", "make_ratio_policy", "membership_at",
    "oracle_keep", "overall_keep",
]
