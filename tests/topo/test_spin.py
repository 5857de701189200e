"""The delay line's spin window (topo.spin, pure): it covers the wake-ups it observed,
stays within its bounds, and stops spinning once a period's budget is spent."""

from __future__ import annotations

import random

import pytest

from topo.spin import SpinConfig, SpinError, SpinWindow

US = 1_000


def test_before_any_wake_up_the_window_is_the_initial_one() -> None:
    w = SpinWindow(SpinConfig(initial_ns=30 * US))
    assert w.window_ns(0) == 30 * US
    assert w.record()["timed_wakes"] == 0


def test_the_window_covers_the_quantile_of_observed_overshoots_plus_the_margin() -> None:
    rng = random.Random(7)
    cfg = SpinConfig(samples=32, quantile=0.9, margin_ns=5 * US, max_ns=500 * US)
    w = SpinWindow(cfg)
    overshoots = [rng.randrange(20 * US, 120 * US) for _ in range(32)]
    for o in overshoots:
        w.woke(o)
    window = w.window_ns(0)
    covered = sum(o + cfg.margin_ns <= window for o in overshoots)
    assert covered == sorted(overshoots).index(window - cfg.margin_ns) + 1
    assert 0.9 * 32 <= covered < 32  # the quantile, not the maximum
    assert w.record()["overshoot_max_us"] == max(overshoots) / US


def test_the_window_follows_the_machine_both_ways_within_its_bounds() -> None:
    cfg = SpinConfig(min_ns=10 * US, max_ns=200 * US, samples=16)
    w = SpinWindow(cfg)
    for _ in range(16):
        w.woke(80 * US)  # an idle host: a halted vCPU wakes late
    assert w.window_ns(0) == 85 * US
    for _ in range(16):
        w.woke(2 * US)  # a busy one: the timer is on time
    assert w.window_ns(0) == cfg.min_ns
    for _ in range(16):
        w.woke(5_000 * US)  # a stall is not worth spinning a whole window for
    assert w.window_ns(0) == cfg.max_ns
    w.woke(-3 * US)  # a clock read before the wake-up: no overshoot, not a negative one
    assert w.overshoot_max_ns == 5_000 * US


def test_a_spent_budget_drops_the_window_to_the_floor_until_the_period_ends() -> None:
    cfg = SpinConfig(min_ns=10 * US, max_ns=200 * US, budget_frac=0.1,
                     period_ns=100_000 * US, samples=4)
    w = SpinWindow(cfg)
    for _ in range(4):
        w.woke(150 * US)
    t = spent = 0
    for _ in range(1000):  # traffic: a release every 200 us, each spinning 155
        if w.window_ns(t) == cfg.min_ns:
            break
        w.spun(155 * US, t)
        spent += 155 * US
        t += 200 * US
    assert 0.1 * cfg.period_ns <= spent <= 0.1 * cfg.period_ns + 155 * US
    assert w.record()["throttled_periods"] == 1
    assert w.window_ns(cfg.period_ns - 1) == cfg.min_ns
    assert w.window_ns(cfg.period_ns) == 155 * US  # a new period: the learnt window again


def test_fixed_is_one_window_never_adapted_nor_throttled() -> None:
    w = SpinWindow(SpinConfig.fixed(30 * US))
    for _ in range(40):
        w.woke(300 * US)
        w.spun(1_000_000 * US, 0)
    assert w.window_ns(0) == 30 * US


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"min_ns": -1}, "min_ns"), ({"initial_ns": 300_000}, "initial_ns"),
    ({"samples": 0}, "samples"), ({"quantile": 1.5}, "quantile"),
    ({"budget_frac": -0.1}, "budget_frac"), ({"max_ns": 2.5}, "max_ns"),
])
def test_bad_configs_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SpinError, match=field):
        SpinConfig(**kwargs)
