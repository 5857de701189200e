"""``[guard]``: what an agent accepts from peers, authenticated or not.

A worker that proved its key can still send a poisoned gradient; ``max_abs_grad`` turns
that into a ``frame_error`` that drops the worker (``run.on_agent_death`` then says whether
the run goes on) instead of a model that silently becomes NaN.

A peer that has not proved its key is held to the admission limits of every listening
socket (``agents.net.admission``): a whole handshake within ``handshake_timeout_s``, at
most ``max_handshakes_per_source`` at once from one address and ``max_handshakes`` in
all (each expected agent's host keeps one slot of its own beyond those), at most
``max_connects_per_source_per_s`` new connections a second from one address, and one
``refused`` event per (source, reason) per ``refusal_report_interval_s``. With
``kernel_admission`` the per-source bounds are enforced in the listening host's kernel too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agents.core.checks import check


@dataclass(frozen=True)
class GuardConfig:
    max_abs_grad: float = 1e6          # |gradient value| above this is a payload error; 0 = no bound
    handshake_timeout_s: float = 5.0  # a whole handshake must finish within this (absolute)
    # Lower: a flood from one host holds fewer slots; too low and agents that share one
    # address (a loopback run) wait for each other's handshakes.
    max_handshakes_per_source: int = 8
    # Unauthenticated connections at once over all sources: a bound on the threads and
    # buffers a flood from many hosts can cost.
    max_handshakes: int = 256
    # New connections a second from one address before the rest of that second is
    # refused unread: lower refuses a reconnecting flood sooner.
    max_connects_per_source_per_s: int = 64
    # Refusals are counted and reported at most once per (source, reason) per interval:
    # longer, fewer events (a flood's log grows by a line per source and reason per
    # interval); shorter, finer timing of a flood in the events.
    refusal_report_interval_s: float = 1.0
    # max_connects_per_source_per_s enforced by netfilter too in each listening agent's
    # host (controller.kernel_admission): a flood's surplus SYNs are dropped by the kernel
    # instead of accepted and closed by the agent; and, in `gradbed torchrun`, the rules
    # that let only the training hosts connect to a training host. false: neither (a
    # machine without iptables or a kernel without xt_hashlimit; the agents' checks alone).
    kernel_admission: bool = True

    def validate(self, p: str) -> None:
        check(math.isfinite(self.max_abs_grad) and self.max_abs_grad >= 0,
              f"{p}.max_abs_grad", self.max_abs_grad,
              "must be a finite number >= 0 (0 = no bound)")
        check(math.isfinite(self.handshake_timeout_s) and 0 < self.handshake_timeout_s <= 3600,
              f"{p}.handshake_timeout_s", self.handshake_timeout_s, "must be in (0, 3600]")
        check(1 <= self.max_handshakes_per_source <= 65536, f"{p}.max_handshakes_per_source",
              self.max_handshakes_per_source, "must be in [1, 65536]")
        check(self.max_handshakes_per_source <= self.max_handshakes <= 65536,
              f"{p}.max_handshakes", self.max_handshakes,
              f"must be in [max_handshakes_per_source={self.max_handshakes_per_source}, 65536]")
        check(1 <= self.max_connects_per_source_per_s <= 1_000_000,
              f"{p}.max_connects_per_source_per_s", self.max_connects_per_source_per_s,
              "must be in [1, 1000000]")
        check(math.isfinite(self.refusal_report_interval_s)
              and 0 < self.refusal_report_interval_s <= 3600,
              f"{p}.refusal_report_interval_s", self.refusal_report_interval_s,
              "must be in (0, 3600] seconds")
        check(isinstance(self.kernel_admission, bool), f"{p}.kernel_admission",
              self.kernel_admission, "must be true or false")
