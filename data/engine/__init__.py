"""Where the per-shard jobs of ``ingest`` and ``tokenize`` run: this machine or a Ray cluster.

Both commands cut their work into shard jobs that are deterministic (the same job writes the
same bytes wherever and however often it runs) and idempotent (outputs go to temporary names,
then are renamed or uploaded whole; a record written last marks the shard done). An engine
only decides where the jobs run and retries what failed, so every engine, worker count and
partitioning gives the same folder, byte for byte.

- ``local`` (default): long-lived spawned processes on this machine (``data.engine.local``).
- ``ray``: actors on a Ray cluster (``data.engine.ray``, the optional extra ``ray``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from data.engine.local import RECYCLE_AFTER_FAILED_DECODES, WORKER_RETRIES, run_local

JobT = TypeVar("JobT")
ResultT = TypeVar("ResultT")

ENGINES = ("local", "ray")


@dataclass(frozen=True)
class EngineConfig:
    kind: str = "local"  # local | ray
    workers: int = 0  # local: processes (0 = 1); ray: CPU actors (0 = one per cluster CPU)
    address: str | None = None  # ray: the cluster to join (None: RAY_ADDRESS, or a local one)
    retries: int = WORKER_RETRIES  # a job whose worker died (or, on ray, hit an OSError) again
    recycle_after: int = RECYCLE_AFTER_FAILED_DECODES  # failed video decodes per worker
    # ray: whose object-storage settings (AWS_* ...) an actor uses: its node's, the driver's
    # filling in what the node lacks ("node"); or the driver's alone ("driver"). data/engine/ray.py.
    storage_env: str = "node"

    def __post_init__(self) -> None:
        if self.kind not in ENGINES:
            raise ValueError(f"--engine {self.kind!r}: choose one of {', '.join(ENGINES)}")
        if self.storage_env not in ("node", "driver"):
            raise ValueError(f"--ray-storage-env {self.storage_env!r}: choose node or driver")
        if self.workers < 0:
            raise ValueError(f"--workers {self.workers}: must be >= 0")


def run_jobs(
    fn: Callable[[JobT], ResultT],
    jobs: list[JobT],
    engine: EngineConfig | None = None,
    *,
    gpu_setup: Callable | None = None,
) -> Iterator[ResultT]:
    """Results of ``fn(job)`` for every job, in the order they finish.

    ``gpu_setup(ray_module, n_gpus)`` (ray only, when the cluster has GPUs) returns a
    ``data.engine.ray.GpuPool``: GPU actors it started and how to point each job at them
    (tokenize's visual tokenizer pool)."""
    engine = engine or EngineConfig()
    if engine.kind == "ray":
        from data.engine.ray import run_ray

        yield from run_ray(fn, jobs, engine, gpu_setup=gpu_setup)
        return
    yield from run_local(
        fn,
        jobs,
        max(1, engine.workers),
        recycle_after=engine.recycle_after,
        retries=engine.retries,
    )


__all__ = ["ENGINES", "EngineConfig", "run_jobs", "run_local"]
