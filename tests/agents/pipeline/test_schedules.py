"""Pipeline schedules as data: string round trip, the validator's rejections, the
simulator's bubble against the closed forms (DESIGN.md 1.3, 1.5)."""

from __future__ import annotations

import pytest

from agents.core.schedules import (
    Action,
    Costs,
    Kind,
    ScheduleError,
    format_grid,
    make,
    names,
    simulate,
    validate,
)
from agents.core.schedules.actions import RA, RG, SA, SG, B, F, R


def test_registered_names():
    assert {"gpipe", "1f1b", "two_group"} <= set(names())
    with pytest.raises(ValueError, match="not a registered pipeline schedule; must be one of 1f1b, gpipe, two_group"):
        make("zero_bubble", 2, 4)


@pytest.mark.parametrize("text", ["F0", "B12", "R3", "SA7", "RA0.1", "SG4.1", "RG9", "OPT2.1"])
def test_action_string_round_trip(text):
    a = Action.parse(text)
    assert str(a) == text and Action.parse(str(a)) == a


def test_action_parse_rejects_garbage():
    for bad in ("X1", "F", "F-1", "F1.", "SAX", "F1.1.1"):
        with pytest.raises(ValueError, match="expected KIND MB"):
            Action.parse(bad)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "two_group"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 5), (4, 8), (4, 16)])
@pytest.mark.parametrize("recompute", [False, True])
def test_every_schedule_validates(name, p, m, recompute):
    sch = validate(make(name, p, m, steps=3, recompute=recompute))
    for acts in sch.actions:  # whole list round-trips through strings
        assert [Action.parse(str(a)) for a in acts] == list(acts)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (2, 16), (4, 4), (4, 8), (4, 16), (3, 1)])
def test_bubble_equals_closed_form_for_equal_costs(name, p, m):
    res = simulate(make(name, p, m), Costs.uniform(1.0, 1.0))
    assert res.bubble == pytest.approx((p - 1) / (m + p - 1))  # GPipe, bubble/total
    assert res.bubble_ideal == pytest.approx((p - 1) / m)  # Megatron, bubble/ideal
    assert res.step_s == pytest.approx(2 * (m + p - 1))
    # With backward twice the forward the fill-drain formula still holds (bubble/total).
    res2 = simulate(make(name, p, m), Costs.uniform(1.0, 2.0))
    assert res2.bubble == pytest.approx((p - 1) / (m + p - 1))


def test_memory_gpipe_holds_m_1f1b_holds_p_minus_s():
    p, m = 4, 8
    assert simulate(make("gpipe", p, m)).peak_inflight == [m] * p
    assert simulate(make("1f1b", p, m)).peak_inflight == [p - s for s in range(p)]
    # Recomputation: a GPipe stage then holds one micro-batch's activations at a time
    # and the inputs of all m (the last stage's last forward keeps its activations: its
    # backward follows at once).
    rec = simulate(make("gpipe", p, m, recompute=True))
    assert rec.peak_inflight == [1] * p and rec.peak_stashed == [m] * p


def test_two_group_beats_1f1b_on_equal_work():
    """Same total work per stage (the two-group schedule's chunks are half a stage each):
    its A/B interleaving fills the fill-drain bubble."""
    p, m = 4, 8
    base = simulate(make("1f1b", p, m, steps=4), Costs.uniform(1.0, 1.0))
    two = simulate(make("two_group", p, m, steps=4), Costs.uniform(0.5, 0.5))
    assert two.bubble < base.bubble and two.step_s < base.step_s


def test_links_slow_the_step():
    sch = make("1f1b", 2, 4)
    free = simulate(sch, Costs.uniform(1.0, 1.0)).step_s
    slow = simulate(sch, Costs.uniform(1.0, 1.0, msg_bytes=1e6, link_bps=8e6)).step_s
    assert slow > free + 1.0  # each message now takes 1 s on the link


def _acts(name="1f1b", p=2, m=2):
    sch = make(name, p, m)
    return sch, [list(a) for a in sch.actions]


def test_rejects_tensor_used_before_it_arrives():
    sch, acts = _acts()
    i = acts[1].index(RA(0))
    acts[1].pop(i)  # stage 1 forwards micro-batch 0 with no activation received
    with pytest.raises(ScheduleError, match=r"stage 1 .*\(F0\) uses its input activation "
                                            r"before it arrives"):
        validate(sch.with_actions(acts))
    sch, acts = _acts()
    rg = acts[0].index(RG(0))
    acts[0][rg], acts[0][rg + 1] = acts[0][rg + 1], acts[0][rg]  # B0 before RG0
    with pytest.raises(ScheduleError, match="uses its output gradient before it arrives"):
        validate(sch.with_actions(acts))


def test_rejects_backward_before_forward():
    sch, acts = _acts("gpipe", 2, 2)
    acts[1].remove(B(1))
    acts[1].insert(0, B(1))
    with pytest.raises(ScheduleError, match=r"stage 1 action 0 \(B1\) runs before its forward"):
        validate(sch.with_actions(acts))


def test_rejects_skipped_and_repeated_micro_batch():
    sch, acts = _acts("gpipe", 2, 3)
    for s in range(2):
        acts[s] = [a for a in acts[s] if a.mb != 2 or a.kind is Kind.OPTIMIZER]
    with pytest.raises(ScheduleError, match="micro-batch 2 skipped"):
        validate(sch.with_actions(acts))
    sch, acts = _acts("gpipe", 2, 3)
    acts[0].insert(1, F(0))
    with pytest.raises(ScheduleError, match="micro-batch 0 repeated"):
        validate(sch.with_actions(acts))


def test_rejects_cross_stage_deadlock():
    """Stage 0 waits for micro-batch 0's gradient before sending its activation: every
    stage's own order is fine, together they wait on each other forever."""
    sch, acts = _acts("1f1b", 2, 1)
    assert acts[0][:2] == [F(0), SA(0)]
    acts[0] = [F(0), RG(0), SA(0), B(0)] + acts[0][4:]
    with pytest.raises(ScheduleError, match="deadlock across stages: stage 0 action 1 "
                                            r"\(RG0\) waits for stage 1; stage 1 action 0 "
                                            r"\(RA0\) waits for stage 0"):
        validate(sch.with_actions(acts))
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sch.with_actions(acts))


def test_rejects_forward_before_previous_optimizer_step():
    sch = make("gpipe", 2, 2, steps=2)
    acts = [list(a) for a in sch.actions]
    opt = acts[0].index(Action(Kind.OPTIMIZER, 0))
    f2 = acts[0].index(F(2))
    acts[0].insert(opt, acts[0].pop(f2))
    with pytest.raises(ScheduleError, match=r"\(F2\) runs before step 0's optimizer step"):
        validate(sch.with_actions(acts))


def test_rejects_unmatched_send():
    sch, acts = _acts("gpipe", 2, 2)
    acts[1].insert(acts[1].index(B(0)) + 1, SG(0))  # a second SG0
    with pytest.raises(ScheduleError, match="repeated"):
        validate(sch.with_actions(acts))


def test_two_group_weight_versions_lag_one_step():
    """Step k's forwards through A may run before step k-1's A update (PipeDream-2BW) but
    never before step k-2's; B's never before step k-1's."""
    sch = validate(make("two_group", 3, 4, steps=3))
    s0 = list(sch.actions[0])
    assert s0.index(F(4, 0)) < s0.index(Action(Kind.OPTIMIZER, 0, 0))  # lags
    assert s0.index(Action(Kind.OPTIMIZER, 0, 1)) < s0.index(F(4, 1))  # B synchronous
    # Position bookkeeping: A_{p-1} feeds B_0 on worker 0.
    assert sch.downstream(2, 0) == (0, 1) and sch.upstream(0, 1) == (2, 0)


def test_recompute_sits_before_the_gradient_wait():
    sch = validate(make("gpipe", 2, 2, recompute=True))
    s0 = list(sch.actions[0])
    assert s0.index(R(0)) + 1 == s0.index(RG(0))


def test_grid_prints_stage_by_time():
    text = format_grid(make("gpipe", 2, 2))
    assert text.splitlines() == [
        "gpipe p=2 m=2 steps=1",
        "t      0   1   2   3   4   5  ",
        "stage0 F0  F1  .   .   B0  B1 ",
        "stage1 .   F0  F1  B0  B1  .  ",
    ]
