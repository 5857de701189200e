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


def _iptables_answers(monkeypatch, answers: list[int]) -> list[list[str]]:
    """``_run`` where ``iptables -V`` works and each rule trial exits with the next of
    ``answers`` (a loaded machine's refusals, then the kernel's own answer)."""
    import subprocess

    tried: list[list[str]] = []

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        if argv[:2] == ["iptables", "-V"]:
            return subprocess.CompletedProcess(argv, 0, "iptables v1.8.9 (nf_tables)\n", "")
        tried.append(argv)
        rc = answers.pop(0) if answers else 0
        return subprocess.CompletedProcess(argv, rc, "", "" if rc == 0 else
                                           "iptables: Resource temporarily unavailable.")

    monkeypatch.setattr(probe_mod, "_run", run)
    return tried


def test_a_netfilter_trial_refused_twice_by_a_busy_machine_still_reads_yes(monkeypatch):
    tried = _iptables_answers(monkeypatch, [4, 4, 0, 0])
    out = probe_mod.probe_netfilter("gbprobe-test")
    assert out["nfqueue"] is True and out["xt_statistic"] is True, out
    assert len(tried) == 4 and not any(k.endswith("_error") for k in out), out


def test_a_netfilter_trial_refused_every_time_reads_no_and_keeps_the_reason(monkeypatch):
    _iptables_answers(monkeypatch, [0] + [4] * probe_mod.NETFILTER_TRIES)
    out = probe_mod.probe_netfilter("gbprobe-test")
    assert out["nfqueue"] is True and out["xt_statistic"] is False, out
    assert "temporarily unavailable" in out["xt_statistic_error"], out
