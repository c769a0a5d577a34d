"""How the loader's DataLoader workers start (``data.worker_start``): forked from the trainer's
process (``fork``, the default), which warms the loader's compiled kernels when the loader is
built, or from multiprocessing's fork server (``forkserver``), started when the loader is built
and preloaded with the loader and its kernels (``worker_preload.py``). Either way a worker loads
nothing before its first batch. Why fork by default, when to choose the fork server and why not
spawn: docs/loader.md, "Worker processes".
"""

from __future__ import annotations

import importlib
import multiprocessing
from multiprocessing import forkserver

WORKER_STARTS = ("fork", "forkserver")
PRELOAD = "data.loader.worker_preload"


def prepare_workers(method: str, workers: int) -> None:
    """Check ``method`` (also without workers: a typo in a config is caught at once) and, with
    workers, make ready what they start from, returning at once for ``forkserver`` (the server
    imports in the background)."""
    if method not in WORKER_STARTS:
        raise ValueError(f"data.worker_start {method!r}: choose one of {', '.join(WORKER_STARTS)}")
    if not workers:
        return
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
