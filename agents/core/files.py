"""Writing a file so that a reader never sees half of it: the one ``write_atomic``.

Run directories (``config.toml``, ``summary.json``), sweep tables and generated traces are
read by other processes (the report, a notebook, a sweep resuming) while a run may still be
writing; a crash mid-write must leave the old file or the new one, never a torn one.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory, flushed to
    disk, then renamed over ``path``. The file gets the mode a plain ``open`` would give
    (0666 less the umask); the temporary file is removed when anything fails."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    write_atomic_with(path, lambda fh: fh.write(raw))


def write_atomic_with(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]
                      ) -> None:
    """:func:`write_atomic` for a writer that takes a binary file (``df.to_parquet``). The
    temporary file is made by this process (``O_EXCL``) and written through its own
    descriptor, so a link another user planted under a temporary name is never followed,
    and it is removed when anything fails (a full disk leaves no ``*.tmp`` behind)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
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


def readable_by_invoker(path: str | os.PathLike[str]) -> bool:
    """Whether the user who ran gradbed may read ``path`` themselves. Under ``sudo`` (root
    with ``SUDO_UID``) root reads any file, so an error that quotes a file's text could
    disclose a file its user may not read: quote it only when the file's mode lets that
    user read it (owner, one of their groups, or everyone). Without sudo: True."""
    import pwd
    import stat

    uid_text = os.environ.get("SUDO_UID")
    if os.geteuid() != 0 or uid_text is None:
        return True
    try:
        uid = int(uid_text)
        st = os.stat(path)
    except (ValueError, OSError):
        return False
    if uid == 0:
        return True
    try:
        user = pwd.getpwuid(uid)
        groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
    except (KeyError, OSError):
        groups = set()
    return bool((st.st_uid == uid and st.st_mode & stat.S_IRUSR)
                or (st.st_gid in groups and st.st_mode & stat.S_IRGRP)
                or st.st_mode & stat.S_IROTH)


def quote_line(path: str | os.PathLike[str], text: str, limit: int = 60) -> str:
    """``text`` (a line or a token of ``path``) for an error message: its first ``limit``
    characters as a literal when the invoking user may read the file, else nothing of it."""
    if not readable_by_invoker(path):
        return "(not shown: the invoking user may not read this file)"
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
