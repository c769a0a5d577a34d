"""``text:PATH`` — prose. A ``.txt``/``.md``/``.rst`` file is one document; a ``.jsonl`` file
holds one document per line (``{"text": ...}``; other fields go to ``meta``); a ``.parquet``
file or a Hugging Face ``save_to_disk`` folder one per row (a ``text`` column; tables.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from data.media import binary_detail
from data.schema import Reject, Sample
from data.sources.base import Item, Part, Source, hidden_dir, read_file, stat_size, unstatable
from data.sources.rows import blank_line, parse_record, refuse_wide
from data.sources.tables import is_table, load_row, table_items

TEXT_EXTS = {".txt", ".md", ".markdown", ".rst", ".text"}


def jsonl_lines(path) -> Iterator[tuple[int, int, int]]:
    """(line number, byte offset, length) of every line, read in binary; a blank line (empty or
    only whitespace) has length 0, for the caller to list as a ``blank-line`` reject."""
    off = 0
    with open(path, "rb") as f:
        refuse_wide(f.read(4096), path)
        f.seek(0)
        for lineno, line in enumerate(f, 1):
            yield lineno, off, len(line) if line.strip() else 0
            off += len(line)


def read_line(path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


class TextSource(Source):
    kind = "text"

    def items(self) -> Iterator[Item]:
        if is_table(self.spec.path):  # .parquet or a Hugging Face save_to_disk folder
            yield from table_items(self)
            return
        for got in self.walk_files(hidden_dir):
            if isinstance(got, Item):
                yield got
                continue
            key, label, path = got
            ext = path.suffix.lower()
            size = stat_size(path)
            if size is None:
                yield self.rejected_item(key, label, "unreadable-file", unstatable(path))
            elif ext == ".jsonl":
                for lineno, off, length in jsonl_lines(path):
                    if not length:
                        rej = blank_line(f"{label}:{lineno}")
                        yield self.rejected_item(
                            f"{key}-{lineno:08d}", rej.path, rej.reason, rej.detail
                        )
                        continue
                    yield Item(
                        f"{key}-{lineno:08d}",
                        f"{label}:{lineno}",
                        ("line", str(path), label, off, length, lineno),
                        length,
                    )
            elif ext not in TEXT_EXTS:
                yield self.rejected_item(
                    key,
                    label,
                    "unknown-type",
                    f"not a text file ({ext or 'no extension'}); text takes "
                    + ", ".join(sorted(TEXT_EXTS | {".jsonl"})),
                )
            elif size > self.limits.max_text_bytes:
                yield self.rejected_item(
                    key,
                    label,
                    "too-large",
                    f"{size} B > limit {self.limits.max_text_bytes} B (--max-text-bytes)",
                )
            else:
                yield Item(key, label, ("file", str(path), label), size)

    def load(self, item: Item) -> Sample | Reject:
        if item.ref[0] == "trow":
            return load_row(self, item)
        if item.ref[0] == "file":
            _, path, label = item.ref
            raw = read_file(Path(path), label)
            if isinstance(raw, Reject):
                return self.reject(raw.path, raw.reason, raw.detail, item.key)
            if why := binary_detail(raw):  # a blob under a text name would go into the BPE
                return self.reject(label, "binary-file", why, item.key)
            return self.assemble(
                item.key, [Part("text", raw, path=label)], {}, {"path": label}, label
            )
        _, path, label, off, length, lineno = item.ref
        where = f"{label}:{lineno}"
        rec = parse_record(read_line(path, off, length), where, self.limits.repair_utf8)
        if isinstance(rec, Reject):
            return self.reject(rec.path, rec.reason, rec.detail, item.key)
        text = rec.pop("text", None)
        if not isinstance(text, str):
            fields = ", ".join(map(str, list(rec)[:8]))  # OSCAR's "content", say: the one to rename
            detail = 'no string field "text"' + (f" (its fields: {fields})" if fields else "")
            return self.reject(where, "bad-record", detail, item.key)
        origin = {"path": label, "line": lineno}
        return self.assemble(item.key, [Part("text", text, path=where)], rec, origin, where)
