"""Load gradbed run directories into typed pandas tables (DESIGN.md section 2, "Run directory").

A run directory explains itself (the Pantheon/Mahimahi habit of logging everything needed to
replot a run years later). This module reads one back:

- ``config.toml``       the resolved config (required);
- ``meta.json``         git SHA, command, versions, kernel capabilities, ``schema_version``
                        (required; must match :data:`agents.core.events.SCHEMA_VERSION`);
- ``events/NODE.parquet`` or ``events/NODE.jsonl`` one per node (at least one required). A run
                        killed before the JSONL to Parquet conversion has only JSONL; those are
                        read too, skipping a truncated final line;
- ``links.parquet``     ``tc -s`` samples of the bottleneck (optional: an interrupted run may not
                        have it, and a run without shaping has nothing to sample);
- ``summary.json``      headline numbers (optional for the same reason);
- ``tcp.parquet``       a ``gradbed torchrun`` run's sock_diag samples of every connection its
                        ranks opened (optional: only such runs have it).

Every failure raises :class:`RunLoadError` naming the file at fault.
"""

from __future__ import annotations

import glob
import json
import math
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from agents.core.config import flatten
from agents.core.events import COMMON_COLUMNS, SCHEMA_VERSION, read_jsonl
from agents.core.links import REQUIRED_LINK_COLUMNS
from agents.core.nodes import PS_NODE, is_worker_node, worker_index

#: Columns every event row carries (agents/core/events.py).
EVENT_COLUMNS = COMMON_COLUMNS
#: Columns every links.parquet row carries (agents/core/links.py).
LINK_COLUMNS = REQUIRED_LINK_COLUMNS
#: The file of a torchrun run's per-connection samples, and the columns read from it
#: (``controller.torchrun.sockdiag.ConnSampler`` writes one row per socket per sample).
TCP_FILE = "tcp.parquet"
TCP_COLUMNS = ("ts_ns", "host", "local", "cookie", "src", "sport", "dst", "dport",
               "bytes_acked", "bytes_received", "snd_cwnd_pkts", "rtt_us")


class RunLoadError(Exception):
    """A run directory (or one of its files) cannot be loaded. The message names the file."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


@dataclass(frozen=True, eq=False)
class Run:
    """One loaded run. The DataFrames are shared, not copied: treat them as read-only.

    ``events`` has the common columns typed (``ts_ns`` int64, ``iter`` int64, ``node`` and
    ``event`` categorical) plus ``t_s``: seconds since the run started (the controller's
    ``run_start`` event when present, else the earliest event). ``links`` carries the same
    ``t_s`` origin, so events and link samples share one time axis.
    """

    path: Path
    config: dict[str, Any]
    meta: dict[str, Any]
    summary: dict[str, Any]
    events: pd.DataFrame
    links: pd.DataFrame
    tcp_info: pd.DataFrame
    decisions: pd.DataFrame
    start_ns: int
    #: A torchrun run's ``tcp.parquet`` (:func:`load_tcp`), with ``t_s``; empty otherwise.
    tcp: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(TCP_COLUMNS)))

    @property
    def name(self) -> str:
        return str(self.config.get("run", {}).get("name") or self.path.name)

    @property
    def workers(self) -> list[str]:
        """Worker node names (``w0``, ``w1``, ...) seen in the events, in numeric order."""
        nodes = [str(n) for n in self.events["node"].unique() if is_worker_node(str(n))]
        return sorted(nodes, key=lambda n: worker_index(n) or 0)

    def of(self, event: str) -> pd.DataFrame:
        """Rows of one event type, with only the columns that event uses (all-NaN dropped)."""
        return _event_rows(self.events, event)

    def iterations(self) -> pd.DataFrame:
        """One row per worker per iteration, from ``iter_done`` (iter_s, compute_s, ...)."""
        df = self.of("iter_done")
        return df.sort_values(["node", "iter"], kind="stable").reset_index(drop=True)

    def evals(self) -> pd.DataFrame:
        """The parameter server's ``eval`` rows and its ``final_eval`` (the model after the last
        step), in time order: ``t_s``, ``iter``, ``event``, ``loss``, ``accuracy``."""
        ev = self.events
        df = ev[ev["event"].isin(["eval", "final_eval"]) & (ev["node"] == PS_NODE)]
        keep = [c for c in df.columns if c in EVENT_COLUMNS or c == "t_s" or df[c].notna().any()]
        df = df[keep].sort_values("ts_ns", kind="stable").reset_index(drop=True)
        for col in ("node", "event"):
            if isinstance(df[col].dtype, pd.CategoricalDtype):
                df[col] = df[col].cat.remove_unused_categories()
        return df


def _event_rows(events: pd.DataFrame, event: str) -> pd.DataFrame:
    df = events[events["event"] == event]
    keep = [c for c in df.columns if c in EVENT_COLUMNS or c == "t_s" or df[c].notna().any()]
    df = df[keep].reset_index(drop=True)
    # The categorical columns keep every category of the whole run; a per-event table is easier
    # to group when it only lists the nodes it has.
    for col in ("node", "event"):
        if isinstance(df[col].dtype, pd.CategoricalDtype):
            df[col] = df[col].cat.remove_unused_categories()
    return df


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunLoadError(path, "missing file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunLoadError(path, f"cannot read JSON: {e}") from e
    if not isinstance(data, dict):
        raise RunLoadError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def _read_config(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise RunLoadError(path, "missing file") from None
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise RunLoadError(path, f"cannot read TOML: {e}") from e


def _read_node_events(path: Path) -> pd.DataFrame:
    try:
        if path.suffix == ".parquet":
            df = pd.read_parquet(path)
        else:
            df = pd.DataFrame(read_jsonl(path))
    except (OSError, ValueError) as e:
        raise RunLoadError(path, f"cannot read events: {e}") from e
    if df.empty:
        return df
    missing = [c for c in EVENT_COLUMNS if c not in df.columns]
    if missing:
        raise RunLoadError(path, f"event schema mismatch: missing columns {missing} "
                                 f"(schema version {SCHEMA_VERSION} needs {list(EVENT_COLUMNS)})")
    return df


def _empty_events() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype="int64" if c in ("ts_ns", "iter") else object)
                         for c in EVENT_COLUMNS})


def load_events(run_dir: str | os.PathLike[str], *, allow_empty: bool = False) -> pd.DataFrame:
    """Every node's events of one run, one row per event, sorted by time: the Parquet file
    of each node, or its JSONL log where the run was cut before conversion (a truncated
    last line is skipped). The one events loader of the project: the controller's summary,
    the benchmarks and :func:`load_run` all read through it.

    Raises RunLoadError naming the file on a missing directory, no event files or a
    schema mismatch; ``allow_empty`` returns an empty frame instead for the first two (a
    run that stopped before any agent logged still gets its summary)."""
    run_dir = Path(run_dir)
    ev_dir = run_dir / "events"
    if not ev_dir.is_dir():
        if allow_empty:
            return _empty_events()
        raise RunLoadError(ev_dir, "missing events directory")
    # Prefer the Parquet file of a node; its JSONL twin is the same data before conversion.
    by_node: dict[str, Path] = {}
    for p in sorted(ev_dir.glob("*.jsonl")):
        by_node[p.stem] = p
    for p in sorted(ev_dir.glob("*.parquet")):
        by_node[p.stem] = p
    if not by_node:
        if allow_empty:
            return _empty_events()
        raise RunLoadError(ev_dir, "no events/*.parquet or events/*.jsonl files")
    frames = [df for df in (_read_node_events(p) for p in by_node.values()) if not df.empty]
    if not frames:
        return _empty_events()
    events = pd.concat(frames, ignore_index=True, sort=False)
    for col in ("ts_ns", "iter"):
        if events[col].isna().any():
            bad = events.loc[events[col].isna(), "node"].iloc[0]
            raise RunLoadError(by_node.get(str(bad), ev_dir),
                               f"event schema mismatch: null {col!r}")
        events[col] = events[col].astype("int64")
    events = events.sort_values("ts_ns", kind="stable").reset_index(drop=True)
    return events


def load_links(path: Path) -> pd.DataFrame:
    """A run's ``links.parquet`` sorted by direction, dev and time (empty, with every
    column, where the file is missing). Raises :class:`RunLoadError` naming the file."""
    if not path.exists():
        return pd.DataFrame({c: pd.Series(dtype=object if c in ("direction", "dev") else "float64")
                             for c in LINK_COLUMNS})
    try:
        links = pd.read_parquet(path)
    except (OSError, ValueError) as e:
        raise RunLoadError(path, f"cannot read Parquet: {e}") from e
    missing = [c for c in LINK_COLUMNS if c not in links.columns]
    if missing:
        raise RunLoadError(path, f"links schema mismatch: missing columns {missing}")
    links = links.copy()
    links["ts_ns"] = links["ts_ns"].astype("int64")
    return links.sort_values(["direction", "dev", "ts_ns"], kind="stable").reset_index(drop=True)


def load_tcp(path: Path) -> pd.DataFrame:
    """A torchrun run's ``tcp.parquet`` (empty, with every column, where the file is
    missing), sorted by host, connection and time. Raises :class:`RunLoadError` naming the
    file when it cannot be read or lacks a column."""
    if not path.exists():
        return pd.DataFrame(columns=list(TCP_COLUMNS))
    try:
        tcp = pd.read_parquet(path)
    except (OSError, ValueError) as e:
        raise RunLoadError(path, f"cannot read Parquet: {e}") from e
    if tcp.empty:
        return pd.DataFrame(columns=list(TCP_COLUMNS))
    missing = [c for c in TCP_COLUMNS if c not in tcp.columns]
    if missing:
        raise RunLoadError(path, f"tcp schema mismatch: missing columns {missing}")
    tcp = tcp.copy()
    tcp["ts_ns"] = tcp["ts_ns"].astype("int64")
    return tcp.sort_values(["host", "cookie", "ts_ns"], kind="stable").reset_index(drop=True)


def run_origin_ns(events: pd.DataFrame, links: pd.DataFrame) -> int:
    """Time zero of a run on its shared clock (CLOCK_MONOTONIC ns): the controller's
    ``run_start`` event when present, else the earliest event, else the earliest link
    sample (0 for a run with neither)."""
    if len(events):
        starts = events.loc[events["event"] == "run_start", "ts_ns"]
        if len(starts):
            return int(starts.min())
        return int(events["ts_ns"].min())
    if len(links):
        return int(links["ts_ns"].min())
    return 0


def load_run(path: str | os.PathLike[str]) -> Run:
    """Load one run directory. Raises :class:`RunLoadError` naming the missing or bad file."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise RunLoadError(run_dir, "not a run directory (missing)")
    config = _read_config(run_dir / "config.toml")
    meta = _read_json(run_dir / "meta.json")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise RunLoadError(run_dir / "meta.json",
                           f"schema_version {version!r} does not match the loader's "
                           f"{SCHEMA_VERSION} (written by another gradbed version)")
    summary_path = run_dir / "summary.json"
    summary = _read_json(summary_path) if summary_path.exists() else {}
    events = load_events(run_dir)
    links = load_links(run_dir / "links.parquet")

    start_ns = run_origin_ns(events, links)
    events["t_s"] = (events["ts_ns"] - start_ns) / 1e9
    links["t_s"] = (links["ts_ns"] - start_ns) / 1e9
    tcp = load_tcp(run_dir / TCP_FILE)
    tcp["t_s"] = (tcp["ts_ns"] - start_ns) / 1e9
    for col in ("node", "event"):
        events[col] = events[col].astype(str).astype("category")
    return Run(path=run_dir, config=config, meta=meta, summary=summary, events=events,
               links=links, tcp_info=_event_rows(events, "tcp_info"),
               decisions=_event_rows(events, "decision"), start_ns=start_ns, tcp=tcp)


def expand_runs(paths_or_glob: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
                ) -> list[Path]:
    """Turn a glob, a path, or a list of either into sorted run directories (those holding a
    ``meta.json``). An explicit path that is not a run directory is kept so loading names it."""
    items = [paths_or_glob] if isinstance(paths_or_glob, str | os.PathLike) else list(paths_or_glob)
    out: list[Path] = []
    for item in items:
        s = os.fspath(item)
        if glob.has_magic(s):
            out.extend(Path(p) for p in sorted(glob.glob(s)) if (Path(p) / "meta.json").exists())
        else:
            out.append(Path(s))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    # 1 and 1.0 and True compare equal in Python but are different settings in a config.
    return type(a) is type(b) and bool(a == b)


def load_runs(paths_or_glob: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]
              ) -> pd.DataFrame:
    """One row per run: the run's ``summary.json`` columns, one column per config key whose
    value differs between the runs (dotted names such as ``compress.name``; a key missing
    from some runs counts as differing, with NaN where absent), and ``run`` (the path).

    Reads only ``config.toml``, ``meta.json`` and ``summary.json``, so a sweep of hundreds of
    runs loads quickly; call :func:`load_run` for a run's events.
    """
    paths = expand_runs(paths_or_glob)
    if not paths:
        raise RunLoadError(Path(os.fspath(paths_or_glob) if isinstance(
            paths_or_glob, str | os.PathLike) else "."), "no run directories matched")
    configs: list[dict[str, Any]] = []
    summaries: list[dict[str, Any]] = []
    for p in paths:
        if not p.is_dir():
            raise RunLoadError(p, "not a run directory (missing)")
        configs.append(flatten(_read_config(p / "config.toml")))
        meta = _read_json(p / "meta.json")
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise RunLoadError(p / "meta.json",
                               f"schema_version {meta.get('schema_version')!r} does not match "
                               f"the loader's {SCHEMA_VERSION}")
        sp = p / "summary.json"
        summaries.append(_read_json(sp) if sp.exists() else {})
    keys = sorted({k for c in configs for k in c})
    missing = object()
    varied = []
    for k in keys:
        vals = [c.get(k, missing) for c in configs]
        first = vals[0]
        if any(v is missing for v in vals) or any(not _same(first, v) for v in vals[1:]):
            varied.append(k)
    rows: list[dict[str, Any]] = []
    for p, cfg, summ in zip(paths, configs, summaries, strict=True):
        row: dict[str, Any] = {"run": str(p)}
        row.update({k: v for k, v in summ.items() if not isinstance(v, dict | list)})
        for k in varied:
            row[k] = cfg.get(k, float("nan"))
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs["varied"] = list(varied)
    return table


def varied_keys(table: pd.DataFrame) -> list[str]:
    """The config keys that differ between the runs of a :func:`load_runs` table."""
    return list(table.attrs.get("varied", []))


def run_labels(table: pd.DataFrame) -> list[str]:
    """A short label per run of a :func:`load_runs` table: its varied config values
    (``compress.name=topk net.bottleneck_mbps=50``), or the directory name when none vary."""
    keys = varied_keys(table)
    if not keys:
        return [Path(p).name for p in table["run"]]
    return [" ".join(f"{k}={row[k]}" for k in keys) for _, row in table.iterrows()]


def default_runs_root() -> Path:
    """Where runs are looked for when no path is given: ``GRADBED_RUNS_ROOT`` or the
    repository's ``runs/`` directory."""
    env = os.environ.get("GRADBED_RUNS_ROOT")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "runs"


def latest_run(root: str | os.PathLike[str] | None = None) -> Path:
    """The most recently started run directory under ``root`` (any depth), by the
    ``meta.json`` modification time. Raises :class:`RunLoadError` when there is none."""
    base = Path(root) if root is not None else default_runs_root()
    metas = sorted(base.glob("**/meta.json"), key=lambda p: p.stat().st_mtime)
    if not metas:
        raise RunLoadError(base, "no run directories (no */meta.json) here; set GRADBED_RUN")
    return metas[-1].parent
