"""``adaptive.rate_source = "drain"`` (agents/core/drain.py): a worker's own link rate from
the kernel's transmit stamps of the packets that waited in its shaper, and the conservative
windowed estimate the adaptive keep is planned on (pure; the last tests use real sockets)."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path

import pytest

from agents.core import config as cfgmod
from agents.core.drain import (
    TxStamp,
    WriteStart,
    conservative_rate_bps,
    queued_departure_rate_bps,
)
from agents.core.ethernet import TCP_MSS_BYTES
from agents.core.policies import AdaptiveRatio
from analysis.load import load_events
from controller.loopback.dp import run_loopback

MS = 1_000_000
GSO_PKT_BYTES = 8 * TCP_MSS_BYTES  # gradbed caps the worker's GSO packets at 8 segments


def htb_tsq(writes: list[tuple[int, int]], rate_bps: float, burst_bytes: int,
            packet_bytes: int, in_qdisc: int = 2) -> list[TxStamp]:
    """The stamps of ``writes`` ((ts_ns, bytes) written to the socket) through an HTB class
    of ``rate_bps`` and a ``burst_bytes`` bucket, full at the start, with the socket in
    front of the qdisc as the kernel has it: the head packet leaves as soon as the tokens
    are >= 0 and is charged afterwards (net/sched/sch_htb.c); TCP Small Queues let at most
    ``in_qdisc`` of the flow's packets sit in the qdisc, the rest of the data waits in the
    socket, and a write appended there fills the last packet not yet handed down (up to
    ``packet_bytes``) before it starts a new one. A packet carries the key of the last
    write that ends in it (the kernel keeps one stamp key per packet, so a write merged
    into a packet after another loses the other's stamp); a packet in which no write ends
    carries none."""
    pending: list[list[int]] = []  # packets still in the socket: [bytes, key or -1]
    queue: list[tuple[int, int, int]] = []  # in the qdisc: (bytes, key, sched_ns)
    out: list[TxStamp] = []
    key, tokens, last_ns, now, i = -1, float(burst_bytes), 0, 0, 0
    while i < len(writes) or pending or queue:
        head_ns = None
        if queue:
            t = max(now, last_ns)
            avail = min(float(burst_bytes), tokens + (t - last_ns) * rate_bps / 8e9)
            head_ns = t if avail >= 0 else t + int(-avail * 8e9 / rate_bps) + 1
        if i < len(writes) and (head_ns is None or writes[i][0] <= head_ns):
            now, size = writes[i]
            i += 1
            while size > 0:
                if not pending or pending[-1][0] == packet_bytes:
                    pending.append([0, -1])
                n = min(size, packet_bytes - pending[-1][0])
                pending[-1][0] += n
                size -= n
                key += n
            pending[-1][1] = key
        else:
            assert head_ns is not None
            now = head_ns
            tokens = min(float(burst_bytes), tokens + (now - last_ns) * rate_bps / 8e9)
            last_ns = now
            size, k, sched = queue.pop(0)
            tokens -= size
            if k >= 0:
                out.append(TxStamp(k, sched, now))
        while pending and len(queue) < in_qdisc:
            size, k = pending.pop(0)
            queue.append((size, k, now))
    return out


def htb(writes: list[tuple[int, int]], rate_bps: float, burst_bytes: int,
        max_pkt_bytes: int = GSO_PKT_BYTES) -> list[TxStamp]:
    """The stamps of ``writes`` ((ts_ns, bytes) handed to the qdisc) through an HTB class
    of ``rate_bps`` and a ``burst_bytes`` bucket, full at the start: each write is cut into
    packets of at most ``max_pkt_bytes``, all in the qdisc as soon as written (no socket
    in between, so no write is merged with another); the last packet of each write
    carries its stamps. :func:`htb_tsq` with room in the qdisc for everything."""
    return htb_tsq(writes, rate_bps, burst_bytes, max_pkt_bytes, in_qdisc=sys.maxsize)


def starts(writes: list[tuple[int, int]], first_key: int = 0) -> list[WriteStart]:
    """The :class:`WriteStart` of each of ``writes`` ((ts_ns, bytes), as the models take
    them), the first byte at ``first_key``."""
    out, key = [], first_key
    for ts_ns, size in writes:
        out.append(WriteStart(key, ts_ns))
        key += size
    return out


def timed(stamps: list[TxStamp], writes: list[tuple[int, int]], **kw: int) -> float | None:
    """The drain rate of stamps from the models here for their ``writes``, whose packets
    hold at most ``GSO_PKT_BYTES`` unless the test says otherwise."""
    kw.setdefault("packet_bytes", GSO_PKT_BYTES)
    return queued_departure_rate_bps(stamps, starts(writes), **kw)


def test_a_queued_upload_reads_its_link_rate() -> None:
    # w0's case: 38 KB written in 11 chunks within 9 ms onto a 10 Mbit/s link whose 10 ms
    # bucket (12.5 KB) lets the first bytes through at once.
    writes = [(k * 900_000, 3_500) for k in range(11)]
    assert timed(htb(writes, 10e6, 12_500), writes) == pytest.approx(10e6, rel=0.02)
    # A dense 340 KB written in 14 ms onto 100 Mbit/s (a 125 KB bucket) reads 100 Mbit/s.
    writes = [(k * 1_300_000, 31_000) for k in range(11)]
    assert timed(htb(writes, 100e6, 125_000), writes) == pytest.approx(100e6, rel=0.05)


def test_a_slow_writer_gives_no_sample() -> None:
    # A 100 Mbit/s link fed by a writer that compresses 3 ms per 5 KB chunk (13 Mbit/s):
    # no packet waits, so nothing about the link is known (and the worker is not cut).
    writes = [(k * 3 * MS, 5_000) for k in range(11)]
    stamps = htb(writes, 100e6, 125_000)
    assert all(s.wait_ns == 0 for s in stamps)
    assert timed(stamps, writes) is None


def test_the_buckets_credit_is_not_timed() -> None:
    # 10 KB on a 10 Mbit/s link with a 12.5 KB bucket leave at once: no rate in that.
    writes = [(0, 5_000), (10_000, 5_000)]
    assert timed(htb(writes, 10e6, 12_500), writes) is None
    # Timing from the credit's last packet would read several times the link's rate.
    writes = [(k * 100_000, 3_000) for k in range(12)]
    stamps = htb(writes, 10e6, 12_500)
    naive = 8e9 * (stamps[-1].key - stamps[0].key) / (stamps[-1].snd_ns - stamps[0].snd_ns)
    assert naive > 1.3 * 10e6
    assert timed(stamps, writes) == pytest.approx(10e6, rel=0.02)


def test_a_writer_stall_breaks_the_run_and_the_rate_holds() -> None:
    # 20 ms without writes in the middle of an upload: the queue drains, the bucket fills
    # again; the longest queued run still reads the link.
    writes = [(k * 300_000, 3_000) for k in range(8)]
    writes += [(22 * MS + k * 300_000, 3_000) for k in range(8)]
    stamps = htb(writes, 8e6, 10_000)
    assert any(s.wait_ns == 0 for s in stamps[9:])          # the refilled bucket's credit
    assert timed(stamps, writes) == pytest.approx(8e6, rel=0.02)


US = 1_000


def test_a_writer_behind_its_link_is_not_timed_from_the_qdiscs_own_delay() -> None:
    # Recorded in Mininet on a quiet machine (load 0.3): 11 writes of 5 KB every 3-8 ms onto
    # a 100 Mbit/s uplink with its 125 KB bucket full (8-segment packets, one a write).
    # No packet waited for tokens, but the qdisc ran 15-71 us late after each sched stamp
    # (times in us from the first): stamps 6 and 7 waited 47 and 71 us, 5.3 ms apart.
    writes = [-57, 4349, 7851, 11082, 20367, 23685, 27256, 32490, 36438, 44032, 52425]
    sched_snd = [(0, 35), (4389, 4418), (7890, 7912), (11114, 11135), (20423, 20464),
                 (23731, 23764), (27333, 27380), (32636, 32707), (36502, 36541),
                 (44089, 44124), (52517, 52580)]
    stamps = [TxStamp(5_000 * (k + 1) - 1, a * US, b * US) for k, (a, b) in enumerate(sched_snd)]
    upload = [(t * US, 5_000) for t in writes]
    # With the threshold under those two waits (45 us), the pair reads as a run of 5 KB in
    # 5.3 ms: a 7.5 Mbit/s "link", as the slow writer of tests/topo/test_drain_mininet.py
    # read 9-11 Mbit/s. Write 7 was begun 5.2 ms after stamp 6 left: the link had idled.
    assert upload[7][0] > stamps[6].snd_ns
    ahead = [(-10**18, size) for _, size in upload]   # the old estimator: no write times
    assert timed(stamps, ahead, wait_min_ns=45 * US) == pytest.approx(7.5e6, rel=0.02)
    assert timed(stamps, upload, wait_min_ns=45 * US) is None
    assert timed(stamps, upload) is None


def random_writes(rng: random.Random, same_size: bool) -> list[tuple[int, int]]:
    t, writes, size = 0, [], rng.randint(500, 40_000)
    for _ in range(rng.randint(3, 20)):
        t += rng.randint(0, 3 * MS)
        writes.append((t, size if same_size else rng.randint(500, GSO_PKT_BYTES)))
    return writes


@pytest.mark.parametrize("same_size", [False, True], ids=["one-packet-writes", "same-size"])
def test_exact_on_random_uploads(same_size: bool) -> None:
    # The two cases the formula is exact for: writes of one packet each (w0's compressed
    # chunks), and writes of one size (a dense gradient's chunks), 300 random uploads each.
    rng = random.Random(7)
    n_timed = 0
    for _ in range(300):
        rate = rng.choice([5e6, 10e6, 50e6, 100e6])
        writes = random_writes(rng, same_size)
        got = timed(htb(writes, rate, int(rate / 8e3 * 10)), writes)
        assert got is None or got == pytest.approx(rate, rel=0.01), (rate, got, writes)
        n_timed += got is not None
    assert n_timed > 60


def test_the_keys_own_packet_would_read_too_high() -> None:
    # Timed end key to end key, a short run whose last packet is the bigger one reads 50 %
    # high (5 Mbit/s read as 7.5): the last packet is paid for only after it left.
    writes = [(174_690, 9_570), (3_079_770, 3_294), (5_003_232, 4_945)]
    stamps = htb(writes, 5e6, 6_250)
    a, b = stamps[1], stamps[2]
    assert 8e9 * (b.key - a.key) / (b.snd_ns - a.snd_ns) > 7e6
    assert timed(stamps, writes) == pytest.approx(5e6, rel=0.01)
    # The third write begun after the second's packet left (5.5 ms): both packets still
    # waited, and this link never idled, but a link that did (the writer behind it) would
    # leave the same stamps, so the pair is not timed.
    assert writes[2][0] < a.snd_ns
    late = writes[:2] + [(a.snd_ns + 500_000, 4_945)]
    stamps = htb(late, 5e6, 6_250)
    assert stamps[1].wait_ns > MS and stamps[2].wait_ns > MS
    assert timed(stamps, late) is None


def test_a_merged_upload_on_a_traced_uplink_reads_its_link() -> None:
    # w0's upload on its traced uplink (one-segment packets, topo.spec.NetSpec.with_traces):
    # 11 writes of 3.6 KB within 3 ms onto 10 Mbit/s; once packets wait in the qdisc the
    # rest waits in the socket. Every write's last packet is stamped.
    writes = [(k * 300_000, 3_624) for k in range(11)]
    stamps = htb_tsq(writes, 10e6, 12_500, TCP_MSS_BYTES)
    assert len(stamps) == len(writes)
    assert timed(stamps, writes, packet_bytes=TCP_MSS_BYTES) == pytest.approx(10e6, rel=0.01)


def merged_errors(segs: int, packet_bytes: int) -> list[float]:
    """Relative errors of the drain rate over 300 random uploads of writes of any size
    through the socket-and-qdisc model with ``segs``-segment packets, timed as if
    packets held ``packet_bytes``; untimed uploads are left out."""
    rng = random.Random(11)
    errors = []
    for _ in range(300):
        rate = rng.choice([5e6, 10e6, 20e6, 100e6])
        writes = random_writes(rng, same_size=False)
        got = timed(htb_tsq(writes, rate, int(rate / 8e3 * 10), segs * TCP_MSS_BYTES),
                    writes, packet_bytes=packet_bytes)
        if got is not None:
            errors.append(got / rate - 1)
    return errors


@pytest.mark.parametrize("segs", [1, 8])
def test_random_merged_uploads_read_their_link(segs: int) -> None:
    # Writes of any size, merged in the socket: a packet's start is known only to within
    # one packet, so single uploads can read off by up to a packet in the run's bytes
    # (measured: 15 % with one segment, 26 % with eight); the typical one reads the link.
    errors = merged_errors(segs, segs * TCP_MSS_BYTES)
    assert len(errors) > 100
    assert statistics.median(abs(e) for e in errors) <= 0.02
    assert max(abs(e) for e in errors) <= 0.3
    if segs == 1:
        # Taking each packet's start right after the previous stamped key (this module
        # before 2026-11-26) reads a packet of a multi-packet write as the whole write:
        # up to twice the link, or a third of it.
        old = merged_errors(segs, 10**9)
        assert max(abs(e) for e in old) > 0.5
        assert statistics.median(abs(e) for e in old) > 2 * statistics.median(
            abs(e) for e in errors)


def test_too_little_to_time_gives_nothing() -> None:
    writes = [(0, 1_001), (0, 1_000)]
    assert timed([], writes) is None
    one = [TxStamp(1_000, 0, 5 * MS)]
    assert timed(one, writes) is None
    short = [TxStamp(1_000, 0, 1 * MS), TxStamp(2_000, 0, 2 * MS)]   # 1 ms, 1 KB
    assert timed(short, writes) is None


def test_bad_input_is_refused_naming_what() -> None:
    one = [TxStamp(1_000, 0, 5 * MS)]
    with pytest.raises(ValueError, match="wait_min_ns"):
        timed(one, [(0, 1_001)], wait_min_ns=-1)
    with pytest.raises(ValueError, match="first byte 2000"):
        queued_departure_rate_bps(one, [WriteStart(2_000, 0)])
    with pytest.raises(ValueError, match="first byte None"):
        queued_departure_rate_bps(one, [])
    with pytest.raises(ValueError, match="write 1 starts at key 0"):
        queued_departure_rate_bps(one, [WriteStart(0, 0), WriteStart(0, 1)])


def test_the_conservative_rate_is_the_window_minimum_unless_at_plan() -> None:
    assert conservative_rate_bps([], 95e6, 0.2) is None
    assert conservative_rate_bps([12e6, 7e6, 9e6], 95e6, 0.2) == 7e6
    # A link as fast as planned reads either side of the plan: not a cut.
    assert conservative_rate_bps([90e6, 80e6, 101e6], 95e6, 0.2) == 95e6
    assert conservative_rate_bps([70e6], 95e6, 0.2) == 70e6
    with pytest.raises(ValueError, match="plan_bps"):
        conservative_rate_bps([1.0], 0.0, 0.2)


def run_iterations(policy: AdaptiveRatio, rates: list[float | None]) -> list[float]:
    """The keep of each iteration's first chunk, feeding after each upload the one sample
    the worker gets (None: the upload gave no sample)."""
    keeps = []
    for i, rate in enumerate(rates):
        policy.start(340_000, r0_bps=95e6, ts_ns=i * 100)
        keeps.append(policy.keep_for_next_chunk(0).keep)
        if rate is not None:
            policy.observe(rate, i * 100 + 50)
    return keeps


def test_a_dip_is_followed_from_the_next_upload_and_held_for_the_window() -> None:
    # w0's link: 10 Mbit/s, a dip to 5 for two uploads, back to 10; one sample per upload.
    rates: list[float | None] = [10e6, 10e6, 10e6, 5e6, 5e6, 10e6, 10e6, 10e6, 10e6, 10e6]
    drain = run_iterations(AdaptiveRatio(rate_source="drain", drain_window=3, eps=0.2),
                           rates)
    assert drain[0] == 1.0                                    # nothing measured yet
    assert drain[1] == pytest.approx(10 / 95)
    assert drain[4] == pytest.approx(5 / 95)                  # the dip, one upload later
    assert drain[5:8] == pytest.approx([5 / 95] * 3)          # held while in the window
    assert drain[8] == pytest.approx(10 / 95)                 # and released after it
    # The old per-iteration window ("writes", carry_rt): one sample per iteration never
    # makes a stable pair, so the keep never leaves the plan -- the failure this replaces.
    old = run_iterations(AdaptiveRatio(rate_source="writes", carry_rt=True, eps=0.2), rates)
    assert old == [1.0] * len(rates)


def test_an_upload_without_a_sample_keeps_the_last_estimate() -> None:
    # A long (dense) upload on a slow link may show no backlogged stretch: falling back to
    # the plan there sent w0 dense for whole runs (measured 2026-11-24 22:08, p99 4.5x).
    keeps = run_iterations(AdaptiveRatio(rate_source="drain", drain_window=2, eps=0.2),
                           [8e6, None, None, None, 9e6])
    assert keeps == pytest.approx([1.0] + [8 / 95] * 4)


def test_a_fast_worker_at_its_plan_is_not_cut() -> None:
    keeps = run_iterations(AdaptiveRatio(rate_source="drain", drain_window=4, eps=0.2),
                           [97e6, 88e6, 101e6, 93e6, 99e6])
    assert keeps == [1.0] * 5


def test_drain_window_is_validated() -> None:
    cfg = cfgmod.from_dict({"adaptive": {"rate_source": "drain", "drain_window": 6}})
    assert cfg.adaptive.drain_window == 6
    with pytest.raises(cfgmod.ConfigError, match="adaptive.drain_window"):
        cfgmod.from_dict({"adaptive": {"drain_window": 0}})


@pytest.mark.loopback
def test_real_workers_read_their_kernel_stamps_every_upload(tmp_path: Path) -> None:
    """The worker's side over loopback TCP (real sockets and kernel stamps, no Mininet, no
    shaper): every upload ends with one ``drain`` event holding its writes' stamps, nothing
    is timed where nothing shapes, and the run completes. (A single packet can still show
    a wait on a busy CPU, when the interrupt or softirq that stamps it runs late; a rate
    needs a run of them spanning 2 ms.)"""
    n, iters = 2, 6
    run_dir, rc = run_loopback(tmp_path, [
        f"net.workers={n}", f"run.iterations={iters}", "workload.hidden=64",
        "workload.chunk_bytes=8192", 'adaptive.policy="adaptive"',
        'adaptive.rate_source="drain"', 'compress.name="topk"'])
    assert rc == 0, (run_dir / "ps.log").read_text()
    ev = load_events(run_dir)
    drains = ev[ev["event"] == "drain"]
    assert len(drains) == n * iters
    assert (drains["stamps"] >= 1).all()
    assert drains["rate_bps"].isna().all(), drains[["stamps", "waited", "rate_bps"]]
