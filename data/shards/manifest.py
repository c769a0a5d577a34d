"""The folder-level manifest (``manifest.json``) and rejects list (``rejects.jsonl``).

Design choices:
- Both are built from the per-shard records in ``DIR/.ingest/``, in plan order, so a
  partitioned, resumed or differently-parallel run gives byte-identical files.
- No timestamps: the manifest records what made the folder (commands, package versions) and
  what it holds (shards with sizes and SHA-256, counts per source, modality and reject reason).
- Every file is written to a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
import platform
from collections import Counter
from importlib import metadata
from pathlib import Path

from data.names import MANIFEST_FILE, REJECTS_FILE

MANIFEST_FORMAT = "earlyfuse-raw-shards"
MANIFEST_VERSION = 1


def shard_entry(record: dict, **extra) -> dict:
    """A manifest's line for one shard, from a shard job's record (ingest and tokenize alike);
    ``extra``: what the kind adds after the common fields (segments, tokens, ...)."""
    return {
        "path": record["tar"],
        "index": record["index_file"],
        "source": record["source"],
        "samples": record["samples"],
        "bytes": record["bytes"],
        "sha256": record["sha256"],
        "index_sha256": record["index_sha256"],
        **extra,
    }


def write_json_atomic(path: Path, obj, *, lines: list | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        if lines is not None:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False, sort_keys=True) + "\n")
        else:
            json.dump(obj, f, indent=1, ensure_ascii=False, sort_keys=True)
            f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def record_path(out: Path, index: int, state_dir: str = ".ingest") -> Path:
    return Path(out) / state_dir / f"shard-{index:06d}.json"


def load_records(out: Path, state_dir: str = ".ingest") -> dict[int, dict]:
    records = {}
    state_path = Path(out) / state_dir
    if state_path.is_dir():
        for record_file in sorted(state_path.glob("shard-*.json")):
            try:
                rec = json.loads(record_file.read_text())
                records[int(rec["index"])] = rec
            except (ValueError, KeyError, OSError):
                continue  # a record cut short by a kill: that shard is simply redone
    return records


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("earlyfuse", "pillow", "decord", "numpy", "tokenizers", "torch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def missing_shards(records: dict[int, dict]) -> list[int]:
    if not records:
        return []
    num_shards = next(iter(records.values()))["plan"]["num_shards"]
    return [index for index in range(num_shards) if index not in records]


def finalize(out: Path, records: dict[int, dict]) -> dict:
    """Write manifest.json and rejects.jsonl from a complete set of shard records."""
    out = Path(out)
    missing = missing_shards(records)
    if missing or not records:
        raise ValueError(f"{out}: {len(missing)} shard(s) not written yet: {missing[:10]}")
    recs = [records[index] for index in sorted(records)]
    sources: dict[str, dict] = {}
    seg_total: Counter = Counter()
    reasons: Counter = Counter()
    rejects: list[dict] = []
    shards = []
    for record in recs:
        source = sources.setdefault(
            record["source"],
            {
                "name": record["source"],
                "kind": record["kind"],
                "path": record["source_path"],
                "samples": 0,
                "bytes": 0,
                "shards": 0,
                "rejects": 0,
                "segments": Counter(),
            },
        )
        source["samples"] += record["samples"]
        source["bytes"] += record["bytes"]
        source["rejects"] += len(record["rejects"])
        source["segments"].update(record["segments"])
        seg_total.update(record["segments"])
        rejects.extend(record["rejects"])
        reasons.update(reject["reason"] for reject in record["rejects"])
        if record["tar"]:
            source["shards"] += 1
            shards.append(shard_entry(record, segments=record["segments"]))
    for source in sources.values():
        source["segments"] = dict(source["segments"])
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "plan": recs[0]["plan"],
        "sources": list(sources.values()),
        "shards": shards,
        "totals": {
            "samples": sum(source["samples"] for source in shards),
            "bytes": sum(source["bytes"] for source in shards),
            "shards": len(shards),
            "segments": dict(seg_total),
            "rejects": len(rejects),
            "rejects_by_reason": dict(sorted(reasons.items())),
            "repaired_utf8": sum(record["repaired_utf8"] for record in recs),
        },
        "created_by": {
            "commands": sorted({json.dumps(record["command"]) for record in recs}),
            "versions": versions(),
        },
    }
    manifest["created_by"]["commands"] = [
        json.loads(command) for command in manifest["created_by"]["commands"]
    ]
    write_json_atomic(out / REJECTS_FILE, None, lines=rejects)
    write_json_atomic(out / MANIFEST_FILE, manifest)
    for stale in out.rglob("*.tmp"):
        stale.unlink(missing_ok=True)
    return manifest


def merge(out: Path) -> dict:
    """Join the shards that partitioned runs wrote into ``out`` (``earlyfuse-prep merge``)."""
    records = load_records(out)
    if not records:
        raise ValueError(
            f"{out}: no ingest records found in {out}/.ingest (is this an ingest output folder?)"
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
    return finalize(out, records)


def load_manifest(out: str | Path, formats: tuple[str, ...] = (MANIFEST_FORMAT,)) -> dict:
    """The manifest of the shard folder ``out``: a local path or an fsspec URL (``s3://...``)."""
    from data.shards.storage import Folder

    folder = Folder(out)
    path = folder.child(MANIFEST_FILE)
    try:
        manifest = json.loads(folder.read_bytes(MANIFEST_FILE))
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no manifest (not an ingest output, or its ingest has not finished: "
            "run `earlyfuse-prep merge` after all partitions)"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") not in formats:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r}, expected {' or '.join(map(repr, formats))}"
        )
    return manifest
