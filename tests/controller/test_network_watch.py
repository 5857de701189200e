"""What the run's watch makes of its network while the agents run
(``controller.run.network_broken``): a lost server, a dead delay line, and a delay line
that died with its server. No root: the network's answers are given as it gives them."""

from __future__ import annotations

import time

from controller.exit_status import FAILED, SERVER_LOST, status_for
from controller.run import network_broken

DEAD = ("host w0: delay line on 10.99.0.2 died (exit 137: (no stderr)); its link drops "
        "every packet")


class _Net:
    """What ``topo.build.Network.dead_delay_line`` says, fixed."""

    def __init__(self, dead: str) -> None:
        self.dead = dead

    def dead_delay_line(self) -> str:
        return self.dead


def test_a_healthy_network_says_nothing() -> None:
    assert network_broken(lambda: "", _Net(""), grace_s=0) == ""  # type: ignore[arg-type]


def test_a_dead_delay_line_stops_the_run_as_failed_naming_host_and_server() -> None:
    why = network_broken(lambda: "", _Net(DEAD), grace_s=0)  # type: ignore[arg-type]
    assert why == f"failed: {DEAD}" and status_for(why) == FAILED


def test_a_delay_line_that_died_with_its_server_leaves_the_reason_to_the_server() -> None:
    seen_at = time.monotonic() + 0.3  # the server's control connection ends a bit later

    def lost() -> str:
        return "server lost: 10.99.0.2 (exit 255)" if time.monotonic() > seen_at else ""

    why = network_broken(lost, _Net(DEAD), grace_s=3)  # type: ignore[arg-type]
    assert why.startswith("server lost: 10.99.0.2") and status_for(why) == SERVER_LOST
