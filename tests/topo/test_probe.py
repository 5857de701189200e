"""The kernel probe runs once per process, also when ``gradbed run`` starts it on a thread
of its own and the run asks for it while it is still running."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from topo import probe as probe_mod


def test_a_background_probe_and_the_runs_own_call_share_one_trial(monkeypatch):
    trials: list[int] = []
    started = threading.Event()

    def slow_trials() -> dict[str, Any]:  # stands for the namespace and its qdisc trials
        trials.append(1)
        started.set()
        time.sleep(0.3)
        return {"htb": True, "netem": False}

    monkeypatch.setattr(probe_mod, "probe_qdiscs", slow_trials)
    monkeypatch.setattr(probe_mod, "_cache", None)
    thread = probe_mod.probe_in_background()
    assert started.wait(10)
    caps = probe_mod.probe()  # while the thread's trial still runs: waits for its result
    thread.join(10)
    assert trials == [1]
    assert caps["htb"] is True and caps["netem"] is False
    caps["htb"] = "changed by a caller"  # each caller gets its own copy
    assert probe_mod.probe()["htb"] is True and trials == [1]


@pytest.fixture(autouse=True)
def _fresh_cache():
    yield
    probe_mod._cache = None
