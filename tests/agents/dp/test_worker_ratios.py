"""Per-worker fixed keep ratios (``compress.worker_ratios``): the config
checks them, each worker's fixed policy keeps its own entry, and over loopback each
worker's compressor really gets its own ratio."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.core.policies import ratio_policy_from_config
from agents.core.policies.base import RatioContext
from analysis.load import load_events
from controller.loopback.dp import run_loopback

REPO = Path(__file__).resolve().parents[3]
HET = REPO / "configs" / "heterogeneous.toml"
FIXED = 'adaptive.policy="fixed"'


@pytest.mark.parametrize("overrides, field, needle", [
    (["compress.worker_ratios=[0.1, 0.5, 0.5]", FIXED], "compress.worker_ratios",
     "one ratio per worker (net.workers = 4), not 3"),
    (["compress.worker_ratios=[0.1, 0, 0.5, 0.5]", FIXED], "compress.worker_ratios[1]",
     "(0, 1]"),
    (["compress.worker_ratios=[0.1, 0.5, 1.5, 0.5]", FIXED], "compress.worker_ratios[2]",
     "(0, 1]"),
    (["compress.worker_ratios=[0.1, 0.5, 0.5, 0.5]"], "compress.worker_ratios",
     'fixed" only, not "adaptive"'),
    (["compress.worker_ratios=0.5", FIXED], "compress.worker_ratios", "must be a list"),
])
def test_bad_worker_ratios_are_named(overrides: list[str], field: str, needle: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        cfgmod.load(HET, overrides)
    msg = str(e.value)
    assert f"{HET}: {field}" in msg, msg
    assert needle in msg, msg


def _keeps(cfg: cfgmod.ExperimentConfig) -> list[float]:
    keeps = []
    for w in range(cfg.net.workers):
        ctx = RatioContext(gradient_bytes=340_000, planned_bps=25e6, workers=cfg.net.workers,
                           worker=w)
        pol = ratio_policy_from_config(cfg, ctx)
        pol.start(340_000)
        keeps.append(pol.keep_for_next_chunk(0).keep)
    return keeps


def test_each_worker_keeps_its_own_ratio_and_the_toml_round_trips(tmp_path: Path) -> None:
    cfg = cfgmod.load(HET, [FIXED, "compress.ratio=0.3",
                            "compress.worker_ratios=[0.05, 0.2, 0.2, 1]"])
    assert _keeps(cfg) == [0.05, 0.2, 0.2, 1.0]
    out = tmp_path / "config.toml"
    out.write_text(cfgmod.dumps(cfg))
    assert cfgmod.load(out) == cfg
    # Without the list every worker keeps compress.ratio.
    assert _keeps(cfgmod.load(HET, [FIXED, "compress.ratio=0.3"])) == [0.3] * 4


@pytest.mark.loopback
def test_loopback_workers_compress_at_their_own_ratio(tmp_path: Path) -> None:
    """Two real worker processes and the PS over loopback TCP: every chunk worker 0
    compresses gets 0.05, every chunk of worker 1 gets 0.5, and worker 0 sends fewer bytes."""
    run_dir, rc = run_loopback(tmp_path, ["net.workers=2", "run.iterations=3",
                                          "workload.hidden=64", 'compress.name="topk"',
                                          "compress.worker_ratios=[0.05, 0.5]", FIXED])
    assert rc == 0, (run_dir / "ps.log").read_text()
    ev = load_events(run_dir)
    comp = ev[ev["event"] == "compress_done"]
    by_worker = {w: sorted(set(g["ratio"])) for w, g in comp.groupby("node")}
    assert by_worker == {"w0": [0.05], "w1": [0.5]}, by_worker
    sent = ev[ev["event"] == "send_done"].groupby("node")["bytes"].sum()
    assert sent["w0"] < 0.2 * sent["w1"], sent
