"""pcap replay as background traffic (traces/pcap.py, controller/background.py): captures
are readdressed with valid checksums and their timing kept, bad files are named before a
network exists, tcpreplay's totals are read, and in Mininet the replayed frames cross the
bottleneck at the rate asked for."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import ARP, Ether
from scapy.packet import Raw
from scapy.utils import rdpcap, wrpcap

from agents.core import config as cfgmod
from agents.core.bandwidth import TraceError
from controller.background import commands, read_tcpreplay
from controller.run import shape_spec
from tests.support.mininet_run import events, gradbed_run, leftovers, summary
from traces.pcap import pcap_summary, read_capture, rewrite_pcap, rewrite_pcap_file

REPO = Path(__file__).resolve().parents[2]
SHARED_PCAP = Path(os.environ.get("GRADBED_SHARED_TRACES", REPO.parent / "shared" / "traces")) / "pcap" / "test.pcap"
ADDR = dict(src_mac="02:00:00:00:00:64", dst_mac="02:00:00:00:00:01", src_ip="10.0.0.100",
            dst_ip="10.0.0.1")


def capture(path: Path, n_udp: int = 20, gap_s: float = 0.001, size: int = 1000) -> Path:
    """A capture with UDP and TCP frames, plus frames replay must leave out: ARP, IPv6
    and one above the 1514-byte MTU."""
    pkts = []
    for i in range(n_udp):
        p = Ether(src="aa:aa:aa:aa:aa:aa", dst="bb:bb:bb:bb:bb:bb") / IP(
            src="192.168.1.2", dst="192.168.1.3") / UDP(sport=4000, dport=5000) / Raw(
            b"x" * (size - 42))
        p.time = 100.0 + i * gap_s
        pkts.append(p)
    extra = [Ether() / IP(src="192.168.1.2", dst="8.8.8.8") / TCP(dport=443, flags="S"),
             Ether() / ARP(), Ether() / IPv6() / UDP(),
             Ether() / IP() / UDP() / Raw(b"y" * 3000)]
    for j, p in enumerate(extra):
        p.time = 100.0 + n_udp * gap_s + j * gap_s
        pkts.append(p)
    wrpcap(str(path), pkts)
    return path


def test_rewrite_readdresses_keeps_timing_and_leaves_out_what_cannot_cross(tmp_path):
    src = capture(tmp_path / "in.pcap")
    s = rewrite_pcap(read_capture(src), tmp_path / "out.pcap", **ADDR)
    assert s.packets == 21 and s.ipv4_packets == 21  # 20 UDP + 1 TCP; ARP, IPv6, jumbo out
    out = rdpcap(str(tmp_path / "out.pcap"))
    assert len(out) == 21
    for p in out:
        assert (p[Ether].src, p[Ether].dst) == (ADDR["src_mac"], ADDR["dst_mac"])
        assert (p[IP].src, p[IP].dst) == (ADDR["src_ip"], ADDR["dst_ip"])
        # The checksums are those of the new addresses: rebuilding gives the same bytes.
        fresh = p.copy()
        del fresh[IP].chksum
        layer = TCP if fresh.haslayer(TCP) else UDP
        del fresh[layer].chksum
        assert bytes(Ether(bytes(fresh))) == bytes(p)
    times = [float(p.time) for p in out]
    assert times[1] - times[0] == pytest.approx(0.001, abs=1e-6)
    assert pcap_summary(src).ipv4_packets == 21 and pcap_summary(src).packets == 24


@pytest.mark.skipif(not SHARED_PCAP.exists(), reason=f"{SHARED_PCAP} is absent")
def test_real_capture_summary():
    s = pcap_summary(SHARED_PCAP)
    assert s.packets == 179 and s.ipv4_packets == 150
    assert s.duration_s == pytest.approx(3.26, abs=0.01)


def test_bad_captures_are_named(tmp_path):
    with pytest.raises(TraceError, match="nope.pcap: cannot read"):
        pcap_summary(tmp_path / "nope.pcap")
    (tmp_path / "text.pcap").write_text("this is not a capture\n")
    with pytest.raises(TraceError, match="text.pcap: not a pcap capture"):
        pcap_summary(tmp_path / "text.pcap")
    wrpcap(str(tmp_path / "arp.pcap"), [Ether() / ARP()])
    with pytest.raises(TraceError, match="arp.pcap: none of its 1 packets is an IPv4"):
        pcap_summary(tmp_path / "arp.pcap")


def test_tcpreplay_totals_are_read(tmp_path):
    log = tmp_path / "bg0.log"
    log.write_text(" User interrupt...\nsendpacket_abort\n"
                   "Actual: 31935 packets (13545540 bytes) sent in 5.41 seconds\n"
                   "Rated: 2499952.9 Bps, 19.99 Mbps, 5893.89 pps\n")
    r = read_tcpreplay(log)
    assert r["packets"] == 31935 and r["bytes"] == 13545540 and r["seconds"] == 5.41
    assert r["mbps"] == pytest.approx(13545540 * 8 / 5.41 / 1e6)
    log.write_text("Fatal Error: bad interface\n")
    assert "no 'Actual" in read_tcpreplay(log)["error"]


def cfg(*overrides: str) -> cfgmod.ExperimentConfig:
    return cfgmod.load(REPO / "configs" / "test_tiny.toml", list(overrides))


def test_pcap_commands_and_config_errors(tmp_path):
    c = cfg("net.background_hosts=2", 'background.kind="pcap"', 'background.pcap="x.pcap"',
            "background.pcap_mbps=5", "background.duration_s=3")
    cmds = commands(c, shape_spec(c), tmp_path)
    assert [x.host for x in cmds] == ["bg0", "bg1"]
    assert cmds[1].argv == ("tcpreplay", "-i", "bg1-eth0", "--loop=0", "--duration=3",
                            "--mbps=5", str(tmp_path / "background" / "bg1.pcap"))
    with pytest.raises(cfgmod.ConfigError, match='background.flows = 2: is for kind = "bulk", '
                                                 'not "pcap"'):
        cfg("net.background_hosts=1", 'background.kind="pcap"', 'background.pcap="x"',
            "background.flows=2")
    with pytest.raises(cfgmod.ConfigError, match="background.direction = 'down': must be up"):
        cfg("net.background_hosts=1", 'background.kind="pcap"', 'background.pcap="x"',
            'background.direction="down"')
    with pytest.raises(cfgmod.ConfigError, match="background.pcap = 'x': needs "
                                                 "net.background_hosts >= 1"):
        cfg('background.kind="pcap"', 'background.pcap="x"')


def test_gradbed_run_names_a_bad_capture(tmp_path, capsys):
    from controller import cli

    bad = tmp_path / "bad.pcap"
    bad.write_text("not a capture")
    rc = cli.main(["run", str(REPO / "configs" / "test_tiny.toml"), "--dry-run", "--set",
                   "net.background_hosts=1", "--set", 'background.kind="pcap"', "--set",
                   f'background.pcap="{bad}"'])
    assert rc == 2
    assert f"test_tiny.toml: background.pcap: {bad}: not a pcap capture" in \
        capsys.readouterr().err


@pytest.mark.mininet
def test_replayed_capture_crosses_the_bottleneck(tmp_path):
    src = capture(tmp_path / "udp.pcap", n_udp=200)
    run_dir, proc = gradbed_run("configs/test_tiny.toml", [
        "run.iterations=12", "run.eval_every=12", "net.background_hosts=1",
        'background.kind="pcap"', f'background.pcap="{src}"', "background.pcap_mbps=10"],
        tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = summary(run_dir)
    ev = events(run_dir)
    bg = ev[ev["event"] == "background"]
    assert list(bg["host"]) == ["bg0"] and bg["packets"].iloc[0] > 1000
    assert s["background_mbps"] == pytest.approx(10.0, rel=0.1)
    links = pd.read_parquet(run_dir / "links.parquet")
    up = links[links["direction"] == "up"]["sent_bytes"]
    assert up.max() - up.min() > s["background_bytes"] + 0.8 * s["bytes_up"]
    assert leftovers() == []


def test_tcprewrite_output_is_byte_identical_to_the_scapy_reference(tmp_path):
    src = capture(tmp_path / "in.pcap")
    ref = rewrite_pcap(read_capture(src), tmp_path / "scapy.pcap", **ADDR)
    fast = rewrite_pcap_file(src, tmp_path / "tcprewrite.pcap", **ADDR)
    assert (tmp_path / "tcprewrite.pcap").read_bytes() == (tmp_path / "scapy.pcap").read_bytes()
    assert fast == ref


def padded_ipv4_frames(path: Path) -> set[int]:
    """Indexes (among IPv4 frames) of frames longer than 14 + their IPv4 total length."""
    ips = [p for p in rdpcap(str(path)) if p.haslayer(IP)]
    return {i for i, p in enumerate(ips) if len(p) > 14 + p[IP].len}


@pytest.mark.skipif(not SHARED_PCAP.exists(), reason=f"{SHARED_PCAP} is absent")
def test_tcprewrite_matches_scapy_on_the_real_capture_but_for_padded_frames(tmp_path):
    rewrite_pcap(read_capture(SHARED_PCAP), tmp_path / "scapy.pcap", **ADDR)
    fast = rewrite_pcap_file(SHARED_PCAP, tmp_path / "tcprewrite.pcap", **ADDR)
    a, b = rdpcap(str(tmp_path / "scapy.pcap")), rdpcap(str(tmp_path / "tcprewrite.pcap"))
    assert len(a) == len(b) == fast.ipv4_packets == 150
    padded = padded_ipv4_frames(SHARED_PCAP)
    assert padded  # the capture has them: short frames padded to 60 bytes
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        assert float(x.time) == float(y.time)
        if i not in padded:
            assert bytes(x) == bytes(y), i
        else:  # tcprewrite stretches the IPv4 total length over the padding
            assert len(x) == len(y) and y[IP].len == len(y) - 14
            fx, fy = x.copy(), y.copy()
            fx[IP].len = fy[IP].len = 0
            fx[IP].chksum = fy[IP].chksum = 0
            assert bytes(fx) == bytes(fy), i


def big_capture(path: Path, n: int) -> Path:
    """``n`` 1000-byte UDP frames, 1 ms apart, written record by record (fast)."""
    import struct as st

    frame = bytes(Ether(src="aa:aa:aa:aa:aa:aa", dst="bb:bb:bb:bb:bb:bb") / IP(
        src="192.168.1.2", dst="192.168.1.3") / UDP(sport=4000, dport=5000) / Raw(b"x" * 958))
    with open(path, "wb") as f:
        f.write(st.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        for i in range(n):
            f.write(st.pack("<IIII", 1000 + i // 1000, (i % 1000) * 1000, len(frame),
                            len(frame)))
            f.write(frame)
    return path


def test_a_50k_packet_capture_is_rewritten_in_seconds(tmp_path):
    import time

    src = big_capture(tmp_path / "big.pcap", 50_000)
    t0 = time.monotonic()
    s = rewrite_pcap_file(src, tmp_path / "out.pcap", **ADDR)
    took_s = time.monotonic() - t0
    assert s.ipv4_packets == 50_000 and s.duration_s == pytest.approx(49.999)
    assert took_s < 10, took_s  # scapy took 67 s for this size
    last = rdpcap(str(tmp_path / "out.pcap"), count=1)[0]
    assert (last[IP].src, last[IP].dst) == (ADDR["src_ip"], ADDR["dst_ip"])


def test_tcprewrite_path_names_bad_files(tmp_path):
    with pytest.raises(TraceError, match="nope.pcap: cannot read"):
        rewrite_pcap_file(tmp_path / "nope.pcap", tmp_path / "o.pcap", **ADDR)
    (tmp_path / "junk.pcap").write_bytes(b"not a capture at all")
    with pytest.raises(TraceError, match="junk.pcap: not a pcap capture"):
        rewrite_pcap_file(tmp_path / "junk.pcap", tmp_path / "o.pcap", **ADDR)
    only_arp = tmp_path / "arp.pcap"
    wrpcap(str(only_arp), [Ether() / ARP()])
    with pytest.raises(TraceError, match="nothing to replay"):
        rewrite_pcap_file(only_arp, tmp_path / "o.pcap", **ADDR)
