"""How the loader's DataLoader workers start: forked from multiprocessing's fork server, which
is started when a loader with workers is built and preloaded with the loader and its compiled
code (``worker_preload.py``).

Design choices:
- The fork server, not a plain fork: a clean single-threaded process (not the trainer's, whose
  threads and CUDA state a plain fork would copy), and a worker leaves through the fork server's
  ``os._exit`` once its queues are flushed. A spawned worker instead tore down a whole
  interpreter, and with torch 2.13 (CPU) one that had run the visual tokenizer (online
  tokenization) aborted in about 1 shutdown of 7 ("terminate called without an active
  exception", SIGABRT in a C++ destructor, no Python frame), which failed the loader.
- The fork server is a fresh interpreter: left to itself it imports only the main script, and
  every worker then imported torch and the loader and paid numba's first-dispatch set-up and
  the loading of its cached kernels before its first batch (about 1.6 s of CPU from its fork to
  its first batch on the 2-core sandbox, 0.1 s forked from the preloaded server). Preloaded with
  ``worker_preload``, the server does that once, and every worker forked from it (each
  DataLoader iterator's, every epoch) finds it done.
- The cost: the server is one more process holding torch (about 350 MB of RSS). Its pages are
  shared with the workers forked from it, so PSS barely changes, but a sum of RSS over the
  process tree counts them once more.
- Started when the loader is built (``start_fork_server``), so that the server's imports run
  while the trainer's process counts the epoch's batches and reads its first shards.
- The preload list is process-wide and read only when the server starts: the loader's module is
  added to whatever a trainer set before (``__main__`` by default), and a server already running
  is left as it is (its workers then import and warm the loader themselves, as before).
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
