"""How the loader's DataLoader workers start (``data.worker_start``): forked from the trainer's
process (``fork``, the default) or from multiprocessing's fork server (``forkserver``). Either
way a worker finds the loader imported and its compiled kernels loaded (``worker_preload.py``)
and imports nothing before its first batch.

Design choices:
- ``fork`` by default, as torch's DataLoader does on Linux and as the trainers we measure
  ourselves against run it: a worker starts at once and shares the trainer's pages, so it adds
  no process holding torch. The trainer's process warms the kernels once, when the loader is
  built; every worker forked later (each iterator's, every epoch and validation pass) inherits
  them. A worker touches no CUDA and none of the trainer's locks (it packs into shared memory;
  the trainer's process pins and copies), and it leaves through ``os._exit``.
- ``forkserver`` for a trainer whose other threads may hold a lock at the moment a worker forks
  that the worker then needs (a library of its own, a custom ``__main__``; Python 3.12 warns
  on every fork of a threaded process). The server is a clean single-threaded process started
  when the loader is built, so its imports run while the trainer counts the epoch; it is
  preloaded with ``worker_preload.py`` after whatever a trainer set (``__main__`` by default).
  The cost is one more process holding torch, its pages shared with the workers. A server
  already running is left as it is (its workers then import and warm the loader themselves).
- Not ``spawn``: a spawned worker tears down a whole interpreter, and one that had run the visual
  tokenizer (online tokenization) could abort in a C++ destructor at shutdown.
"""

from __future__ import annotations

import importlib
import multiprocessing
from multiprocessing import forkserver

WORKER_STARTS = ("fork", "forkserver")
PRELOAD = "data.loader.worker_preload"


def prepare_workers(method: str) -> None:
    """Make ready what the loader's workers start from, returning at once for ``forkserver``
    (the server imports in the background)."""
    if method not in WORKER_STARTS:
        raise ValueError(f"data.worker_start {method!r}: choose one of {', '.join(WORKER_STARTS)}")
    if method == "fork":
        importlib.import_module(PRELOAD)  # warms this process's kernels, once: workers inherit them
        return
    server = forkserver._forkserver  # the process-wide server that forkserver contexts use
    if getattr(server, "_forkserver_pid", None) is None:  # not running (no public query)
        # No public getter: the list a trainer may have set (multiprocessing's default: __main__)
        preload = list(getattr(server, "_preload_modules", None) or ["__main__"])
        if PRELOAD not in preload:
            multiprocessing.get_context(method).set_forkserver_preload([*preload, PRELOAD])
    forkserver.ensure_running()
