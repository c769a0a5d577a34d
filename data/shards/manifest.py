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


def write_json_atomic(path: Path, obj, *, lines: list | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        if lines is not None:
            for x in lines:
                f.write(json.dumps(x, ensure_ascii=False, sort_keys=True) + "\n")
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
    d = Path(out) / state_dir
    if d.is_dir():
        for p in sorted(d.glob("shard-*.json")):
            try:
                rec = json.loads(p.read_text())
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
    n = next(iter(records.values()))["plan"]["num_shards"]
    return [i for i in range(n) if i not in records]


def finalize(out: Path, records: dict[int, dict]) -> dict:
    """Write manifest.json and rejects.jsonl from a complete set of shard records."""
    out = Path(out)
    missing = missing_shards(records)
    if missing or not records:
        raise ValueError(f"{out}: {len(missing)} shard(s) not written yet: {missing[:10]}")
    recs = [records[i] for i in sorted(records)]
    sources: dict[str, dict] = {}
    seg_total: Counter = Counter()
    reasons: Counter = Counter()
    rejects: list[dict] = []
    shards = []
    for r in recs:
        s = sources.setdefault(
            r["source"],
            {
                "name": r["source"],
                "kind": r["kind"],
                "path": r["source_path"],
                "samples": 0,
                "bytes": 0,
                "shards": 0,
                "rejects": 0,
                "segments": Counter(),
            },
        )
        s["samples"] += r["samples"]
        s["bytes"] += r["bytes"]
        s["rejects"] += len(r["rejects"])
        s["segments"].update(r["segments"])
        seg_total.update(r["segments"])
        rejects.extend(r["rejects"])
        reasons.update(x["reason"] for x in r["rejects"])
        if r["tar"]:
            s["shards"] += 1
            shards.append(
                {
                    "path": r["tar"],
                    "index": r["index_file"],
                    "source": r["source"],
                    "samples": r["samples"],
                    "bytes": r["bytes"],
                    "sha256": r["sha256"],
                    "index_sha256": r["index_sha256"],
                    "segments": r["segments"],
                }
            )
    for s in sources.values():
        s["segments"] = dict(s["segments"])
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "plan": recs[0]["plan"],
        "sources": list(sources.values()),
        "shards": shards,
        "totals": {
            "samples": sum(s["samples"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "shards": len(shards),
            "segments": dict(seg_total),
            "rejects": len(rejects),
            "rejects_by_reason": dict(sorted(reasons.items())),
            "repaired_utf8": sum(r["repaired_utf8"] for r in recs),
        },
        "created_by": {
            "commands": sorted({json.dumps(r["command"]) for r in recs}),
            "versions": versions(),
        },
    }
    manifest["created_by"]["commands"] = [json.loads(c) for c in manifest["created_by"]["commands"]]
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
    prints = {r["fingerprint"] for r in records.values()}
    if len(prints) > 1:
        raise ValueError(
            f"{out}: records of {len(prints)} different ingests (plans {sorted(prints)}); "
            "partitions must be run with identical inputs and flags"
        )
    missing = missing_shards(records)
    if missing:
        parts = next(iter(records.values()))["partition"][1]
        owners = sorted({i % parts for i in missing})
        raise ValueError(
            f"{out}: {len(missing)} shard(s) not written yet (partitions {owners} of "
            f"--num-partitions {parts} have not finished); run them, then merge again"
        )
    return finalize(out, records)


def load_manifest(out: Path, formats: tuple[str, ...] = (MANIFEST_FORMAT,)) -> dict:
    path = Path(out) / MANIFEST_FILE
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no manifest (not an ingest output, or its ingest has not finished: "
            "run `earlyfuse-prep merge` after all partitions)"
        ) from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if m.get("format") not in formats:
        raise ValueError(
            f"{path}: format {m.get('format')!r}, expected {' or '.join(map(repr, formats))}"
        )
    return m
