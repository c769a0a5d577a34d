"""The local engine: per-shard jobs in long-lived spawned worker processes on this machine.

Design choices:
- Workers live for the whole run: a worker pays its imports and builds its tokenizers once
  (``data.engine.worker_cache``), then takes job after job over its own pipe: replacing
  workers every few jobs would re-import torch and reload the visual tokenizer each time.
- A worker is replaced only when it has seen ``recycle_after`` failed video decodes:
  decord leaks about 40 KB per failing decode (DESIGN.md), so on untrusted video a worker's
  memory stays bounded by ``recycle_after * 40 KB`` instead of growing with the corpus. The
  count comes from ``data.media.decode_failures()``, bumped wherever decord fails.
- ``workers <= 1`` runs jobs in this process (no spawn, no imports twice) until this
  process itself has seen ``recycle_after`` failed decodes; the remaining jobs then go to one
  spawned worker that is recycled like the others, so the parent never grows without bound.
- A worker that dies (killed, out of memory, a crash in native code) has its job retried on
  a fresh worker, ``retries`` times; outputs are written under temporary names and renamed,
  so a retried shard is the same bytes. A job that raises is not retried: the exception
  (with the worker's traceback as its cause) stops the run, as a bad input folder should.
- Spawned, not forked: nothing inherits the parent's threads (tokenizers, torch) or locks.
- A worker outlives a parent killed mid-job only until its job ends: its reply then finds the
  pipe closed and it leaves quietly.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from data.media import decode_failures
from data.signal_handlers import handled

JobT = TypeVar("JobT")
ResultT = TypeVar("ResultT")

RECYCLE_AFTER_FAILED_DECODES = 256  # ~10 MB of decord's leak per worker at most
WORKER_RETRIES = 2


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker, attached as the parent's ``__cause__``."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


class WorkerDied(RuntimeError):
    pass


def _worker_main(conn: Connection, fn: Callable, recycle_after: int) -> None:
    """A worker's loop: a job in, ``(ok, result-or-error, retire)`` out, until told to stop.
    Ctrl-C reaches the whole process group: the parent stops the workers itself (``run_pool``'s
    ``finally``), so a worker ignores it (from its start: ``_Worker``) rather than send back a
    KeyboardInterrupt per job."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start = decode_failures()
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):  # the parent is gone (killed): stop quietly
            return
        if job is None:
            return
        try:
            reply: tuple[bool, Any] = (True, fn(job))
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
            reply = (False, _portable(e))
        retire = recycle_after > 0 and decode_failures() - start >= recycle_after
        try:
            conn.send((*reply, retire))
        except OSError:  # the parent is gone (killed): nobody to tell, no traceback to print
            return
        if retire:
            return


def _portable(error: BaseException) -> tuple[BaseException, str]:
    """The exception (or a RuntimeError naming it when it cannot be pickled) and its traceback."""
    import pickle

    trace_text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any pickling failure: send its text instead
        error = RuntimeError(f"{type(error).__name__}: {error}")
    return error, trace_text


class _Worker:
    def __init__(self, ctx, fn: Callable, recycle_after: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, fn, recycle_after), daemon=True, name="prep-worker"
        )
        # Started ignoring Ctrl-C (a spawned child keeps SIG_IGN): one pressed while it imports
        # would print its KeyboardInterrupt traceback
        with handled(signal.SIGINT, signal.SIG_IGN):
            self.proc.start()
        child.close()
        self.job: tuple[int, Any] | None = None  # (position, job) being run

    def stop(self, *, kill: bool = False) -> None:
        if kill and self.proc.is_alive():
            self.proc.kill()
        elif self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
        self.proc.join(timeout=None if not kill else 5)
        self.conn.close()


def run_pool(
    fn: Callable[[JobT], ResultT],
    jobs: list[JobT],
    workers: int,
    *,
    recycle_after: int = RECYCLE_AFTER_FAILED_DECODES,
    retries: int = WORKER_RETRIES,
    on_start: Callable[[int], None] | None = None,
) -> Iterator[ResultT]:
    """Results of ``fn(job)`` as they finish, from ``workers`` spawned processes.
    ``on_start(pid)`` is called for every worker started (tests watch recycling with it)."""
    ctx = get_context("spawn")
    queue: deque[tuple[int, JobT]] = deque(enumerate(jobs))
    tries = dict.fromkeys(range(len(jobs)), 0)
    pool: list[_Worker] = []

    def start() -> _Worker:
        worker = _Worker(ctx, fn, recycle_after)
        if on_start:
            on_start(worker.proc.pid)
        pool.append(worker)
        return worker

    try:
        for _ in range(min(workers, len(jobs))):
            start()
        while queue or any(worker.job for worker in pool):
            for worker in pool:
                if worker.job is None and queue:
                    worker.job = queue.popleft()
                    worker.conn.send(worker.job[1])
            busy = [worker for worker in pool if worker.job is not None]
            for conn in wait([worker.conn for worker in busy]):
                worker = next(other for other in busy if other.conn is conn)
                pos, job = worker.job  # type: ignore[misc]
                worker.job = None
                try:
                    succeeded, value, retire = worker.conn.recv()
                except (EOFError, OSError):
                    worker.proc.join()
                    pool.remove(worker)
                    tries[pos] += 1
                    code = worker.proc.exitcode
                    if tries[pos] > retries:
                        raise WorkerDied(
                            f"a worker died {tries[pos]} times running job {pos} "
                            f"(exit code {code}); giving up"
                        ) from None
                    # said, not only redone: a worker the kernel's OOM killer took is the hint
                    # that --workers is too many for this machine's memory
                    how = (
                        "killed by signal 9: out of memory?"  # what the kernel's OOM killer sends
                        if code == -signal.SIGKILL
                        else f"killed by signal {-code}"
                        if code and code < 0
                        else f"exit code {code}"
                    )
                    print(
                        f"warning: a worker died running job {pos} ({how}); "
                        "running it again in a new worker",
                        file=sys.stderr,
                        flush=True,
                    )
                    queue.appendleft((pos, job))
                    start()
                    continue
                if retire:
                    pool.remove(worker)
                    worker.proc.join()
                    worker.conn.close()
                    if queue:
                        start()
                if not succeeded:
                    exc, trace_text = value
                    raise exc from RemoteTraceback(trace_text)
                yield value
    finally:
        for worker in pool:
            worker.stop(kill=worker.job is not None or worker.proc.exitcode is not None)


def run_local(
    fn: Callable[[JobT], ResultT],
    jobs: list[JobT],
    workers: int = 1,
    *,
    recycle_after: int = RECYCLE_AFTER_FAILED_DECODES,
    retries: int = WORKER_RETRIES,
) -> Iterator[ResultT]:
    """``workers`` > 1: a pool; otherwise inline here, moving to one recycled worker only once
    this process has seen ``recycle_after`` failed decodes (see the module's docstring)."""
    if workers > 1 and len(jobs) > 1:
        yield from run_pool(fn, jobs, workers, recycle_after=recycle_after, retries=retries)
        return
    start = decode_failures()
    for index, job in enumerate(jobs):
        yield fn(job)
        if (
            recycle_after > 0
            and decode_failures() - start >= recycle_after
            and index + 1 < len(jobs)
        ):
            yield from run_pool(
                fn, jobs[index + 1 :], 1, recycle_after=recycle_after, retries=retries
            )
            return


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
