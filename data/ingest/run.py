"""Run an ingest plan: write the shards of this partition in parallel, resume what a kill cut
short, and finish with ``manifest.json`` and ``rejects.jsonl`` once every shard exists.

Design choices:
- A shard is the unit of work and of resumption. A worker writes the tar and index under
  temporary names, renames them, then writes the shard's record in ``DIR/.ingest/``; a shard
  counts as done only when its record exists, matches the plan's fingerprint and its tar has
  the recorded size. A killed run therefore redoes only the shards it had not finished.
- Rejects travel inside the shard records, so ``rejects.jsonl`` comes out in plan order,
  identical for any worker count or partitioning.
- Workers are spawned processes that are replaced every few shards (``data.parallel``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from data.ingest.plan import Plan, ShardPlan
from data.parallel import run_jobs
from data.schema import SEGMENT_TYPES, Reject
from data.shards.manifest import finalize, load_records, record_path, write_json_atomic
from data.shards.writer import ShardWriter
from data.sources import Limits, Source, SourceSpec, build_source

_SOURCES: dict[SourceSpec, Source] = {}


@dataclass
class ShardJob:
    out: str
    shard: ShardPlan
    spec: SourceSpec
    limits: Limits
    plan: dict  # Plan.describe(): fingerprint, shard count, limits
    partition: tuple[int, int]
    command: list[str]


def write_shard(job: ShardJob) -> dict:
    """Worker: turn one planned shard into a tar + index + record. Returns the record."""
    src = _SOURCES.get(job.spec) or _SOURCES.setdefault(
        job.spec, build_source(job.spec, job.limits)
    )
    out, shard = Path(job.out), job.shard
    tar_rel, idx_rel = f"{shard.name}.tar", f"{shard.name}.idx.jsonl"
    writer: ShardWriter | None = None
    rejects: list[dict] = []
    segments = dict.fromkeys(SEGMENT_TYPES, 0)
    repaired = 0
    try:
        for item in shard.items:
            got = item.reject or src.load(item)
            if isinstance(got, Reject):
                rejects.append(got.to_dict())
                continue
            if writer is None:
                writer = ShardWriter(out / tar_rel, out / idx_rel)
            media = [
                {k: v for k, v in s.items() if k != "type"}
                for s in got.doc["segments"]
                if "member" in s
            ]
            writer.write(got, {"media": media} if media else None)
            for s in got.doc["segments"]:
                segments[s["type"]] += 1
            repaired += got.doc["origin"].get("repaired_utf8", 0)
        result = writer.close() if writer else None
    except BaseException:
        if writer:
            writer.abort()
        raise
    record = {
        "fingerprint": job.plan["fingerprint"],
        "plan": job.plan,
        "index": shard.index,
        "name": shard.name,
        "source": job.spec.name if shard.split == "train" else f"val/{job.spec.name}",
        "kind": job.spec.kind,
        "source_path": job.spec.path,
        "partition": list(job.partition),
        "command": job.command,
        "samples": result.samples if result else 0,
        "tar": tar_rel if result else None,
        "index_file": idx_rel if result else None,
        "bytes": result.bytes if result else 0,
        "sha256": result.sha256 if result else None,
        "index_sha256": result.index_sha256 if result else None,
        "segments": segments,
        "repaired_utf8": repaired,
        "rejects": rejects,
    }
    write_json_atomic(record_path(out, shard.index), record)
    return record


def _is_done(out: Path, shard: ShardPlan, fingerprint: str, records: dict[int, dict]) -> bool:
    rec = records.get(shard.index)
    if not rec or rec.get("fingerprint") != fingerprint:
        return False
    if rec["tar"] is None:
        return True
    tar = out / rec["tar"]
    return (
        tar.is_file() and tar.stat().st_size == rec["bytes"] and (out / rec["index_file"]).is_file()
    )


def check_output_dir(out: Path, plan: Plan) -> dict[int, dict]:
    """Records of earlier runs into ``out``; refuses a folder that holds a different ingest."""
    manifest = out / "manifest.json"
    if manifest.is_file():
        try:
            old = json.loads(manifest.read_text())["plan"]["fingerprint"]
        except (ValueError, KeyError):
            old = None
        if old != plan.fingerprint:
            raise ValueError(
                f"{out} already holds a different ingest (plan {old} != {plan.fingerprint}: "
                "other inputs or flags); choose a new --out or delete that folder"
            )
    records = load_records(out)
    other = {r["fingerprint"] for r in records.values()} - {plan.fingerprint}
    if other:
        raise ValueError(
            f"{out}/.ingest holds shards of a different ingest (plan {sorted(other)[0]} != "
            f"{plan.fingerprint}: the inputs or flags changed since); choose a new --out "
            "or delete that folder"
        )
    return records


def run_plan(
    out: Path,
    plan: Plan,
    *,
    workers: int = 1,
    num_partitions: int = 1,
    partition: int = 0,
    command: list[str] | None = None,
    progress: bool = True,
) -> dict:
    """Write this partition's missing shards; finalize when all shards exist. Returns a summary."""
    if not (num_partitions >= 1 and 0 <= partition < num_partitions):
        raise ValueError(f"--partition {partition} is outside 0..{num_partitions - 1}")
    out.mkdir(parents=True, exist_ok=True)
    records = check_output_dir(out, plan)
    mine = [s for s in plan.shards if s.index % num_partitions == partition]
    todo = [s for s in mine if not _is_done(out, s, plan.fingerprint, records)]
    jobs = [
        ShardJob(
            str(out),
            s,
            plan.sources[s.source],
            plan.limits,
            plan.describe(),
            (partition, num_partitions),
            command or [],
        )
        for s in todo
    ]
    bar = tqdm(
        total=len(mine),
        initial=len(mine) - len(todo),
        desc="ingest",
        unit=" shards",
        disable=not progress,
    )
    for rec in run_jobs(write_shard, jobs, workers):
        records[rec["index"]] = rec
        bar.update()
    bar.close()
    missing = [s.index for s in plan.shards if not _is_done(out, s, plan.fingerprint, records)]
    summary = {
        "written": len(jobs),
        "skipped_done": len(mine) - len(todo),
        "partition": [partition, num_partitions],
        "missing": missing,
        "finalized": False,
    }
    if not missing:
        summary["manifest"] = finalize(out, records)
        summary["finalized"] = True
    return summary


def command_line() -> list[str]:
    return [Path(sys.argv[0]).name] + sys.argv[1:]
