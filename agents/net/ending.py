"""How every agent process ends: its main's errors said in one line, then a fast exit.

Kept apart from :mod:`agents.net.wire` so that an agent without tensors (the flow
generator of background traffic) ends the same way without importing torch, whose import
takes a second or more of a short run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable


def run_agent(body: Callable[[], int], *, name: Callable[[], str],
              errors: tuple[type[BaseException], ...], code: int,
              on_error: Callable[[str], None], close: Callable[[], None]) -> int:
    """The end of every agent's ``main``: run ``body``; an error of ``errors`` (the ones the
    agent expects from its peers and the network) is recorded with ``on_error`` (its event),
    said in one line on stderr naming the agent (``name()``), and ends the agent with
    ``code`` instead of a traceback; ``close`` runs however it ends."""
    try:
        return body()
    except errors as e:
        on_error(str(e))
        print(f"{name()}: {e}", file=sys.stderr)
        return code
    finally:
        close()


def exit_process(code: int) -> None:
    """End an agent process once its results are on disk: flush stdio, then ``os._exit``.

    A normal interpreter exit runs C++ static destructors while daemon threads (the
    PS's accept loop and control reader, a worker's TCP_INFO sampler) may still be inside
    torch; once in a few dozen runs that ended in ``terminate called without an active
    exception`` (SIGABRT) after the last iteration was saved, and the run was reported as
    failed. Every file the agent writes is closed (and atomically renamed) before this.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
