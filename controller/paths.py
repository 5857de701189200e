"""Where the files a config names are: made absolute before any agent starts.

A config is read by processes that do not share its author's working directory (the
agents start in their own hosts, a sweep re-runs a copy of the config from its own
directory), so every file a config names is resolved once, here, into an absolute path,
and the run directory's ``config.toml`` records that path. The rule, for each path field
(:data:`PATH_FIELDS`):

1. an absolute path (``~`` expanded) stays as it is;
2. a relative path written in the config file is relative to the config file's folder; one
   given on the command line (``--set trace.up=...``) is relative to the working directory,
   where the user typed it;
3. a relative path found in neither place but naming a data file shipped with gradbed (a
   ``traces/data/NAME`` path, as the shipped configs write, or a bare ``NAME``) is that
   shipped file, found through :mod:`importlib.resources` so an installed gradbed finds it
   outside any checkout;
4. otherwise it is the absolute form of rule 2's path, so the loader's "not found" names
   the file that was looked for.

Config files themselves follow rules 1, 3 and 4: ``gradbed run configs/demo.toml`` works from
any directory, because ``configs/`` ships with gradbed too.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections.abc import Iterable
from importlib import resources
from pathlib import Path

from agents.core import config as cfgmod
from controller.rundir import hand_over, make_dirs

#: The config fields that name a file (section, field). A new path field is one line here.
#: A field may hold one name or a table of them (``topo.traces``: shaping point -> trace).
PATH_FIELDS: tuple[tuple[str, str], ...] = (
    ("trace", "up"), ("trace", "down"), ("background", "flow_cdf"), ("background", "pcap"),
    ("topo", "traces"), ("cluster", "key_path"),
    ("cluster", "ssh_config"), ("torchrun", "script"),
)

#: The shipped data: package, folder inside it, and the prefix a config writes for it.
_SHIPPED_DATA = ("traces", "data", "traces/data/")
_SHIPPED_CONFIGS = ("configs", "", "configs/")


def _shipped(value: str, package: str, folder: str, prefix: str) -> Path | None:
    """The shipped file ``value`` names (``PREFIX/NAME`` or a bare ``NAME``), or None."""
    rel = value[len(prefix):] if value.startswith(prefix) else value
    if "/" in rel or not rel:
        return None
    try:
        root = resources.files(package)
    except ModuleNotFoundError:
        return None
    entry = root.joinpath(folder, rel) if folder else root.joinpath(rel)
    # A wheel installs as plain files, so the resource is a real path (never a zip member).
    return Path(str(entry)) if entry.is_file() else None


def resolve_path(value: str, base_dir: Path) -> str:
    """The absolute path ``value`` (a config's file field) stands for; "" stays "" (rules
    in the module docstring)."""
    if not value:
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    here = (base_dir / p).absolute()
    if here.exists():
        return str(here)
    shipped = _shipped(value, *_SHIPPED_DATA)
    return str(shipped) if shipped is not None else str(here)


def resolve_config_file(value: str | os.PathLike[str]) -> Path:
    """A config file named on the command line: as given when it exists, else the shipped
    config of that name (``configs/demo.toml`` or ``demo.toml``), else as given."""
    p = Path(value).expanduser()
    if p.exists() or p.is_absolute():
        return p
    shipped = _shipped(str(value), *_SHIPPED_CONFIGS)
    return shipped if shipped is not None else p


def resolve_paths(cfg: cfgmod.ExperimentConfig, base_dir: Path,
                  cli_fields: Iterable[str] = (), cwd: Path | None = None
                  ) -> cfgmod.ExperimentConfig:
    """``cfg`` with every path field absolute: relative to ``base_dir`` (the config file's
    folder), or to ``cwd`` for the dotted fields in ``cli_fields`` (given by ``--set``)."""
    cwd = Path.cwd() if cwd is None else cwd
    from_cli = set(cli_fields)
    sections: dict[str, object] = {}
    for section, name in PATH_FIELDS:
        if not hasattr(cfg, section):
            continue
        sec = sections.get(section, getattr(cfg, section))
        dotted = f"{section}.{name}"
        base = cwd if any(f == dotted or f.startswith(dotted + ".") for f in from_cli) \
            else base_dir
        old = getattr(sec, name)
        value: object = ({k: resolve_path(v, base) for k, v in old.items()}
                         if isinstance(old, dict) else resolve_path(old, base))
        sections[section] = dataclasses.replace(sec, **{name: value})  # type: ignore[type-var]
    # topo.traces: shaping point -> trace file, each resolved the same way.
    base = cwd if any(f.startswith("topo.traces") for f in from_cli) else base_dir
    traces = {point: resolve_path(path, base) for point, path in cfg.topo.traces.items()}
    sections["topo"] = dataclasses.replace(cfg.topo, traces=traces)
    return dataclasses.replace(cfg, **sections)  # type: ignore[arg-type]


def override_fields(overrides: Iterable[str]) -> list[str]:
    """The dotted fields that ``--set`` overrides name (``trace.up=x`` -> ``trace.up``)."""
    return [".".join(cfgmod.parse_override(o)[0]) for o in overrides]


def load_config(path: str | os.PathLike[str], overrides: list[str] | None = None
                ) -> cfgmod.ExperimentConfig:
    """Load a config as the command line does: the file (or the shipped config of that
    name), the ``--set`` overrides, and every path field made absolute."""
    overrides = list(overrides or [])
    config_file = resolve_config_file(path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", FutureWarning)
        cfg = cfgmod.load(config_file, overrides)
    for w in said:  # a deprecated field: one line naming the file and the new name
        print(f"{config_file}: warning: {w.message}", file=sys.stderr)
    return resolve_paths(cfg, config_file.parent.absolute(), override_fields(overrides))


class OutDirError(ValueError):
    """``--out`` names something a run directory cannot be made in."""


def check_out_dir(out: str | os.PathLike[str], flag: str = "--out") -> Path:
    """``out`` made (with its parents) and proved writable by making and removing a folder
    in it; its absolute path. Raises OutDirError with one line saying what is wrong."""
    import errno
    import tempfile

    path = Path(out).expanduser().absolute()
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError as e:  # a folder on the way that this user may not enter
        raise OutDirError(f"{flag} {out}: cannot reach it: {_why(e)}") from None
    if is_file:
        raise OutDirError(f"{flag} {out}: is a file, not a directory")
    try:
        made = make_dirs(path)
    except OSError as e:
        blocker = next((p for p in path.parents if _is_file(p)), None)
        if blocker is not None:
            raise OutDirError(f"{flag} {out}: {blocker} is a file, not a directory") from None
        raise OutDirError(f"{flag} {out}: cannot create it: {_why(e)}") from None
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gradbed-write-test-", dir=path))
    except OSError as e:
        for d in reversed(made):  # leave no empty folders behind a refusal
            try:
                d.rmdir()
            except OSError:
                break
        what = "read-only file system" if e.errno == errno.EROFS else _why(e)
        raise OutDirError(f"{flag} {out}: not writable: {what}") from None
    for d in made:
        hand_over(d, recursive=False)
    return path


def _is_file(p: Path) -> bool:
    try:
        return p.exists() and not p.is_dir()
    except OSError:
        return False


def _why(e: OSError) -> str:
    return (e.strerror or str(e)).lower()
