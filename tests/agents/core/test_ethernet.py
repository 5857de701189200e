"""The goodput ceiling of a shaped link per MTU (``agents.core.ethernet``): the 1500-byte
constant and the 1450-byte links of a run over several servers come from one formula."""

from __future__ import annotations

import pytest

from agents.core.ethernet import TCP_GOODPUT_FRACTION, tcp_goodput_fraction


def test_1500_is_the_constant_and_1450_carries_1398_of_1464():
    assert tcp_goodput_fraction(1500) == TCP_GOODPUT_FRACTION
    assert tcp_goodput_fraction(1450) == 1398 / 1464
    assert tcp_goodput_fraction(9000) > tcp_goodput_fraction(1500)  # jumbo frames: less overhead


def test_an_mtu_that_holds_no_payload_is_refused():
    with pytest.raises(ValueError, match="mtu_bytes=52"):
        tcp_goodput_fraction(52)
