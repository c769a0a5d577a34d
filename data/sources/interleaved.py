"""``interleaved:PATH`` — documents mixing text and media, one JSON object per line.

Two forms per line (media paths relative to the JSONL file's folder, or absolute; a path that
leads out of that folder is an ``outside-tree`` reject unless ``--allow-outside-paths``):
- OBELICS: ``{"texts": [str|null, ...], "images": [path|null, ...], "videos": [...]?}``, the
  lists aligned; at each position the non-null entries are taken in the order text, image, video.
- native: ``{"segments": [{"type": "text"|"code"|"image"|"video", "text": ..., "lang": ...,
  "path": ...}]}``.
The same OBELICS lists as columns of a ``.parquet`` file or a Hugging Face ``save_to_disk``
folder, images as bytes, paths or ``{bytes, path}`` structs (tables.py).
An ``id`` field names the sample; every other field goes to ``meta``. A document whose media is
missing or remote is rejected as a whole (reason ``missing-media``), never kept without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from data.media import VIDEO_EXTS
from data.schema import SEGMENT_TYPES, Reject, Sample, sanitize_key, unsafe_name_reason
from data.sources.base import (
    Item,
    Part,
    Source,
    no_size,
    not_strings,
    on_disk,
    shown,
    stat_size,
)
from data.sources.rows import blank_line, parse_record
from data.sources.tables import LIST_COLUMNS, aligned_entries, is_table, load_row, table_items
from data.sources.text import jsonl_lines, read_line


def doc_parts(rec: dict, base: Path, label: str) -> list[Part] | Reject:
    """The document's parts in order (media paths resolved), or why the record is malformed.
    Consumes the fields it reads from ``rec``; what is left is the document's meta."""
    if "segments" in rec:
        if both := [column for column, _ in LIST_COLUMNS if column in rec]:
            # one layout a record: the lists would be left out unsaid, in the meta
            lists = ", ".join(f'"{column}"' for column in both)
            return Reject(label, "bad-record", f'both "segments" and {lists}: give one')
        segs = rec.pop("segments")
        if not isinstance(segs, list):
            return Reject(label, "bad-record", '"segments" must be a list')
        parts = []
        for position, seg in enumerate(segs):
            kind = seg.get("type") if isinstance(seg, dict) else None
            if kind not in SEGMENT_TYPES:
                return Reject(label, "bad-record", f"segment {position}: unknown type {kind!r}")
            if wrong := not_strings(seg, position):  # the line is named, the file goes on
                return Reject(label, "bad-record", wrong)
            if kind in ("text", "code"):
                parts.append(
                    Part(
                        kind,
                        seg.get("text") or "",
                        path=label,
                        lang=seg.get("lang"),
                        role=seg.get("role"),  # "caption": as a wds tar's segments keep it
                    )
                )
            else:
                parts.append(Part(kind, path=seg.get("path") or seg.get("file") or ""))
    elif any(column in rec for column, _ in LIST_COLUMNS):
        entries = aligned_entries(rec, label)
        if isinstance(entries, Reject):
            return entries
        parts = []
        for position, kind, value in entries:
            if not isinstance(value, str):
                return Reject(label, "bad-record", f"{kind} at position {position} is not a string")
            parts.append(
                Part(kind, value, path=label) if kind == "text" else Part(kind, path=value)
            )
    else:
        return Reject(label, "bad-record", 'neither "segments" nor OBELICS "texts"/"images" lists')
    for part in parts:
        if part.type in ("image", "video"):
            given = part.path or ""
            if not given:
                return Reject(label, "bad-record", f"{part.type} segment without a path")
            if "://" in given:
                return Reject(
                    label, "missing-media", f"{given} is remote; ingest takes local files"
                )
            if part.type == "image" and Path(given).suffix.lower() in VIDEO_EXTS:
                return Reject(
                    label, "unknown-type", f"{given} is a video in the images: list it in videos"
                )
            part.path = str(on_disk(base / given if not Path(given).is_absolute() else Path(given)))
            part.ext = Path(given).suffix.lower()
            part.label = f"{label} ({shown(given)})"  # the line that names it, as it was given
    return parts


class InterleavedSource(Source):
    kind = "interleaved"

    def items(self) -> Iterator[Item]:
        if is_table(self.spec.path):  # .parquet or a Hugging Face save_to_disk folder
            yield from table_items(self)
            return
        if self.root.suffix.lower() != ".jsonl" or not self.root.is_file():
            yield self.rejected_item(
                self.key(sanitize_key(self.root.name)),
                str(self.root),
                "unknown-type",
                "interleaved takes a .jsonl or .parquet file or a Hugging Face dataset folder",
            )
            return
        for lineno, off, length in jsonl_lines(self.root):
            label = f"{self.root.name}:{lineno}"
            key = self.key(f"{lineno:08d}")
            rec = (
                parse_record(read_line(self.root, off, length), label, self.limits.repair_utf8)
                if length
                else None
            )
            if rec is None:
                rej = blank_line(label)
                yield self.rejected_item(key, label, rej.reason, rej.detail)
                continue
            if isinstance(rec, Reject):
                yield self.rejected_item(key, label, rec.reason, rec.detail)
                continue
            if rec.get("id") not in (None, ""):
                why = unsafe_name_reason(str(rec["id"]))
                if why:
                    yield self.rejected_item(key, label, "unsafe-name", f"id: {why}")
                    continue
                key = self.key(sanitize_key(str(rec["id"])))
            parts = doc_parts(rec, self.root.parent, label)
            if isinstance(parts, Reject):
                yield self.rejected_item(key, label, parts.reason, parts.detail)
                continue
            size, missing = length, None
            outside = next(
                (
                    skip
                    for part in parts
                    if part.type in ("image", "video")
                    and (
                        skip := self.outside_tree(part.path or "", self.root.parent)
                        or self.outside(part.path or "")
                    )
                ),
                None,
            )
            if outside:
                yield self.rejected_item(key, label, outside.reason, outside.detail)
                continue
            for part in parts:
                if part.type in ("image", "video"):
                    media_size = stat_size(Path(part.path)) if part.path else None
                    if media_size is None:
                        missing = part.path
                        break
                    size += media_size
            if missing:
                reason, detail = no_size(Path(missing))
                yield self.rejected_item(key, label, reason, f"{shown(missing)}: {detail}")
                continue
            yield Item(key, label, ("line", str(self.root), label, off, length, lineno), size)

    def load(self, item: Item) -> Sample | Reject:
        if item.ref[0] == "trow":
            return load_row(self, item)
        _, path, label, off, length, lineno = item.ref
        rec = parse_record(read_line(path, off, length), label, self.limits.repair_utf8)
        if isinstance(rec, Reject):
            return self.reject(rec.path, rec.reason, rec.detail, item.key)
        parts = doc_parts(rec, Path(path).parent, label)
        if isinstance(parts, Reject):
            return self.reject(parts.path, parts.reason, parts.detail, item.key)
        rec.pop("id", None)
        return self.assemble(item.key, parts, rec, {"path": Path(path).name, "line": lineno}, label)
