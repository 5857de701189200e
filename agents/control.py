"""Control plane between agents and the controller: JSON lines over a Unix socket.

Mininet hosts share the file system but not the network, so a Unix socket at
``RUN_DIR/control.sock`` reaches the controller from every host without a byte
crossing the emulated links: control traffic never disturbs what is measured.

Agents send reports (``{"type": "iter_done", ...}``); the controller may send
commands back on the same connection (``{"type": "pace", "rate_bps": ...}``).
A controller that is absent (an agent started by hand, or in a test) is not an
error: the client then drops reports and receives no commands.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
from pathlib import Path
from typing import Any

# sun_path holds 108 bytes; keep a margin for the NUL and relative-path surprises.
MAX_SOCKET_PATH = 100
FALLBACK_DIR = Path("/run/gradbed")


def control_path(run_dir: str | os.PathLike[str]) -> Path:
    """Where a run's control socket lives: ``RUN_DIR/control.sock``, unless that path is
    too long for a Unix socket (a deeply nested ``--out``); then under /run/gradbed,
    named after the run, with ``RUN_DIR/control.path`` saying where."""
    run_dir = Path(run_dir)
    pointer = run_dir / "control.path"
    if pointer.exists():
        return Path(pointer.read_text().strip())
    path = run_dir.resolve() / "control.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return path
    FALLBACK_DIR.mkdir(parents=True, exist_ok=True)
    fallback = FALLBACK_DIR / f"{run_dir.name}.sock"
    tmp = run_dir / ".control.path.tmp"
    tmp.write_text(f"{fallback}\n")
    os.replace(tmp, pointer)
    return fallback


class ControlClient:
    def __init__(self, path: str | os.PathLike[str] | None, node: str) -> None:
        self.node = node
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        if path and os.path.exists(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(os.fspath(path))
            self._sock = s
            self.send("hello")
            threading.Thread(target=self._reader, name="control-reader", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def send(self, type_: str, **fields: Any) -> None:
        if self._sock is None:
            return
        msg = json.dumps({"type": type_, "node": self.node, **fields}) + "\n"
        with self._lock:
            try:
                self._sock.sendall(msg.encode())
            except OSError:
                self._sock = None  # controller gone: keep running, stop reporting

    def poll(self) -> list[dict[str, Any]]:
        """All commands received since the last poll, oldest first (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out

    def _reader(self) -> None:
        assert self._sock is not None
        f = self._sock.makefile("r", encoding="utf-8")
        for line in f:
            try:
                self.commands.put(json.loads(line))
            except json.JSONDecodeError:
                continue

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
