"""Run an ingest plan: write the shards of this partition in parallel, resume what a kill cut
short, and finish with ``manifest.json`` and ``rejects.jsonl`` once every shard exists.

Design choices:
- A shard is the unit of work and of resumption. A worker writes the tar and index under
  temporary names, renames them, then writes the shard's record in ``DIR/.ingest/``; a shard
  counts as done only when its record exists, matches the plan's fingerprint, and its tar and
  index have the recorded sizes. A killed run therefore redoes only the shards it
  had not finished.
- Rejects travel inside the shard records, so ``rejects.jsonl`` comes out in plan order,
  identical for any worker count or partitioning.
- Jobs run on an engine (``data.engine``): long-lived local worker processes, or a Ray cluster.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data.engine import EngineConfig
from data.ingest.plan import Plan, ShardPlan
from data.names import INDEX_SUFFIX, MANIFEST_FILE, REJECTS_FILE
from data.schema import SEGMENT_TYPES, Reject
from data.shards.content import describe, folder_fingerprints, sample_fingerprints
from data.shards.manifest import (
    finalize,
    missing_shards,
    partition_share,
    record_path,
    refuse_strays,
    rejects_by_reason,
    run_shard_jobs,
    shard_done,
)
from data.shards.storage import Folder, Staging
from data.shards.writer import ShardWriter
from data.sources import Limits, Source, SourceSpec, build_source

STATE_DIR = ".ingest"
_SOURCES: dict[tuple[SourceSpec, Limits], Source] = {}
_EXCLUDED: dict[tuple[str, ...], dict[str, tuple[str, str]]] = {}


def excluded_fingerprints(folders: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """Fingerprint -> (folder, source:key) of every document of the excluded folders; read once
    per worker process."""
    if folders not in _EXCLUDED:
        found: dict[str, tuple[str, str]] = {}
        for folder in folders:
            for fp, where in folder_fingerprints(folder).items():
                found.setdefault(fp, (folder, where))
        _EXCLUDED[folders] = found
    return _EXCLUDED[folders]


@dataclass
class ShardJob:
    out: str
    shard: ShardPlan
    spec: SourceSpec
    limits: Limits
    plan: dict  # Plan.describe(): fingerprint, shard count, limits
    partition: tuple[int, int]
    command: list[str]
    exclude: tuple[str, ...] = ()  # raw folders whose content this ingest must not repeat


def write_shard(job: ShardJob) -> dict:
    """Worker: turn one planned shard into a tar + index + record. Returns the record."""
    # per spec and limits: another ingest in this process may read the same source differently
    src = _SOURCES.get((job.spec, job.limits)) or _SOURCES.setdefault(
        (job.spec, job.limits), build_source(job.spec, job.limits)
    )
    dest = Folder(job.out)
    with Staging(dest) as stage:
        record = _write_shard(job, src, stage)
    dest.write_json(record_path(job.shard.index, STATE_DIR), record)
    return record


def _write_shard(job: ShardJob, src: Source, stage: Staging) -> dict:
    shard = job.shard
    tar_rel, idx_rel = f"{shard.name}.tar", f"{shard.name}{INDEX_SUFFIX}"
    writer: ShardWriter | None = None
    rejects: list[dict] = []
    segments = dict.fromkeys(SEGMENT_TYPES, 0)
    repaired = 0
    excluded = excluded_fingerprints(job.exclude) if job.exclude else {}
    try:
        for item in shard.items:
            got = item.reject or src.load(item)
            if isinstance(got, Reject):
                rejects.append(got.to_dict())
                continue
            content = sample_fingerprints(got)
            hit = next((fp for fp in content if fp in excluded), None)
            if hit is not None:
                folder, where = excluded[hit]
                rejects.append(
                    Reject(
                        item.label,
                        "duplicate-of-excluded",
                        f"{describe(hit)} is also in {folder} ({where}); "
                        "--exclude-content-of keeps it out",
                        key=item.key,
                        source=job.spec.name,
                    ).to_dict()
                )
                continue
            if writer is None:
                writer = ShardWriter(stage.path(tar_rel), stage.path(idx_rel))
            media = [
                {field: value for field, value in seg.items() if field != "type"}
                for seg in got.doc["segments"]
                if "member" in seg
            ]
            writer.write(got, {"content": content, **({"media": media} if media else {})})
            for seg in got.doc["segments"]:
                segments[seg["type"]] += 1
            repaired += got.doc["origin"].get("repaired_utf8", 0)
        result = writer.close() if writer else None
    except BaseException:
        if writer:
            writer.abort()
        raise
    index_sizes = {idx_rel: stage.path(idx_rel).stat().st_size} if result else {}
    if result:
        stage.publish([idx_rel, tar_rel])  # object storage: the index first, like the renames
    return {
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
        "index_sizes": index_sizes,
        "bytes": result.bytes if result else 0,
        "sha256": result.sha256 if result else None,
        "index_sha256": result.index_sha256 if result else None,
        "segments": segments,
        "repaired_utf8": repaired,
        "rejects": rejects,
    }


def check_output_dir(out: Folder, plan: Plan) -> dict[int, dict]:
    """Records of earlier runs into ``out``; refuses a folder that holds a different ingest."""
    if out.exists(MANIFEST_FILE):
        try:
            old = out.read_json(MANIFEST_FILE)["plan"]["fingerprint"]
        except (ValueError, KeyError):
            old = None
        if old != plan.fingerprint:
            raise ValueError(
                f"{out} already holds a different ingest (plan {old} != {plan.fingerprint}: "
                "other inputs or flags, or another earlyfuse version, which may word a reject "
                "otherwise); choose a new --out or delete that folder"
            )
    records = out.records(STATE_DIR)
    if not records and not out.exists(MANIFEST_FILE):
        ours = {f"{shard.name}{ext}" for shard in plan.shards for ext in (".tar", INDEX_SUFFIX)}
        refuse_strays(out, ours | {REJECTS_FILE}, (STATE_DIR,), "ingest")
    other = {record["fingerprint"] for record in records.values()} - {plan.fingerprint}
    if other:
        raise ValueError(
            f"{out}/.ingest holds shards of a different ingest (plan {sorted(other)[0]} != "
            f"{plan.fingerprint}: the inputs or flags changed since, or it was begun by another "
            "earlyfuse version); choose a new --out "
            "or delete that folder"
        )
    return records


def run_plan(
    out: str | Path,
    plan: Plan,
    *,
    workers: int = 1,
    num_partitions: int = 1,
    partition: int = 0,
    command: list[str] | None = None,
    progress: bool = True,
    engine: EngineConfig | None = None,
    exclude: tuple[str, ...] = (),
) -> dict:
    """Write this partition's missing shards; finalize when all shards exist. Returns a summary.
    ``engine`` says where the jobs run (default: ``workers`` local processes). ``exclude``: raw
    folders whose documents' content (data/shards/content.py) is rejected here; it must be the
    one the plan was fingerprinted with."""
    engine = engine or EngineConfig(workers=workers)
    mine = [
        plan.shards[index] for index in partition_share(len(plan.shards), num_partitions, partition)
    ]
    dest = Folder(out)
    if not dest.remote:
        dest.local.mkdir(parents=True, exist_ok=True)
    records = check_output_dir(dest, plan)
    sizes = dest.sizes()
    todo = [
        shard for shard in mine if not shard_done(sizes, records.get(shard.index), plan.fingerprint)
    ]
    jobs = [
        ShardJob(  # an absolute path: a Ray actor runs in another folder, maybe on another node
            dest.absolute(),
            shard,
            plan.sources[shard.source],
            plan.limits,
            plan.describe(),
            (partition, num_partitions),
            command or [],
            tuple(str(Path(p).absolute()) for p in exclude),
        )
        for shard in todo
    ]
    run_shard_jobs(write_shard, jobs, engine, records, len(mine), "ingest", progress)
    records.update(dest.records(STATE_DIR))  # what other partitions finished meanwhile
    sizes = dest.sizes()
    missing = [
        shard.index
        for shard in plan.shards
        if not shard_done(sizes, records.get(shard.index), plan.fingerprint)
    ]
    ran = {shard.index for shard in todo}
    # a planned shard whose inputs were all rejected when read holds no file: none is counted
    held = [shard.index for shard in mine if (records.get(shard.index) or {}).get("samples")]
    summary = {
        "written": sum(index in ran for index in held),
        "skipped_done": sum(index not in ran for index in held),
        "only_rejects": sum(1 for shard in mine if shard.index in records) - len(held),
        "partition": [partition, num_partitions],
        "missing": missing,
        "finalized": False,
        "rejects_by_reason": rejects_by_reason(records, [shard.index for shard in mine]),
    }
    if not missing:
        summary["manifest"] = finish(dest, records)
        summary["finalized"] = True
    return summary


def merge(out: str | Path) -> dict:
    """Join the shards that partitioned runs wrote into ``out``, a folder or an fsspec URL
    (``earlyfuse-prep merge``)."""
    dest = Folder(out)
    records = dest.records(STATE_DIR)
    if not records:
        raise ValueError(
            f"{out}: no ingest records found in {dest.child(STATE_DIR)} (is this an ingest "
            "output folder?)"
        )
    prints = {record["fingerprint"] for record in records.values()}
    if len(prints) > 1:
        raise ValueError(
            f"{out}: records of {len(prints)} different ingests (plans {sorted(prints)}); "
            "partitions must be run with identical inputs and flags"
        )
    missing = missing_shards(records)
    if missing:
        parts = next(iter(records.values()))["partition"][1]
        owners = sorted({index % parts for index in missing})
        raise ValueError(
            f"{out}: {len(missing)} shard(s) not written yet (partitions {owners} of "
            f"--num-partitions {parts} have not finished); run them, then merge again"
        )
    return finish(dest, records)


def finish(dest: Folder, records: dict[int, dict]) -> dict:
    """Once every shard exists: leave out repeated documents if the plan asks (``--dedupe``
    needs a local folder: ingest refuses it with a URL), then write the manifest."""
    if next(iter(records.values()))["plan"]["dedupe"] and not dest.remote:
        from data.ingest.dedupe import dedupe_shards

        dedupe_shards(dest.local, records)
    return finalize(dest, records)
