"""The periodic loop of the controller's samplers (``links.parquet``, ``classes.parquet``).

A sampler is a daemon thread that calls :meth:`PeriodicSampler.sample` every
``period_s`` until :attr:`~PeriodicSampler.stop_event` is set, and once more then.
Reads are scheduled on a fixed grid of CLOCK_MONOTONIC, so a slow read does not shift
every later one; after a stall (the controller shares the cores with the agents) the
grid restarts from now instead of firing a burst of catch-up reads whose samples would
all carry nearly the same timestamp. A read that raises ends the loop and keeps what was
sampled; the message is in :attr:`~PeriodicSampler.error`. :meth:`~PeriodicSampler.start`
takes the first read in the caller's thread and :meth:`~PeriodicSampler.finish` the last
one, while the network still stands: every transfer between the two lies inside the
samples, however late the thread is scheduled on a busy machine.
"""

from __future__ import annotations

import threading
import time


class PeriodicSampler(threading.Thread):
    """Calls :meth:`sample` every ``period_s`` seconds until :attr:`stop_event` is set."""

    def __init__(self, name: str, period_s: float) -> None:
        super().__init__(name=name, daemon=True)
        if period_s <= 0:
            raise ValueError(f"{name}: period_s={period_s} must be > 0")
        self.period_s = period_s
        self.stop_event = threading.Event()
        self.error: str | None = None

    def sample(self) -> None:
        """One read of every point (subclasses)."""
        raise NotImplementedError

    def start(self) -> None:
        """The first read now, in the caller's thread (before the agents start: a window
        that begins at once is inside the samples), then the loop in its own."""
        self._read()
        super().start()

    def finish(self, timeout_s: float = 10.0) -> None:
        """Stops the loop after one last read, and waits for it (before the network is
        torn down: that read must find the points still there). Idempotent."""
        self.stop_event.set()
        if self.is_alive():
            self.join(timeout=timeout_s)

    def _read(self) -> bool:
        try:
            self.sample()
        except Exception as e:  # the network is going away; keep what we have
            self.error = str(e)
            return False
        return True

    def run(self) -> None:
        next_t = time.monotonic() + self.period_s
        self.stop_event.wait(self.period_s)
        while not self.stop_event.is_set():
            if not self._read():
                return
            next_t += self.period_s
            now = time.monotonic()
            if next_t < now:  # fell behind (a stall): no burst of catch-up reads
                next_t = now
            self.stop_event.wait(max(0.0, next_t - now))
        # One read when stopped: the samples then reach past the agents' last moment, so
        # a run's last window (ended up to a period before the stop) is inside them.
        self._read()
