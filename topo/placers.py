"""Mininet Cluster Edition's placers (``mininet/examples/cluster.py``) as gradbed uses
them: with pins laid over its switch bins, and its random placement seeded
(``topo.placement.place`` runs them over a spec's names)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from mininet.examples.cluster import RandomPlacer, RoundRobinPlacer, SwitchBinPlacer

from topo.spec import SpecError

__all__ = ["PinnedSwitchBinPlacer", "RoundRobinPlacer", "SeededRandomPlacer"]


class PinnedSwitchBinPlacer(SwitchBinPlacer):  # type: ignore[misc]
    """Mininet's switch bins, then the pins: a pinned switch moves to its server and takes
    every unpinned host whose (last) switch it is along, as ``SwitchBinPlacer`` co-locates
    a host with its switch; a pinned host stays where it is pinned."""

    def __init__(self, *args: Any, pins: Mapping[str, str], **kwargs: Any) -> None:
        self.pins = dict(pins)
        super().__init__(*args, **kwargs)

    def calculatePlacement(self) -> dict[str, str]:  # noqa: N802  (Mininet's name)
        free = [s for s in self.switches if s not in self.pins]
        placement: dict[str, str] = dict(self.bin(free, self.servers))
        placement.update({s: self.pins[s] for s in self.switches if s in self.pins})
        switch_for: dict[str, str] = {}
        for src, dst in self.links:  # the last switch a host links to, as upstream does
            if src in self.hset and dst in self.sset:
                switch_for[src] = dst
            if dst in self.hset and src in self.sset:
                switch_for[dst] = src
        for h in self.hosts:
            if h in self.pins:
                placement[h] = self.pins[h]
            elif h in switch_for:
                placement[h] = placement[switch_for[h]]
            else:
                raise SpecError(f"cluster.placement = 'switchbin': host {h} links to no "
                                "switch, so it has no switch to sit with; pin it "
                                "(cluster.pins) or use roundrobin")
        return placement


class SeededRandomPlacer(RandomPlacer):  # type: ignore[misc]
    """Mininet's random placement, drawn from a generator seeded with the run's seed, so
    the dry run and the build (and every rerun) place alike."""

    def __init__(self, *args: Any, seed: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rng = random.Random(seed)

    def place(self, node: str) -> str:
        return str(self.servers[self.rng.randrange(len(self.servers))])
