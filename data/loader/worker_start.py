"""How the loader's DataLoader workers start: forked from multiprocessing's fork server, which
is started when a loader with workers is built and preloaded with the loader and its compiled
code (``worker_preload.py``).

Design choices:
- The fork server, not a plain fork: a clean single-threaded process (a plain fork would copy
  the trainer's threads and CUDA state), and a worker leaves through the fork server's
  ``os._exit``. A spawned worker tears down a whole interpreter instead, and one that had run
  the visual tokenizer (online tokenization) could abort in a C++ destructor at shutdown.
- Preloaded, the server imports torch and the loader and loads numba's cached kernels once;
  every worker forked from it finds that done instead of paying it before its first batch. The
  cost is one more process holding torch (its pages shared with the workers).
- Started when the loader is built, so that its imports run while the trainer counts the
  epoch's batches and reads its first shards.
- The preload list is process-wide and read when the server starts: the loader's module is
  added to whatever a trainer set (``__main__`` by default); a server already running is left
  as it is (its workers then import and warm the loader themselves).
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
