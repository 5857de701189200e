"""The controller's end of the control plane (see ``agents/net/control.py``).

A thread accepts agent connections on ``RUN_DIR/control.sock``
(:func:`agents.net.handshake.accept_forever`, under ``[guard]``'s admission limits: per
peer process, in all, and the handshake's absolute deadline) and hands every JSON-line
report (at most 64 KiB a line) to a callback. ``send(node, msg)`` pushes a command to
one agent. The callback runs on the connection's thread; it must be quick. Each node
holds at most one connection, so authenticated connections are bounded by the run's
agents, and unauthenticated ones by the admission limits.

A connection counts only once its peer has proved it knows its node's key
(``key_for(node)``), through the run's one handshake driver (``agents.net.handshake``, the
controller answering); its reports then always carry that node's name, whatever they
claim. The peer's pid and uid (``SO_PEERCRED``) go into the hello the callback sees. A
peer that fails, or has not finished the handshake within its deadline
(``guard.handshake_timeout_s``), or is not admitted, is closed; refusals are reported as
``control_refused`` aggregated, one per (source, reason) per
``guard.refusal_report_interval_s`` with a ``count``. A connection that ends after its
hello is reported as ``control_closed`` (the run's liveness watch reads it).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agents.core.guard_config import GuardConfig
from agents.net import handshake, protocol
from agents.net.admission import AdmissionLimits, RefusalReport
from agents.net.control import CONTROL_RUN_ID, CONTROL_TAG, CONTROLLER_END, read_objects

Handler = Callable[[dict[str, Any]], None]
KeyFor = Callable[[str], bytes | None]


def peer_source(conn: socket.socket, _addr: Any) -> str:
    """A control-socket peer's source for admission: its process (``SO_PEERCRED``).
    Every Mininet host runs as root, so the uid tells no host from another; one process
    flooding is held to ``guard.max_handshakes_per_source``, many to ``max_handshakes``."""
    pid, uid, _gid = peer_cred(conn)
    return f"pid {pid} uid {uid}"


def peer_cred(conn: socket.socket) -> tuple[int, int, int]:
    pid, uid, gid = struct.unpack("3i", conn.getsockopt(
        socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid, gid


class ControlServer:
    def __init__(self, path: str | os.PathLike[str], handler: Handler, key_for: KeyFor, *,
                 guard: GuardConfig | None = None,
                 log: handshake.EventSink | None = None) -> None:
        """``guard``: the handshake's deadline and the admission limits (``[guard]``'s
        defaults when None); ``log``: where each handshake is reported (an event log;
        it is written from the connection's thread)."""
        self.path = Path(path)
        self.handler = handler
        self.key_for = key_for
        self.guard = guard or GuardConfig()
        self.log = log
        self._conns: dict[str, socket.socket] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        if self.path.exists():
            self.path.unlink()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(os.fspath(self.path))
        self._srv.listen(128)
        self._acceptor = threading.Thread(
            target=handshake.accept_forever, name="control-accept", daemon=True,
            args=(self._srv, self._serve),
            kwargs=dict(stopped=self._stopped, report=self._refused,
                        limits=AdmissionLimits.from_guard(self.guard), source=peer_source))
        self._acceptor.start()

    def _refused(self, r: RefusalReport) -> None:
        self._report({"type": "control_refused", "source": r.source, "reason": r.reason,
                      "count": r.count, "error": r.example})

    def _report(self, msg: dict[str, Any]) -> None:
        try:
            self.handler(msg)
        except Exception:  # noqa: BLE001  (the control plane outlives a bad handler)
            pass

    def _authenticate(self, conn: socket.socket) -> dict[str, Any]:
        """The peer's hello, once it has proved its node's key; raises HandshakeError
        otherwise."""
        pid, uid, _gid = peer_cred(conn)
        answerer = protocol.Answerer(
            CONTROL_RUN_ID, "agent", lambda h: self.key_for(h.node) if h.node else None,
            accepts="this run's agents")
        handshake.answer(conn, answerer, run_tag=CONTROL_TAG,
                         name=f"controller <- pid {pid} uid {uid}", welcome=CONTROLLER_END,
                         timeout_s=self.guard.handshake_timeout_s, log=self.log,
                         log_refusal=False)
        assert answerer.hello is not None
        conn.settimeout(None)
        return {"type": "hello", "node": answerer.hello.node, "pid": pid, "uid": uid}

    def _serve(self, conn: socket.socket, _peer: str) -> None:
        """One connection (``accept_forever`` runs it on a thread of its own, admitted):
        the handshake, then its reports until it closes. Each node holds one connection:
        a newer one that proved the same key replaces it."""
        rest = bytearray()
        with conn:
            hello = self._authenticate(conn)
            node = hello["node"]
            with self._lock:
                old = self._conns.get(node)
                self._conns[node] = conn
            if old is not None:
                try:
                    old.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already gone
            self._report(hello)
            self._read_reports(conn, node, rest)
        with self._lock:
            if self._conns.get(node) is conn:
                del self._conns[node]
        self._report({"type": "control_closed", "node": node})

    def _read_reports(self, conn: socket.socket, node: str, rest: bytearray) -> None:
        for msg in read_objects(conn, rest):
            msg["node"] = node  # an authenticated peer speaks only for itself
            try:
                self.handler(msg)
            except Exception as e:  # a bad report must not kill the control plane
                self._report({"type": "handler_error", "node": node, "error": repr(e)})

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
        """Stop accepting; the refusals still being counted are reported before this
        returns (the acceptor's last report)."""
        self._stopped.set()
        try:
            try:
                self._srv.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            except OSError:
                pass
            self._acceptor.join(timeout=2 * self.guard.refusal_report_interval_s + 1)
            self._srv.close()
        finally:
            if self.path.exists():
                self.path.unlink()
