"""Seeded loss (topo.loss) as a pure function, the delay line's drop path, the rules and the
plan for ``net.loss_model = "seeded"`` (pure: no root). The real thing, two runs with the
same seed losing the same datagrams, is in tests/topo/test_delay_mininet.py."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from topo import delayline as dl
from topo.loss import LossDraw, LossError, drops, threshold, uniform_u64
from topo.netfilter import Impairment, delay_queues, loss_args, mechanisms, rule_commands
from topo.plan import build_plan, impairments, require_impairments
from topo.qdisc import CapabilityError
from topo.shapes import shape_spec
from topo.shapes.star import StarSpec
from topo.spec import LinkSpec, SpecError

REPO = Path(__file__).resolve().parents[2]
NO_NETEM = {"netem": False, "nfqueue": True, "xt_statistic": True,
            "tcp_congestion_control": ["cubic"]}


def lost(seed: int, link: str, n: int, loss_pct: float) -> set[int]:
    return {i for i in range(1, n + 1) if drops(seed, link, i, loss_pct)}


def test_the_same_arguments_always_give_the_same_answer() -> None:
    assert lost(7, "ps-eth0/any", 20_000, 1.0) == lost(7, "ps-eth0/any", 20_000, 1.0)
    # The class with its key computed once agrees with the function.
    draw = LossDraw(7, "ps-eth0/any", 1.0)
    assert {i for i in range(1, 20_001) if draw.drops(i)} == lost(7, "ps-eth0/any", 20_000,
                                                                  1.0)


def test_the_draw_is_the_documented_formula() -> None:
    key = hashlib.blake2b((5).to_bytes(8, "little") + b"w0-eth0/any", digest_size=32,
                          person=b"gradbed-loss").digest()
    u = int.from_bytes(hashlib.blake2b((123).to_bytes(8, "little"), key=key,
                                       digest_size=8).digest(), "little")
    assert uniform_u64(key, 123) == u
    assert drops(5, "w0-eth0/any", 123, 30.0) == (u < round(0.3 * 2**64))
    assert threshold(0.0) == 0 and threshold(100.0) == 2**64
    assert not any(drops(5, "x", i, 0.0) for i in range(1000))
    assert all(drops(5, "x", i, 100.0) for i in range(1000))


def test_another_seed_or_link_loses_other_packets() -> None:
    base = lost(1, "ps-eth0/any", 50_000, 1.0)
    other_seed = lost(2, "ps-eth0/any", 50_000, 1.0)
    other_link = lost(1, "w0-eth0/any", 50_000, 1.0)
    # Independent 1 % draws over 50k packets share about 5 of ~500 losses.
    assert len(base & other_seed) < 50 and len(base & other_link) < 50


@pytest.mark.parametrize("loss_pct", [0.1, 1.0, 5.0, 50.0])
def test_the_rate_is_the_configured_one(loss_pct: float) -> None:
    n = 200_000
    got = len(lost(11, "ps-eth0/any", n, loss_pct)) / n
    p = loss_pct / 100
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(got - p) < 5 * sigma, (got, p)


def test_losses_are_not_bunched_like_a_burst_model() -> None:
    # Bernoulli: the chance that a loss follows a loss is the loss rate itself.
    n, p = 400_000, 0.05
    seq = [drops(3, "l", i, 100 * p) for i in range(n)]
    after_loss = [b for a, b in zip(seq, seq[1:], strict=False) if a]
    assert abs(sum(after_loss) / len(after_loss) - p) < 0.01


def test_bad_seeds_links_rates_and_indices_are_refused() -> None:
    for bad in (-1, 2**63, 1.5, True):
        with pytest.raises(LossError, match="loss seed"):
            drops(bad, "l", 1, 1.0)  # type: ignore[arg-type]
    with pytest.raises(LossError, match="link name"):
        drops(1, "", 1, 1.0)
    with pytest.raises(LossError, match="loss_pct"):
        LossDraw(1, "l", 101.0)
    with pytest.raises(LossError, match="packet index"):
        drops(1, "l", -1, 1.0)


def test_the_delay_line_drops_what_the_draw_loses_and_holds_the_rest() -> None:
    draw = LossDraw(9, "ps-eth0/any", 20.0)
    line = dl.DelayLine(queue=100, delay_ms=0.0, loss=draw)
    kept = [i for i in range(1, 1001) if line.arrive(i, 0)]
    assert kept == [i for i in range(1, 1001) if not draw.drops(i)]
    assert line.stats.dropped == 1000 - len(kept) and len(line.held) == len(kept)
    assert line.due(0) == kept[-1]  # every held id, none of the dropped, in one batch
    msg = dl.verdict_one(100, 42)
    length, kind, _, _, _ = dl.NLMSG_HDR.unpack_from(msg)
    assert length == len(msg) and kind == (3 << 8) | dl.NFQNL_MSG_VERDICT
    assert struct.unpack_from("!II", msg, 24) == (dl.NF_DROP, 42)


def test_loss_arguments_are_checked() -> None:
    q, draw = dl.parse_loss_arg("100:1.5:42:ps-eth0/10.0.0.10")
    assert q == 100 and draw == LossDraw(42, "ps-eth0/10.0.0.10", 1.5)
    for bad in ("100:1:42", "100:x:42:l", "100:1:-4:l", "100:200:1:l", "99999:1:1:l"):
        with pytest.raises(dl.DelayLineError, match="--loss"):
            dl.parse_loss_arg(bad)
    assert dl.main(["--queue", "100:1", "--loss", "101:1:1:l"]) == 2


def test_seeded_rules_queue_instead_of_the_statistic_match() -> None:
    imps = [Impairment("ps-eth0", loss_pct=1.0, loss_seed=42),
            Impairment("ps-eth0", delay_ms=5, loss_pct=2.0, sources=("10.0.0.10",),
                       loss_seed=42)]
    text = [" ".join(c) for c in rule_commands(imps)]
    assert not any("statistic" in t for t in text)
    assert text[0].endswith("--queue-num 100") and text[1].endswith("--queue-num 101")
    assert delay_queues(imps) == [(100, 0.0), (101, 5)]
    assert loss_args(imps) == ["--loss", "100:1.0:42:ps-eth0/any",
                               "--loss", "101:2.0:42:ps-eth0/10.0.0.10"]


def test_mechanisms_and_capabilities_for_a_seeded_loss() -> None:
    assert mechanisms(NO_NETEM, seeded_loss=True)["loss"] == "seeded"
    assert mechanisms({"netem": True, "nfqueue": True}, seeded_loss=True) == {
        "delay": "netem", "loss": "seeded"}
    spec = replace(StarSpec(workers=1, bottleneck_up=LinkSpec(rate_mbps=10.0, loss_pct=2.0)
                            ).net_spec(), loss_seed=3)
    with pytest.raises(CapabilityError, match="NFQUEUE"):
        require_impairments(spec, {"netem": True, "nfqueue": False})
    # With netem: netem delays, the delay line loses; netem gets no loss of its own.
    netem = {"netem": True, "nfqueue": True, "tcp_congestion_control": ["cubic"]}
    delayed = replace(StarSpec(workers=1, bottleneck_up=LinkSpec(
        rate_mbps=10.0, delay_ms=4.0, loss_pct=2.0)).net_spec(), loss_seed=3)
    assert impairments(delayed, netem=True) == {"ps": [Impairment(
        "ps-eth0", delay_ms=0.0, loss_pct=2.0, loss_seed=3)]}
    argv = [" ".join(s.argv) for s in build_plan(delayed, netem)]
    assert any("netem" in a and "delay 4" in a for a in argv)
    assert not any("loss" in a for a in argv)
    with pytest.raises(SpecError, match="loss_seed"):
        replace(delayed, loss_seed=-1)


def test_the_config_selects_the_seeded_loss_with_the_run_seed() -> None:
    path = REPO / "configs" / "heterogeneous.toml"
    cfg = cfgmod.load(path, ["net.loss_pct=1", 'net.loss_model="seeded"', "run.seed=17"])
    spec = shape_spec(cfg)
    assert spec.loss_seed == 17
    assert all(i.loss_seed == 17 for imps in impairments(spec).values() for i in imps
               if i.loss_pct > 0)
    assert shape_spec(cfgmod.load(path, ["net.loss_pct=1"])).loss_seed is None
    with pytest.raises(cfgmod.ConfigError, match="net.loss_model"):
        cfgmod.load(path, ['net.loss_model="gilbert"'])
