"""A/B of two socket knobs the agents could use at data-centre rates (docs/linerate.md):
socket buffers fitted to the bandwidth-delay product instead of the kernel's autotuning,
and ``MSG_ZEROCOPY`` instead of a copying ``send``.

Two network namespaces joined by a veth pair, the sender's end shaped by HTB at
``--rate-mbps`` with netem's ``--delay-ms`` under it (the path's RTT; ACKs are not
delayed), the same kernel path as one access link of gradbed's fabric without the
bridge. Each trial sends ``--mbytes`` MB in ``--message-mb`` MB messages, as the agents
write chunks, from a fresh Python process in one namespace to one in the other, and
reports goodput (payload bytes over the receiver's first-to-last-byte time), and the
sender's and the receiver's CPU seconds (user + system, their own processes: softirq
work the kernel charges to whichever process runs is mixed in) per GB. The A and B of a comparison alternate,
``--repeats`` times each, so both see the same load; the load average is printed with
every trial. Needs root (``ip netns``). Nothing of the project is imported: this is
the kernel's side of the question, not the agents'.

Headline: the medians of B over A per comparison (goodput and CPU per GB).
``zc_copied_fraction``: of the zero-copy sends, those the kernel completed by copying
after all (``SO_EE_CODE_ZEROCOPY_COPIED``: the path could not keep the user pages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

NS_A, NS_B = "gbknob-a", "gbknob-b"
VETH_A, VETH_B = "gbknob-va", "gbknob-vb"
IP_A, IP_B = "10.231.0.1", "10.231.0.2"
PORT = 5901

# The two ends, run as ``python -c`` in their namespaces. The sender's options: "bdp"
# sets SO_SNDBUF/SO_RCVBUF to 2 x rate x RTT (the kernel doubles what it is given and
# keeps half for its own bookkeeping); "zerocopy" sets SO_ZEROCOPY and sends with
# MSG_ZEROCOPY, reaping the completions from the error queue as Linux requires.
RECEIVER = r"""
import json, resource, socket, sys, time
bufs = int(sys.argv[1]); total = int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
if bufs: srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, bufs)
srv.bind(("0.0.0.0", int(sys.argv[3]))); srv.listen(1); print("ready", flush=True)
c, _ = srv.accept(); buf = bytearray(1 << 22); view = memoryview(buf); got = 0; t0 = None
r0 = resource.getrusage(resource.RUSAGE_SELF)
while got < total:
    n = c.recv_into(view)
    if n == 0: break
    if t0 is None: t0 = time.monotonic()
    got += n
t1 = time.monotonic(); r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps({"bytes": got, "s": t1 - t0, "cpu_s": cpu}), flush=True)
"""
SENDER = r"""
import errno, json, os, resource, socket, struct, sys
bufs, total, msg_bytes, zc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
s = socket.socket()
if bufs: s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bufs)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
SO_ZEROCOPY, MSG_ZEROCOPY, MSG_ERRQUEUE = 60, 0x4000000, 0x2000
if zc: s.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
s.connect((sys.argv[5], int(sys.argv[6])))
payload = memoryview(bytearray(os.urandom(1024)) * (msg_bytes // 1024))
done = {"calls": 0, "copied": 0}
def reap(block):
    while True:
        try:
            _, anc, _, _ = s.recvmsg(0, 1024, MSG_ERRQUEUE | (0 if block else socket.MSG_DONTWAIT))
        except BlockingIOError:
            return
        for _, _, data in anc:
            code, lo, hi = data[6], *struct.unpack_from("=II", data, 8)
            done["calls"] += hi - lo + 1
            done["copied"] += (hi - lo + 1) if code == 1 else 0  # SO_EE_CODE_ZEROCOPY_COPIED
        if not block: continue
        return
r0 = resource.getrusage(resource.RUSAGE_SELF); sent = 0; calls = 0
while sent < total:
    view = payload[:total - sent]
    while len(view):
        try:
            n = s.sendmsg([view], [], MSG_ZEROCOPY) if zc else s.send(view)
        except OSError as e:
            if e.errno != errno.ENOBUFS: raise
            reap(True); continue
        calls += 1; view = view[n:]; sent += n
        if zc: reap(False)
while zc and done["calls"] < calls: reap(True)
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps({"cpu_s": cpu, "calls": calls, "zc_copied": done["copied"]}), flush=True)
s.close()
"""


def sh(cmd: str) -> None:
    print(f"$ {cmd}", file=sys.stderr)
    subprocess.run(cmd, shell=True, check=True)


def setup(rate_mbps: float, delay_ms: float) -> None:
    teardown()
    sh(f"ip netns add {NS_A} && ip netns add {NS_B}")
    sh(f"ip link add {VETH_A} netns {NS_A} type veth peer name {VETH_B} netns {NS_B}")
    for ns, dev, ip in ((NS_A, VETH_A, IP_A), (NS_B, VETH_B, IP_B)):
        sh(f"ip -n {ns} addr add {ip}/24 dev {dev} && ip -n {ns} link set {dev} up "
           f"&& ip -n {ns} link set lo up")
    # The queue holds one BDP plus 1 MB, so the shaper, not a small queue, sets the pace.
    limit_pkts = int((rate_mbps * 1e6 / 8 * delay_ms / 1e3 + 1e6) / 1500) + 100
    sh(f"ip netns exec {NS_A} tc qdisc add dev {VETH_A} root handle 1: htb default 1")
    sh(f"ip netns exec {NS_A} tc class add dev {VETH_A} parent 1: classid 1:1 htb "
       f"rate {rate_mbps}mbit ceil {rate_mbps}mbit")
    if delay_ms > 0:  # a kernel without sch_netem (the dev VM's) runs the path undelayed
        sh(f"ip netns exec {NS_A} tc qdisc add dev {VETH_A} parent 1:1 handle 10: netem "
           f"delay {delay_ms}ms limit {limit_pkts}")
    else:
        sh(f"ip netns exec {NS_A} tc qdisc add dev {VETH_A} parent 1:1 handle 10: pfifo "
           f"limit {limit_pkts}")


def teardown() -> None:
    for ns in (NS_A, NS_B):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def trial(bufs: int, zerocopy: bool, total: int, msg_bytes: int) -> dict[str, float]:
    rx = subprocess.Popen(["ip", "netns", "exec", NS_B, sys.executable, "-c", RECEIVER,
                           str(bufs), str(total), str(PORT)], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    tx = subprocess.run(["ip", "netns", "exec", NS_A, sys.executable, "-c", SENDER, str(bufs),
                         str(total), str(msg_bytes), "1" if zerocopy else "0", IP_B, str(PORT)],
                        capture_output=True, text=True, check=False, timeout=600)
    if tx.returncode != 0:
        rx.kill()
        raise RuntimeError(f"sender failed: {tx.stderr[-2000:]}")
    got = json.loads(rx.stdout.readline())
    rx.wait(timeout=30)
    sent = json.loads(tx.stdout)
    return {"goodput_mbps": got["bytes"] * 8 / got["s"] / 1e6,
            "cpu_s_per_gb": sent["cpu_s"] / (total / 1e9),
            "rx_cpu_s_per_gb": got["cpu_s"] / (total / 1e9), "calls": sent["calls"],
            "zc_copied_fraction": sent["zc_copied"] / sent["calls"] if zerocopy else 0.0,
            "load1": os.getloadavg()[0]}


def compare(name: str, a: tuple[int, bool], b: tuple[int, bool], args: argparse.Namespace
            ) -> dict[str, object]:
    total, msg = int(args.mbytes * 1e6), int(args.message_mb * 1e6)
    rows: dict[str, list[dict[str, float]]] = {"A": [], "B": []}
    for _ in range(args.repeats):
        for key, (bufs, zc) in (("A", a), ("B", b)):
            r = trial(bufs, zc, total, msg)
            rows[key].append(r)
            print(f"{name} {key}: {json.dumps(r)}", file=sys.stderr)

    def med(key: str, col: str) -> float:
        return statistics.median(r[col] for r in rows[key])
    return {"comparison": name, "trials": rows,
            "goodput_b_over_a": med("B", "goodput_mbps") / med("A", "goodput_mbps"),
            "cpu_per_gb_b_over_a": med("B", "cpu_s_per_gb") / med("A", "cpu_s_per_gb"),
            "rx_cpu_per_gb_b_over_a": med("B", "rx_cpu_s_per_gb") / med("A", "rx_cpu_s_per_gb")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbps", type=float, default=1000.0)
    ap.add_argument("--delay-ms", type=float, default=0.0,
                    help="netem delay on the sender's side (needs sch_netem)")
    ap.add_argument("--rtt-ms", type=float, default=0.0,
                    help="the RTT the fitted buffers are sized for (default: --delay-ms, "
                         "else 1 ms, above the undelayed path's base RTT)")
    ap.add_argument("--mbytes", type=float, default=200.0, help="MB per trial")
    ap.add_argument("--message-mb", type=float, default=4.0, help="MB per send (a chunk)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rtt_ms = args.rtt_ms or args.delay_ms or 1.0
    bdp2 = int(2 * args.rate_mbps * 1e6 / 8 * rtt_ms / 1e3)
    setup(args.rate_mbps, args.delay_ms)
    try:
        out = {"rate_mbps": args.rate_mbps, "delay_ms": args.delay_ms, "rtt_ms": rtt_ms,
               "kernel": os.uname().release,
               "buffers_bytes_fitted": bdp2,
               "results": [compare("buffers: autotuned (A) vs 2 x BDP (B)", (0, False),
                                   (bdp2, False), args),
                           compare("send (A) vs MSG_ZEROCOPY (B)", (0, False), (0, True), args)]}
    finally:
        teardown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
