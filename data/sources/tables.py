"""Columnar tables as sources: a ``.parquet`` file or a Hugging Face ``save_to_disk`` folder,
for the kinds ``text``, ``images``, ``videos`` and ``interleaved`` (the optional extra
``parquet``: pyarrow).

One row is one document, with the same rejects and accounting as the JSONL/CSV tables:
- ``text``: a ``text`` column.
- ``images`` / ``videos``: an ``image`` (``video``) column holding the bytes, a path relative
  to the table's folder, or a Hugging Face ``Image()`` struct ``{bytes, path}``; optional
  ``caption`` and ``id``. A path must stay inside the table's folder (``outside-tree``
  otherwise, unless ``--allow-outside-paths``), as in the JSONL/CSV tables.
- ``interleaved``: OBELICS-style aligned lists ``texts`` and ``images`` (and ``videos``), each
  image as bytes, a path or a ``{bytes, path}`` struct; ``null`` where the position holds the
  other kind.
Every other column goes to the document's ``meta`` (JSON values only; bytes are left out).

Design choices:
- A Hugging Face folder (``dataset_info.json`` + ``state.json`` + ``data-*.arrow``) is read
  with pyarrow directly: its files are Arrow IPC streams, memory-mapped here, so neither the
  ``datasets`` package nor a copy of the data is needed. A ``DatasetDict`` folder (splits in
  subfolders) is refused with the split folders named.
- The plan reads no media: rows are located as (file, row group, row) and sized from the
  table's metadata; only an ``id`` column and media *path* columns are read then (for keys and
  missing files). Workers read one row group at a time and keep the last one, so the rows of a
  shard, which are consecutive, cost one read per row group.
- A table can be an fsspec URL (``--source images:s3://bucket/laion/part-00000.parquet``): a
  parquet file is read by ranged requests (its footer, then the row groups a worker needs), a
  Hugging Face folder's Arrow files whole. Media there must be bytes in the table: paths
  relative to a remote table are rejected (``missing-media``), never fetched one by one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

from data.schema import Reject, Sample, sanitize_key, unsafe_name_reason
from data.shards.storage import exists, filesystem, is_remote, read_bytes, retried
from data.sources.base import (
    Item,
    Part,
    Source,
    caption_part,
    no_size,
    pop_caption,
    shown,
    stat_size,
)

HF_FILES = ("dataset_info.json", "state.json")


def import_pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ValueError(
            "parquet and Hugging Face dataset sources need pyarrow: pip install 'earlyfuse[parquet]'"
        ) from None
    return pyarrow


class Location:
    """A table source's path: a local Path or an fsspec URL (``s3://...``), joined with ``/``."""

    text: str

    def __init__(self, path: str | Path | Location) -> None:
        self.text = (path.text if isinstance(path, Location) else str(path)).rstrip("/")
        self.remote = is_remote(self.text)
        if self.remote:
            self.fs, self.inner = filesystem(self.text)

    def __truediv__(self, name: str) -> Location:
        return Location(f"{self.text}/{name}" if self.remote else Path(self.text) / name)

    @property
    def name(self) -> str:
        return self.text.rsplit("/", 1)[-1]

    def is_file(self) -> bool:
        return exists(self.text)

    def read_bytes(self) -> bytes:
        return read_bytes(self.text)

    def open(self):
        """A seekable binary file (ranged reads when remote)."""
        if not self.remote:
            return open(self.text, "rb")
        return retried(self.text, lambda: self.fs.open(self.inner, "rb", cache_type="none"))


def is_table(root: str | Path | Location) -> bool:
    """A .parquet file, or a Hugging Face save_to_disk folder (a Dataset or a DatasetDict)."""
    loc = Location(root)
    if loc.text.lower().endswith(".parquet"):
        return loc.is_file()
    if not loc.remote and not Path(loc.text).is_dir():
        return False
    return all((loc / name).is_file() for name in HF_FILES) or (loc / "dataset_dict.json").is_file()


def table_files(root: str | Path | Location) -> list[Location]:
    """The data files of a table source, in row order."""
    loc = Location(root)
    if loc.text.lower().endswith(".parquet"):
        return [loc]
    if (loc / "dataset_dict.json").is_file():
        splits = json.loads((loc / "dataset_dict.json").read_bytes()).get("splits", [])
        raise ValueError(
            f"{loc.text} is a DatasetDict; pass one split's folder, e.g. "
            + ", ".join((loc / split).text for split in splits)
        )
    state = json.loads((loc / "state.json").read_bytes())
    return [loc / entry["filename"] for entry in state.get("_data_files", [])]


class TableFile:
    """One parquet or Arrow-stream file: row groups, plan-time columns, rows by position."""

    def __init__(self, loc: Location) -> None:
        self.pa = import_pyarrow()
        self.loc = loc
        self._group: tuple[int, list[dict] | str] | None = None
        if loc.text.lower().endswith(".parquet"):
            self.parquet = self._reading(lambda: self._open_parquet())
            self.schema = self.parquet.schema_arrow
            meta = self.parquet.metadata
            self.groups = [
                (meta.row_group(group).num_rows, meta.row_group(group).total_byte_size)
                for group in range(meta.num_row_groups)
            ]
            self.table = None
        else:  # a Hugging Face Arrow stream: memory-mapped here, read whole when remote; one group
            self.parquet = None
            source = loc.read_bytes() if loc.remote else self.pa.memory_map(loc.text)
            with self.pa.ipc.open_stream(source) as reader:
                self.table = reader.read_all()
            self.schema = self.table.schema
            self.groups = [(self.table.num_rows, max(1, self.table.nbytes))]

    def _open_parquet(self):
        return self.pa.parquet.ParquetFile(
            self.loc.text if not self.loc.remote else self.loc.open()
        )

    def _reading(self, call):
        """``call()``; remote: retried, on a freshly opened file after a failure."""
        if not self.loc.remote:
            return call()

        def once():
            try:
                return call()
            except Exception:
                if getattr(self, "parquet", None) is not None:
                    self.parquet = self._open_parquet()
                raise

        return retried(self.loc.text, once)

    def read_group(self, group: int, columns: list[str] | None = None):
        """A row group's rows (``columns`` of them, or all), or why it cannot be read: a damaged
        page costs that group's rows, not the table's other groups."""
        try:
            if self.table is not None:
                part = self.table
            else:
                part = self._reading(lambda: self.parquet.read_row_group(group, columns=columns))
            return part.to_pylist()
        except (OSError, ValueError, UnicodeDecodeError) as e:  # ArrowIOError, ArrowInvalid
            if isinstance(e, OSError) and e.errno:  # the machine's (EIO, a stale handle): exit 1
                raise
            said = " ".join("".join(c if c.isprintable() else " " for c in str(e)).split())
            return f"row group {group} cannot be read ({said[:200]})"

    def row(self, group: int, index: int) -> dict | str:
        """The row, or why its row group cannot be read (said once per row)."""
        if self._group is None or self._group[0] != group:
            self._group = (group, self.read_group(group))
        rows = self._group[1]
        return rows if isinstance(rows, str) else rows[index]


def _is_path_type(pa, arrow_type) -> bool:
    """A column (or list element) that holds paths, which the plan checks exist."""
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        arrow_type = arrow_type.value_type
    return pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type)


def jsonable(value):
    """A cell as JSON for ``meta``; bytes and other non-JSON values are left out (None)."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, dict):
        return {
            str(key): jsonable(item) for key, item in value.items() if not isinstance(item, bytes)
        }
    if isinstance(value, bytes):
        return None
    return str(value)  # dates, decimals: their text


def media_value(value, base: Location) -> tuple[bytes | None, str | None, str] | str:
    """(bytes, resolved path, path as written) of a media cell, or why it holds no media."""
    if isinstance(value, dict):  # a Hugging Face Image()/Video() struct
        if value.get("bytes"):
            return value["bytes"], None, ""
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return (bytes(value), None, "") if value else "empty media bytes"
    if isinstance(value, str) and value:
        if "://" in value or base.remote:
            return f"{value} is remote; ingest reads media bytes in the table or local files"
        return None, (base / value).text if not Path(value).is_absolute() else value, value
    return "no media in this cell"


MEDIA_COLUMNS = {"images": "image", "videos": "video"}
LIST_COLUMNS = (("texts", "text"), ("images", "image"), ("videos", "video"))


def table_items(src: Source) -> Iterator[Item]:
    """The plan's items of a table source: one per row."""
    root = Location(src.spec.path)
    single = root.text.lower().endswith(".parquet")
    base = Location(root.text.rsplit("/", 1)[0]) if single else root
    paths = []  # media path columns to check: (column, is_list)
    row = 0
    for file in table_files(root):
        table = TableFile(file)
        arrow = table.pa
        names = table.schema.names
        if src.kind == "interleaved":
            if not any(column in names for column, _ in LIST_COLUMNS):
                raise ValueError(f"{file.name}: no texts/images/videos columns (OBELICS layout)")
            paths = [
                column
                for column in ("images", "videos")
                if column in names and _is_path_type(arrow, table.schema.field(column).type)
            ]
        elif src.kind in MEDIA_COLUMNS:
            col = MEDIA_COLUMNS[src.kind]
            if col not in names:
                raise ValueError(f"{file.name}: no {col!r} column (it has {names})")
            paths = [col] if _is_path_type(arrow, table.schema.field(col).type) else []
        elif "text" not in names:
            raise ValueError(f"{file.name}: no 'text' column (it has {names})")
        label_file = file.name
        start = 0
        for group, (num_rows, nbytes) in enumerate(table.groups):
            size = max(1, nbytes // max(1, num_rows))
            wanted = [column for column in ("id", *paths) if column in names]  # the plan's checks
            cells = table.read_group(group, wanted) if wanted else [{}] * num_rows
            for row_in_group in range(num_rows):
                pos = start + row_in_group
                label = f"{label_file}:row {pos}"
                key = src.key(f"{row:08d}")
                row += 1
                if isinstance(cells, str):
                    yield src.rejected_item(key, label, "corrupt-table", cells)
                    continue
                rid = _row_id(cells[row_in_group].get("id"))
                media = {column: cells[row_in_group][column] for column in paths}
                if rid is not None:
                    why = unsafe_name_reason(str(rid))
                    if why:
                        yield src.rejected_item(key, label, "unsafe-name", f"id: {why}")
                        continue
                    key = src.key(sanitize_key(rid))
                missing = (
                    _linked_out(src, media, base, tree=True)
                    or _missing_media(media, base)
                    or _linked_out(src, media, base)
                )
                if missing:
                    reason, detail, written = missing
                    where = f"{label} ({shown(written)})" if written else label
                    yield src.rejected_item(key, where, reason, detail)
                    continue
                yield Item(key, label, ("trow", file.text, group, row_in_group, label, pos), size)
            start += num_rows


def _missing_media(media: dict, base: Location) -> tuple[str, str, str] | None:
    """(reason, detail, path as written) when a media path of the row (``media``: its path
    columns' cells) is missing or remote."""
    for cell in media.values():
        for value in cell if isinstance(cell, list) else [cell]:
            if value is None:
                continue
            got = media_value(value, base)
            if isinstance(got, str):
                return ("missing-media" if "remote" in got else "bad-record"), got, ""
            if got[1] is not None and stat_size(Path(got[1])) is None:
                return (*no_size(Path(got[1])), got[2])
    return None


def _linked_out(src: Source, media: dict, base: Location, tree=False):
    """(reason, detail, path as written) when a local media path of the row is a symlink leading
    out of the table's folder, or with ``tree`` a path written to lead out of it (the same rules
    as the JSONL/CSV tables: ``Source.outside`` and ``Source.outside_tree``)."""
    if base.remote:
        return None
    for cell in media.values():
        for value in cell if isinstance(cell, list) else [cell]:
            got = media_value(value, base) if value is not None else None
            if got is None or isinstance(got, str) or got[1] is None:
                continue
            if tree:
                skip = src.outside_tree(got[2], Path(base.text))
            else:
                skip = src.outside(Path(got[1]), Path(base.text).resolve())
            if skip:
                return skip.reason, skip.detail, got[2]
    return None


_OPEN: dict[str, TableFile] = {}  # per worker: the last table read, and its row group


def _row_id(value: object) -> str | None:
    """A row's ``id`` as its key's text; None for none. pandas writes an integer column with a
    gap as floats, the gap a NaN: 3.0 is the id 3 and NaN no id (the row's number keys it)."""
    if value is None or value == "" or isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def load_row(src: Source, item: Item) -> Sample | Reject:
    _, file, group, index, label, pos = item.ref
    table = _OPEN.get(file)
    if table is None:
        _OPEN.clear()
        table = _OPEN[file] = TableFile(Location(file))
    row = table.row(group, index)
    if isinstance(row, str):  # the row group's other rows are rejects too; the rest are kept
        return src.reject(label, "corrupt-table", row, item.key)
    rec = dict(row)
    root = Location(src.spec.path)
    single = root.text.lower().endswith(".parquet")
    base = Location(root.text.rsplit("/", 1)[0]) if single else root
    origin = {"path": file.rsplit("/", 1)[-1], "row": pos}
    rec.pop("id", None)
    if src.kind == "text":
        text = rec.pop("text", None)
        if not isinstance(text, str):
            return src.reject(label, "bad-record", 'no string in column "text"', item.key)
        parts = [Part("text", text, path=label)]
    elif src.kind in MEDIA_COLUMNS:
        col = MEDIA_COLUMNS[src.kind]
        got = media_value(rec.pop(col, None), base)
        if isinstance(got, str):
            return src.reject(label, "bad-record", f'column "{col}": {got}', item.key)
        refused = _refused_path(src, got, base, label)
        if refused:
            return src.reject(refused.path, refused.reason, refused.detail, item.key)
        parts = [_media_part(src.kind[:-1], got, label)]
        caption, no_text = caption_part(pop_caption(rec), label)
        if no_text:
            return src.reject(label, "bad-record", no_text, item.key)
        if caption is not None:
            parts.append(caption)
    else:
        got_parts = _interleaved_parts(src, rec, base, label)
        if isinstance(got_parts, Reject):
            return src.reject(got_parts.path, got_parts.reason, got_parts.detail, item.key)
        parts = got_parts
    meta = {
        key: value
        for key, value in ((key, jsonable(value)) for key, value in rec.items())
        if value is not None
    }
    return src.assemble(item.key, parts, meta, origin, label)


def _media_part(kind: str, got: tuple[bytes | None, str | None, str], label: str) -> Part:
    """A media part; rejects name it ``LABEL (path as written)`` like the JSONL tables do."""
    data, path, written = got
    ext = Path(path).suffix.lower() if path else None  # bytes: the container names a clip's
    where = f"{label} ({shown(written)})" if written else label
    return Part(kind, path=path or label, data=data, ext=ext, label=where)


def _refused_path(
    src: Source, got: tuple[bytes | None, str | None, str], base: Location, label: str
) -> Reject | None:
    """Why a media path read from a row must not be read (it leads out of the table's folder,
    as written or through a symlink). The plan checks path columns; a Hugging Face ``{bytes,
    path}`` struct shows its path only here, where the row is read."""
    if got[1] is None or base.remote:
        return None
    skip = src.outside_tree(got[2], Path(base.text)) or src.outside(
        Path(got[1]), Path(base.text).resolve()
    )
    return Reject(f"{label} ({got[2]})", skip.reason, skip.detail) if skip else None


def aligned_entries(rec: dict, label: str) -> list[tuple[int, str, object]] | Reject:
    """The OBELICS lists (``texts``, ``images``, ``videos``, aligned) of a JSONL record or a
    table row as (position, kind, value) in document order: at each position the non-null
    entries in the order text, image, video. Consumes the columns it reads from ``rec``."""
    lists = [(rec.pop(column, None) or [], kind) for column, kind in LIST_COLUMNS]
    for (values, _), (column, _) in zip(lists, LIST_COLUMNS):
        if not isinstance(values, (list, tuple)):  # a string would be taken letter by letter
            return Reject(label, "bad-record", f'"{column}" is not a list')
    length = max(len(column_values) for column_values, _ in lists)
    if any(column_values and len(column_values) != length for column_values, _ in lists):
        return Reject(label, "bad-record", "texts/images/videos lists differ in length")
    return [
        (position, kind, values[position])
        for position in range(length)
        for values, kind in lists
        if values and values[position] is not None
    ]


def _interleaved_parts(src: Source, rec: dict, base: Location, label: str) -> list[Part] | Reject:
    entries = aligned_entries(rec, label)
    if isinstance(entries, Reject):
        return entries
    parts = []
    for position, kind, value in entries:
        if kind == "text":
            if not isinstance(value, str):
                return Reject(label, "bad-record", f"text at position {position} is not a string")
            parts.append(Part("text", value, path=label))
            continue
        got = media_value(value, base)
        if isinstance(got, str):
            return Reject(label, "bad-record", f"{kind} at position {position}: {got}")
        refused = _refused_path(src, got, base, label)
        if refused:
            return refused
        parts.append(_media_part(kind, got, f"{label}:{kind} {position}"))
    return parts
