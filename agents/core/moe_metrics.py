"""The MoE measurements, each defined once (DESIGN.md 1.4 and 5): agents, analysis and
benchmarks all call these."""

from __future__ import annotations

from collections.abc import Sequence

from agents.core.ethernet import TCP_GOODPUT_FRACTION


def load_imbalance(tokens_per_expert: Sequence[int | float]) -> float:
    """``max_e n_e / mean_e n_e`` over the experts' token counts: 1 = perfectly balanced,
    E = everything on one expert (the straggler factor of an expert-parallel layer).
    0 when no expert got a token."""
    n = [float(x) for x in tokens_per_expert]
    mean = sum(n) / len(n) if n else 0.0
    return max(n) / mean if mean > 0 else 0.0


def drop_fraction(kept: Sequence[int], dropped: Sequence[int]) -> float:
    """Dropped token choices / all token choices (tokens x k)."""
    total = sum(kept) + sum(dropped)
    return sum(dropped) / total if total else 0.0


def dispatch_efficiency(payload_bytes: int, phase_s: float, rate_mbps: float) -> float:
    """All-to-all dispatch efficiency of one layer's dispatch in one step:

        payload_bytes / (phase_s x rate_mbps x 1e6 / 8 x TCP_GOODPUT_FRACTION)

    ``payload_bytes``: the token bytes through the busiest access-link direction of any
    host (max over hosts of max(sent, received); frame headers and counts are overhead,
    not payload): the bytes that bound the phase from below; ``phase_s``: from the first
    moment a token may move to the moment the last host finishes. Each host sends its
    counts in the same message as its tokens, as soon as it enters the dispatch, so the
    window opens when the first host enters (a run that sent the counts in a round of
    their own opened it when the last host entered that round: no token moved before
    every host had every count). No payload moves before the window; one host's own
    phase time is no measure: its peers' rows may already sit in its receive buffer when
    it starts (``analysis.moe.dispatch_table`` gives the window and ``arrival_spread_s``).
    ``rate_mbps``: the access links' shaped rate. 1 = the busiest link carried payload
    at the TCP goodput ceiling for the whole phase.
    """
    if phase_s <= 0 or rate_mbps <= 0:
        raise ValueError(f"dispatch_efficiency: phase_s={phase_s}, rate_mbps={rate_mbps}")
    return payload_bytes / (phase_s * rate_mbps * 1e6 / 8 * TCP_GOODPUT_FRACTION)


def dispatch_link_efficiency(link_bytes: float, phase_s: float, rate_mbps: float) -> float:
    """All-to-all dispatch efficiency from the links' own counters:

        link_bytes / (phase_s x rate_mbps x 1e6 / 8)

    ``link_bytes``: the bytes the busiest access-link direction's HTB class (``1:1``)
    let out during the dispatch (max over every ``gbhI.up`` and ``gbhI.down``), from
    the class counters the controller samples (``topo.class_sample_ms``;
    ``classes.parquet``), each end of the phase interpolated linearly between the two
    samples around it. These are Ethernet frames as the shaper charges them: token
    payload with its TCP/IP and frame headers, the counts frames, and the ACKs of the
    reverse traffic sharing that direction (about 2 % of the bytes), so the rate is not
    scaled by the goodput fraction: a link sending full segments for the whole phase
    reads 1 by either formula.
    ``phase_s``: the same window as :func:`dispatch_efficiency` (the last host entering
    the counts phase to the last host finishing the tokens phase). Above 1 means the
    link sent faster than its rate for part of the phase: HTB's bucket (``burst``
    bytes) filled while the link idled and drained at line rate when the dispatch began.
    """
    if phase_s <= 0 or rate_mbps <= 0:
        raise ValueError(f"dispatch_link_efficiency: phase_s={phase_s}, rate_mbps={rate_mbps}")
    return link_bytes / (phase_s * rate_mbps * 1e6 / 8)
