"""``images:PATH`` and ``videos:PATH`` — media files with optional captions.

PATH is either
- a folder: every image (or video) file below it is one document; its caption comes from a
  sidecar ``NAME.txt`` (or the ``caption`` field of ``NAME.json``, whose other fields go to
  ``meta``), or from a ``captions.jsonl`` / ``captions.csv`` at the folder's top with columns
  ``file`` (path relative to the folder) and ``caption`` (a row whose file is not in the
  folder is a ``missing-media`` reject, a second row for one file a ``duplicate-key``), or from
  a Hugging Face imagefolder's ``metadata.jsonl`` / ``metadata.csv`` (``file_name``, caption in
  ``text``) in the folder or any folder below (a split's ``train/metadata.csv``), naming files
  relative to its own folder; its own ``file`` column, if any, stays in ``meta``. Where two
  give a caption, ``NAME.txt`` is used and the other (a ``NAME.json``'s or a table row's) stays
  in ``meta`` as ``caption``, with the row's other columns;
- or a ``.jsonl`` / ``.csv`` table with a column ``image`` (or ``video``), optional ``caption``
  and ``id``; paths are relative to the table's folder and stay inside it (``outside-tree``
  otherwise, unless ``--allow-outside-paths``); other columns go to ``meta``; malformed rows
  and blank lines are rejects naming their line (rows.py);
- or a ``.parquet`` file / Hugging Face ``save_to_disk`` folder with those columns, the media
  column holding bytes, paths or ``{bytes, path}`` structs (tables.py).

A document is ``[media, caption]``; the caption segment carries ``"role": "caption"``. Wherever
a caption is read (a table row, a sidecar ``NAME.json``, a wds ``KEY.json``), a record without
``caption`` gives its ``text`` (a Hugging Face dataset's name for it), either name in any case
(base.pop_caption); the record's other fields go to ``meta``.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import unicodedata
from collections.abc import Iterator
from pathlib import Path

from data.media import (
    IMAGE_EXTS,
    IMAGE_FORMATS,
    VIDEO_EXTS,
    binary_detail,
    decode_text,
    image_format,
)
from data.schema import Reject, Sample, sanitize_key, unsafe_name_reason
from data.sources.base import (
    Item,
    Part,
    Source,
    caption_part,
    hidden_dir,
    no_size,
    on_disk,
    pop_caption,
    read_file,
    shown,
    special_file,
    stat_size,
    unstatable,
    walk,
)
from data.sources.rows import parse_record, read_table
from data.sources.tables import is_table, load_row, table_items

# A folder's caption tables: ours (file, caption), and a Hugging Face imagefolder's metadata
# (file_name, and its caption in text or caption), read the same way
CAPTION_TABLES = ("captions.jsonl", "captions.csv", "metadata.jsonl", "metadata.csv")


def _hf(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face imagefolder's metadata: its first record (a CSV's
    header, a JSONL's first line) has a ``file_name``."""
    if not path.is_file():  # absent, or a named pipe, never opened
        return False
    try:
        with open(path, "rb") as f:
            first = f.readline(1 << 16).decode("utf-8-sig", "replace")
    except OSError:
        return False
    if path.suffix == ".csv":
        return "file_name" in (field.strip().strip('"') for field in first.split(","))
    try:
        return "file_name" in json.loads(first)
    except (ValueError, TypeError):
        return False


def sidecar_digest(*sidecars: Path | None) -> str:
    """A short SHA-256 of the sidecar captions' bytes ("" for none; one that cannot be read is
    left to the load, which names it)."""
    digest = hashlib.sha256()
    for sidecar in sidecars:
        if sidecar is not None:
            try:
                digest.update(sidecar.read_bytes())
            except OSError:
                digest.update(b"\0unreadable")
    return digest.hexdigest()[:16] if any(sidecars) else ""


class CaptionedSource(Source):
    exts: set[str] = set()
    column = ""
    part_type = ""

    def items(self) -> Iterator[Item]:
        if is_table(self.spec.path):  # .parquet or a Hugging Face save_to_disk folder
            yield from table_items(self)
            return
        if self.root.is_dir():
            yield from self._folder_items()
        elif self.root.suffix.lower() in (".jsonl", ".csv"):
            yield from self._table_items()
        else:
            yield self.rejected_item(
                self.key(sanitize_key(self.root.name)),
                self.root.name,
                "unknown-type",
                f"{self.kind} takes a folder, a .jsonl/.csv/.parquet table or a Hugging Face "
                "dataset folder",
            )

    # --- a folder of media files -----------------------------------------------------------
    def _folder_items(self) -> Iterator[Item]:
        captions: dict[str, dict] = {}
        caption_rows: dict[str, str] = {}  # file -> the row that captions it ("captions.csv:3")
        files = list(walk(self.root, hidden_dir, follow=self.limits.follow_links_outside))
        tables = sorted(
            (rel for rel, skipped in files if not skipped and self._caption_table(rel)),
            key=lambda rel: (rel.count("/"), CAPTION_TABLES.index(Path(rel).name), rel),
        )
        for table in tables:
            if outside := self.outside(self.root / table):
                yield self.rejected_item(
                    self.key(sanitize_key(table)), table, outside.reason, outside.detail
                )
                continue
            hf = Path(table).name.startswith("metadata.")
            # an imagefolder's metadata names files relative to its own folder (train/, test/)
            folder = posixpath.dirname(table)
            for lineno, rec in read_table(
                self.root / table, ("file_name",) if hf else ("file",), self.limits.repair_utf8
            ):
                displaced = None  # an imagefolder's own "file" column, kept in meta
                if hf and isinstance(rec, dict) and "file_name" in rec:
                    displaced = rec.pop("file", None)
                    rec["file"] = rec.pop("file_name")  # its caption, "text": pop_caption
                if isinstance(rec, Reject) or not rec.get("file"):
                    reason, detail = (
                        (rec.reason, rec.detail)
                        if isinstance(rec, Reject)
                        else ("bad-record", f'no "{"file_name" if hf else "file"}" column')
                    )
                    yield self.rejected_item(
                        self.key(sanitize_key(f"{table}:{lineno}")),
                        f"{table}:{lineno}",
                        reason,
                        detail,
                    )
                    continue
                # names compared composed (NFC): macOS writes them decomposed (on_disk)
                file = unicodedata.normalize("NFC", str(rec.pop("file")))
                file = posixpath.normpath(posixpath.join(folder, file))
                if displaced is not None:
                    rec["file"] = displaced
                row = f"{table}:{lineno}"
                if file in caption_rows:
                    yield self.rejected_item(
                        self.key(sanitize_key(f"{table}:{lineno}")),
                        row,
                        "duplicate-key",
                        f"{file} already has its caption from {caption_rows[file]}",
                    )
                    continue
                captions[file], caption_rows[file] = rec, row
        listed = {unicodedata.normalize("NFC", rel) for rel, _ in files}
        for file, row in caption_rows.items():
            if file not in listed:  # a caption row must not vanish because its file is absent
                yield self.rejected_item(
                    self.key(sanitize_key(row)),
                    f"{row} ({file})",
                    "missing-media",
                    f"no file {file} in the folder (paths are relative to it)",
                )
        media = {
            rel for rel, skipped in files if not skipped and Path(rel).suffix.lower() in self.exts
        }
        stems = {str(Path(rel).with_suffix("")) for rel in media}
        # (stem, .txt or .json) -> the sidecar of that stem, its suffix in any case: a camera's
        # IMG_0001.JPG comes with IMG_0001.TXT; of two (a.txt and a.TXT) the lower case one
        sidecars: dict[tuple[str, str], str] = {}
        for rel, skipped in files:
            stem, suffix = str(Path(rel).with_suffix("")), Path(rel).suffix.lower()
            if not skipped and rel not in media and suffix in (".txt", ".json") and stem in stems:
                if Path(rel).suffix == suffix:  # a.txt beside a.TXT: the usual name is read
                    sidecars[stem, suffix] = rel
                else:
                    sidecars.setdefault((stem, suffix), rel)
        captioned: dict[Path, str] = {}  # a sidecar caption -> the media file it captions
        for rel, skipped in files:
            if skipped:
                yield self.rejected_item(self.key(sanitize_key(rel)), rel, *skipped)
                continue
            if rel in tables:
                continue
            stem, suffix = str(Path(rel).with_suffix("")), Path(rel).suffix.lower()
            if rel not in media:
                if (read := sidecars.get((stem, suffix))) == rel:
                    continue  # a sidecar caption, read with its media file
                if read:
                    detail = f"a second {suffix} caption of {Path(stem).name}: {read} is read"
                    yield self.rejected_item(
                        self.key(sanitize_key(rel)), rel, "duplicate-key", detail
                    )
                    continue
                detail = self._unknown_detail(rel, suffix, media)
                yield self.rejected_item(self.key(sanitize_key(rel)), rel, "unknown-type", detail)
                continue
            key = self.path_key(rel)
            path = self.root / rel
            txt, json_path = (
                self.root / sidecars.get((stem, side), stem + side) for side in (".txt", ".json")
            )
            # the media file and its sidecar captions: none may be a link out of the folder
            outside = next(
                (
                    skip
                    for sidecar in (path, txt, json_path)
                    if sidecar.exists() and (skip := self.outside(sidecar))
                ),
                None,
            )
            if outside:
                yield self.rejected_item(key, rel, outside.reason, outside.detail)
                continue
            size = stat_size(path)
            if size is None:
                yield self.rejected_item(key, rel, "unreadable-file", unstatable(path))
                continue
            broken = next(
                (
                    s
                    for s in (txt, json_path)
                    if s.is_symlink() and not s.exists() or special_file(s)
                ),
                None,
            )
            if broken:  # a link that is broken or loops, a named pipe: a caption not to be read
                detail = f"its sidecar {broken.name}: {unstatable(broken)}"
                yield self.rejected_item(key, rel, "unreadable-file", detail)
                continue
            caption = captions.get(unicodedata.normalize("NFC", rel))
            # the sidecar that gives its caption: a .txt always, a .json unless a table does
            txt_file, json_file = txt.is_file(), json_path.is_file()
            side = txt if txt_file else json_path if json_file and not caption else None
            if side and captioned.setdefault(side, rel) != rel:
                # coffee.bmp and coffee.tiff: most often one picture in two formats, which
                # would be two documents, perhaps one on each side of the held-out split
                yield self.rejected_item(
                    key,
                    rel,
                    "duplicate-key",
                    f"its caption {side.name} is {captioned[side]}'s too (one picture in two "
                    "formats?): rename one, or give each a caption of its own",
                )
                continue
            ref = (
                "file",
                str(path),
                rel,
                json.dumps(caption, sort_keys=True) if caption is not None else "",
                str(txt) if txt_file else "",
                str(json_path) if json_file else "",
                # the sidecars' content is in the plan's fingerprint, as a table's captions are:
                # a caption edited after an ingest makes its rerun another ingest, not stale
                sidecar_digest(txt if txt_file else None, json_path if json_file else None),
            )
            yield Item(key, rel, ref, size)

    # --- a table of media paths and captions ----------------------------------------------
    def _table_items(self) -> Iterator[Item]:
        base = self.root.parent
        for lineno, rec in read_table(
            self.root, (self.column, "file", "path"), self.limits.repair_utf8
        ):
            label = f"{self.root.name}:{lineno}"
            key = self.key(f"{lineno:08d}")
            if isinstance(rec, Reject):
                yield self.rejected_item(key, label, rec.reason, rec.detail)
                continue
            if rec.get("id") not in (None, ""):
                rid = str(rec["id"])
                why = unsafe_name_reason(rid)
                if why:
                    yield self.rejected_item(key, label, "unsafe-name", f"id: {why}")
                    continue
                key = self.key(sanitize_key(rid))
            media = rec.pop(self.column, None) or rec.pop("file", None) or rec.pop("path", None)
            if not isinstance(media, str) or not media:
                yield self.rejected_item(key, label, "bad-record", f'no "{self.column}" column')
                continue
            if "://" in media:
                yield self.rejected_item(
                    key,
                    label,
                    "missing-media",
                    f"{media} is remote; ingest takes local files (download first)",
                )
                continue
            path = on_disk((base / media) if not Path(media).is_absolute() else Path(media))
            outside = self.outside_tree(media, base) or self.outside(path)
            if outside:
                where = f"{label} ({shown(media)})"
                yield self.rejected_item(key, where, outside.reason, outside.detail)
                continue
            size = stat_size(path)
            if size is None:
                yield self.rejected_item(key, f"{label} ({shown(media)})", *no_size(path))
                continue
            yield Item(
                key, label, ("row", str(path), label, media, json.dumps(rec, sort_keys=True)), size
            )

    # --- worker side -------------------------------------------------------------------------
    def load(self, item: Item) -> Sample | Reject:
        if item.ref[0] == "trow":
            return load_row(self, item)
        if item.ref[0] == "file":
            _, path, rel, table_rec, txt, json_path, _ = item.ref
            meta = json.loads(table_rec) if table_rec else {}
            table_caption = pop_caption(meta)
            caption: object = table_caption
            if json_path:
                raw = read_file(Path(json_path), rel)
                rec = (
                    raw
                    if isinstance(raw, Reject)
                    else parse_record(
                        raw, str(Path(rel).with_suffix(".json")), self.limits.repair_utf8
                    )
                )
                if isinstance(rec, Reject):  # named by the media file it leaves out
                    detail = f"its sidecar {Path(json_path).name}: {rec.detail}"
                    return self.reject(rel, rec.reason, detail, item.key)
                if not txt:  # with a .txt sidecar too, the .json's caption stays in meta
                    caption = pop_caption(rec, caption)
                meta.update(rec)
            if txt:
                raw = read_file(Path(txt), rel)
                if isinstance(raw, Reject):
                    return self.reject(raw.path, raw.reason, raw.detail, item.key)
                if why := binary_detail(raw):  # a caption of NULs would be trained on
                    detail = f"its sidecar {Path(txt).name}: {why}"
                    return self.reject(rel, "binary-file", detail, item.key)
                got = decode_text(raw, rel, repair=self.limits.repair_utf8)
                if isinstance(got, Reject):  # named by the caption file, the one to fix
                    detail = f"its sidecar {Path(txt).name}: {got.detail}"
                    return self.reject(rel, got.reason, detail, item.key)
                caption = raw
            if table_caption is not None and caption is not table_caption:
                meta.setdefault("caption", table_caption)  # not used: kept with the document
            origin, label = {"path": rel}, rel
        else:
            _, path, label, media, rec = item.ref
            meta = json.loads(rec)
            caption = pop_caption(meta)
            origin = {"path": media, "row": label}
        # a table row's media reject names the row and the file, as its missing-media does
        shown = f"{origin['row']} ({origin['path']})" if "row" in origin else origin["path"]
        parts = [Part(self.part_type, path=path, ext=Path(path).suffix.lower(), label=shown)]
        caption_seg, refused = caption_part(caption, label)
        if refused:
            return self.reject(label, "bad-record", refused, item.key)
        if caption_seg is not None:
            parts.append(caption_seg)
        return self.assemble(item.key, parts, meta, origin, label)

    def _caption_table(self, rel: str) -> bool:
        """Whether the folder's file ``rel`` captions its media: our captions.jsonl/.csv at the
        top, a Hugging Face imagefolder's metadata.jsonl/.csv (one with ``file_name``) in any
        folder (a split's own, train/metadata.csv)."""
        name = Path(rel).name
        if name.startswith("captions."):
            return name in CAPTION_TABLES and "/" not in rel and (self.root / rel).is_file()
        return name in CAPTION_TABLES and _hf(self.root / rel)

    def _unknown_detail(self, rel: str, suffix: str, media: set[str]) -> str:
        """Why a file of the folder is not one of its media, and what to do about it."""
        detail = f"not a{'n image' if self.kind == 'images' else ' video'} file ({suffix or 'no extension'})"
        other = "videos" if self.kind == "images" else "images"
        if (name := Path(rel).name.lower()) in CAPTION_TABLES:
            if name.startswith("captions.") and "/" in rel:
                return detail + f"; a {name} is read at the folder's top only"
            if name != Path(rel).name:
                return detail + f"; a caption table is read under the name {name}"
            return detail + "; a metadata table captions its folder when it has a file_name column"
        if suffix in (".txt", ".json"):
            if str(Path(rel).with_suffix("")) in media:
                named = Path(rel).with_suffix("").with_suffix(suffix).name
                return detail + f"; the caption sidecar of {Path(rel).stem} is named {named}"
            return detail + f"; a caption with no {self.part_type} named {Path(rel).stem}.*"
        if suffix == ".caption":  # kohya's sidecars
            return (
                detail + f"; captions are read from {Path(rel).stem}.txt: rename the .caption files"
            )
        if suffix in (".heic", ".heif"):
            return detail + "; HEIC/HEIF is not read: convert it to JPEG first"
        if self.kind == "images" and (fmt := image_format(self.root / rel)):
            # a picture under another name (a .mp4, no extension): Pillow sees what it is
            named = f"a {suffix} name" if suffix else "a name without extension"
            return f"an image ({fmt}) under {named}: rename it to .{IMAGE_FORMATS[fmt]}"
        if suffix in (VIDEO_EXTS if self.kind == "images" else IMAGE_EXTS):
            return detail + f"; give the {other} a source of their own ({other}:PATH)"
        return detail + "; this source takes " + " ".join(sorted(self.exts))


class ImagesSource(CaptionedSource):
    kind = "images"
    exts = IMAGE_EXTS
    column = "image"
    part_type = "image"


class VideosSource(CaptionedSource):
    kind = "videos"
    exts = VIDEO_EXTS
    column = "video"
    part_type = "video"
