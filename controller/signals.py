"""The signals that stop a run: SIGINT (Ctrl-C), SIGTERM (a kill, a scheduler) and SIGHUP
(a closed terminal or SSH session, the commonest way a run is stopped).

The first of them, at any moment of a run, becomes :class:`Interrupted` in the main
thread, so the run unwinds through its ``finally`` blocks (agents stopped, network torn
down, summary written) instead of dying where it stood. From then on, and from the moment
the controller starts tearing down on its own, every further signal is only noted: a
second Ctrl-C, or a SIGTERM after a Ctrl-C, must not cut the finalisation short (the
default handlers come back only once the run directory is complete).

After SIGHUP the terminal is gone and writing to it fails (EIO): :attr:`StopSignals.hung_up`
tells the controller to write to its run log only.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived; ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    """Context manager: the stop signals' handlers for one run (main thread only; in
    another thread, where Python allows no handler, it does nothing).

    ``received``: every stop signal seen, in order. ``armed``: whether the next one
    raises; :meth:`disarm` once teardown has begun."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.armed = True
        self._old: dict[int, Any] = {}

    @property
    def hung_up(self) -> bool:
        return signal.SIGHUP in self.received

    def disarm(self) -> None:
        self.armed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self.armed:
            self.armed = False
            raise Interrupted(signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                self._old[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()
