"""How the loader's DataLoader workers start: forked from multiprocessing's fork server, which
is started when a loader with workers is built and preloaded with the loader and its compiled
code (``worker_preload.py``). Why a fork server rather than a plain fork or spawn, and what
the preload list keeps: docs/loader.md, "Worker processes".
"""

from __future__ import annotations

import multiprocessing
from multiprocessing import forkserver

WORKER_START = "forkserver"
PRELOAD = "data.loader.worker_preload"


def start_fork_server() -> None:
    """Start the fork server the loader's workers fork from (preloaded with ``PRELOAD``) unless
    one runs already; returns at once (the server imports in the background)."""
    server = forkserver._forkserver  # the process-wide server that forkserver contexts use
    if getattr(server, "_forkserver_pid", None) is None:  # not running (no public query)
        # No public getter: the list a trainer may have set (multiprocessing's default: __main__)
        preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
        if PRELOAD not in preload:
            multiprocessing.get_context(WORKER_START).set_forkserver_preload([*preload, PRELOAD])
    forkserver.ensure_running()
