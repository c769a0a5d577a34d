"""Kept for callers of the old name: ``run_jobs(fn, jobs, workers)`` on the local engine
(``data.engine.local``: long-lived workers, recycled only after failed video decodes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from data.engine.local import run_local

JobT = TypeVar("JobT")
ResultT = TypeVar("ResultT")


def run_jobs(fn: Callable[[JobT], ResultT], jobs: list[JobT], workers: int) -> Iterator[ResultT]:
    return run_local(fn, jobs, workers)
