"""The run directory: creation, atomic writes, metadata, and finalisation.

A run directory explains itself (Pantheon's metadata, Mahimahi's logged command
line): ``config.toml`` (resolved), ``meta.json`` (git SHA, command line, package
versions, kernel capabilities, schema version), ``events/*.parquet``,
``links.parquet``, ``summary.json`` and ``run.log`` with every external command.
Every file is written atomically (temporary name, then ``os.replace``), so an
interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import datetime as dt
import json
import platform
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from agents.core.events import SCHEMA_VERSION, jsonl_to_parquet
from agents.core.files import write_atomic

REPO_ROOT = Path(__file__).resolve().parents[1]


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def create(out_root: Path, name: str) -> Path:
    """A new, uniquely named run directory under ``out_root``."""
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_root / f"{name}-{stamp}-{secrets.token_hex(2)}"
    (path / "events").mkdir(parents=True)
    (path / "logs").mkdir()
    # No key is written here: every host can read this directory (agents.auth).
    return path


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
                             capture_output=True, text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if dirty else "")


def _version(module: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(module)
    except Exception:
        return None


def _tool_version(argv: list[str]) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout or out.stderr).strip().splitlines()
    return text[0] if text else None


def versions() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "gradbed": _version("gradbed"),
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "pandas": _version("pandas"),
        "pyarrow": _version("pyarrow"),
        "mininet": _version("mininet"),
        "iperf3": _tool_version(["iperf3", "--version"]),
        "tc": _tool_version(["tc", "-V"]),
    }


def meta(run_dir: Path, caps: dict[str, Any], started_ns: int, argv: list[str] | None = None,
         **extra: Any) -> dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_dir.name,
        "git_sha": git_sha(),
        "command": argv if argv is not None else sys.argv,
        "versions": versions(),
        "kernel": caps,
        "host": platform.node(),
        "started_ns": started_ns,
        "started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **extra,
    }


def convert_events(run_dir: Path) -> list[Path]:
    """Every ``events/*.jsonl`` to Parquet. A file that fails is reported, never lost:
    its JSONL stays where it is and the loaders read it."""
    out = []
    for src in sorted((run_dir / "events").glob("*.jsonl")):
        if src.stat().st_size == 0:
            continue
        try:
            out.append(jsonl_to_parquet(src))
        except Exception as e:  # keep going: the JSONL is still there
            print(f"warning: {src}: not converted to Parquet: {e}", file=sys.stderr)
    return out
