"""Config loading: typed, validated, and every error names the field, value and range."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.core.registry import WORKLOAD
from controller.run import plan_commands, star_spec
from tests.support.bad_config import BAD_IN_EVERY_SECTION, bad_config_toml

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.toml"


@pytest.mark.parametrize("override, field, allowed", [
    ("net.bottleneck_mbps=-5", "net.bottleneck_mbps", "[0.01, 10000]"),
    ("net.bottleneck_mbps=20000", "net.bottleneck_mbps", "[0.01, 10000]"),
    ("net.workers=0", "net.workers", "[1, 64]"),
    ("net.congestion='dctcp'", "net.congestion", "reno, cubic, bbr"),
    ("net.queue_bytes=10", "net.queue_bytes", "1500"),
    ("compress.ratio=0", "compress.ratio", "(0, 1]"),
    ("compress.name='zip'", "compress.name", "topk"),
    ("workload.name='gpt'", "workload.name", "digits_mlp"),
    ("workload.name='gpt'", "workload.name", "digits_cnn"),
    ("workload.channels=0", "workload.channels", "[1, 1024]"),
    ("shaping.method='magic'", "shaping.method", "pacing"),
    ("shaping.pace_guard=0.5", "shaping.pace_guard", "0 (off) or in [1, 4]"),
    ("adaptive.formula='other'", "adaptive.formula", "literal"),
    ("adaptive.notsent_lowat_bytes=10", "adaptive.notsent_lowat_bytes", "[1024, 67108864]"),
    ("run.iterations=0", "run.iterations", ">= 1"),
    ("run.allocator='tcmalloc'", "run.allocator", "steady or default"),
    ("membership.schedule=[[9, 2, -1]]", "membership.schedule[0][0]", "[0, 3]"),
    ("membership.schedule=[[1, 5, 3]]", "membership.schedule[0]", "rejoin_iter"),
])
def test_errors_name_field_value_and_range(override: str, field: str, allowed: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(DEMO, [override])
    msg = str(e.value)
    assert msg.startswith(f"{DEMO}: {field}"), msg
    assert allowed in msg, msg


def test_types_unknown_fields_and_sections_are_errors() -> None:
    for override, needle in [("net.workers='four'", "net.workers = 'four': must be an integer"),
                             ("net.bogus=1", "net.bogus: unknown field"),
                             ("nett.workers=1", "nett: unknown section"),
                             ("net.offload=1", "net.offload = 1: must be true or false")]:
        with pytest.raises(cfgmod.ConfigError, match=needle.replace("(", r"\(")):
            cfgmod.load(DEMO, [override])


def test_bad_toml_and_missing_file_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[net\nworkers = 2\n")
    with pytest.raises(cfgmod.ConfigError, match=f"{bad}: not valid TOML"):
        cfgmod.load(bad)
    with pytest.raises(cfgmod.ConfigError, match="config file not found"):
        cfgmod.load(tmp_path / "nope.toml")


def test_round_trip_through_the_resolved_toml(tmp_path: Path) -> None:
    cfg = cfgmod.load(DEMO, ["net.bottleneck_mbps=42", "membership.schedule=[[1, 3, 5]]",
                             "compress.params={levels = 15}"])
    out = tmp_path / "config.toml"
    out.write_text(cfgmod.dumps(cfg))
    again = cfgmod.load(out)
    assert again == cfg
    assert again.net.bottleneck_mbps == 42.0 and again.membership.schedule == ((1, 3, 5),)
    with pytest.raises(AttributeError):
        cfg.net.workers = 3  # type: ignore[misc]  # frozen


def test_rates_up_to_10_gbit_are_accepted_and_reach_the_topology() -> None:
    cfg = cfgmod.load(DEMO, ["net.bottleneck_mbps=10000", "net.bottleneck_down_mbps=2500"])
    spec = star_spec(cfg)
    assert spec.bottleneck_up.rate_mbps == 10000 and spec.bottleneck_down.rate_mbps == 2500


def test_dry_run_prints_every_qdisc_without_root() -> None:
    cfg = cfgmod.load(DEMO, ["net.workers=2"])
    lines = plan_commands(cfg, {"netem": False, "tcp_congestion_control": ["cubic"]})
    rate = f"rate {round(cfg.net.bottleneck_mbps * 1e6)}bit"  # the up bottleneck's HTB class
    assert any("tc class replace dev gbsw0-eth1" in ln and rate in ln for ln in lines)
    assert sum("-m agents.dp.worker" in ln for ln in lines) == 2


def test_cli_reports_config_errors_with_exit_status_2() -> None:
    p = subprocess.run([sys.executable, "-m", "controller.cli", "run", str(DEMO), "--set",
                        "net.workers=100", "--dry-run"], cwd=REPO, capture_output=True,
                       text=True)
    assert p.returncode == 2 and "net.workers = 100: must be in [1, 64]" in p.stderr
    p = subprocess.run([sys.executable, "-m", "controller.cli", "run", str(DEMO), "--set",
                        "net.delay_ms=5", "--dry-run"], cwd=REPO, capture_output=True,
                       text=True)
    # netem where the kernel has it, else the NFQUEUE delay line in the receiving hosts;
    # the dry run names the mechanism either way.
    assert p.returncode == 0, p.stderr
    assert "netem" in p.stdout or ("# delay by nfqueue" in p.stdout
                                   and "-m topo.delayline --queue 100:5" in p.stdout)


@pytest.mark.parametrize("name", WORKLOAD.declared())
def test_every_workload_the_config_accepts_is_built(name: str) -> None:
    from agents.workloads.factory import make_workload

    wl = cfgmod.WorkloadConfig(name=name, hidden=8, channels=4, replay_bytes=4096)
    wl.validate("workload")
    assert make_workload(wl).name == name


def test_an_unknown_workload_name_lists_the_known_ones() -> None:
    from agents.workloads.factory import make_workload

    with pytest.raises(ValueError, match="digits_cnn, digits_deep, digits_mlp, fashion_resnet, fashion_vit, replay"):
        make_workload(cfgmod.WorkloadConfig(name="gpt"))



def test_one_bad_value_in_every_section_is_reported_at_once(tmp_path: Path) -> None:
    import dataclasses

    assert set(BAD_IN_EVERY_SECTION) == {f.name for f in
                                         dataclasses.fields(cfgmod.ExperimentConfig)}
    path = tmp_path / "bad.toml"
    path.write_text(bad_config_toml())
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(path)
    errors = e.value.errors
    wanted = [f"{s}.{n}" for s, (n, _) in BAD_IN_EVERY_SECTION.items()]
    wanted += ["guard.handshake_timeout_s = ", "pipeline.ratio = "]
    for needle in wanted:
        assert any(m.startswith(f"{path}: {needle}") for m in errors), (needle, errors)
    assert len(errors) == len(set(errors)), errors  # each error once


def test_a_bad_guard_or_pipeline_value_does_not_hide_later_checks() -> None:
    for section, name in (("guard", "max_abs_grad"), ("pipeline", "stages")):
        data = {section: {name: -1}, "feedback": {"warmup_iterations": -1}}
        with pytest.raises(cfgmod.ConfigError) as e:
            cfgmod.from_dict(data)
        assert [m.split(" =")[0] for m in e.value.errors] == [f"{section}.{name}",
                                                              "feedback.warmup_iterations"]


@pytest.mark.parametrize("old, new, value", [
    ("net.ps_port", "net.port", 5100),
    ("moe.port", "net.port", 6100),
    ("pipeline.base_port", "net.port", 6200),
    ("pipeline.ratio", "compress.ratio", 0.25),
    ("moe.lr", "workload.lr", 0.07),
    ("moe.momentum", "workload.momentum", 0.5),
    ("moe.batch_size", "workload.batch_size", 12),
    ("run.on_worker_death", "run.on_agent_death", "stop"),
])
def test_an_old_name_is_read_under_its_new_one_with_a_warning(old: str, new: str,
                                                              value: object) -> None:
    assert cfgmod.RENAMED[old] == new
    section, name = old.split(".")
    with pytest.warns(cfgmod.ConfigDeprecation, match=rf"^{old} is deprecated: it is now {new}"):
        cfg = cfgmod.from_dict({section: {name: value}})
    new_section, new_name = new.split(".")
    assert getattr(getattr(cfg, new_section), new_name) == value
    assert old not in cfgmod.flatten(cfg.to_dict())  # the resolved config has the new name only
    # Given with the new name too, and differently, it is an error naming both.
    with pytest.raises(cfgmod.ConfigError, match=rf"{old} = .*old name of {new}"):
        both: dict[str, dict[str, object]] = {section: {name: value}}
        both.setdefault(new_section, {})[new_name] = 2
        cfgmod.from_dict(both)


def test_every_old_name_has_a_test() -> None:
    tested = {"net.ps_port", "moe.port", "pipeline.base_port", "pipeline.ratio", "moe.lr",
              "moe.momentum", "moe.batch_size", "run.on_worker_death"}
    assert set(cfgmod.RENAMED) == tested
