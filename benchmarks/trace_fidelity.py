"""Trace-replay fidelity: does the bottleneck deliver, second by second, what the trace allows?

The Mahimahi invariant (Netravali et al., "Mahimahi", USENIX ATC 2015) checked on gradbed's
HTB replay (DESIGN.md section 1.1): a 1-worker star replays a step trace on the up
bottleneck with ``TraceReplayer`` + ``StarNetwork.set_bottleneck_rate`` (``tc class change``,
exactly what ``controller.driver`` does), iperf3 (four parallel flows) from w0 to ps keeps it saturated,
and the bottleneck veth's tx byte counter (what left the HTB/bfifo; checked against the
bfifo's own counter) is sampled every 100 ms. For every 1 s window of the trace the bytes
delivered are compared with ``trace.bytes_between`` over the same
(measured) sample instants.

Unit: wire bytes as HTB meters them, i.e. Ethernet frames without preamble/FCS (``skb->len``),
both for the counter and for the trace allowance (rate x time / 8).

Honesty notes:
- Slow start: the flow runs for ``WARMUP_S`` at the trace's first rate before the trace clock
  starts, so no window contains slow start; every window of the trace is reported and counted.
- Windows are aligned with the trace's seconds, so a rate step falls on a window edge; the
  queue carried over a decrease is still drained at the *new* rate (HTB meters dequeue), so a
  saturated link stays exact across steps. The lag of each ``tc class change`` is reported.
- A rate change lands ``lag_ms`` after it is due (negative: early); until it lands the old
  rate holds, so the window after a step is off by about ``lag x (old - new) / new``. The
  change goes over rtnetlink from this process (``topo/netlink.py``) and is issued early by
  the lag recent changes showed (``traces.replay.LeadTimer``), as ``controller.driver`` does;
  the counter samples are read that lead ahead of each 100 ms mark, so a window spans the
  measured instants (about a lead before each second) and its edge sample precedes the step;
  without both, changes here landed 30-65 ms late and the second after a 100 -> 20 step was
  12-19 % over.
- The bottleneck has a fixed deep bfifo (``QUEUE_BYTES``) so that the flow never starves it.

Headline: the worst absolute window error in percent. Needs root and Mininet.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import emit, log

from agents.core.bandwidth import BandwidthTrace, load_trace
from agents.core.events import now_ns
from topo.build import StarNetwork
from topo.shapes.star import StarSpec
from topo.spec import LinkSpec
from traces.replay import LeadTimer, TraceReplayer, calibrate_lead

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = REPO / "traces" / "data" / "fidelity_1_100.log"
STREAMS = 4
QUEUE_BYTES = 1_000_000   # deep enough that the flow never lets the bottleneck go idle
WARMUP_S = 2.0            # the flow leaves slow start before the trace clock starts
SAMPLE_S = 0.1


@dataclass(frozen=True)
class Sample:
    t_s: float          # seconds since the trace start (midpoint of the tc call)
    sent_bytes: int     # bytes out of the bottleneck since the trace start (Ethernet frames)
    read_us: float      # how long reading the counter took (the sample instant's uncertainty)


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float
    rate_mbps: float        # the trace's rate at the window start (steps sit on edges)
    delivered_bytes: int
    allowed_bytes: float

    @property
    def error(self) -> float:
        return self.delivered_bytes / self.allowed_bytes - 1.0

    def as_dict(self) -> dict[str, float]:
        return {"start_s": round(self.start_s, 4), "end_s": round(self.end_s, 4),
                "rate_mbps": self.rate_mbps, "delivered_bytes": self.delivered_bytes,
                "allowed_bytes": round(self.allowed_bytes, 1),
                "error_pct": round(100 * self.error, 3)}


def window_errors(samples: list[Sample], trace: BandwidthTrace, duration_s: float,
                  window_s: float = 1.0) -> list[Window]:
    """Compare delivered and allowed bytes over consecutive ``window_s`` windows.

    Each window edge is the sample closest to the nominal edge; the allowance is integrated
    over the *measured* sample instants, so sampling jitter does not count as an error.
    Pure: unit-testable with synthetic samples.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least 2 samples, got {len(samples)}")
    ts = [s.t_s for s in samples]
    out: list[Window] = []
    k = 0
    while (k + 1) * window_s <= duration_s + 1e-9:
        a = min(range(len(ts)), key=lambda i: abs(ts[i] - k * window_s))
        b = min(range(len(ts)), key=lambda i: abs(ts[i] - (k + 1) * window_s))
        if b <= a:
            raise ValueError(f"window {k}: no samples between {k * window_s} and "
                             f"{(k + 1) * window_s} s")
        out.append(Window(ts[a], ts[b], trace.rate_at(max(ts[a], 0.0) + 1e-6),
                          samples[b].sent_bytes - samples[a].sent_bytes,
                          trace.bytes_between(max(ts[a], 0.0), ts[b])))
        k += 1
    return out


def replay_and_measure(trace: BandwidthTrace, duration_s: float, *,
                       queue_bytes: int = QUEUE_BYTES, warmup_s: float = WARMUP_S,
                       sample_s: float = SAMPLE_S) -> dict[str, Any]:
    """Build a 1-worker star, saturate it with iperf3 and replay ``trace`` for ``duration_s``.

    Returns the samples (relative to the trace start), the applied steps with their lag,
    and iperf3's retransmits. Needs root.
    """
    # Built at the trace's highest rate, then set to its first: the sender's GSO size is
    # chosen at build time (StarSpec.sender_gso_segs), and one-segment packets at 100
    # Mbit/s load the CPU enough to delay the tc changes (a window 4-7 % over after a
    # 100 -> 20 step in the full suite).
    spec = StarSpec(workers=1, worker_link=LinkSpec(rate_mbps=None),
                    bottleneck_up=LinkSpec(rate_mbps=max(trace.rates_mbps),
                                           queue_bytes=queue_bytes),
                    bottleneck_down=LinkSpec(rate_mbps=None), offload=False)
    samples: list[Sample] = []
    steps: list[dict[str, float]] = []
    with StarNetwork(spec, log=None) as net:
        net.set_bottleneck_rate("up", trace.rates_mbps[0])
        server = net.popen("ps", ["iperf3", "-s", "-1", "-B", net.ip("ps")],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        total_s = int(warmup_s + duration_s + 2)
        # Four parallel streams: a loss episode of one flow (an RTO after a burst of drops
        # at a rate step) would otherwise idle the bottleneck for tens of ms and be
        # counted against the replay; the others keep it saturated.
        client = net.popen("w0", ["iperf3", "-c", net.ip("ps"), "-t", str(total_s),
                                  "-P", str(STREAMS)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # As controller.driver does: changes are issued early by their recent lag, and the
        # lead is primed with no-op changes while the flows leave slow start.
        lead = LeadTimer()
        t_warm = time.monotonic()
        calibrate_lead(lead, lambda: net.set_bottleneck_rate("up", trace.rates_mbps[0]),
                       clock_ns=now_ns, sleep_s=time.sleep)
        time.sleep(max(0.0, warmup_s - (time.monotonic() - t_warm)))
        dev = net.bottleneck_dev("up")  # in the root namespace: its sysfs is readable here
        qdisc_before = net.bottleneck_stats("up")
        tx_before = _tx_bytes(dev)
        start_ns = now_ns()
        rep = TraceReplayer(trace, granularity_s=0.1, start_ns=start_ns)
        end_ns = start_ns + round(duration_s * 1e9)
        sample_ns = round(sample_s * 1e9)
        next_sample = start_ns
        while True:
            nd = rep.next_deadline_ns()
            # Samples are read a lead ahead too, and before a change due at the same
            # instant: a sample that lands after a step it should precede would count the
            # new rate over the wake-up lag against the old one (-5 % in a 1 Mbit/s second).
            ahead = lead.lead_ns
            deadline = min(next_sample, nd) if nd is not None else next_sample
            deadline -= ahead
            wait_s = (deadline - now_ns()) / 1e9
            if wait_s > 0:
                time.sleep(wait_s)
            now = now_ns()
            # Counter first, then the rate: a window edge then closes before the step's own
            # tc latency, and that latency (lag_ms) lands in the window it really affects.
            if now + ahead >= next_sample:
                t_a = now_ns()
                sent = _tx_bytes(dev)
                t_b = now_ns()
                samples.append(Sample(((t_a + t_b) / 2 - start_ns) / 1e9, sent - tx_before,
                                      (t_b - t_a) / 1e3))
                next_sample += sample_ns
                if t_a > end_ns:
                    break
            for ch in rep.due(now_ns() + ahead):
                net.set_bottleneck_rate("up", ch.rate_mbps)
                applied = now_ns()
                if ch.index or ch.loop:  # the first rate is set as the clock starts
                    lead.observe(ch.t_ns, applied, ahead)
                steps.append({"t_s": (ch.t_ns - start_ns) / 1e9, "rate_mbps": ch.rate_mbps,
                              "lag_ms": (applied - ch.t_ns) / 1e6})
        qdisc_after = net.bottleneck_stats("up")
        tx_after = _tx_bytes(dev)
        client.wait(timeout=total_s + 30)
        server.wait(timeout=10)
    return {"samples": samples, "steps": steps,
            "drops": qdisc_after.drops - qdisc_before.drops,
            # Cross-check of the unit: the veth's tx counter against the bfifo's dequeues.
            "tx_over_qdisc_bytes": (tx_after - tx_before)
            / max(1, qdisc_after.sent_bytes - qdisc_before.sent_bytes)}


def _tx_bytes(dev: str) -> int:
    """The veth's transmitted bytes: what left the bottleneck qdisc, as Ethernet frames
    (``skb->len``). Read from sysfs in microseconds, so the sample instant is exact, unlike a
    ``tc -s`` subprocess that a loaded machine can delay by tens of milliseconds."""
    with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
        return int(f.read())


def run(trace: BandwidthTrace, duration_s: float, **kw: Any) -> dict[str, Any]:
    res = replay_and_measure(trace, duration_s, **kw)
    windows = window_errors(res["samples"], trace, duration_s)
    worst = max(windows, key=lambda w: abs(w.error))
    return {**res, "windows": windows, "worst": worst}


def main() -> int:
    if os.geteuid() != 0:
        log("trace_fidelity needs root (Mininet)")
        return 1
    trace = load_trace(DEFAULT_TRACE)
    duration_s = trace.period_s
    res = run(trace, duration_s)
    for w in res["windows"]:
        log(f"[{w.start_s:6.2f}, {w.end_s:6.2f}) s at {w.rate_mbps:6g} Mbit/s: delivered "
            f"{w.delivered_bytes:>10d} B, allowed {w.allowed_bytes:>12.0f} B, "
            f"error {100 * w.error:+.3f} %")
    samples = res["samples"]
    errs = [abs(w.error) for w in res["windows"]]
    headline = 100 * max(errs)
    emit("trace_fidelity", round(headline, 3), "% (worst 1 s window |delivered/allowed - 1|)",
         "<= 3",
         {"trace": str(DEFAULT_TRACE.relative_to(REPO)), "duration_s": duration_s,
          "windows": [w.as_dict() for w in res["windows"]],
          "mean_abs_error_pct": round(100 * sum(errs) / len(errs), 3),
          "steps": res["steps"], "max_step_lag_ms": max(s["lag_ms"] for s in res["steps"]),
          "drops": res["drops"], "tx_over_qdisc_bytes": round(res["tx_over_qdisc_bytes"], 5),
          "max_sample_read_us": round(max(s.read_us for s in samples), 1),
          "queue_bytes": QUEUE_BYTES, "streams": STREAMS, "warmup_s": WARMUP_S, "sample_s": SAMPLE_S,
          "unit": "wire bytes (Ethernet frames as HTB meters them, no preamble/FCS)",
          "first_second": f"flow warmed up {WARMUP_S} s at the first rate before t=0; "
                          "every window counted"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
