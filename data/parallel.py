"""Kept for callers of the old name: ``run_jobs(fn, jobs, workers)`` on the local engine
(``data.engine.local``: long-lived workers, recycled only after failed video decodes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from data.engine.local import run_local

J = TypeVar("J")
R = TypeVar("R")


def run_jobs(fn: Callable[[J], R], jobs: list[J], workers: int) -> Iterator[R]:
    return run_local(fn, jobs, workers)
