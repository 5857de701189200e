"""The controller's end of the control plane (see ``agents/control.py``).

A thread accepts agent connections on ``RUN_DIR/control.sock`` and hands every
JSON-line report to a callback. ``send(node, msg)`` pushes a command to one
agent. The callback runs on the connection's thread; it must be quick.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

Handler = Callable[[dict[str, Any]], None]


class ControlServer:
    def __init__(self, path: str | os.PathLike[str], handler: Handler) -> None:
        self.path = Path(path)
        self.handler = handler
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
        while not self._closed:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        node = None
        with conn, conn.makefile("r", encoding="utf-8") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    continue
                node = msg.get("node", node)
                if msg.get("type") == "hello" and node:
                    with self._lock:
                        self._conns[node] = conn
                try:
                    self.handler(msg)
                except Exception as e:  # a bad report must not kill the control plane
                    self.handler({"type": "handler_error", "node": node, "error": repr(e)})
        if node:
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
