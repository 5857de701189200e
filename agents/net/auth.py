"""Per-agent keys, and how an agent gets its own.

Mininet hosts share the file system and the PID namespace, so a key in a file of the run
directory, or in an agent's environment (``/proc/PID/environ``), is readable from every
emulated host, background hosts included. The controller therefore keeps one random
master key in memory only and hands each agent what it needs through the agent's stdin,
a pipe only the controller holds the other end of:

- worker k: ``key_k = HMAC(HMAC(master, "workers"), "w{k}")``, its own and no other;
- the PS: its own control key and ``HMAC(master, "workers")``, from which it derives any
  worker's key to check that worker's challenge response;
- background hosts: nothing;
- an agent of a mesh (pipeline stages, MoE expert hosts): the pair key of every link it
  is an end of, ``pair_key(master, mesh, a, b) = HMAC(derive(master, "mesh/<mesh>"),
  "<a>|<b>")`` with ``a < b`` (the two ends' names in that mesh), and no other. Two
  agents sharing a link key are its two ends, so no agent can pass for another to a
  third (:mod:`agents.net.link` runs the challenge-response over it).

The pipe stays open for the agent's life: EOF on it means the controller is gone, and
the agent ends itself (:func:`exit_with_controller`), so a ``kill -9`` of the controller
leaves no agent training with nobody watching.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import select
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from agents.core.nodes import worker_index, worker_node

KEY_BYTES = 32
MAX_BUNDLE_BYTES = 1 << 16  # a mesh agent holds one 32-byte key per link


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


def link_name(mesh: str, a: str, b: str) -> str:
    """The name of the link between ``a`` and ``b`` of ``mesh``: the same from either end."""
    if a == b or not a or not b or "|" in a + b:
        raise ValueError(f"link of mesh {mesh!r}: ends {a!r} and {b!r} must be two "
                         "different non-empty names without '|'")
    lo, hi = sorted((a, b))
    return f"{mesh}/{lo}|{hi}"


def pair_key(master: bytes, mesh: str, a: str, b: str) -> bytes:
    """The key only the two ends of one mesh link hold (see the module docstring)."""
    _, _, ends = link_name(mesh, a, b).partition("/")
    return derive(derive(master, f"mesh/{mesh}"), ends)


def file_master(secret: bytes) -> bytes:
    """The master of an agent started by hand or by a test with ``--auth file``: derived
    from ``RUN/secret``, which every process that can read the run directory knows, so it
    keeps other runs out and authenticates no one (runs started by the controller use
    ``--auth stdin``)."""
    return derive(secret, "file master")


Link = tuple[str, str, str]  # (mesh, this agent's name in it, the peer's name)


@dataclass(frozen=True)
class KeyBundle:
    """What one agent is told: its node name, its key, (the PS only) the workers' root
    key, and (a mesh agent) the key of each link it is an end of, by :func:`link_name`."""

    node: str
    key: bytes
    workers_root: bytes = b""
    links: tuple[tuple[str, bytes], ...] = ()

    def encode(self) -> bytes:
        obj: dict[str, object] = {"node": self.node, "key": self.key.hex()}
        if self.workers_root:
            obj["workers_root"] = self.workers_root.hex()
        if self.links:
            obj["links"] = {name: key.hex() for name, key in self.links}
        return json.dumps(obj).encode() + b"\n"

    def link_key(self, mesh: str, me: str, peer: str) -> bytes:
        """The key of link ``me``-``peer`` of ``mesh``; KeyError naming it if we hold none
        (``peer`` is not a neighbour of ours)."""
        name = link_name(mesh, me, peer)
        for n, key in self.links:
            if n == name:
                return key
        raise KeyError(f"no key for link {name} in {self.node}'s bundle "
                       f"({len(self.links)} links)")


def bundle_for(master: bytes, node: str, links: Sequence[Link] = ()) -> KeyBundle:
    """Node ``node``'s bundle; ``links``: the mesh links it is an end of, as
    ``(mesh, its name there, the peer's name)`` (the role that places it knows them)."""
    return KeyBundle(node, node_key(master, node),
                     workers_root(master) if node == "ps" else b"",
                     tuple((link_name(m, a, b), pair_key(master, m, a, b))
                           for m, a, b in links))


def file_bundle(secret: bytes, node: str, links: Sequence[Link] = ()) -> KeyBundle:
    """The bundle of an agent started with ``--auth file`` (see :func:`file_master`)."""
    return bundle_for(file_master(secret), node, links)


def decode_bundle(line: bytes) -> KeyBundle:
    try:
        obj = json.loads(line.decode())
        links = obj.get("links", {})
        if not isinstance(links, dict):
            raise TypeError("links: not an object")
        bundle = KeyBundle(str(obj["node"]), bytes.fromhex(obj["key"]),
                           bytes.fromhex(obj.get("workers_root", "")),
                           tuple((str(n), bytes.fromhex(k)) for n, k in links.items()))
    except (ValueError, KeyError, TypeError, RecursionError, AttributeError) as e:
        raise ValueError(f"key bundle on stdin: malformed ({e})") from None
    if len(bundle.key) != KEY_BYTES:
        raise ValueError(f"key bundle on stdin: key of {len(bundle.key)} bytes")
    bad = [n for n, k in bundle.links if len(k) != KEY_BYTES]
    if bad:
        raise ValueError(f"key bundle on stdin: link {bad[0]} has a key of the wrong size")
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


def add_auth_argument(ap: argparse.ArgumentParser) -> None:
    """The ``--auth`` option of the agents whose keys come from :func:`agent_keys` (a
    pipeline stage, the pipeline's PS, an expert host)."""
    ap.add_argument("--auth", choices=("stdin", "file"), default="file",
                    help="stdin: started by the controller (key bundle on stdin, exit when "
                         "it goes); file: RUN/secret names the run (tests, by hand)")


def agent_keys(mode: str, run_dir: Path, public_secret: bytes
               ) -> tuple[KeyBundle | None, bytes]:
    """An agent's keys at start-up, by its ``--auth`` mode: ``stdin`` (started by the
    controller): the key bundle from the pipe, the agent ending when the controller goes,
    and the run's public tag secret; ``file`` (tests, by hand): no bundle and
    ``RUN/secret``."""
    if mode == "stdin":
        keys = read_bundle()
        exit_with_controller()
        return keys, public_secret
    return None, (run_dir / "secret").read_bytes()
