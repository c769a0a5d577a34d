"""``interleaved:PATH`` — documents mixing text and media, one JSON object per line.

Two forms per line (media paths relative to the JSONL file's folder, or absolute):
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

from data.schema import SEGMENT_TYPES, Reject, Sample, sanitize_key, unsafe_name_reason
from data.sources.base import Item, Part, Source, stat_size
from data.sources.tables import is_table, load_row, table_items
from data.sources.text import jsonl_lines, parse_record, read_line

OBELICS_LISTS = (("texts", "text"), ("images", "image"), ("videos", "video"))


def doc_parts(rec: dict, base: Path, label: str) -> list[Part] | Reject:
    """The document's parts in order (media paths resolved), or why the record is malformed.
    Consumes the fields it reads from ``rec``; what is left is the document's meta."""
    if "segments" in rec:
        segs = rec.pop("segments")
        if not isinstance(segs, list):
            return Reject(label, "bad-record", '"segments" must be a list')
        parts = []
        for i, s in enumerate(segs):
            t = s.get("type") if isinstance(s, dict) else None
            if t not in SEGMENT_TYPES:
                return Reject(label, "bad-record", f"segment {i}: unknown type {t!r}")
            if t in ("text", "code"):
                parts.append(Part(t, s.get("text") or "", path=label, lang=s.get("lang")))
            else:
                parts.append(Part(t, path=s.get("path") or s.get("file") or ""))
    elif any(k in rec for k, _ in OBELICS_LISTS):
        lists = [(rec.pop(k, None) or [], t) for k, t in OBELICS_LISTS]
        n = max(len(v) for v, _ in lists)
        if any(v and len(v) != n for v, _ in lists):
            return Reject(label, "bad-record", "texts/images/videos lists differ in length")
        parts = []
        for i in range(n):
            for values, t in lists:
                v = values[i] if values else None
                if v is None:
                    continue
                if not isinstance(v, str):
                    return Reject(label, "bad-record", f"{t} at position {i} is not a string")
                parts.append(Part(t, v, path=label) if t == "text" else Part(t, path=v))
    else:
        return Reject(label, "bad-record", 'neither "segments" nor OBELICS "texts"/"images" lists')
    for p in parts:
        if p.type in ("image", "video"):
            given = p.path or ""
            if not given:
                return Reject(label, "bad-record", f"{p.type} segment without a path")
            if "://" in given:
                return Reject(
                    label, "missing-media", f"{given} is remote; ingest takes local files"
                )
            p.path = str(base / given) if not Path(given).is_absolute() else given
            p.ext = Path(given).suffix.lower()
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
            rec = parse_record(read_line(self.root, off, length), label)
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
                    o
                    for p in parts
                    if p.type in ("image", "video") and (o := self.outside(p.path or ""))
                ),
                None,
            )
            if outside:
                yield self.rejected_item(key, label, outside.reason, outside.detail)
                continue
            for p in parts:
                if p.type in ("image", "video"):
                    s = stat_size(Path(p.path)) if p.path else None
                    if s is None:
                        missing = p.path
                        break
                    size += s
            if missing:
                yield self.rejected_item(key, label, "missing-media", f"{missing} does not exist")
                continue
            yield Item(key, label, ("line", str(self.root), label, off, length, lineno), size)

    def load(self, item: Item) -> Sample | Reject:
        if item.ref[0] == "trow":
            return load_row(self, item)
        _, path, label, off, length, lineno = item.ref
        rec = parse_record(read_line(path, off, length), label)
        if isinstance(rec, Reject):
            return self.reject(rec.path, rec.reason, rec.detail, item.key)
        parts = doc_parts(rec, Path(path).parent, label)
        if isinstance(parts, Reject):
            return self.reject(parts.path, parts.reason, parts.detail, item.key)
        rec.pop("id", None)
        return self.assemble(item.key, parts, rec, {"path": Path(path).name, "line": lineno}, label)
