"""Pipeline measurements from a run's stage events, each defined once here.

Over the measured steps (``skip`` warm-up steps left out; a step's actions are those of
its micro-batches, and its optimizer steps):

- ``wall_s`` = the sum over measured steps of (last compute end - first compute start of
  the step, over all stages) when the steps do not overlap (GPipe and 1F1B flush at every
  step, so the optimizer steps between them are left out); when they overlap (the
  two-group schedule runs the next step's A forwards during this step's drain), the
  whole window from the first measured compute start to the last end;
- ``busy_s[stage]`` = seconds the stage spent in forward, backward and recompute;
- ``bubble`` (bubble/total) = ``1 - sum(busy_s) / (p * wall_s)``: GPipe's
  ``(p-1)/(m+p-1)`` for equal costs and free links (Huang et al. 2019);
  ``bubble_ideal`` = ``bubble / (1 - bubble)``: Megatron's ``(p-1)/m`` (Narayanan et al.
  2021) is this quantity (idle relative to the ideal time);
- ``bubble_per_stage[stage]`` = ``1 - busy_s[stage] / wall_s``;
- ``samples_per_s`` = ``steps * m * micro_batch_size * d / wall_s``;
- ``link_bytes_per_step[(src, dst)]`` = wire bytes (headers included) the stage ``src``
  sent to ``dst`` per step (every step counted);
- ``dp_link_bytes_per_step[(src, dst)]`` = data-parallel wire bytes per step (every step
  counted) between a stage and the pipeline's PS (``d > 1``): its slice gradients up
  (``pp_ps_send`` of kind ``G``, keyed ``(rRsS, "ps")``) and the means down
  (``ps_slice_sent``, keyed ``("ps", rRsS)``); weights sent for evaluation not included;
- ``peak_act_bytes[stage]`` = the most bytes of activations the stage held at once
  (autograd's saved tensors plus stashed inputs), from its ``pp_done``;
- ``link_load[(src, dst)]`` (:func:`link_load`) = ``8 * link_bytes_per_step / (rate_bps *
  wall_s / steps)``: the fraction of a measured step that the stage link ``src -> dst``,
  shaped at ``rate_bps``, spends carrying that step's bytes at its rate (1.0 = busy the
  whole step).

Transfer windows (:func:`transfer_windows`, what ``agent_limited`` judges): each
stage-to-stage message from its sender thread taking it (``pp_send.start_ns``) to the
receiver's reader thread holding its last byte (``pp_recv.arrived_ns``), a sender's
overlapping windows merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from analysis.metrics import merge_windows

COMPUTE = ("F", "B", "R")


@dataclass(frozen=True)
class PipelineMetrics:
    steps: int
    wall_s: float
    busy_s: dict[str, float]
    bubble: float
    bubble_ideal: float
    bubble_per_stage: dict[str, float]
    samples_per_s: float
    link_bytes_per_step: dict[tuple[str, str], float]
    peak_act_bytes: dict[str, int]
    dp_link_bytes_per_step: dict[tuple[str, str], float]


def pipeline_metrics(events: pd.DataFrame, *, micro_batches: int, micro_batch_size: int,
                     replicas: int = 1, skip: int = 1) -> PipelineMetrics:
    act = events[events["event"] == "pp_action"]
    if act.empty:
        raise ValueError("pipeline_metrics: no pp_action events (not a pipeline run?)")
    steps_all = int(act.loc[act["kind"] == "OPT", "iter"].max()) + 1
    skip = min(skip, steps_all - 1)
    comp = act[act["kind"].isin(COMPUTE) & (act["iter"] >= skip)]
    win = comp.groupby("iter").agg(t0=("start_ns", "min"), t1=("end_ns", "max")).sort_index()
    disjoint = bool((win["t0"].to_numpy()[1:] >= win["t1"].to_numpy()[:-1]).all())
    if disjoint:
        wall = float((win["t1"] - win["t0"]).sum()) / 1e9
    else:
        wall = (int(win["t1"].max()) - int(win["t0"].min())) / 1e9
    dur = (comp["end_ns"] - comp["start_ns"]) / 1e9
    busy = {str(k): float(v) for k, v in dur.groupby(comp["node"]).sum().items()}
    p = len(busy)
    bubble = 1.0 - sum(busy.values()) / (p * wall)
    per_stage = {n: 1.0 - b / wall for n, b in busy.items()}
    steps = steps_all - skip
    snd = events[events["event"] == "pp_send"]
    links: dict[tuple[str, str], float] = {}
    for key, total in snd.groupby(["node", "to"])["bytes"].sum().items():
        node, to = str(key[0]), int(key[1])  # type: ignore[index]
        prefix = node[: node.rfind("s")]  # replica prefix ("" or "rK")
        links[(node, f"{prefix}s{to}")] = float(total) / steps_all
    dp: dict[tuple[str, str], float] = {}
    up = events[events["event"] == "pp_ps_send"]
    up = up[up["kind"] == "G"] if len(up) else up
    for src, total in up.groupby(up["node"].astype(str))["bytes"].sum().items():
        dp[(str(src), "ps")] = float(total) / steps_all
    down = events[events["event"] == "ps_slice_sent"]
    if len(down):
        for dst, total in down.groupby(down["to"].astype(str))["bytes"].sum().items():
            dp[("ps", str(dst))] = float(total) / steps_all
    done = events[events["event"] == "pp_done"]
    peak = {str(r["node"]): int(r["peak_held_bytes"]) for r in done.to_dict("records")}
    return PipelineMetrics(
        steps=steps, wall_s=wall, busy_s=busy, bubble=bubble,
        bubble_ideal=bubble / (1 - bubble) if bubble < 1 else float("inf"),
        bubble_per_stage=per_stage,
        samples_per_s=steps * micro_batches * micro_batch_size * replicas / wall,
        link_bytes_per_step=links, peak_act_bytes=peak, dp_link_bytes_per_step=dp)


def link_load(m: PipelineMetrics, rate_mbps: float) -> dict[tuple[str, str], float]:
    """How busy each stage-to-stage link of rate ``rate_mbps`` was over a measured step
    (the module docstring gives the formula)."""
    step_s = m.wall_s / m.steps
    return {k: 8 * b / (rate_mbps * 1e6 * step_s) for k, b in m.link_bytes_per_step.items()}


def transfer_windows(events: pd.DataFrame) -> list[tuple[int, int, int]]:
    """``(step, start_ns, end_ns)``: every stage-to-stage message from its ``pp_send``
    start to its ``pp_recv`` arrival (matched by sender, receiver, kind, micro-batch and
    chunk), the overlapping windows of each sender merged
    (:func:`analysis.metrics.merge_windows`). Messages to and from the pipeline's PS
    are not counted: the schedule waits on the stage links. Empty without a match."""
    snd = events[events["event"] == "pp_send"]
    rcv = events[events["event"] == "pp_recv"]
    if snd.empty or rcv.empty:
        return []
    node = snd["node"].astype(str)
    cut = node.str.rfind("s")
    prefix = [n[:c] for n, c in zip(node, cut, strict=True)]  # replica prefix ("" or "rK")
    snd = snd[["node", "iter", "kind", "mb", "chunk", "start_ns"]].assign(
        recv_node=[f"{p}s{int(t)}" for p, t in zip(prefix, snd["to"], strict=True)],
        from_stage=[int(n[c + 1:]) for n, c in zip(node, cut, strict=True)],
        recv_kind=snd["kind"].map({"SA": "RA", "SG": "RG"}))
    keys = ["mb", "chunk"]
    rcv = rcv[["node", "from_stage", "kind", *keys, "arrived_ns"]].astype(
        {"from_stage": int, "mb": int, "chunk": int})
    both = snd.astype({"mb": int, "chunk": int}).merge(
        rcv, left_on=["recv_node", "from_stage", "recv_kind", *keys],
        right_on=["node", "from_stage", "kind", *keys], suffixes=("", "_r"))
    return merge_windows(
        (str(n), int(i), int(s), int(e)) for n, i, s, e in zip(
            both["node"], both["iter"], both["start_ns"], both["arrived_ns"], strict=True))
