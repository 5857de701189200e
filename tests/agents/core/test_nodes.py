"""Worker node names are defined once (agents/core/nodes.py) and every reader agrees."""

from __future__ import annotations

import pytest

from agents.core.nodes import is_worker_node, worker_index, worker_node


@pytest.mark.parametrize("k", [0, 1, 9, 10, 63])
def test_a_worker_name_round_trips(k: int) -> None:
    assert worker_index(worker_node(k)) == k
    assert is_worker_node(worker_node(k))


@pytest.mark.parametrize("node", ["ps", "controller", "w", "wx", "w01", "w-1", "bg0", "w1 ",
                                  "sw1", "W1"])
def test_other_names_are_not_workers(node: str) -> None:
    assert not is_worker_node(node)
    assert worker_index(node) is None


def test_the_topology_and_the_loader_use_the_same_names() -> None:
    from topo.shapes.star import StarSpec
    from topo.spec import LinkSpec

    spec = StarSpec(workers=3, worker_link=LinkSpec(rate_mbps=100.0),
                    bottleneck_up=LinkSpec(rate_mbps=10.0),
                    bottleneck_down=LinkSpec(rate_mbps=10.0))
    assert spec.worker_names() == ["w0", "w1", "w2"]
    assert all(is_worker_node(n) for n in spec.worker_names())
    built = spec.net_spec()
    assert [h.name for h in built.hosts if h.role == "worker"] == ["w0", "w1", "w2"]
    with pytest.raises(ValueError):
        worker_node(-1)
