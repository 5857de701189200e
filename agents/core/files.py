"""Writing a file so that a reader never sees half of it: the one ``write_atomic``.

Run directories (``config.toml``, ``summary.json``), sweep tables and generated traces are
read by other processes (the report, a notebook, a sweep resuming) while a run may still be
writing; a crash mid-write must leave the old file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, flushed to
    disk, then renamed over ``path``. The file gets the mode a plain ``open`` would give
    (0666 less the umask); the temporary file is removed when anything fails."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        with os.fdopen(fd, "wb") as fh:
            fh.write(raw)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; run files and shipped traces must be readable like any other.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
