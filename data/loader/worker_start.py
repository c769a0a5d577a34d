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
import os
import signal
import sys
import threading
from multiprocessing import forkserver, resource_tracker

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
    # The fork server (the workers' parent) and the resource tracker start with the signals a
    # scheduler sends the whole group blocked: killed by one, they took the workers with them
    group = {signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, group)
    try:
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, group)  # its start unblocked SIGTERM again
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def stop_only_when_told(trainer: int, worker_id: int) -> None:
    """A DataLoader worker's ``worker_init_fn``. Ctrl-C and a scheduler's SIGTERM reach the whole
    process group (torchrun and Slurm signal groups): a worker killed by one failed the trainer's
    step before the checkpoint the signal asked for. So a worker ignores SIGINT, leaves on SIGTERM
    only from the trainer (``trainer``, its pid) or its parent, as torch's own handler does, and
    dies with its parent (``kill -9``: one blocked writing to the queue outlived it by hours)."""
    for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):  # the trainer's to act on
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by the thread below
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG

    def on_sigterm() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid not in (trainer, os.getppid()):
            pass
        os._exit(0)  # 0: the trainer's SIGCHLD check counts no failure

    threading.Thread(target=on_sigterm, daemon=True).start()
