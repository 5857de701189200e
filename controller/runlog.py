"""What a run says, and where: each line into ``run.log`` with the time, and the status
lines on the terminal too (above the progress bar while one shows).

A command the run executes is echoed as ``$ tc ...`` (STYLE.md: every external command
in the run log); it goes into run.log and the controller's events (``tc``), never on the
terminal. After SIGHUP the terminal is gone (writes fail with EIO): run.log only. A full
disk loses a line, never the run.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from agents.core.events import EventLog


class RunLog:
    """The log of one run. show: status lines on the terminal too. hung_up: whether the
    terminal is gone (``controller.signals.StopSignals.hung_up``)."""

    def __init__(self, show: bool, hung_up: Callable[[], bool]) -> None:
        self.show = show
        self._hung_up = hung_up
        # A network over several servers says its commands from several threads.
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._events: EventLog | None = None
        self._bar: Any = None
        self._accuracy: float | None = None  # the last one reported, kept on the bar

    def open(self, path: Path, events: EventLog) -> None:
        """From now on lines go into ``path`` (appended) and commands into ``events``."""
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._events = events

    def say(self, line: str) -> None:
        """A line of the run: a status line, or an echoed command (``$ ...``)."""
        if self.show and not line.startswith("$ ") and not self._hung_up():
            if self._bar is not None:
                self._bar.write(line, file=sys.stderr)
            else:
                print(line, file=sys.stderr, flush=True)
        self._write(line, command=line.startswith("$ "))

    def note(self, line: str) -> None:
        """A line for run.log only (a command written out whole, with its variables, whose
        terminal line is shorter)."""
        self._write(line, command=False)

    def _write(self, line: str, command: bool) -> None:
        try:
            with self._lock:
                if self._file is not None:
                    self._file.write(f"{time.strftime('%H:%M:%S')} {line}\n")
                    self._file.flush()
                    if command and self._events is not None:
                        self._events.emit("tc", cmd=line[2:])
        except OSError:
            pass  # a full disk: the line is lost, the run goes on and its summary has room

    # -- the progress bar ---------------------------------------------------------------

    def start_bar(self, total: int, desc: str) -> None:
        """A progress bar of ``total`` iterations on the terminal (when lines show)."""
        if not self.show:
            return
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=desc, unit="it", dynamic_ncols=True,
                         file=sys.stderr)

    def progress(self, msg: dict[str, Any]) -> None:
        """An ``iter_done`` report of a node that counts the run's iterations."""
        if msg.get("accuracy") is not None:
            self._accuracy = msg["accuracy"]
        if self._bar is None or self._hung_up():
            return
        post = {"workers": msg.get("workers")}
        if self._accuracy is not None:
            post["acc"] = f"{self._accuracy:.3f}"
        self._bar.set_postfix(post, refresh=False)
        self._bar.update(int(msg["iter"]) + 1 - self._bar.n)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def close(self) -> None:
        """run.log closed; later lines reach the terminal only."""
        with self._lock:
            f, self._file = self._file, None
        if f is not None:
            f.close()
