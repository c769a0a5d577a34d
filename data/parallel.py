"""Run per-shard jobs in spawned worker processes (or inline), results as they finish.

Shared by ingest and tokenize. Spawned (not forked) workers, replaced every few jobs: decord
and FFmpeg state never leaks across many shards, and nothing inherits the parent's threads.
(Replacing workers needs Python 3.11; on 3.10 each worker lives as long as the pool.)
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from typing import TypeVar

J = TypeVar("J")
R = TypeVar("R")


def run_jobs(fn: Callable[[J], R], jobs: list[J], workers: int) -> Iterator[R]:
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(job)
        return
    if sys.version_info >= (3, 11):
        pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"), max_tasks_per_child=8)
    else:
        pool = ProcessPoolExecutor(workers, mp_context=get_context("spawn"))
    with pool:
        pending = {pool.submit(fn, j) for j in jobs}
        try:
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    yield f.result()
        except BaseException:
            for f in pending:
                f.cancel()
            raise
