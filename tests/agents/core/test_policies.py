"""Rate and ratio policies (DESIGN.md 1.1): pure functions of synthetic reports and a fake
clock, so every test here runs without sockets, root or time."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from agents.core.policies import (
    AdaptiveConfig,
    AdaptiveRatio,
    CapChange,
    FixedRatio,
    LinkNShaper,
    NoShaper,
    OracleRatio,
    RatePolicy,
    RateReport,
    RatioPolicy,
    chunk_keep,
    keep_ratio,
    linkn_caps,
    make_rate_policy,
    make_ratio_policy,
    membership_at,
    oracle_keep,
    overall_keep,
)
from traces import generate

MB = 1_000_000


# -- the keep formulas ---------------------------------------------------------------------


def test_unchanged_rate_means_no_extra_compression() -> None:
    for sent in (0, 10 * MB, 99 * MB):
        assert keep_ratio(100 * MB, sent, 50e6, 50e6) == 1.0
        assert chunk_keep(100 * MB, sent, 1.0) == 1.0


def test_halved_rate_halves_the_unsent_part() -> None:
    overall = overall_keep(100 * MB, 40 * MB, 100e6, 50e6)
    assert overall == pytest.approx(0.7)  # 40 sent + 60 * 0.5
    assert chunk_keep(100 * MB, 40 * MB, overall) == pytest.approx(0.5)
    # Whatever has been sent, the remaining part is cut by rt / r0.
    for sent in (0, 25 * MB, 80 * MB):
        o = overall_keep(100 * MB, sent, 80e6, 20e6)
        assert chunk_keep(100 * MB, sent, o) == pytest.approx(0.25)


def test_clamps_hold() -> None:
    # A collapsed rate is clamped at keep_min, overall and per chunk.
    assert overall_keep(100 * MB, 0, 100e6, 0.0, keep_min=0.01) == 0.01
    assert chunk_keep(100 * MB, 0, 0.01, keep_min=0.01) == 0.01
    # A faster link never sends more than everything.
    assert overall_keep(100 * MB, 10 * MB, 10e6, 100e6) == 1.0
    # The literal formula goes negative when rt > r0; the clamp catches it.
    lit = overall_keep(100 * MB, 0, 10e6, 30e6, formula="literal", keep_min=0.001)
    assert lit == 0.001
    assert chunk_keep(100 * MB, 0, lit, keep_min=0.001) == 0.001
    with pytest.raises(ValueError, match="sent_bytes"):
        overall_keep(100, 101, 1.0, 1.0)
    with pytest.raises(ValueError, match="formula"):
        overall_keep(100, 0, 1.0, 1.0, formula="other")
    with pytest.raises(ValueError, match="keep_min"):
        AdaptiveConfig(keep_min=0.0)


def test_literal_formula_reproduces_the_patent_arithmetic() -> None:
    # S = 100 MB, 40 MB sent, r0 = 100 Mbit/s, rt = 60 Mbit/s:
    # c = (100 - 60) / 100 = 0.4; CR = (40 + 60 * 0.4) / 100 = 0.64.
    cr = overall_keep(100 * MB, 40 * MB, 100e6, 60e6, formula="literal")
    assert cr == pytest.approx(0.64)
    assert chunk_keep(100 * MB, 40 * MB, cr) == pytest.approx(0.4)  # = c
    # Read literally, an unchanged rate sends nothing more (CR = sent / S).
    assert overall_keep(100 * MB, 40 * MB, 100e6, 100e6, formula="literal") == pytest.approx(0.4)
    # The consistent reading of the same example keeps 0.6 of the remainder.
    assert overall_keep(100 * MB, 40 * MB, 100e6, 60e6) == pytest.approx(0.76)


# -- AdaptiveRatio -------------------------------------------------------------------------


def test_adaptive_waits_for_a_stable_rate() -> None:
    pol = AdaptiveRatio(AdaptiveConfig(eps=0.1))
    pol.start(10 * MB, 100e6, ts_ns=0)
    d = pol.keep_for_next_chunk(0)
    assert (d.keep, d.reason, d.rt_bps) == (1.0, "no-stable-rate", None)
    pol.observe(100e6, 1)
    pol.observe(50e6, 2)  # |100 - 50| / 100 > eps: not stable
    assert pol.keep_for_next_chunk(MB).reason == "no-stable-rate"
    pol.observe(52e6, 3)  # |50 - 52| / 50 <= eps: stable at 52
    d = pol.keep_for_next_chunk(2 * MB)
    assert d.reason == "stable" and d.rt_bps == 52e6
    assert d.keep == pytest.approx(0.52)
    assert d.overall_keep == pytest.approx((2 + 8 * 0.52) / 10)
    assert (d.sent_bytes, d.remaining_bytes, d.ts_ns) == (2 * MB, 8 * MB, 3)
    pol.observe(150e6, 4)  # unstable again: the last stable rt stays
    assert pol.keep_for_next_chunk(3 * MB).rt_bps == 52e6
    assert pol.keep_for_next_chunk(10 * MB).reason == "nothing-remaining"
    # start() forgets the previous iteration.
    pol.start(10 * MB, 100e6, ts_ns=5)
    assert pol.keep_for_next_chunk(0).reason == "no-stable-rate"


def test_adaptive_plan_keep_scales_the_plan_not_the_rule() -> None:
    # Planning 5 % of the gradient at r0: before a stable rate the plan is followed; an
    # unchanged rate keeps 5 %; a halved rate 2.5 %; a tripled rate 15 %; never above 1.
    pol = AdaptiveRatio(AdaptiveConfig(eps=0.1, plan_keep=0.05))
    pol.start(10 * MB, 10e6, ts_ns=0)
    d = pol.keep_for_next_chunk(0)
    assert (d.keep, d.reason) == (0.05, "no-stable-rate")
    for rate, want in [(10e6, 0.05), (5e6, 0.025), (30e6, 0.15), (400e6, 1.0)]:
        pol.start(10 * MB, 10e6, ts_ns=0)
        pol.observe(rate, 1)
        pol.observe(rate, 2)
        d = pol.keep_for_next_chunk(0)
        assert d.keep == pytest.approx(want), rate
        assert d.r0_bps == 10e6  # the decision reports the planned rate itself
    # plan_keep = 1 is the seed's rule, unchanged.
    one = AdaptiveRatio(AdaptiveConfig(eps=0.1, plan_keep=1.0))
    one.start(10 * MB, 10e6)
    one.observe(5e6, 1)
    one.observe(5e6, 2)
    assert one.keep_for_next_chunk(0).keep == pytest.approx(0.5)
    with pytest.raises(ValueError, match="plan_keep"):
        AdaptiveConfig(plan_keep=0.0)


def test_adaptive_min_samples_and_r0_from_first_sample() -> None:
    pol = AdaptiveRatio(eps=0.05, min_samples=3)
    pol.start(MB)  # no r0: the first sample is r0
    pol.observe(80e6, 1)
    pol.observe(40e6, 2)
    pol.observe(41e6, 3)
    assert pol.keep_for_next_chunk(0).reason == "no-stable-rate"  # only one agreeing pair
    pol.observe(40.5e6, 4)
    d = pol.keep_for_next_chunk(0)
    assert d.r0_bps == 80e6 and d.keep == pytest.approx(40.5 / 80)


def test_adaptive_reasons_for_clamps() -> None:
    pol = AdaptiveRatio(AdaptiveConfig(keep_min=0.05))
    pol.start(MB, 100e6)
    pol.observe(1e6, 1)
    pol.observe(1e6, 2)
    d = pol.keep_for_next_chunk(0)
    assert (d.keep, d.reason) == (0.05, "clamped-min")
    pol.start(MB, 10e6)
    pol.observe(30e6, 1)
    pol.observe(30e6, 2)
    d = pol.keep_for_next_chunk(0)
    assert (d.keep, d.reason) == (1.0, "clamped-max")
    lit = AdaptiveRatio(AdaptiveConfig(formula="literal"))
    lit.start(MB, 100e6)
    lit.observe(100e6, 1)
    lit.observe(100e6, 2)
    assert lit.keep_for_next_chunk(0).reason == "clamped-min"  # c = 0


def _simulate(policy: RatioPolicy, rate_bps: Callable[[float], float], *, n_iters: int,
              size_bytes: int, n_chunks: int, r0: Callable[[float], float], seed: int,
              compute_s: float = 0.3, sample_s: float = 0.01) -> list[tuple[float, float, float]]:
    """A worker on a fake clock: compute, then send the gradient chunk by chunk at the
    (noisy) link rate, feeding the policy one kernel sample every ``sample_s``. Returns
    (transfer start s, transfer end s, keep of the last chunk) for each iteration."""
    rng = random.Random(seed)
    t = 0.0
    chunk = size_bytes // n_chunks
    out: list[tuple[float, float, float]] = []
    for _ in range(n_iters):
        t += compute_s
        t_start = t
        policy.start(size_bytes, r0(t), ts_ns=round(t * 1e9))
        sent = 0
        keep = 1.0
        for _c in range(n_chunks):
            keep = policy.keep_for_next_chunk(sent).keep
            wire = chunk * keep
            while wire > 0:
                r = rate_bps(t) * (1 + rng.uniform(-0.02, 0.02))
                dt = min(sample_s, wire * 8 / r)
                wire -= r * dt / 8
                t += dt
                policy.observe(r, round(t * 1e9))
            sent += chunk
        out.append((t_start, t, keep))
    return out


def _step_iteration(iters: list[tuple[float, float, float]], t_step: float) -> int:
    """The first iteration whose transfer ends after the step: the one that sees it first."""
    return next(i for i, (_, t_end, _) in enumerate(iters) if t_end > t_step)


def test_adaptive_keep_settles_within_three_iterations_of_a_step() -> None:
    # 100 -> 20 -> 100 Mbit/s shared by 4 workers; r0 is the rate planned at 100 Mbit/s / 4,
    # so the keep should go to rt / r0 = 0.2 after the drop and back to 1 after the rise.
    trace = generate.steps([(0.0, 100.0), (6.0, 20.0), (20.0, 100.0)], 100.0)
    share = 4

    def rate(t: float) -> float:
        return trace.rate_at(t) * 1e6 / share

    iters = _simulate(AdaptiveRatio(), rate, n_iters=60, size_bytes=2 * MB, n_chunks=8,
                      r0=lambda t: 100e6 / share, seed=1)
    keeps = [k for _, _, k in iters]
    drop, rise = _step_iteration(iters, 6.0), _step_iteration(iters, 20.0)
    assert rise - drop > 6 and len(iters) - rise > 6  # both plateaus are long enough to judge
    assert all(k == pytest.approx(1.0, abs=0.03) for k in keeps[:drop])
    # Settled by the third iteration after each step, and stays there until the next one.
    assert all(k == pytest.approx(0.2, rel=0.05) for k in keeps[drop + 2:rise])
    assert all(k == pytest.approx(1.0, abs=0.03) for k in keeps[rise + 2:])


def test_adaptive_with_r0_measured_at_start_compresses_only_within_the_iteration() -> None:
    # DESIGN 1.1 step 2 as written: r0 is the rate as the transfer starts. A rate that stays
    # low for whole iterations is the new normal: no extra compression after the step.
    trace = generate.steps([(0.0, 100.0), (6.0, 20.0)], 40.0)

    def rate(t: float) -> float:
        return trace.rate_at(t) * 1e6 / 4

    iters = _simulate(AdaptiveRatio(), rate, n_iters=30, size_bytes=2 * MB, n_chunks=8,
                      r0=rate, seed=2)
    keeps = [k for _, _, k in iters]
    step = _step_iteration(iters, 6.0)
    assert all(k == pytest.approx(1.0, abs=0.06) for i, k in enumerate(keeps) if i != step)
    assert keeps[step] < 1.0 or iters[step][0] >= 6.0  # cut only if the step fell mid-transfer


# -- fixed and oracle ----------------------------------------------------------------------


def test_fixed_ratio() -> None:
    pol = FixedRatio(0.1)
    pol.start(10 * MB, 5e6)
    pol.observe(1e6, 10)
    d = pol.keep_for_next_chunk(4 * MB)
    assert (d.keep, d.reason, d.ts_ns) == (0.1, "fixed", 10)
    assert d.overall_keep == pytest.approx((4 + 6 * 0.1) / 10)
    with pytest.raises(ValueError, match="fixed.keep"):
        FixedRatio(0.0)


def test_oracle_keep_is_what_fits() -> None:
    trace = generate.steps([(0.0, 100.0), (10.0, 20.0)], 20.0)
    # 1 s at 100 Mbit/s shared by 4: 3.125 MB of a 10 MB gradient.
    assert oracle_keep(10 * MB, 1.0, trace, 2.0, 4) == pytest.approx(0.3125)
    # Straddling the step: 0.5 s at 100 + 0.5 s at 20 = 7.5 MB / 4.
    assert oracle_keep(10 * MB, 1.0, trace, 9.5, 4) == pytest.approx(0.1875)
    assert oracle_keep(MB, 1.0, trace, 2.0, 1) == 1.0
    pol = OracleRatio(trace, n_workers=4, planned_s=1.0, trace_start_ns=1_000_000_000)
    pol.start(10 * MB, ts_ns=3_000_000_000)  # trace time 2 s
    d = pol.keep_for_next_chunk(0)
    assert d.keep == pytest.approx(0.3125) and d.rt_bps == pytest.approx(25e6)
    pol.observe(0.0, 3_500_000_000)  # half the plan gone, half the gradient still to send
    d = pol.keep_for_next_chunk(5 * MB)
    assert d.keep == pytest.approx(0.3125)
    pol.observe(0.0, 4_500_000_000)
    assert pol.keep_for_next_chunk(6 * MB).reason == "over-plan"
    pol.set_workers(1)
    pol.start(MB, ts_ns=1_000_000_000)
    assert pol.keep_for_next_chunk(0).reason == "clamped-max"


# -- link/N --------------------------------------------------------------------------------


def test_linkn_caps() -> None:
    assert linkn_caps(100.0, {0, 1, 2, 3}) == {0: 25.0, 1: 25.0, 2: 25.0, 3: 25.0}
    assert linkn_caps(1000.0, {0, 1}, worker_link_mbps=100.0) == {0: 100.0, 1: 100.0}
    assert linkn_caps(100.0, frozenset({5, 7}), headroom=0.9) == {5: 45.0, 7: 45.0}
    assert linkn_caps(100.0, set()) == {}
    with pytest.raises(ValueError, match="bottleneck_mbps"):
        linkn_caps(-1.0, {0})


def test_linkn_recomputes_on_leave_and_the_rest_get_more() -> None:
    sh = LinkNShaper(100.0, 4)
    assert sh.initial() == [CapChange(w, 25.0) for w in range(4)]
    assert sh.on_bandwidth(100.0) == []  # nothing changed, nothing emitted
    changes = sh.on_leave(2)
    assert {c.worker for c in changes} == {0, 1, 3}
    assert all(c.rate_mbps == pytest.approx(100 / 3) for c in changes)
    assert sh.caps() == {w: pytest.approx(100 / 3) for w in (0, 1, 3)}
    changes = sh.on_bandwidth(20.0)
    assert [c.rate_mbps for c in changes] == [pytest.approx(20 / 3)] * 3
    changes = sh.on_join(2)
    assert {c.worker: c.rate_mbps for c in changes} == {w: 5.0 for w in range(4)}
    assert sh.on_bandwidth(0.0)[0].rate_mbps == 0.01  # HTB needs a positive rate
    with pytest.raises(ValueError, match="not active"):
        sh.on_leave(9)
    with pytest.raises(ValueError, match="already active"):
        sh.on_join(0)


def test_membership_schedule() -> None:
    sched = ((1, 10, 20), (3, 15, None))
    assert membership_at(9, sched, 4) == {0, 1, 2, 3}
    assert membership_at(10, sched, 4) == {0, 2, 3}
    assert membership_at(15, sched, 4) == {0, 2}
    assert membership_at(20, sched, 4) == {0, 1, 2}
    assert membership_at(10**6, sched, 4) == {0, 1, 2}
    with pytest.raises(ValueError, match=r"schedule\[0\]: rejoin_iter"):
        membership_at(0, ((1, 5, 5),), 4)
    with pytest.raises(ValueError, match="worker 7"):
        membership_at(0, ((7, 1, None),), range(4))


# -- registry ------------------------------------------------------------------------------


def test_registry_builds_every_policy_by_name() -> None:
    trace = generate.constant(100.0, 10.0)
    built = [make_ratio_policy("fixed", keep=0.5), make_ratio_policy("adaptive", eps=0.05),
             make_ratio_policy("oracle", trace=trace, n_workers=2, planned_s=1.0)]
    for pol in built:
        assert isinstance(pol, RatioPolicy)
        pol.start(MB, 10e6, ts_ns=0)
        assert 0.0 < pol.keep_for_next_chunk(0).keep <= 1.0
    assert [p.name for p in built] == ["fixed", "adaptive", "oracle"]
    rate = make_rate_policy("linkn", bottleneck_mbps=50.0, workers=[0, 1])
    assert isinstance(rate, RatePolicy) and rate.initial()[0].rate_mbps == 25.0
    assert isinstance(make_rate_policy("none", workers=2), NoShaper)
    with pytest.raises(ValueError, match="'topk'.*adaptive"):
        make_ratio_policy("topk")
    with pytest.raises(ValueError, match="rate policy"):
        make_rate_policy("red")


def test_rate_report_prefers_the_acked_delta_rate() -> None:
    r = RateReport(worker=0, ts_ns=1, bytes_acked=10, delivery_rate_bps=5e6)
    assert r.best_rate_bps == 5e6
    assert RateReport(0, 1, 10, 5e6, rate_bps=4e6).best_rate_bps == 4e6


def test_adaptive_carries_the_stable_rate_into_the_next_iteration_when_asked() -> None:
    from agents.core.policies import AdaptiveRatio

    for carry, first_keep in ((False, 1.0), (True, 0.5)):
        p = AdaptiveRatio(carry_rt=carry)
        p.start(1000, r0_bps=100.0, ts_ns=0)
        p.observe(50.0, 1)
        p.observe(50.0, 2)
        assert p.keep_for_next_chunk(0).keep == 0.5
        p.start(1000, r0_bps=100.0, ts_ns=3)  # next iteration, no sample yet
        assert p.keep_for_next_chunk(0).keep == first_keep


def test_adaptive_ewma_smooths_bursty_samples_into_a_stable_rate() -> None:
    from agents.core.policies import AdaptiveRatio

    raw, smooth = AdaptiveRatio(eps=0.1), AdaptiveRatio(eps=0.1, ewma_alpha=0.2)
    for p in (raw, smooth):
        p.start(1000, r0_bps=100.0)
        for i, r in enumerate([50.0, 50.0] + [40.0, 60.0] * 20):
            p.observe(r, i)
    assert raw.rt_bps == 50.0  # only the first pair ever agreed
    assert smooth.rt_bps is not None and abs(smooth.rt_bps - 50.0) < 3.0
