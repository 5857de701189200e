"""Registries (agents/core/registry.py): every registered name builds, an unknown name's
error lists the known ones, and the names the core reads from the modules' source are
exactly the ones the modules register when imported (so no list is kept anywhere)."""

from __future__ import annotations

import pytest

from agents.core import config as cfgmod
from agents.core.policies import (
    RATE_POLICIES,
    RATIO_POLICIES,
    RatioContext,
    make_rate_policy,
    ratio_policy_from_config,
)
from agents.core.registry import (
    COMPRESSOR,
    KINDS,
    RATE_POLICY,
    RATIO_POLICY,
    SCHEDULE,
    WORKLOAD,
    Registry,
    RegistryKind,
    UnknownName,
)


def registry_of(kind: RegistryKind) -> Registry:  # type: ignore[type-arg]
    from agents.compress.base import COMPRESSORS
    from agents.core.schedules.registry import SCHEDULES
    from agents.workloads.base import WORKLOADS

    return {WORKLOAD: WORKLOADS, COMPRESSOR: COMPRESSORS, RATIO_POLICY: RATIO_POLICIES,
            RATE_POLICY: RATE_POLICIES, SCHEDULE: SCHEDULES}[kind]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.label)
def test_the_source_scan_finds_exactly_what_the_modules_register(kind: RegistryKind) -> None:
    assert kind.declared(), kind
    assert registry_of(kind).names() == kind.declared()


def test_the_known_names() -> None:
    # Not a second list to keep in sync: a floor, so the scan cannot silently find nothing.
    assert {"digits_mlp", "digits_cnn", "replay"} <= set(WORKLOAD.declared())
    assert {"none", "topk", "dgc", "powersgd"} <= set(COMPRESSOR.declared())
    assert {"fixed", "adaptive", "oracle"} <= set(RATIO_POLICY.declared())
    assert {"linkn", "none"} <= set(RATE_POLICY.declared())


@pytest.mark.parametrize("name", WORKLOAD.declared())
def test_every_workload_builds_from_the_config(name: str) -> None:
    from agents.workloads.base import make_workload

    wl = make_workload(cfgmod.WorkloadConfig(name=name, hidden=8, channels=4,
                                             replay_bytes=4096))
    assert wl.name == name
    assert sum(p.numel() for p in wl.build_model(0).parameters()) > 0


@pytest.mark.parametrize("name", COMPRESSOR.declared())
def test_every_compressor_builds(name: str) -> None:
    import torch

    from agents.compress import make

    c = make(name)
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    payload = c.compress(x, "k", 0.5, torch.Generator().manual_seed(1))
    assert payload.compressor == name
    assert c.decompress(payload).shape == x.shape


@pytest.mark.parametrize("name", RATIO_POLICY.declared())
def test_every_ratio_policy_builds_from_the_config(name: str) -> None:
    cfg = cfgmod.from_dict({"adaptive": {"policy": name}, "compress": {"ratio": 0.5}})
    pol = ratio_policy_from_config(cfg, RatioContext(gradient_bytes=4_000_000,
                                                     planned_bps=25e6, workers=4))
    assert pol.name == name
    pol.start(4_000_000, 25e6, 0)
    pol.observe(25e6, 1_000_000)
    d = pol.keep_for_next_chunk(0)
    assert 0 < d.keep <= 1
    for attr in ("decides_in_flight", "follows_bandwidth", "budgets_bytes"):
        assert isinstance(getattr(pol, attr), bool), (name, attr)


@pytest.mark.parametrize("name", RATE_POLICY.declared())
def test_every_rate_policy_builds(name: str) -> None:
    pol = make_rate_policy(name, bottleneck_mbps=100.0, workers=4, worker_link_mbps=1000.0,
                           headroom=1.0)
    pol.initial()
    pol.on_bandwidth(50.0)
    pol.on_leave(3)
    pol.on_join(3)
    assert all(0 < cap <= 50.0 for cap in pol.caps().values())


@pytest.mark.parametrize(("section", "field", "kind"), [
    ("workload", "name", WORKLOAD), ("compress", "name", COMPRESSOR),
    ("adaptive", "policy", RATIO_POLICY), ("shaping", "policy", RATE_POLICY)])
def test_the_config_rejects_an_unknown_name_listing_the_known(section: str, field: str,
                                                               kind: RegistryKind) -> None:
    with pytest.raises(cfgmod.ConfigError) as err:
        cfgmod.from_dict({section: {field: "bogus"}})
    msg = str(err.value)
    assert msg.startswith(f"{section}.{field} = 'bogus'")
    assert ", ".join(kind.declared()) in msg


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.label)
def test_building_an_unknown_name_lists_the_known(kind: RegistryKind) -> None:
    with pytest.raises(UnknownName, match=", ".join(kind.declared())):
        registry_of(kind).get("bogus")


def test_a_name_registered_twice_is_an_error() -> None:
    reg: Registry[object] = Registry(RegistryKind("thing", "agents.core.policies", "nothing"))
    reg.register("a")(int)
    reg.register("a")(int)  # the same entry again (a module imported twice) is harmless
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(float)


def test_the_scan_reads_both_decorator_forms(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pkg = tmp_path / "plugpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "one.py").write_text('@reg("by_argument")\nclass A:\n    pass\n')
    (pkg / "two.py").write_text('@reg\nclass B:\n    name = "by_attribute"\n'
                                '@other("not_this")\nclass C:\n    pass\n')
    # Nested where only a statement walk reaches them, and a module that never names the
    # decorator (skipped unparsed, yet not valid Python: parsing it would raise).
    (pkg / "three.py").write_text(
        'try:\n    import x\nexcept ImportError:\n    @mod.reg("in_handler")\n'
        '    def f():\n        pass\nif True:\n    class Outer:\n        @reg("in_class")\n'
        '        class Inner:\n            pass\n'
        'match 1:\n    case 1:\n        @reg("in_case")\n        def g():\n'
        '            def h():\n                @reg("in_function")\n'
        '                class D:\n                    pass\n')
    (pkg / "four.py").write_text("this is not python (\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert RegistryKind("plug", "plugpkg", "reg").declared() == (
        "by_argument", "by_attribute", "in_case", "in_class", "in_function", "in_handler")


def test_shapes_roles_and_schedules_use_the_one_registry_type() -> None:
    from agents.core.schedules.registry import SCHEDULES
    from controller.roles import ROLES
    from topo.shapes import SHAPES

    for reg in (SCHEDULES, ROLES, SHAPES):
        assert isinstance(reg, Registry), reg
    assert {"star", "dumbbell", "fabric"} <= set(SHAPES.names())
    assert {"ps", "worker", "stage", "expert"} <= set(ROLES.names())
    # The shapes' and schedules' source scan finds what their modules register (a test may
    # have registered a shape of its own at run time, as gradbed.register_shape allows).
    from topo.shapes import SHAPE

    assert set(SHAPE.declared()) <= set(SHAPES.names())
    assert {"star", "dumbbell", "fabric"} <= set(SHAPE.declared())
    assert SCHEDULES.names() == SCHEDULE.declared()
