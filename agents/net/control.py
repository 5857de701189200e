"""Control plane between agents and the controller: JSON lines over a Unix socket.

Mininet hosts share the file system but not the network, so a Unix socket at
``RUN_DIR/control.sock`` reaches the controller from every host without a byte
crossing the emulated links: control traffic never disturbs what is measured.

Agents send reports (``{"type": "iter_done", ...}``), and every agent a heartbeat
(``{"type": "heartbeat"}`` every ``HEARTBEAT_S``) from a thread of its own, so that the
controller tells a hung agent from a slow one without looking at the data path; the
controller may send commands back on the same connection (``{"type": "pace", ...}``).
A controller that is absent (an agent started by hand, or in a test) is not an
error: the client then drops reports and receives no commands.

Every emulated host can reach the socket (it is a file), so each side proves it knows
the agent's own key before a line counts: the connection opens with the run's one
handshake (:mod:`agents.net.handshake`), the agent dialing as role ``agent`` with its
node name and proving that node's key, the controller answering and sealing its WELCOME
under the same key. The server also reads the peer's pid and uid (``SO_PEERCRED``) for
its log. A host without a key (a background host) gets no further than its HELLO.
After the handshake the connection carries JSON lines only.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agents.core.config import HEARTBEAT_S
from agents.net import auth, codec, handshake, protocol

# sun_path holds 108 bytes; keep a margin for the NUL and relative-path surprises.
MAX_SOCKET_PATH = 100
FALLBACK_DIR = Path("/run/gradbed")
MAX_LINE_BYTES = 65536
# The handshake's context: the socket is the run's own file and the keys are the run's,
# so the run id would add nothing; a fixed one keeps the agents' control client free of it.
CONTROL_RUN_ID = "gradbed control"
CONTROL_TAG = codec.run_tag(CONTROL_RUN_ID, codec.PUBLIC_SECRET)
#: What the controller's end says it is in its WELCOME.
CONTROLLER_END = ("controller", 0)


def control_dialer(node: str, key: bytes) -> protocol.Dialer:
    """The agent ``node``'s end of a control-socket handshake, under its own key."""
    return protocol.Dialer(CONTROL_RUN_ID, "agent", 0, key, node=node,
                           welcome_from=CONTROLLER_END)


def read_objects(sock: socket.socket, buf: bytearray) -> Iterator[dict[str, Any]]:
    """The JSON objects ``sock`` sends, one per line (:func:`read_line`), until it closes
    or fails; a line that is not a JSON object is skipped (a peer's bytes are not trusted
    to be either)."""
    while True:
        try:
            line = read_line(sock, buf)
        except (ConnectionError, OSError):
            return
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(msg, dict):
            yield msg


def read_line(sock: socket.socket, buf: bytearray) -> bytes:
    """One line from ``sock`` (blocking, under the socket's timeout), at most
    MAX_LINE_BYTES; ``buf`` keeps what came after it."""
    while b"\n" not in buf:
        if len(buf) > MAX_LINE_BYTES:
            raise ConnectionError(f"control: line longer than {MAX_LINE_BYTES} bytes")
        data = sock.recv(4096)
        if not data:
            raise ConnectionError("control: connection closed")
        buf += data
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


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
    """An agent's end of the control socket. ``log``: where its handshake is reported
    (the agent's event log). Raises ConnectionError when the socket is there
    but the handshake fails (not our controller, or it does not know us)."""

    def __init__(self, path: str | os.PathLike[str] | None, node: str, key: bytes, *,
                 timeout_s: float = handshake.DEFAULT_TIMEOUT_S,
                 log: handshake.EventSink | None = None,
                 heartbeat_s: float | None = HEARTBEAT_S) -> None:
        """``heartbeat_s``: how often a thread of its own says ``heartbeat`` (None: never).
        It is a thread, not the agent's main loop, so an agent blocked on its data path
        (a zero-rate stretch of a trace) is alive, and one that is stopped (SIGSTOP) or
        gone is not: the controller declares it lost after ``run.stall_timeout_s``."""
        self.node = node
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._rest = bytearray()
        if path and os.path.exists(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.settimeout(timeout_s)
                s.connect(os.fspath(path))
                handshake.dial(s, control_dialer(node, key), run_tag=CONTROL_TAG,
                               name=f"{node} -> controller", timeout_s=timeout_s, log=log)
            except (OSError, codec.FrameError) as e:
                s.close()
                raise ConnectionError(f"{node}: control socket: {e}") from None
            s.settimeout(None)
            self._sock = s
            threading.Thread(target=self._reader, name="control-reader", daemon=True).start()
            if heartbeat_s:
                threading.Thread(target=self._beat, args=(heartbeat_s,), daemon=True,
                                 name="control-heartbeat").start()

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

    def _beat(self, every_s: float) -> None:
        while self._sock is not None:
            self.send("heartbeat")
            time.sleep(every_s)

    def poll(self) -> list[dict[str, Any]]:
        """All commands received since the last poll, oldest first (non-blocking)."""
        out = []
        while True:
            try:
                out.append(self.commands.get_nowait())
            except queue.Empty:
                return out

    def _reader(self) -> None:
        sock = self._sock
        assert sock is not None
        for msg in read_objects(sock, self._rest):
            self.commands.put(msg)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def liveness_client(run_dir: str | os.PathLike[str], keys: auth.KeyBundle | None, *,
                    timeout_s: float = handshake.DEFAULT_TIMEOUT_S,
                    log: handshake.EventSink | None = None) -> ControlClient | None:
    """The control connection of an agent that reports nothing but that it is alive (a
    pipeline stage, the pipeline's PS, an expert host): its heartbeats. None when it was
    started without a controller's key bundle (``--auth file``: by hand, or a test)."""
    if keys is None:
        return None
    return ControlClient(control_path(run_dir), keys.node, keys.key, timeout_s=timeout_s,
                         log=log)
