"""``ingest --dedupe``: leave out every document whose whole content repeats an earlier one's.

Design choices:
- Exact duplicates only: the ``d:`` fingerprint of data/shards/content.py (every segment's type
  and text or media bytes, in order; key, source and metadata left out), which ingest already
  writes into every index line. Near duplicates are another tool's job.
- A pass over the finished shards, once every shard of the plan exists, rather than inside the
  parallel workers: which copy is "earlier" must not depend on which worker finished first.
  Training shards come before validation shards, each in plan order, so the copy kept is the
  first training one and a held-out document never repeats a training document.
- A shard that held a duplicate is written again without it (index first, then tar, as ingest
  writes them) and its record updated: the duplicate is a ``duplicate`` reject naming the copy
  kept. The pass is idempotent, so a run killed during it is simply rerun: a shard rewritten
  but not yet recorded no longer matches its record, and ingest writes it again.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from data.schema import Reject, Sample
from data.shards.content import repeat_of
from data.shards.index import read_index
from data.shards.manifest import record_path
from data.shards.storage import Folder
from data.shards.writer import ShardWriter


def origin_label(origin: dict, key: str) -> str:
    """Where a document came from, as the source's own rejects name it: a table's row or a
    JSONL line (a caption table's row label, with its media file), else the file."""
    path, row, line = str(origin.get("path", key)), origin.get("row"), origin.get("line")
    if isinstance(row, str):
        return f"{row} ({path})"
    if row is not None:
        return f"{path}:row {row}"
    return f"{path}:{line}" if line is not None else path


def dedupe_shards(out: Path, records: dict[int, dict]) -> int:
    """Rewrite the shards of ``out`` that hold a repeated document; update ``records`` (and their
    files). Returns the number of documents left out by this pass."""
    first_of: dict[str, str] = {}  # whole-document fingerprint -> source:key of the copy kept
    shard_of: dict[str, int] = {}  # source:key of a copy kept -> its record
    labels: dict[str, str] = {}  # source:key of a copy kept -> where it came from (its origin)
    indexes: dict[int, dict[str, dict]] = {}  # record -> its index entries by key, as read
    order = sorted(records, key=lambda index: (records[index]["source"].startswith("val/"), index))
    removed = 0
    for index in order:
        record = records[index]
        if not record.get("tar"):
            continue
        entries = read_index(out / record["index_file"])
        repeats: dict[str, str] = {}  # key -> where the copy kept came from
        for entry in entries:
            where = f"{record['source']}:{entry['key']}"
            kept = repeat_of(first_of, entry, where)
            if kept:
                if kept not in labels:
                    held = shard_of[kept]
                    if held not in indexes:
                        found = read_index(out / records[held]["index_file"])
                        indexes[held] = {e["key"]: e for e in found}
                    labels[kept] = _label_of(out, records[held], indexes[held], kept)
                repeats[entry["key"]] = labels[kept]
            else:
                shard_of.setdefault(where, index)
        if repeats:
            _rewrite(out, record, entries, repeats)
            indexes.pop(index, None)  # its members moved
            Folder(out).write_json(record_path(index), record)
            removed += len(repeats)
    return removed


def _label_of(out: Path, record: dict, entries: dict[str, dict], where: str) -> str:
    """The path (or row, or line) the kept copy ``where`` (source:key) came from, read from its
    shard as it is now (``entries``: its index's, by key; the shard may have been rewritten
    without its own repeats)."""
    source, key = where.split(":", 1)
    offset, size = entries[key]["members"]["json"]
    with open(out / record["tar"], "rb") as tar:
        tar.seek(offset)
        return f"{origin_label(json.loads(tar.read(size)).get('origin', {}), key)} in {source}"


def _rewrite(out: Path, record: dict, entries: list[dict], repeats: dict[str, str]) -> None:
    """The shard without the documents of ``repeats``; ``record`` updated in place."""
    tar_path, index_path = out / record["tar"], out / record["index_file"]
    kept = [entry for entry in entries if entry["key"] not in repeats]
    dropped_types: Counter = Counter()
    source = record["source"].removeprefix("val/")
    with open(tar_path, "rb") as old:

        def member(entry: dict, suffix: str) -> bytes:
            offset, size = entry["members"][suffix]
            old.seek(offset)
            return old.read(size)

        for entry in entries:
            if entry["key"] in repeats:
                dropped_types.update(entry["types"])
                origin = json.loads(member(entry, "json")).get("origin", {})
                record["rejects"].append(
                    Reject(
                        origin_label(origin, entry["key"]),
                        "duplicate",
                        f"the same content as {repeats[entry['key']]} (--dedupe keeps the first)",
                        key=entry["key"],
                        source=source,
                    ).to_dict()
                )
        if not kept:
            old.close()
            tar_path.unlink()
            index_path.unlink()
            record.update(
                samples=0, tar=None, index_file=None, bytes=0, sha256=None, index_sha256=None
            )
            record["index_sizes"] = {}
        else:
            writer = ShardWriter(tar_path, index_path)
            try:
                for entry in kept:
                    suffixes = sorted(entry["members"], key=lambda name: entry["members"][name][0])
                    sample = Sample(
                        entry["key"],
                        json.loads(member(entry, "json")),
                        [(name, member(entry, name)) for name in suffixes if name != "json"],
                    )
                    extra = {
                        field: value
                        for field, value in entry.items()
                        if field not in ("key", "offset", "size", "members", "types", "sha256")
                    }
                    writer.write(sample, extra)
                result = writer.close()
            except BaseException:
                writer.abort()
                raise
            record.update(
                samples=result.samples,
                bytes=result.bytes,
                sha256=result.sha256,
                index_sha256=result.index_sha256,
                index_sizes={record["index_file"]: index_path.stat().st_size},
            )
    for kind, count in dropped_types.items():
        record["segments"][kind] -= count
