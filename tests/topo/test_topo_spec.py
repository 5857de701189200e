"""Topology specs validate every field and name it in the error (DESIGN.md section 4)."""

from __future__ import annotations

import math

import pytest

from topo.shapes.star import StarSpec
from topo.spec import LinkSpec, SpecError, default_queue_bytes


@pytest.mark.parametrize("kwargs, field, allowed", [
    ({"rate_mbps": 0.0}, "rate_mbps=0.0", "0.01..10000"),
    ({"rate_mbps": 10_001.0}, "rate_mbps=10001.0", "0.01..10000"),
    ({"rate_mbps": math.nan}, "rate_mbps=nan", "0.01..10000"),
    ({"rate_mbps": 10.0, "queue_bytes": 100}, "queue_bytes=100", "1514.."),
    ({"rate_mbps": 10.0, "delay_ms": -1.0}, "delay_ms=-1.0", "0..10000"),
    ({"rate_mbps": 10.0, "loss_pct": 101.0}, "loss_pct=101.0", "0..100"),
    ({"rate_mbps": "100mbit"}, "rate_mbps='100mbit'", "not a number"),
])
def test_link_spec_errors_name_field_value_and_range(kwargs, field, allowed):
    with pytest.raises(SpecError) as info:
        LinkSpec(**kwargs)
    assert field in str(info.value)
    assert allowed in str(info.value)


def test_link_spec_accepts_10_gbit_unlike_mininet():
    assert LinkSpec(rate_mbps=10_000.0).rate_mbps == 10_000.0


def test_default_queue_is_20ms_with_a_32_frame_floor():
    assert default_queue_bytes(1000.0) == 2_500_000
    assert default_queue_bytes(1.0) == 32 * 1514
    assert LinkSpec(rate_mbps=100.0).effective_queue_bytes() == 250_000
    assert LinkSpec(rate_mbps=100.0, queue_bytes=9000).effective_queue_bytes() == 9000


def test_netem_need_and_shaped():
    assert not LinkSpec(rate_mbps=10.0).needs_netem
    assert LinkSpec(rate_mbps=10.0, delay_ms=5).needs_netem
    assert LinkSpec(rate_mbps=None, loss_pct=1).needs_netem
    assert not LinkSpec(rate_mbps=None).shaped


@pytest.mark.parametrize("kwargs, text", [
    ({"workers": 0}, "topo.workers=0"),
    ({"workers": 65}, "topo.workers=65"),
    ({"workers": True}, "topo.workers=True"),
    ({"workers": 2, "extra_hosts": -1}, "topo.extra_hosts=-1"),
    ({"workers": 2, "offload": "yes"}, "topo.offload='yes'"),
    ({"workers": 2, "bottleneck_up": 100}, "topo.bottleneck_up=100"),
])
def test_star_spec_errors_name_field(kwargs, text):
    with pytest.raises(SpecError, match=None) as info:
        StarSpec(**kwargs)
    assert text in str(info.value)


def test_star_names_ips_and_ports():
    spec = StarSpec(workers=3, extra_hosts=2)
    assert spec.host_names() == ["ps", "w0", "w1", "w2", "bg0", "bg1"]
    assert spec.ip("ps") == "10.0.0.1"
    assert spec.ip("w2") == "10.0.0.12"
    assert spec.ip("bg1") == "10.0.0.101"
    assert [spec.switch_port(h) for h in spec.host_names()] == [1, 2, 3, 4, 5, 6]
    assert len(set(spec.ip(h) for h in spec.host_names())) == 6
    with pytest.raises(SpecError, match="host='w3'"):
        spec.ip("w3")


def test_star_spec_is_frozen_and_describable():
    spec = StarSpec(workers=2, bottleneck_up=LinkSpec(rate_mbps=50.0, queue_bytes=30_000))
    with pytest.raises(AttributeError):
        spec.workers = 3  # type: ignore[misc]
    d = spec.describe()
    assert d["bottleneck_up"] == {"rate_mbps": 50.0, "queue_bytes": 30_000, "delay_ms": 0.0,
                                  "loss_pct": 0.0, "burst_ms": None,
                                  "effective_queue_bytes": 30_000}
    assert d["hosts"]["w1"] == "10.0.0.11"
    assert d["switch"] == "gbsw0"


def test_sender_gso_segs_fits_every_sender_in_half_the_up_queue():
    from topo.spec import GSO_SEGS_MAX, WIRE_FRAME_BYTES

    shallow = StarSpec(workers=16, bottleneck_up=LinkSpec(rate_mbps=100.0, queue_bytes=100_000))
    assert shallow.sender_gso_segs("w3") == 1  # 1 ms of 6.25 Mbit/s is under one frame
    shallow_1g = StarSpec(workers=16, bottleneck_up=LinkSpec(rate_mbps=1000.0, queue_bytes=100_000))
    assert shallow_1g.sender_gso_segs("w3") == 2  # half of 100 KB over 16 senders
    assert shallow.sender_gso_segs("ps") == 1  # the down bottleneck stays packet-exact
    deep = StarSpec(workers=16, bottleneck_up=LinkSpec(rate_mbps=1000.0, queue_bytes=10**7))
    assert deep.sender_gso_segs("w0") == 5  # 1 ms of 62.5 Mbit/s
    one = StarSpec(workers=1, bottleneck_up=LinkSpec(rate_mbps=1000.0, queue_bytes=10**7))
    assert one.sender_gso_segs("w0") == GSO_SEGS_MAX == 43
    slow = StarSpec(workers=16, bottleneck_up=LinkSpec(rate_mbps=100.0, queue_bytes=10**7))
    assert slow.sender_gso_segs("w0") == 1
    tiny = StarSpec(workers=64, bottleneck_up=LinkSpec(rate_mbps=10.0, queue_bytes=20_000))
    assert tiny.sender_gso_segs("w0") == 1
    for spec in (shallow, deep, one, slow, tiny):
        n = spec.workers + spec.extra_hosts
        segs = spec.sender_gso_segs("w0")
        assert segs == 1 or n * segs * WIRE_FRAME_BYTES <= spec.bottleneck_up.queue_bytes / 2
    # A worker's own slow access link caps its packets too: 1 ms of 10 Mbit/s is one
    # frame, whatever 1 Gbit/s shared by two would allow.
    own = StarSpec(workers=2, worker_link=LinkSpec(rate_mbps=10.0),
                   bottleneck_up=LinkSpec(rate_mbps=1000.0, queue_bytes=10**7))
    assert own.sender_gso_segs("w0") == 1
    assert StarSpec(workers=2, bottleneck_up=LinkSpec(
        rate_mbps=1000.0, queue_bytes=10**7)).sender_gso_segs("w0") == 41
    with pytest.raises(SpecError, match="host='w99'"):
        shallow.sender_gso_segs("w99")
