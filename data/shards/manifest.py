"""The folder-level manifest (``manifest.json``) and rejects list (``rejects.jsonl``), and what
ingest and tokenize share as drivers of shard jobs: a partition's shards, running them, and
where each job's record goes.

Design choices:
- Both files are built from the per-shard records in ``DIR/.ingest/``, in plan order, so a
  partitioned, resumed or differently-parallel run gives byte-identical files.
- No timestamps: the manifest records what made the folder (commands, package versions) and
  what it holds (shards with sizes and SHA-256, counts per source, modality and reject reason).
- Every file goes through ``Folder.write_json`` (a renamed temp file here, one PUT in object
  storage), so a reader never sees half a file; the manifest is written last.
"""

from __future__ import annotations

import json
import os
import platform
import posixpath
import re
from collections import Counter
from importlib import metadata
from pathlib import Path

from data.names import MANIFEST_FILE, REJECTS_FILE
from data.shards.storage import Folder

MANIFEST_FORMAT = "earlyfuse-raw-shards"
TOKEN_FORMAT = "earlyfuse-token-shards"  # what data/tokenize/run.py writes
MANIFEST_VERSION = 1
# What every reader of a manifest takes from each shard entry (load_manifest checks they are there)
SHARD_FIELDS = ("path", "index", "sha256", "index_sha256", "samples")


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


def record_path(index: int, state_dir: str = ".ingest") -> str:
    """Where a shard job's record goes, relative to the output folder."""
    return f"{state_dir}/shard-{index:06d}.json"


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


def rejects_by_reason(records: dict[int, dict], shards: list[int]) -> dict[str, int]:
    """reason -> count of the rejects the records of ``shards`` hold (a partition's own)."""
    return dict(
        Counter(
            r["reason"] for index in shards for r in (records.get(index) or {}).get("rejects", [])
        )
    )


def shard_done(sizes: dict[str, int], rec: dict | None, fingerprint: str) -> bool:
    """A shard job's record matches ``fingerprint`` and the files it names are there, the tar
    and its indexes with their recorded sizes (``sizes``: one listing of the folder). An ingest shard whose every
    input was rejected has no files."""
    if not rec or rec.get("fingerprint") != fingerprint:
        return False
    if rec["tar"] is None:
        return True
    named = (rec["index_file"], rec.get("index_bin"))  # index_bin: token shards only
    indexes_whole = all(sizes.get(n) == size for n, size in rec.get("index_sizes", {}).items())
    return (
        sizes.get(rec["tar"]) == rec["bytes"]
        and indexes_whole
        and all(n in sizes for n in named if n)
    )


def refuse_strays(out: Folder, ours: set[str], folders: tuple[str, ...], command: str) -> None:
    """Refuse a folder that holds files this run would not write, when no record or manifest of
    a run is there (a new run): another run's shards, copied in or left from an earlier run
    whose records were deleted, would be mixed with this one's, or overwritten. Files this run
    writes (and their ``.tmp`` names) are allowed: a run killed before its first record leaves
    them, as may its own ``folders`` (its records, tokenize's copy of the tokenizers)."""
    strays = sorted(
        name
        for name in out.sizes()
        if re.sub(r"(\.\d+)?\.tmp$", "", name) not in ours  # NAME.tmp, NAME.PID.tmp: cut by a kill
        and not name.startswith(tuple(f"{folder}/" for folder in folders))
    )
    if strays:
        raise ValueError(
            f"{out} holds {len(strays)} file(s) that this {command} does not write and no record "
            f"of a run (e.g. {', '.join(strays[:3])}): another run's shards, or inputs? Give an "
            "--out of its own (a new or empty folder)"
        )


def partition_share(num_shards: int, num_partitions: int, partition: int) -> list[int]:
    """The shards that partition I of P writes: those whose index is I mod P."""
    if not (num_partitions >= 1 and 0 <= partition < num_partitions):
        raise ValueError(f"--partition {partition} is outside 0..{num_partitions - 1}")
    return list(range(partition, num_shards, num_partitions))


def run_shard_jobs(
    job_fn, jobs: list, engine, records: dict, total: int, desc: str, progress: bool, **engine_args
) -> None:
    """Run one partition's shard jobs (ingest's or tokenize's; ``total``: the partition's
    shards) under a progress bar; ``records`` gains each job's record."""
    from tqdm import tqdm

    from data.engine import run_jobs

    initial = total - len(jobs)
    with tqdm(total=total, initial=initial, desc=desc, unit=" shards", disable=not progress) as bar:
        for rec in run_jobs(job_fn, jobs, engine, **engine_args):
            records[rec["index"]] = rec
            bar.update()


def finalize(out: Folder, records: dict[int, dict]) -> dict:
    """Write rejects.jsonl, then manifest.json (the folder is done once it is there), from a
    complete set of shard records."""
    missing = missing_shards(records)
    if missing or not records:
        raise ValueError(f"{out}: {len(missing)} shard(s) not written yet: {missing[:10]}")
    recs = [records[index] for index in sorted(records)]
    sources: dict[str, dict] = {}
    seg_total: Counter = Counter()
    reasons: Counter = Counter()
    rejects: list[dict] = []
    shards = []

    def source_of(name: str, record: dict) -> dict:
        entry = {"name": name, "kind": record["kind"], "path": record["source_path"]}
        counts = {"samples": 0, "bytes": 0, "shards": 0, "rejects": 0, "segments": Counter()}
        return sources.setdefault(name, entry | counts)

    for record in recs:
        source = source_of(record["source"], record)
        source["samples"] += record["samples"]
        source["bytes"] += record["bytes"]
        source["segments"].update(record["segments"])
        seg_total.update(record["segments"])
        rejects.extend(record["rejects"])
        reasons.update(reject["reason"] for reject in record["rejects"])
        if record["tar"]:
            source["shards"] += 1
            shards.append(shard_entry(record, segments=record["segments"]))
    for record in recs:
        for reject in record["rejects"]:
            # A held-out shard's rejects count with their training source, as rejects.jsonl
            # lists them: a reject has no val/ side (it never became a sample)
            source_of(reject.get("source") or record["source"], record)["rejects"] += 1
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
    out.write_json(REJECTS_FILE, lines=rejects)
    out.write_json(MANIFEST_FILE, manifest)
    if not out.remote:
        for stale in out.local.rglob("*.tmp"):
            stale.unlink(missing_ok=True)
    return manifest


def load_manifest(out: str | Path, formats: tuple[str, ...] = (MANIFEST_FORMAT,)) -> dict:
    """The manifest of the shard folder ``out``: a local path or an fsspec URL (``s3://...``)."""
    folder = Folder(out)
    path = folder.child(MANIFEST_FILE)
    try:
        manifest = json.loads(folder.read_bytes(MANIFEST_FILE))
    except FileNotFoundError:
        parent, name = posixpath.split(folder.url.rstrip("/").replace(os.sep, "/"))
        parent = parent or "."
        # OUT/val: the held-out split's sources are listed in OUT's manifest, as val/NAME
        held_out = name == "val" and Folder(parent).exists(MANIFEST_FILE)
        if held_out:
            why = (
                f"the held-out split is described by {parent}'s, as its val/ sources: give {parent}"
            )
        elif not folder.sizes():  # a mistyped path, or a bucket that does not exist
            why = f"nothing is at {folder.url}: check the path" + (
                " (the bucket and prefix, and the endpoint)" if folder.remote else ""
            )
        else:
            why = (
                "not an ingest output, or its ingest has not finished: run `earlyfuse-prep "
                "merge` after all partitions"
            )
        raise ValueError(f"{path}: no manifest ({why})") from None
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if manifest.get("format") not in formats:
        raise ValueError(
            f"{path}: format {manifest.get('format')!r}, expected {' or '.join(map(repr, formats))}"
        )
    # What every reader takes from it, checked once here (a manifest written by hand may lack it)
    if not isinstance(manifest.get("shards"), list):
        raise ValueError(f"{path}: no shards list")
    for i, shard in enumerate(manifest["shards"]):
        lacks = [k for k in SHARD_FIELDS if not isinstance(shard, dict) or k not in shard]
        if lacks:
            named = f" ({shard['path']})" if isinstance(shard, dict) and "path" in shard else ""
            raise ValueError(f"{path}: shards[{i}]{named} has no {', '.join(lacks)}")
    return manifest
