"""Control plane between agents and the controller: JSON lines over a Unix socket.

Mininet hosts share the file system but not the network, so a Unix socket at
``RUN_DIR/control.sock`` reaches the controller from every host without a byte
crossing the emulated links: control traffic never disturbs what is measured.

Agents send reports (``{"type": "iter_done", ...}``); the controller may send
commands back on the same connection (``{"type": "pace", "rate_bps": ...}``).
A controller that is absent (an agent started by hand, or in a test) is not an
error: the client then drops reports and receives no commands.

Every emulated host can reach the socket (it is a file), so each side proves it knows
the agent's own key before a line counts: the client opens with
``{"type": "hello", "node", "nonce"}``, the server answers with its nonce and an HMAC
over both nonces, and the client replies with its own HMAC (:func:`control_proof`,
compared in constant time). The server also reads the peer's pid and uid
(``SO_PEERCRED``) for its log. A host without a key (a background host) gets no
further than the hello.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import secrets
import socket
import threading
from pathlib import Path
from typing import Any

# sun_path holds 108 bytes; keep a margin for the NUL and relative-path surprises.
MAX_SOCKET_PATH = 100
FALLBACK_DIR = Path("/run/gradbed")
AUTH_TIMEOUT_S = 10.0
MAX_LINE_BYTES = 65536


def control_proof(key: bytes, side: str, node: str, client_nonce: str, server_nonce: str
                  ) -> str:
    """HMAC-SHA256 (hex) that ``side`` ("server" or "client") knows ``node``'s key, bound
    to both nonces of this connection."""
    msg = "\0".join(("gradbed control", side, node, client_nonce, server_nonce)).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def read_line(sock: socket.socket, buf: bytearray) -> bytes:
    """One line from ``sock`` (blocking, under the socket's timeout), at most
    MAX_LINE_BYTES; ``buf`` keeps what came after it."""
    while b"\n" not in buf:
        if len(buf) > MAX_LINE_BYTES:
            raise ConnectionError(f"control: line longer than {MAX_LINE_BYTES} bytes")
        data = sock.recv(4096)
        if not data:
            raise ConnectionError("control: connection closed during authentication")
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
    def __init__(self, path: str | os.PathLike[str] | None, node: str, key: bytes) -> None:
        self.node = node
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        if path and os.path.exists(path):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(AUTH_TIMEOUT_S)
            s.connect(os.fspath(path))
            self._rest = bytearray()
            self._authenticate(s, key)
            s.settimeout(None)
            self._sock = s
            threading.Thread(target=self._reader, name="control-reader", daemon=True).start()

    def _authenticate(self, s: socket.socket, key: bytes) -> None:
        cn = secrets.token_hex(16)
        s.sendall((json.dumps({"type": "hello", "node": self.node, "nonce": cn}) + "\n")
                  .encode())
        try:
            msg = json.loads(read_line(s, self._rest))
            sn = str(msg["nonce"])
            ok = hmac.compare_digest(str(msg["proof"]),
                                     control_proof(key, "server", self.node, cn, sn))
        except (ValueError, KeyError, TypeError, OSError) as e:
            s.close()
            raise ConnectionError(f"{self.node}: control socket: no valid challenge ({e})"
                                  ) from None
        if not ok:
            s.close()
            raise ConnectionError(f"{self.node}: control socket: the server does not know "
                                  "our key (not our controller)")
        s.sendall((json.dumps({"type": "auth",
                               "proof": control_proof(key, "client", self.node, cn, sn)})
                   + "\n").encode())

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
        sock = self._sock
        assert sock is not None
        while True:
            try:
                line = read_line(sock, self._rest)
            except (ConnectionError, OSError):
                return
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(msg, dict):
                self.commands.put(msg)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
