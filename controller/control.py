"""The controller's end of the control plane (see ``agents/net/control.py``).

A thread accepts agent connections on ``RUN_DIR/control.sock`` and hands every
JSON-line report to a callback. ``send(node, msg)`` pushes a command to one
agent. The callback runs on the connection's thread; it must be quick.

A connection counts only once its peer has proved it knows its node's key
(``key_for(node)``), through the run's one handshake driver (``agents.net.handshake``, the
controller answering); its reports then always carry that node's name, whatever they
claim. The peer's pid and uid (``SO_PEERCRED``) go into the hello the callback sees. A
peer that fails, or has not finished the handshake within its deadline
(``handshake_timeout_s``), is closed and reported as ``control_refused``.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.net import handshake, protocol
from agents.net.codec import FrameError
from agents.net.control import CONTROL_RUN_ID, CONTROL_TAG, CONTROLLER_END, read_line

Handler = Callable[[dict[str, Any]], None]
KeyFor = Callable[[str], bytes | None]


class ControlServer:
    def __init__(self, path: str | os.PathLike[str], handler: Handler, key_for: KeyFor, *,
                 handshake_timeout_s: float = handshake.DEFAULT_TIMEOUT_S,
                 log: handshake.EventSink | None = None) -> None:
        """``log``: where each handshake is reported (an event log; it is written
        from the connection's thread)."""
        self.path = Path(path)
        self.handler = handler
        self.key_for = key_for
        self.handshake_timeout_s = handshake_timeout_s
        self.log = log
        self._conns: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        if self.path.exists():
            self.path.unlink()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(os.fspath(self.path))
        self._srv.listen(128)
        self._closed = False
        threading.Thread(target=self._accept, name="control-accept", daemon=True).start()

    def _accept(self) -> None:
        pause = 0.01
        while not self._closed:
            try:
                conn, _ = self._srv.accept()
            except OSError as e:
                if self._closed or e.errno in (errno.EBADF, errno.EINVAL):
                    return
                self._report({"type": "control_refused", "error": f"accept: {e}"})
                time.sleep(pause)  # EMFILE and the like pass: back off and retry
                pause = min(2 * pause, 1.0)
                continue
            pause = 0.01
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _report(self, msg: dict[str, Any]) -> None:
        try:
            self.handler(msg)
        except Exception:  # noqa: BLE001  (the control plane outlives a bad handler)
            pass

    def _authenticate(self, conn: socket.socket) -> dict[str, Any]:
        """The peer's hello, once it has proved its node's key; raises otherwise."""
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        answerer = protocol.Answerer(
            CONTROL_RUN_ID, "agent", lambda h: self.key_for(h.node) if h.node else None,
            accepts="this run's agents")
        try:
            handshake.answer(conn, answerer, run_tag=CONTROL_TAG,
                             name=f"controller <- pid {pid} uid {uid}",
                             welcome=CONTROLLER_END, timeout_s=self.handshake_timeout_s,
                             log=self.log)
        except FrameError as e:
            raise ConnectionError(str(e)) from None
        assert answerer.hello is not None
        conn.settimeout(None)
        return {"type": "hello", "node": answerer.hello.node, "pid": pid, "uid": uid}

    def _serve(self, conn: socket.socket) -> None:
        rest = bytearray()
        with conn:
            try:
                hello = self._authenticate(conn)
            except (ConnectionError, OSError, ValueError, AttributeError,
                    RecursionError) as e:
                self._report({"type": "control_refused", "error": str(e)})
                return
            node = hello["node"]
            with self._lock:
                self._conns[node] = conn
            self._report(hello)
            while True:
                try:
                    line = read_line(conn, rest)
                except (ConnectionError, OSError):
                    break
                try:
                    msg = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if not isinstance(msg, dict):
                    continue
                msg["node"] = node  # an authenticated peer speaks only for itself
                try:
                    self.handler(msg)
                except Exception as e:  # a bad report must not kill the control plane
                    self._report({"type": "handler_error", "node": node, "error": repr(e)})
        with self._lock:
            if self._conns.get(node) is conn:
                del self._conns[node]

    def send(self, node: str, type_: str, **fields: Any) -> bool:
        with self._lock:
            conn = self._conns.get(node)
        if conn is None:
            return False
        try:
            conn.sendall((json.dumps({"type": type_, **fields}) + "\n").encode())
            return True
        except OSError:
            return False

    def nodes(self) -> list[str]:
        with self._lock:
            return list(self._conns)

    def close(self) -> None:
        self._closed = True
        try:
            self._srv.close()
        finally:
            if self.path.exists():
                self.path.unlink()
