"""gradbed's own qdiscs: HTB for the rate, bfifo for a byte queue, netem when present.

DESIGN.md section 3: Mininet's ``TCLink`` builds delay, loss and queue size on netem (absent
on these kernels), caps rates at 1000 Mbit/s, and changes a rate by deleting the qdisc
(dropping what is queued). gradbed instead installs, on the egress of one interface::

    root htb 1: (default 1) -> class 1:1 rate=ceil=R -> [netem 10: delay/loss ->] bfifo

A host's own access link (where a link/N cap queues the host's upload) can send its pure
ACKs first (``ack_first``): under the same class 1:1, so the cap still bounds everything,
two children borrow all of their rate from it, the ACKs' (prio 0, pfifo) ahead of the
data's (prio 1, the bfifo)::

    root htb 1: (default 11) -> class 1:1 rate=ceil=R -+- class 1:10 prio 0 -> pfifo 21:
        u32: IPv4 TCP, no IP options, length < 128,    '- class 1:11 prio 1 -> bfifo 20:
             flags exactly ACK -> 1:10

and changes rates only with ``tc class change`` (seeds/004: link/N shaping must never
drop the queue). The command builders are pure (argv lists) so they are unit-tested and
printable in a dry run; ``parse_tc_stats`` turns ``tc -s [-j] qdisc show`` into counters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from topo.netlink import HtbClass
from topo.spec import RATE_MAX_MBPS, RATE_MIN_MBPS, WIRE_FRAME_BYTES, LinkSpec, SpecError

ROOT_HANDLE = "1:"
CLASS_ID = "1:1"
NETEM_HANDLE = "10:"
# The bfifo sits directly under the HTB class, or under netem's single class when delay
# or loss is asked for; either way it is the queue whose counters describe the bottleneck.
LEAF_HANDLE = "20:"
# ack_first: the children of 1:1 and the ACKs' own queue.
ACK_CLASS_ID = "1:10"
DATA_CLASS_ID = "1:11"
ACK_LEAF_HANDLE = "21:"
# The children's own (guaranteed) rate: a token, so everything they send is borrowed from
# 1:1 and the cap holds. A class under its own rate may send past its parent's, so this is
# also the most the pair can add to R: 8 kbit/s, one frame every 1.5 s.
CHILD_RATE = "8000bit"
ACK_QUEUE_PKTS = 1000
# A pure ACK: IPv4 TCP, no IP options, total length < 128 bytes (timestamps and SACK blocks
# fit), TCP flags exactly ACK (offset 20 + 13). Data with a piggybacked ACK is longer.
PURE_ACK_MATCH = ["match", "ip", "protocol", "6", "0xff",
                  "match", "u8", "0x05", "0x0f", "at", "0",
                  "match", "u16", "0x0000", "0xff80", "at", "2",
                  "match", "u8", "0x10", "0xff", "at", "33"]

# Largest skb HTB sees with GSO/TSO on: a 64 KiB super-packet plus headers.
GSO_FRAME_BYTES = 65_536 + 1514
# How long the HTB class may go without a dequeue (timer slack, a core busy with other
# work) before it starts losing tokens. Measured on the 2-core machines under load
# (benchmarks/link_fidelity.py, tests): at 100 Mbit/s a 2 ms burst gave 0.990-0.995 of
# the TCP ceiling, 10 ms gave 0.998-1.000. The cost is at most 10 ms of line-rate
# overshoot after an idle period, 1 % of a 1 s trace-replay window.
HTB_BURST_S = 0.010
# Quantum only splits bandwidth between sibling classes (there are none), but the kernel
# derives it from rate/r2q when absent and warns "quantum is big" above 200000 bytes.
# A fixed value at least one GSO frame silences that and keeps DRR correct with GSO on.
HTB_QUANTUM_BYTES = GSO_FRAME_BYTES
# netem's own delay line holds the packets in flight on the delayed link.
NETEM_LIMIT_PKTS = 100_000


class CapabilityError(RuntimeError):
    """The spec asks for a kernel feature this machine lacks; the message names it."""


def rate_arg(rate_mbps: float) -> str:
    """tc rate string in bit/s; integral so tc does not round it."""
    if not RATE_MIN_MBPS <= rate_mbps <= RATE_MAX_MBPS:
        raise SpecError(f"rate_mbps={rate_mbps!r} is out of range; "
                        f"allowed {RATE_MIN_MBPS:g}..{RATE_MAX_MBPS:g} Mbit/s")
    return f"{round(rate_mbps * 1e6)}bit"


def htb_burst_bytes(rate_mbps: float, offload: bool = False,
                    burst_ms: float | None = None) -> int:
    """HTB burst/cburst: ``burst_ms`` (a link's ``LinkSpec.burst_ms``; None =
    HTB_BURST_S) worth of bytes at the rate, at least two frames."""
    frame = GSO_FRAME_BYTES if offload else WIRE_FRAME_BYTES
    burst_s = HTB_BURST_S if burst_ms is None else burst_ms / 1000
    return max(2 * frame, int(rate_mbps * 1e6 / 8 * burst_s))


def cap_burst_bytes(rate_mbps: float, bottleneck_queue_bytes: int, n_workers: int,
                    offload: bool = False) -> int:
    """HTB burst of one worker's link/N cap: :func:`htb_burst_bytes`, but no larger than
    ``bottleneck_queue_bytes / (2 N)`` (and never below two frames).

    Every cap saves up its burst while its worker computes or waits for weights, and a
    synchronous iteration starts all N uploads at once: the N bursts reach the bottleneck
    together, at the workers' line rate. With the 10 ms burst of a lone link, 16 caps of
    6.25 Mbit/s released 125 KB into a 100 KB queue at each iteration's start, and the
    shaped incast lost 497 packets in 30 iterations. Half the queue for all N bursts
    together leaves room for the packets already queued.
    """
    if n_workers < 1:
        raise SpecError(f"n_workers={n_workers!r}; allowed >= 1")
    if bottleneck_queue_bytes < 1:
        raise SpecError(f"bottleneck_queue_bytes={bottleneck_queue_bytes!r}; allowed >= 1")
    frame = GSO_FRAME_BYTES if offload else WIRE_FRAME_BYTES
    share = bottleneck_queue_bytes // (2 * n_workers)
    return max(2 * frame, min(htb_burst_bytes(rate_mbps, offload), share))


def htb_class_args(rate_mbps: float, offload: bool = False,
                   burst_bytes: int | None = None) -> list[str]:
    """HTB class arguments; ``burst_bytes`` overrides :func:`htb_burst_bytes`."""
    rate = rate_arg(rate_mbps)
    burst = str(burst_bytes if burst_bytes is not None else htb_burst_bytes(rate_mbps, offload))
    return ["htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
            "quantum", str(HTB_QUANTUM_BYTES)]


def htb_class(rate_mbps: float, offload: bool = False,
              burst_bytes: int | None = None) -> HtbClass:
    """The class :func:`htb_class_args` describes, as the netlink request carries it
    (iproute2 parses ``Nbit`` as N/8 bytes per second)."""
    rate_arg(rate_mbps)  # validates the range
    burst = burst_bytes if burst_bytes is not None else htb_burst_bytes(rate_mbps, offload)
    return HtbClass(rate_bytes_per_s=int(round(rate_mbps * 1e6) / 8), burst_bytes=burst,
                    quantum_bytes=HTB_QUANTUM_BYTES)


def netem_args(link: LinkSpec) -> list[str]:
    args = ["netem", "limit", str(NETEM_LIMIT_PKTS)]
    if link.delay_ms > 0:
        args += ["delay", f"{round(link.delay_ms * 1000)}us"]
    if link.loss_pct > 0:
        args += ["loss", f"{link.loss_pct:g}%"]
    return args


def require_netem(link: LinkSpec, caps: Mapping[str, Any], where: str) -> None:
    if link.needs_netem and not caps.get("netem"):
        asked = ", ".join(p for p, v in (("delay_ms", link.delay_ms),
                                         ("loss_pct", link.loss_pct)) if v > 0)
        raise CapabilityError(
            f"{where}: {asked} needs the netem qdisc, which this kernel lacks "
            f"(delay_ms={link.delay_ms:g}, loss_pct={link.loss_pct:g}); "
            f"use a kernel with sch_netem or set them to 0")


def acks_first(link: LinkSpec, ack_first: bool) -> bool:
    """Whether ``link`` gets the ACKs-first layout: asked for, shaped, and without netem
    (the ACKs would skip its delay and loss)."""
    return ack_first and link.shaped and not link.needs_netem


def data_class_id(ack_first: bool) -> str:
    """The HTB class whose leaf is the bfifo (the data's queue)."""
    return DATA_CLASS_ID if ack_first else CLASS_ID


def shaping_commands(dev: str, link: LinkSpec, caps: Mapping[str, Any], *,
                     offload: bool = False, ack_first: bool = False) -> list[list[str]]:
    """argv lists that install ``link`` on the egress of ``dev`` (empty if unshaped).

    An unshaped rate (None) with a queue or netem still gets an HTB at the 10 Gbit/s
    maximum, so the qdisc layout (and the counters' location) is the same on every link.
    ``ack_first``: pure ACKs leave ahead of the queued data, within the same rate
    (module docstring; not on a link with netem, see :func:`acks_first`).
    Raises CapabilityError before building anything the kernel cannot do.
    """
    require_netem(link, caps, f"link on {dev}")
    if not link.shaped:
        return []
    rate_mbps = link.rate_mbps if link.rate_mbps is not None else RATE_MAX_MBPS
    split = acks_first(link, ack_first)
    cmds = [
        ["tc", "qdisc", "replace", "dev", dev, "root", "handle", ROOT_HANDLE, "htb",
         "default", data_class_id(split).split(":")[1]],
        ["tc", "class", "replace", "dev", dev, "parent", ROOT_HANDLE, "classid", CLASS_ID,
         *htb_class_args(rate_mbps, offload,
                         htb_burst_bytes(rate_mbps, offload, link.burst_ms))],
    ]
    if split:
        for classid, prio in ((ACK_CLASS_ID, "0"), (DATA_CLASS_ID, "1")):
            cmds.append(["tc", "class", "replace", "dev", dev, "parent", CLASS_ID,
                         "classid", classid, "htb", "rate", CHILD_RATE,
                         "ceil", rate_arg(RATE_MAX_MBPS), "cburst", str(GSO_FRAME_BYTES),
                         "prio", prio, "quantum", str(HTB_QUANTUM_BYTES)])
        cmds.append(["tc", "qdisc", "replace", "dev", dev, "parent", ACK_CLASS_ID, "handle",
                     ACK_LEAF_HANDLE, "pfifo", "limit", str(ACK_QUEUE_PKTS)])
        cmds.append(["tc", "filter", "replace", "dev", dev, "parent", ROOT_HANDLE,
                     "protocol", "ip", "prio", "1", "u32", *PURE_ACK_MATCH,
                     "flowid", ACK_CLASS_ID])
    leaf_parent = data_class_id(split)
    if link.needs_netem:
        cmds.append(["tc", "qdisc", "replace", "dev", dev, "parent", CLASS_ID, "handle",
                     NETEM_HANDLE, *netem_args(link)])
        leaf_parent = "10:1"
    cmds.append(["tc", "qdisc", "replace", "dev", dev, "parent", leaf_parent, "handle",
                 LEAF_HANDLE, "bfifo", "limit", str(link.effective_queue_bytes())])
    return cmds


def change_rate_commands(dev: str, rate_mbps: float, *, offload: bool = False,
                         burst_bytes: int | None = None) -> list[list[str]]:
    """Change the HTB rate in place. Never delete and re-add: that drops the queue."""
    return [["tc", "class", "change", "dev", dev, "parent", ROOT_HANDLE, "classid", CLASS_ID,
             *htb_class_args(rate_mbps, offload, burst_bytes)]]


def change_queue_commands(dev: str, queue_bytes: int, *, netem: bool = False,
                          ack_first: bool = False) -> list[list[str]]:
    """Resize the bfifo leaf in place (``qdisc change`` keeps the queued packets).
    ``ack_first``: the link was built with the ACKs-first layout (its bfifo is under
    1:11)."""
    parent = "10:1" if netem else data_class_id(ack_first)
    return [["tc", "qdisc", "change", "dev", dev, "parent", parent, "handle", LEAF_HANDLE,
             "bfifo", "limit", str(queue_bytes)]]


# The kernel's default (and largest) number of segments in one GSO packet.
GSO_MAX_SEGS_DEFAULT = 65_535


def offload_commands(dev: str, offload: bool, gso_max_segs: int = 1) -> list[list[str]]:
    """Turn GSO/TSO/GRO on or off on ``dev``.

    Off also sets ``gso_max_segs`` (1 unless told otherwise). Turning the device's GSO
    off is not enough on its own: a local TCP sender always builds GSO packets (the stack segments them in software
    after the qdisc), so without the segment limit an HTB on the sender's own interface (a
    worker's link/N cap, the down bottleneck on the PS) is charged and released in packets
    of up to 64 KB. Measured: a worker capped at 1 Mbit/s sent 21 back-to-back frames after
    an idle second whatever the HTB burst, and 16 workers capped far below B/N still
    overflowed a 100 KB bottleneck queue. With one segment per packet the cap releases
    frames one by one at its rate. ``gso_max_segs`` (offload off only) allows a few
    segments where the queue can take them (``StarSpec.sender_gso_segs``).
    """
    if not 1 <= gso_max_segs <= GSO_MAX_SEGS_DEFAULT:
        raise SpecError(f"gso_max_segs={gso_max_segs!r}; allowed 1..{GSO_MAX_SEGS_DEFAULT}")
    state = "on" if offload else "off"
    segs = GSO_MAX_SEGS_DEFAULT if offload else gso_max_segs
    return [["ethtool", "-K", dev, "gso", state, "tso", state, "gro", state],
            ["ip", "link", "set", "dev", dev, "gso_max_segs", str(segs)]]


@dataclass(frozen=True)
class QdiscStats:
    """Counters of one qdisc from ``tc -s qdisc show``; bytes include the Ethernet header."""

    kind: str
    handle: str
    parent: str  # "root" for the root qdisc
    sent_bytes: int
    sent_pkts: int
    drops: int
    overlimits: int
    requeues: int
    backlog_bytes: int
    backlog_pkts: int


def _from_json(obj: Mapping[str, Any]) -> QdiscStats:
    return QdiscStats(
        kind=str(obj["kind"]), handle=str(obj["handle"]),
        parent="root" if obj.get("root") else str(obj.get("parent", "")),
        sent_bytes=int(obj.get("bytes", 0)), sent_pkts=int(obj.get("packets", 0)),
        drops=int(obj.get("drops", 0)), overlimits=int(obj.get("overlimits", 0)),
        requeues=int(obj.get("requeues", 0)), backlog_bytes=int(obj.get("backlog", 0)),
        backlog_pkts=int(obj.get("qlen", 0)))


_HEAD = re.compile(r"^qdisc (\S+) (\S+) (root|parent (\S+))")
_SENT = re.compile(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) "
                   r"requeues (\d+)\)")
_BACKLOG = re.compile(r"backlog (\d+)([KMG]?)b (\d+)p")
_SCALE = {"": 1, "K": 1000, "M": 1000_000, "G": 1000_000_000}


def _from_text(text: str) -> list[QdiscStats]:
    out: list[QdiscStats] = []
    blocks = re.split(r"(?m)^(?=qdisc )", text)
    for block in blocks:
        head = _HEAD.match(block)
        if not head:
            continue
        sent, backlog = _SENT.search(block), _BACKLOG.search(block)
        if not sent or not backlog:
            raise ValueError(f"tc stats: no Sent/backlog line for qdisc {head.group(0)!r}")
        out.append(QdiscStats(
            kind=head.group(1), handle=head.group(2),
            parent="root" if head.group(3) == "root" else str(head.group(4)),
            sent_bytes=int(sent.group(1)), sent_pkts=int(sent.group(2)),
            drops=int(sent.group(3)), overlimits=int(sent.group(4)),
            requeues=int(sent.group(5)),
            # iproute2 prints large backlogs as e.g. "1514Kb" (x1000, not 1024).
            backlog_bytes=int(backlog.group(1)) * _SCALE[backlog.group(2)],
            backlog_pkts=int(backlog.group(3))))
    return out


def parse_tc_stats(text: str) -> list[QdiscStats]:
    """Every qdisc in ``tc -s -j qdisc show dev D`` (JSON) or ``tc -s qdisc show`` (text)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tc stats: bad JSON at char {exc.pos}: {exc.msg}") from exc
        return [_from_json(obj) for obj in data]
    return _from_text(text)


def tc_handle(handle: int) -> str:
    """A qdisc handle or parent as ``tc`` prints it: ``20:``, ``1:1``, ``root``."""
    if handle == 0xFFFF_FFFF:
        return "root"
    major, minor = handle >> 16, handle & 0xFFFF
    return f"{major:x}:{minor:x}" if minor else f"{major:x}:"


def bottleneck_counters(text: str) -> QdiscStats:
    """The bottleneck's counters from ``tc -s -j qdisc show`` (:func:`bottleneck_of`)."""
    return bottleneck_of(parse_tc_stats(text))


def bottleneck_of(stats: Sequence[QdiscStats]) -> QdiscStats:
    """The bottleneck's counters: the bfifo leaf's, with HTB's overlimits.

    The leaf is where packets wait for tokens, so its bytes/drops/backlog are the queue's.
    A bfifo never reports overlimits; HTB's root does (each time the class was throttled),
    which tells a saturated link from an idle one.
    """
    leaf = next((s for s in stats if s.handle == LEAF_HANDLE and s.kind == "bfifo"), None)
    if leaf is None:
        found = ", ".join(f"{s.kind} {s.handle}" for s in stats) or "none"
        raise ValueError(f"tc stats: no bfifo {LEAF_HANDLE} leaf (found: {found})")
    root = next((s for s in stats if s.parent == "root" and s.kind == "htb"), None)
    overlimits = root.overlimits if root is not None else leaf.overlimits
    return QdiscStats(kind=leaf.kind, handle=leaf.handle, parent=leaf.parent,
                      sent_bytes=leaf.sent_bytes, sent_pkts=leaf.sent_pkts, drops=leaf.drops,
                      overlimits=overlimits, requeues=leaf.requeues,
                      backlog_bytes=leaf.backlog_bytes, backlog_pkts=leaf.backlog_pkts)


def stats_command(dev: str) -> list[str]:
    return ["tc", "-s", "-j", "qdisc", "show", "dev", dev]
