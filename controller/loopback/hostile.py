"""Attackers and faults against a live loopback run, shared by the hardening tests and
``benchmarks/robustness.py``. Each attack returns what the attacker saw; the PS's events say
what it did about it.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from agents.core.config import ExperimentConfig
from agents.net import codec, protocol, wire
from agents.workloads.base import FlatModel, chunk_ranges
from agents.workloads.factory import make_workload
from controller.loopback.dp import connect, handshake, public_tag, start_ps, start_worker


@contextmanager
def endless_fifo(path: Path) -> Iterator[Path]:
    """A FIFO at ``path`` whose writer never stops writing ``1``s and no newline: a file that
    is one endless line, which only a reader that reads in bounded pieces gets past. The
    writer is stopped, and unblocked if it still waits for a reader, on the way out."""
    os.mkfifo(path)
    stop = threading.Event()

    def write_forever() -> None:
        try:
            with open(path, "wb") as f:
                while not stop.is_set():
                    f.write(b"1" * 65536)
        except OSError:  # the reader went (BrokenPipeError among them)
            pass

    writer = threading.Thread(target=write_forever, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        stop.set()
        try:  # unblock a writer still waiting for a reader
            os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
        writer.join(timeout=5)


def rss_peak_kb(pid: int) -> int:
    """VmHWM (peak resident set) of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def read_error(s: socket.socket, timeout_s: float = 10.0) -> str:
    """What the PS answered: its ERROR text (frames before it, such as the weights after
    a WELCOME, are skipped), "closed" or "timeout"."""
    s.settimeout(timeout_s)
    reader = wire.FrameReader(s, max_payload_bytes=1 << 26)
    for _ in range(100_000):
        try:
            h, body = reader.read_frame()
        except wire.ConnectionClosed:
            return "closed"
        except TimeoutError:
            return "timeout"
        except (OSError, codec.FrameError) as e:
            return f"error: {e}"
        if h.msg_type == codec.MsgType.ERROR:
            return bytes(body).decode("utf-8", "replace")
    return "no ERROR frame"


class CapturingProxy(threading.Thread):
    """A tap between one worker and the PS (what tcpdump on the link would see): forwards
    both ways and keeps every byte the worker sent."""

    def __init__(self, ps_port: int) -> None:
        super().__init__(daemon=True)
        self.ps_port = ps_port
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.up = bytearray()
        self.lock = threading.Lock()
        self.upstream: socket.socket | None = None
        self.connected = threading.Event()

    def inject(self, raw: bytes) -> None:
        """Send ``raw`` to the server as if the client had sent it (a replay on the link),
        between two of the client's writes."""
        self.connected.wait(30)
        assert self.upstream is not None
        with self.lock:
            self.upstream.sendall(raw)

    def run(self) -> None:
        cli, _ = self.srv.accept()
        ps = connect(self.ps_port)
        ps.settimeout(None)
        self.upstream = ps
        self.connected.set()

        def pump(a: socket.socket, b: socket.socket, keep: bytearray | None) -> None:
            try:
                while data := a.recv(1 << 16):
                    if keep is None:
                        b.sendall(data)
                        continue
                    with self.lock:  # the client's bytes and injected ones never interleave
                        keep += data
                        b.sendall(data)
            except OSError:
                pass
            for x in (a, b):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pump, args=(ps, cli, None), daemon=True).start()
        pump(cli, ps, self.up)

    def frames(self) -> list[tuple[codec.FrameHeader, bytes]]:
        """The captured frames, in order (raw header + payload bytes each)."""
        out, data, off = [], bytes(self.up), 0
        while off + codec.HEADER_SIZE <= len(data):
            h = codec.decode_header(data[off:off + codec.HEADER_SIZE])
            end = off + codec.HEADER_SIZE + h.payload_len
            if end > len(data):
                break
            out.append((h, data[off:end]))
            off = end
        return out


def replay_handshake(port: int, captured: list[tuple[codec.FrameHeader, bytes]]) -> str:
    """Replay a captured HELLO, then its PROOF, against a fresh challenge."""
    hello = next(raw for h, raw in captured if h.msg_type == codec.MsgType.HELLO)
    proof = next(raw for h, raw in captured if h.msg_type == codec.MsgType.PROOF)
    s = connect(port)
    try:
        s.sendall(hello)
        reader = wire.FrameReader(s, max_payload_bytes=4096)
        h, _ = reader.read_frame()
        if h.msg_type != codec.MsgType.CHALLENGE:
            return f"unexpected {h.msg_type.name}"
        s.sendall(proof)
        return read_error(s)
    finally:
        s.close()


def replay_frame(port: int, raw: bytes) -> str:
    """Send one captured frame (a GRAD, say) as the first frame of a new connection."""
    s = connect(port)
    try:
        s.sendall(raw)
        return read_error(s)
    finally:
        s.close()


def second_hello(port: int, run_dir: Path, worker: int) -> str:
    """A complete, correct handshake (the real key) for a worker that is alive."""
    s = connect(port)
    try:
        handshake(s, run_dir, worker)
        return "admitted"
    except protocol.Rejected as e:
        return str(e)
    except (OSError, codec.FrameError) as e:
        return f"error: {e}"
    finally:
        s.close()


def file_reader(port: int, run_dir: Path, worker: int) -> list[str]:
    """A host that reads every file of the run directory and tries each as the key (and,
    as the old protocol's secret, as the run tag's HMAC key)."""
    results = []
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file()):
        try:
            content = path.read_bytes()[:4096]
        except OSError:
            continue
        for key in {content[:32].ljust(32, b"\0"), content.strip()[:64] or b"\0" * 32}:
            s = connect(port)
            try:
                handshake(s, run_dir, worker, key=key)
                results.append(f"{path.name}: admitted")
            except (protocol.Rejected, OSError, codec.FrameError) as e:
                results.append(f"{path.name}: {e}")
            finally:
                s.close()
            if content:
                old_tag = codec.run_tag(run_dir.name, content)
                hdr, body = codec.frame_for_bytes(codec.hello_payload("worker", worker),
                                                  msg_type=codec.MsgType.HELLO,
                                                  run_tag=old_tag, worker=worker)
                results.append(f"{path.name} (old tag): "
                               f"{replay_frame(port, hdr + bytes(body))}")
    return results


def huge_header(port: int, run_dir: Path, *, authenticated_as: int | None = None,
                payload_len: int = 2**32) -> str:
    """A header announcing ``payload_len`` bytes: before authentication (a HELLO with the
    right run tag), or as an authenticated worker's GRAD."""
    s = connect(port)
    try:
        numel = payload_len
        if authenticated_as is None:
            h = codec.FrameHeader(msg_type=codec.MsgType.HELLO, run_tag=public_tag(run_dir),
                                  worker=0, iteration=0, chunk=0, dtype=codec.DType.UINT8,
                                  numel=numel, payload_len=payload_len)
            s.sendall(codec.encode_header(h))
        else:
            _, session = handshake(s, run_dir, authenticated_as)
            h = codec.FrameHeader(msg_type=codec.MsgType.GRAD, run_tag=0,
                                  worker=authenticated_as, iteration=0, chunk=0,
                                  dtype=codec.DType.UINT8, numel=numel,
                                  payload_len=payload_len)
            s.sendall(session.up.seal(codec.encode_header(h)))
        s.sendall(b"\0" * 65536)  # start on the payload: the PS must not have reserved it
        return read_error(s)
    except protocol.Rejected as e:
        return str(e)
    finally:
        s.close()


def slow_connections(port: int, n: int, source: str = "127.0.0.2") -> list[socket.socket]:
    """``n`` connections from ``source`` (a background host: loopback answers on all of
    127/8, so a stranger need not share the real workers' 127.0.0.1) that send 10 bytes
    of a header and then nothing."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((source, 0))
        s.settimeout(30)
        s.connect(("127.0.0.1", port))
        try:
            s.sendall(b"GBED\x01\x00\x01\x00\x00\x00")
        except OSError:
            pass  # refused unread already: it counts as closed below
        socks.append(s)
    return socks


class Flood(threading.Thread):
    """A keyless host's flood: keeps ``per_source`` slow connections (10 bytes of a
    header, then nothing) open from each of ``sources`` to ``port``, opening a new one as
    soon as the far end closes one, until :meth:`stop`. ``opened``: connections made."""

    REOPEN_PER_ROUND = 200

    def __init__(self, port: int, sources: list[str], per_source: int) -> None:
        super().__init__(daemon=True, name="flood")
        self.port = port
        self.sources = sources
        self.per_source = per_source
        self.opened = 0
        self.peak_open = 0
        self._halt = threading.Event()

    def _open(self, source: str) -> socket.socket | None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((source, 0))
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
            self.opened += 1
            return s
        except OSError:
            s.close()
            return None

    def run(self) -> None:
        live: dict[socket.socket, str] = {}
        sent: set[socket.socket] = set()
        poller = select.poll()
        try:
            while not self._halt.is_set():
                have = {src: 0 for src in self.sources}
                for src in live.values():
                    have[src] += 1
                for src, n in have.items():
                    # At most REOPEN_PER_ROUND a round: a flood, not a busy loop that
                    # takes the cores the run under attack needs.
                    for _ in range(min(self.per_source - n, self.REOPEN_PER_ROUND)):
                        s = self._open(src)
                        if s is not None:
                            live[s] = src
                            poller.register(s, select.POLLOUT | select.POLLIN | select.POLLHUP)
                self.peak_open = max(self.peak_open, len(live))
                by_fd = {s.fileno(): s for s in live}
                for fd, ev in poller.poll(100):
                    s = by_fd[fd]
                    if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                        poller.unregister(s)  # closed (or refused) by the far end
                        del live[s]
                        sent.discard(s)
                        s.close()
                    elif s not in sent:
                        try:
                            s.send(b"GBED\x01\x00\x01\x00\x00\x00")
                        except OSError:
                            pass
                        sent.add(s)
                        poller.modify(s, select.POLLIN | select.POLLHUP)
        finally:
            for s in live:
                s.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=10)


def closed_count(socks: list[socket.socket], wait_s: float) -> int:
    """How many of ``socks`` the PS closed (EOF or an ERROR frame) within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    closed = 0
    for s in socks:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            while s.recv(4096):
                pass
            closed += 1
        except TimeoutError:
            pass
        except OSError:
            closed += 1
        finally:
            s.close()
    return closed


POISONS = ("nan", "inf", "oversize", "duplicate")


def poison_gradient(kind: str, chunk_numel: int) -> list[torch.Tensor]:
    """One top-k payload (values, int32 indices) for chunk 0 of the given poison."""
    k = 16
    values = torch.ones(k)
    idx = torch.arange(k, dtype=torch.int32)
    if kind == "nan":
        values[3] = float("nan")
    elif kind == "inf":
        values[5] = float("-inf")
    elif kind == "oversize":
        values[7] = 3e38
    elif kind == "duplicate":
        idx = torch.zeros(k, dtype=torch.int32)  # one index, k times
    else:
        raise ValueError(kind)
    assert int(idx.max()) < chunk_numel
    return [values, idx]


class PoisonWorker(threading.Thread):
    """Joins as ``worker`` with its real key (a compromised worker), takes the weights,
    sends one poisoned GRAD for iteration 0, chunk 0."""

    def __init__(self, port: int, run_dir: Path, worker: int, nchunks: int, chunk_numel: int,
                 kind: str) -> None:
        super().__init__(daemon=True)
        self.port, self.run_dir, self.worker = port, run_dir, worker
        self.nchunks, self.chunk_numel, self.kind = nchunks, chunk_numel, kind
        self.answer = ""

    def run(self) -> None:
        try:
            s = connect(self.port)
            s.settimeout(150)  # admission waits for every worker, real ones included
            reader, session = handshake(s, self.run_dir, self.worker)
            for _ in range(self.nchunks):
                reader.read_message()
            wire.send_message(s, poison_gradient(self.kind, self.chunk_numel),
                              msg_type=codec.MsgType.GRAD, run_tag=0, worker=self.worker,
                              iteration=0, chunk=0, mac=session.up)
            s.settimeout(120)
            try:
                while s.recv(65536):
                    pass
                self.answer = "dropped"
            except TimeoutError:
                self.answer = "not dropped within 120 s"
            except OSError:
                self.answer = "dropped"  # a reset: the PS closed with our bytes unread
            s.close()
        except BaseException as e:  # reported by the caller
            self.answer = f"error: {e!r}"


def poisoned_run(run_dir: Path, cfg: ExperimentConfig, ps_wait_s: float
                 ) -> tuple[int, list[int], list[PoisonWorker]]:
    """A run of ``cfg`` with two real workers (0, 1) and one PoisonWorker per kind of
    POISONS as workers 2, 3, ...: returns the PS's exit code, the real workers' exit codes
    and the fakes (each with its ``answer``). Every process is gone when it returns."""
    model = FlatModel(make_workload(cfg.workload).build_model(cfg.run.seed))
    chunks = chunk_ranges(model.numel, cfg.workload.chunk_bytes)
    port = cfg.net.port
    ps = start_ps(run_dir)
    workers = [start_worker(run_dir, k, port) for k in (0, 1)]
    fakes = [PoisonWorker(port, run_dir, 2 + i, len(chunks), chunks[0][1] - chunks[0][0], kind)
             for i, kind in enumerate(POISONS)]
    try:
        for f in fakes:
            f.start()
        for f in fakes:
            f.join(timeout=180)
        rc = ps.wait(timeout=ps_wait_s)
        return rc, [w.wait(timeout=30) for w in workers], fakes
    finally:
        for p in [ps, *workers]:
            if p.poll() is None:
                p.kill()
