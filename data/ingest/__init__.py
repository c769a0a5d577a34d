"""``earlyfuse-prep ingest``: raw corpora in, raw shards + index + manifest + rejects out."""

from __future__ import annotations

from pathlib import Path

from data.engine import EngineConfig
from data.ingest.plan import Plan, make_plan
from data.ingest.run import run_plan
from data.shards.manifest import partition_share
from data.shards.storage import is_remote
from data.sources import Limits, parse_sources


def ingest(
    out: str | Path,
    sources: list[str],
    *,
    limits: Limits | None = None,
    shard_max_bytes: int = 256 << 20,
    shard_max_samples: int = 0,
    workers: int = 1,
    num_partitions: int = 1,
    partition: int = 0,
    progress: bool = False,
    command: list[str] | None = None,
    engine: EngineConfig | None = None,
    val_fraction: float = 0.0,
    exclude_content_of: list[str | Path] | None = None,
    dedupe: bool = False,
) -> dict:
    """Plan and write shards; returns a summary (see ``run_plan``) with the plan's counts.
    ``exclude_content_of``: raw shard folders (e.g. the training set, for a held-out set) whose
    documents, media and long texts are rejected here as ``duplicate-of-excluded``. ``dedupe``:
    a document repeating an earlier one's whole content is left out, a ``duplicate`` reject."""
    if dedupe and is_remote(out):
        raise ValueError(
            f"--dedupe rewrites the shards that held a duplicate and needs a local --out, not {out}"
        )
    partition_share(0, num_partitions, partition)  # a bad --partition refused before planning
    specs = parse_sources(sources)
    for spec in specs:  # the shards written would be read as inputs by the next run
        if not is_remote(out) and Path(out).resolve().is_relative_to(spec.path):
            raise ValueError(
                f"--out {out} is inside the folder of --source {spec.name} ({spec.path}): "
                "write the shards outside every source"
            )
    exclude = tuple(str(Path(p)) for p in exclude_content_of or [])
    plan = make_plan(
        specs,
        limits or Limits(),
        shard_max_bytes=shard_max_bytes,
        shard_max_samples=shard_max_samples,
        progress=progress,
        val_fraction=val_fraction,
        exclude=exclude,
        dedupe=dedupe,
    )
    summary = run_plan(
        out if is_remote(out) else Path(out),
        plan,
        workers=workers,
        num_partitions=num_partitions,
        partition=partition,
        command=command,
        progress=progress,
        engine=engine,
        exclude=exclude,
    )
    summary["plan"] = plan.describe()
    summary["val_fraction_needed"] = {
        name: count["val_fraction_needed"] for name, count in plan.counts.items()
    }
    return summary


__all__ = ["Plan", "ingest", "make_plan", "run_plan"]
