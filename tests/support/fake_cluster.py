"""The tests' name for :mod:`topo.fake_cluster` (the fake servers live in product code so
that ``benchmarks/cluster_fidelity.py`` uses them too; a benchmark never imports a test
helper)."""

from topo.fake_cluster import (  # noqa: F401  (re-exported for the cluster tests)
    BRIDGE,
    LOCK_PATH,
    MONO_STEP_S,
    SUBNET,
    FakeCluster,
    fake_cluster,
    leftovers,
)
