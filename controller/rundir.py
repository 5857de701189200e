"""The run directory: creation, atomic writes, metadata, and finalisation.

A run directory explains itself (Pantheon's metadata, Mahimahi's logged command
line): ``config.toml`` (resolved), ``meta.json`` (git SHA, command line, package
versions, kernel capabilities, schema version), ``events/*.parquet``,
``links.parquet``, ``summary.json``, ``trace.json`` (the timelines, Chrome Trace Event
Format) and ``run.log`` with every external command.
Every file is written atomically (temporary name, then ``os.replace``), so an
interrupted run never leaves a half-written file.
"""

from __future__ import annotations

import datetime as dt
import errno
import json
import os
import platform
import secrets
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.core.events import SCHEMA_VERSION, jsonl_to_parquet
from agents.core.files import write_atomic

if TYPE_CHECKING:  # pandas is imported where the run's tables are written, not at the start
    import pandas as pd

REPO_ROOT = Path(__file__).resolve().parents[1]


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


# -- a summary whatever happens ---------------------------------------------------------------
# A run directory's file system may fill up mid-run (its agents' events, someone else's
# files). The summary is what must survive: a provisional one is written first, room for the
# final one is kept in a reserve file from the start and given back just before it is
# written, and every other file of the finalisation is best effort.

#: Bytes kept for the summary (and the meta that follows it): far above either's size.
RESERVE_BYTES = 1 << 20
RESERVE_NAME = ".summary.reserve"
#: The ``stop_reason`` of a provisional summary: the run has not ended (or its controller
#: died before it could say how; ``gradbed cleanup`` then finishes it).
RUNNING = "running"


def provisional_summary() -> dict[str, Any]:
    return {"provisional": True, "stop_reason": RUNNING, "interrupted": True,
            "iterations": 0}


def reserve_room(run_dir: Path) -> None:
    """Keep :data:`RESERVE_BYTES` of the run directory's file system for its summary."""
    fd = os.open(run_dir / RESERVE_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.write(fd, b"\0" * RESERVE_BYTES)  # a file system without fallocate
    finally:
        os.close(fd)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    """Write ``summary.json`` atomically, first giving back the room kept for it when this is
    the final one."""
    if not summary.get("provisional"):
        try:
            os.unlink(run_dir / RESERVE_NAME)
        except FileNotFoundError:
            pass
    write_json(run_dir / "summary.json", summary)


def complete(run_dir: Path) -> bool:
    """Whether the run directory has its final summary."""
    try:
        return not json.loads((run_dir / "summary.json").read_text()).get("provisional")
    except (OSError, ValueError, AttributeError):
        return False


def best_effort(action: Any, what: str, say: Any) -> None:
    """Run ``action()``; a failure to write (a full disk) is said, not raised: the summary
    after it matters more than ``what``."""
    try:
        action()
    except OSError as e:
        say(f"warning: {what} not written: {e}")


def create(out_root: Path, name: str) -> Path:
    """A new, uniquely named run directory under ``out_root``, as an absolute path (the
    agents start in other working directories). Folders made here, ``out_root``'s missing
    parents included, belong to the user who ran sudo (:func:`hand_over`)."""
    out_root = Path(out_root).absolute()
    made = make_dirs(out_root)
    check_owner(out_root)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = out_root / f"{name}-{stamp}-{secrets.token_hex(2)}"
    # mkdir, not makedirs: it fails on anything already there, a planted link included.
    path.mkdir(mode=0o755)
    (path / "events").mkdir()
    (path / "logs").mkdir()
    for d in made:
        hand_over(d, recursive=False)
    # No key is written here: every host can read this directory (agents.net.auth).
    return path


def check_owner(folder: Path) -> None:
    """Refuse, under sudo, an ``--out`` folder (or a link on its way) that belongs to a
    user other than root and the one who ran sudo: that user could swap what is in it for
    links, and root would then write where they point."""
    owner = invoking_user()
    if owner is None:
        return
    p = folder
    while True:
        st = os.lstat(p)
        if st.st_uid not in (0, owner[0]):
            raise PermissionError(f"{p} belongs to uid {st.st_uid}, neither root nor the "
                                  f"user who ran sudo (uid {owner[0]}); choose another --out")
        if p.parent == p:
            return
        p = p.parent


def not_a_run_dir(path: Path) -> str:
    """Why ``path`` is not a run directory root may finish ("" when it is one): a link, not
    a folder, without the ``events`` folder every run has, or in a folder that belongs to a
    user other than root and the one who ran sudo (:func:`check_owner`)."""
    try:
        st = os.lstat(path)
        ev = os.lstat(path / "events")
    except FileNotFoundError:
        return "not a gradbed run directory (no events folder)"
    if not stat.S_ISDIR(st.st_mode) or not stat.S_ISDIR(ev.st_mode):
        return "not a gradbed run directory (a link or not a folder)"
    try:
        check_owner(path)
    except PermissionError as e:
        return str(e)
    return ""


def make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``; returns the folders it made, outermost first."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def invoking_user() -> tuple[int, int] | None:
    """(uid, gid) of the user who ran ``sudo gradbed ...``; None when not run through sudo
    as root (then whatever is made belongs to whoever made it, as usual)."""
    if os.geteuid() != 0:
        return None
    try:
        return int(os.environ["SUDO_UID"]), int(os.environ["SUDO_GID"])
    except (KeyError, ValueError):
        return None


def hand_over(path: Path, recursive: bool = True) -> None:
    """Give ``path`` (and, recursively, what is in it) to the user who ran sudo, so a run
    made with ``sudo gradbed run`` can be read, moved and deleted without root. Links are
    changed themselves, never followed; files that vanish meanwhile are skipped."""
    owner = invoking_user()
    if owner is None:
        return
    uid, gid = owner
    todo = [Path(path)]
    while todo:
        p = todo.pop()
        try:
            os.chown(p, uid, gid, follow_symlinks=False)
            if recursive and p.is_dir() and not p.is_symlink():
                todo.extend(p.iterdir())
        except FileNotFoundError:
            continue


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


# -- runs that ended without their controller's finalisation ---------------------------------

#: One file per run in progress, naming its directory and its controller's process, so
#: ``gradbed cleanup`` finds the runs whose controller was killed (SIGKILL leaves no chance
#: to write anything) even when no agent is left to point at them.
ACTIVE_DIR = Path("/run/gradbed/runs")
#: Where a run's control socket goes when ``RUN/control.sock`` is too long a path
#: (agents.net.control.FALLBACK_DIR), named after the run.
SOCKET_DIR = Path("/run/gradbed")


def _start_ticks(pid: int) -> int | None:
    """A process's start time in clock ticks since boot (``/proc/PID/stat`` field 22):
    with the pid, it tells a live controller from a new process that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def mark_active(run_dir: Path) -> None:
    """Record that this process is running ``run_dir`` (best effort: a machine without a
    writable /run only loses ``gradbed cleanup``'s finding it by itself)."""
    try:
        ACTIVE_DIR.mkdir(parents=True, exist_ok=True)
        write_json(ACTIVE_DIR / f"{run_dir.name}.json",
                   {"run_dir": str(run_dir), "pid": os.getpid(),
                    "start_ticks": _start_ticks(os.getpid())})
    except OSError:
        pass


def mark_done(run_dir: Path) -> None:
    try:
        (ACTIVE_DIR / f"{run_dir.name}.json").unlink()
    except OSError:
        pass


def orphaned_runs() -> list[tuple[Path, Path]]:
    """(registry entry, run directory) of every run whose controller is gone."""
    out = []
    for entry in sorted(ACTIVE_DIR.glob("*.json")) if ACTIVE_DIR.is_dir() else []:
        try:
            rec = json.loads(entry.read_text())
            pid, ticks, run_dir = int(rec["pid"]), rec.get("start_ticks"), Path(rec["run_dir"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written by a controller killed while writing it: not ours to judge
        if _start_ticks(pid) is not None and _start_ticks(pid) == ticks:
            continue  # still running
        out.append((entry, run_dir))
    return out


def finish(run_dir: Path, stop_reason: str, error: str | None = None,
           cfg_toml: str | None = None, argv: list[str] | None = None) -> list[str]:
    """Make a run directory that stopped without (or part way through) its controller's
    finalisation explain itself: ``config.toml`` (from ``cfg_toml``) and ``meta.json`` where
    missing, events converted to Parquet, a ``summary.json`` computed from whatever events
    the agents wrote (where none exists; an existing one only gains the ``stop_reason`` it
    lacks and the ``error``), and no secret or control socket left. Returns what it did.

    Root acts here on a folder a user may have written in: only paths derived from the run's
    name are removed (``RUN/control.sock``, ``/run/gradbed/NAME.sock``, ``RUN/secret``,
    ``RUN/control.path``), never one a file in the folder names, and only what is what it
    should be (a socket is removed only if it is a socket; a link is removed, not followed).
    """
    done: list[str] = []
    if cfg_toml is not None and not (run_dir / "config.toml").exists():
        write_atomic(run_dir / "config.toml", cfg_toml)
        done.append("wrote config.toml")
    if not (run_dir / "meta.json").exists():
        write_json(run_dir / "meta.json", {**meta(run_dir, {}, 0, argv), "started_ns": None,
                                           "incomplete": True})
        done.append("wrote meta.json")
    convert_events(run_dir)
    summary_path = run_dir / "summary.json"
    if complete(run_dir):
        summary = json.loads(summary_path.read_text())
        summary["stop_reason"] = summary.get("stop_reason") or stop_reason
    else:
        summary = _summary_from_events(run_dir, stop_reason)
        done.append(f"wrote summary.json (stop_reason: {stop_reason})")
    if error:
        summary["error"] = error
    write_summary(run_dir, summary)
    for tmp in [*run_dir.glob(".*.tmp"), *(run_dir / "events").glob(".*.tmp")]:
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink()  # a writer killed mid-write left it
            done.append(f"removed {tmp}")
    if write_timelines(run_dir, done.append):
        done.append("wrote trace.json")
    done += remove_leftovers(run_dir)
    hand_over(run_dir)
    return done


def write_timelines(run_dir: Path, say: Callable[[str], object],
                    events: pd.DataFrame | None = None) -> bool:
    """Write ``trace.json`` (:func:`analysis.trace.write_trace`, given the run's ``events``
    when the caller loaded them already); a failure is said, never raised: the timelines
    are a view of the events, which are what must survive."""
    try:
        from analysis.trace import write_trace

        write_trace(run_dir, events)
    except Exception as e:
        say(f"warning: trace.json not written: {type(e).__name__}: {e}")
        return False
    return True


def remove_leftovers(run_dir: Path) -> list[str]:
    """Remove the run's secret and control socket, by the names gradbed gives them (see
    :func:`finish`); one line per thing removed."""
    done = []
    for leftover, kind in ((run_dir / "secret", None), (run_dir / "control.path", None),
                           (run_dir / "control.sock", stat.S_ISSOCK),
                           (SOCKET_DIR / f"{run_dir.name}.sock", stat.S_ISSOCK)):
        try:
            st = os.lstat(leftover)
        except FileNotFoundError:
            continue
        if kind is not None and not kind(st.st_mode):
            continue  # not the socket gradbed made under that name: not ours to remove
        leftover.unlink()
        done.append(f"removed {leftover}")
    return done


def _summary_from_events(run_dir: Path, stop_reason: str) -> dict[str, Any]:
    """The summary of a run whose controller never wrote one: the usual headline numbers from
    the agents' events (no link samples: those lived in the controller), ``interrupted``."""
    import tomllib

    import pandas as pd

    from analysis.load import LINK_COLUMNS, load_events
    from controller.summary import summarize

    base: dict[str, Any] = {"interrupted": True, "stop_reason": stop_reason}
    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
        events = load_events(run_dir, allow_empty=True)
        links_path = run_dir / "links.parquet"
        links = pd.read_parquet(links_path) if links_path.exists() \
            else pd.DataFrame(columns=list(LINK_COLUMNS))
        wall_s = (int(events["ts_ns"].max()) - int(events["ts_ns"].min())) / 1e9 \
            if len(events) else 0.0
        return summarize(events, links, cfg, wall_s, True, stop_reason)
    except Exception as e:  # what can be said is said; the reason must get written
        return {**base, "summary_error": f"{type(e).__name__}: {e}"}
