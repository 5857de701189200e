"""Per-agent keys, and how an agent gets its own (issue 22).

Mininet hosts share the file system and the PID namespace, so a key in a file of the run
directory, or in an agent's environment (``/proc/PID/environ``), is readable from every
emulated host, background hosts included. The controller therefore keeps one random
master key in memory only and hands each agent what it needs through the agent's stdin,
a pipe only the controller holds the other end of:

- worker k: ``key_k = HMAC(HMAC(master, "workers"), "w{k}")``, its own and no other;
- the PS: its own control key and ``HMAC(master, "workers")``, from which it derives any
  worker's key to check that worker's challenge response;
- background hosts: nothing.

The pipe stays open for the agent's life: EOF on it means the controller is gone, and
the agent ends itself (:func:`exit_with_controller`), so a ``kill -9`` of the controller
leaves no agent training with nobody watching.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import select
import sys
import threading
from dataclasses import dataclass
from typing import BinaryIO

from agents.core.nodes import worker_index, worker_node

KEY_BYTES = 32
MAX_BUNDLE_BYTES = 4096


def new_master() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def derive(key: bytes, label: str) -> bytes:
    return hmac.new(key, b"gradbed key\0" + label.encode(), hashlib.sha256).digest()


def workers_root(master: bytes) -> bytes:
    return derive(master, "workers")


def worker_key(root: bytes, worker: int) -> bytes:
    """Worker ``worker``'s key from the PS's workers root."""
    return derive(root, worker_node(worker))


def node_key(master: bytes, node: str) -> bytes:
    """The key node ``node`` proves itself with (to the PS, and on the control socket)."""
    worker = worker_index(node)
    if worker is not None:
        return worker_key(workers_root(master), worker)
    return derive(master, f"agent/{node}")


@dataclass(frozen=True)
class KeyBundle:
    """What one agent is told: its node name, its key, and (the PS only) the workers'
    root key."""

    node: str
    key: bytes
    workers_root: bytes = b""

    def encode(self) -> bytes:
        obj = {"node": self.node, "key": self.key.hex()}
        if self.workers_root:
            obj["workers_root"] = self.workers_root.hex()
        return json.dumps(obj).encode() + b"\n"


def bundle_for(master: bytes, node: str) -> KeyBundle:
    return KeyBundle(node, node_key(master, node),
                     workers_root(master) if node == "ps" else b"")


def decode_bundle(line: bytes) -> KeyBundle:
    try:
        obj = json.loads(line.decode())
        bundle = KeyBundle(str(obj["node"]), bytes.fromhex(obj["key"]),
                           bytes.fromhex(obj.get("workers_root", "")))
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise ValueError(f"key bundle on stdin: malformed ({e})") from None
    if len(bundle.key) != KEY_BYTES:
        raise ValueError(f"key bundle on stdin: key of {len(bundle.key)} bytes")
    return bundle


def read_bundle(stream: BinaryIO | None = None, timeout_s: float = 30.0) -> KeyBundle:
    """Read this agent's key bundle: one JSON line on stdin (see the module docstring)."""
    f = stream if stream is not None else sys.stdin.buffer
    fd = f.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], timeout_s)
        if not ready:
            raise ValueError(f"no key bundle on stdin after {timeout_s} s (agents are "
                             "started by the controller, which writes it)")
        chunk = os.read(fd, MAX_BUNDLE_BYTES - len(buf))
        if not chunk:
            raise ValueError("no key bundle on stdin (EOF): agents are started by the "
                             "controller, which writes it")
        buf += chunk
        if len(buf) >= MAX_BUNDLE_BYTES:
            raise ValueError(f"key bundle on stdin: longer than {MAX_BUNDLE_BYTES} bytes")
    return decode_bundle(buf)


def exit_with_controller(on_exit: object = None, stream: BinaryIO | None = None) -> None:
    """Watch stdin on a daemon thread; at EOF (the controller died, or closed our pipe)
    print why and end the process at once (``os._exit(4)``)."""
    fd = (stream if stream is not None else sys.stdin.buffer).fileno()

    def watch() -> None:
        while True:
            try:
                data = os.read(fd, 4096)
            except OSError:
                data = b""
            if not data:
                print("controller gone (stdin closed): exiting", file=sys.stderr, flush=True)
                if callable(on_exit):
                    try:
                        on_exit()
                    except Exception:  # noqa: BLE001  (exiting anyway)
                        pass
                sys.stderr.flush()
                os._exit(4)

    threading.Thread(target=watch, name="controller-watch", daemon=True).start()
