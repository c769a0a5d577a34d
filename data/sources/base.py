"""What every source kind shares: specs, limits, plan items, and turning parts into a sample.

A source kind has two halves:
- ``items()`` runs once, in the planning process: it lists the inputs cheaply (names, sizes,
  line offsets) in a deterministic order, so the plan of shards is the same on every machine
  and for any worker count. Problems visible at this stage (missing media, unsafe names,
  vendored folders) become items that already carry their reject.
- ``load(item)`` runs in a worker: it reads the bytes, validates them and returns a ``Sample``
  or a ``Reject``.
"""

from __future__ import annotations

import json
import math
import os
import stat
import unicodedata
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from data.media import (
    MAX_IMAGE_PIXELS,
    VIDEO_EXTS,
    ImageInfo,
    VideoInfo,
    clean_json_text,
    decode_text,
    probe_image,
    probe_video,
    video_container,
)
from data.schema import MEDIA_PREFIX, Reject, Sample, name_not_utf8


@dataclass(frozen=True)
class SourceSpec:
    kind: str
    path: str  # absolute
    name: str  # unique per ingest; prefixes every key and names the shard folder


@dataclass(frozen=True)
class Limits:
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_video_seconds: float = 600.0
    max_text_bytes: int = 16 << 20
    max_code_bytes: int = 1 << 20
    repair_utf8: bool = False
    # Read files through symlinks that lead out of a source's folder (default: rejected)
    follow_links_outside: bool = False
    # Read media paths a table gives that lead out of the table's folder (default: rejected)
    allow_outside_paths: bool = False

    def describe(self) -> dict:
        """The limits for the plan fingerprint. ``allow_outside_paths`` is left out: its whole
        effect is on the planned items (an outside path is an item read, or one carrying its
        reject), which the fingerprint hashes one by one."""
        fields = asdict(self)
        del fields["allow_outside_paths"]
        return fields


LINK_OUTSIDE = "link-outside-source"
OUTSIDE_TREE = "outside-tree"


def leaves_folder(written: str, base: Path) -> str | None:
    """Why a media path as a table wrote it leads out of the table's folder ``base``, or None.
    ``..`` are folded without following links (a link out is ``outside_root``'s to find); an
    absolute path inside ``base`` stays inside."""
    folder = os.path.normpath(base)
    target = os.path.normpath(os.path.join(folder, written))
    if Path(target).is_relative_to(folder):
        return None
    # an interleaved table's path arrives joined to ``base``: its '..' say how it leads out
    how = "a path whose '..' lead" if ".." in Path(written).parts else "an absolute path"
    return (
        f"{written} is {how} outside the table's folder {folder} "
        "(--allow-outside-paths reads such paths)"
    )


class Skip(NamedTuple):
    """Why ``walk`` did not enter a folder (or list a file): a reject reason and its detail."""

    reason: str
    detail: str


def unnameable(written: str) -> str | None:
    """Why a path a table gives can name no file (a NUL byte, a name longer than file systems
    allow: most often a web scrape's image given inline as a data: URI), or None."""
    parts = written.split("/")
    if any(part.startswith("data:") for part in parts):
        return "a data: URI, not a path: decode it to a file, or give the bytes in a parquet column"
    if "\0" in written:
        return "its path holds a NUL byte"
    longest = max((len(part.encode("utf-8", "surrogateescape")) for part in parts), default=0)
    if longest > 255:
        return f"a name in its path is {longest} bytes long (file systems allow 255)"
    return None


def shown(written: str, limit: int = 120) -> str:
    """A path as written, cut for a message: a data: URI is hundreds of kilobytes."""
    return (
        written if len(written) <= limit else f"{written[:limit]}... ({len(written):,} characters)"
    )


def outside_root(path: Path, root: Path) -> Skip | None:
    """Why reading ``path`` would follow a symlink out of ``root`` (a resolved folder), or None.
    ``path`` as written (".." folded, no link followed) inside ``root`` must really be there: no
    symlink on its way (the file's, or a folder's) may lead out. A path written to lie outside
    ``root`` (a table's media path, read only under ``--allow-outside-paths``) must really be
    where it is written: the file itself may not be a symlink out of its folder."""
    if "\0" in str(path):
        return None  # no file to follow: its stat fails, and no_size says why
    lexical = Path(os.path.abspath(path))
    base = root if lexical.is_relative_to(root) else lexical.parent.resolve()
    try:
        real = lexical.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13)
        return Skip("unreadable-file", f"{path}: symlink loop ({e})")
    if not real.is_relative_to(base):
        return Skip(LINK_OUTSIDE, f"{path} is a symlink to {real}, outside {base}")
    return None


@dataclass(frozen=True)
class Item:
    key: str  # the sample key in the shard (source name + local key)
    label: str  # where it came from, for people (relative path, file:line)
    ref: tuple  # how ``load`` finds it; JSON-able, part of the plan fingerprint
    size: int  # estimated bytes in the shard, for cutting shards
    reject: Reject | None = None


@dataclass
class Part:
    """One segment as found in the input, before validation."""

    type: str  # text | code | image | video
    text: str | bytes | None = None  # text/code content (bytes are decoded as UTF-8)
    path: str | None = None  # media file to read, or a label for messages
    data: bytes | None = None  # media bytes already in hand (e.g. from a tar)
    lang: str | None = None  # code language
    role: str | None = None  # e.g. "caption"
    ext: str | None = None  # video container extension, e.g. ".mp4"
    label: str | None = None  # how rejects name a media file (default: its path)


@dataclass
class Source:
    spec: SourceSpec
    limits: Limits = field(default_factory=Limits)
    # key -> the path that took it first (path_key)
    path_keys: dict[str, str] = field(default_factory=dict, init=False, repr=False)

    kind = ""

    def items(self) -> Iterator[Item]:
        raise NotImplementedError

    def load(self, item: Item) -> Sample | Reject:
        raise NotImplementedError

    # helpers ------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return Path(self.spec.path)

    @property
    def folder(self) -> Path:
        """The source's root folder: the folder given, or the folder of the file given."""
        return self.root if self.root.is_dir() else self.root.parent

    def outside(self, path: Path | str, root: Path | None = None) -> Skip | None:
        """Why ``path`` must not be read (a symlink leads out of ``root``, default the source's
        folder; see ``outside_root``), unless ``--follow-links-outside`` allows it."""
        if self.limits.follow_links_outside:
            return None
        return outside_root(Path(path), root or self.folder)

    def outside_tree(self, written: str, base: Path) -> Skip | None:
        """Why a media path a table gives must not be read: it leads out of the table's folder
        ``base`` (see ``leaves_folder``), unless ``--allow-outside-paths`` allows it."""
        if self.limits.allow_outside_paths:
            return None
        why = leaves_folder(written, base)
        return Skip(OUTSIDE_TREE, why) if why else None

    def key(self, local: str) -> str:
        return f"{self.spec.name}-{local}"

    def path_key(self, rel: str) -> str:
        """The key of the file at ``rel``. Paths that map onto one key (a/b.py, a_b.py, a b.py)
        are different files: each after the first this listing gave that key also keeps 8 hex
        digits of its path's SHA-256, as a name outside ASCII does, so that none is lost."""
        from data.schema import path_digest, sanitize_key

        local = sanitize_key(rel)
        if self.path_keys.setdefault(local, rel) != rel:
            local = f"{local}-{path_digest(rel)}"
        return self.key(local)

    def reject(self, path: str, reason: str, detail: str = "", key: str | None = None) -> Reject:
        return Reject(path, reason, detail, key=key, source=self.spec.name)

    def rejected_item(self, key: str, path: str, reason: str, detail: str = "") -> Item:
        return Item(key, path, ("rejected",), 0, self.reject(path, reason, detail, key))

    def walk_files(
        self, skip_dir: Callable[[str], str | None]
    ) -> Iterator[tuple[str, str, Path] | Item]:
        """(key, label, path) of every file under the root, in order; a folder that
        ``skip_dir`` names a reason for is yielded once, as its rejected Item, and so is a file or
        folder whose symlink leads out of the root."""
        from data.schema import sanitize_key

        for rel, skipped in walk(self.root, skip_dir, follow=self.limits.follow_links_outside):
            label = self.display(rel)
            path = self.root / rel if self.root.is_dir() else self.root
            skipped = skipped or self.outside(path)
            if skipped:  # a skipped file takes no key from a file that is read
                yield self.rejected_item(self.key(sanitize_key(rel)), label, *skipped)
            else:
                yield self.path_key(rel), label, path

    def display(self, rel: str) -> str:
        """How a file inside this source is named in rejects and metadata: relative to the root."""
        return rel if self.root.is_dir() else self.root.name

    def assemble(
        self, key: str, parts: list[Part], meta: dict, origin: dict, label: str
    ) -> Sample | Reject:
        return assemble(self, key, parts, meta, origin, label)


def with_source(rej: Reject, src: Source, key: str) -> Reject:
    return Reject(rej.path, rej.reason, rej.detail, key=key, source=src.spec.name)


def assemble(
    src: Source, key: str, parts: list[Part], meta: dict, origin: dict, label: str
) -> Sample | Reject:
    """Validate every part and build the sample; the first failing part rejects the document.

    ``meta`` holds the input's own fields (a caption file's extra columns, a JSONL record's other
    keys); ``origin`` says where the document came from (path relative to the source, line)."""
    lim = src.limits
    segments: list[dict] = []
    media: list[tuple[str, bytes]] = []
    repaired = 0
    counters = {"image": 0, "video": 0}
    # The size limits apply to a document's text however it came: a file's size is checked
    # when listed, a table's row or a JSONL line's only here (the BPE trainer's memory grows
    # with the longest document).
    text_bytes = {"text": 0, "code": 0}
    limits = {"text": lim.max_text_bytes, "code": lim.max_code_bytes}
    for part in parts:
        if part.type in ("text", "code"):
            where = part.path or label
            raw = part.text
            text_bytes[part.type] += len(
                raw if isinstance(raw, bytes) else (raw or "").encode("utf-8", "surrogatepass")
            )
            if text_bytes[part.type] > limits[part.type]:
                return src.reject(
                    label,
                    "too-large",
                    f"{text_bytes[part.type]} B of {part.type} > limit {limits[part.type]} B "
                    f"(--max-{part.type}-bytes)",
                    key,
                )
            if isinstance(raw, bytes):
                got = decode_text(raw, where, repair=lim.repair_utf8)
            else:
                got = clean_json_text(raw or "", where, repair=lim.repair_utf8)
            if isinstance(got, Reject):
                return with_source(got, src, key)
            text, bad = got
            repaired += bad
            if part.role == "caption":  # a sidecar's final newline (echo, any editor) is no text:
                text = text.strip()  # the model would learn captions that end in one, or not
            if not text.strip():
                continue  # an empty paragraph or caption is no content; the document may still be
            seg = {"type": part.type, "text": text}
            if part.lang:
                seg["lang"] = part.lang
            if part.role:
                seg["role"] = part.role
            segments.append(seg)
        elif part.type in MEDIA_PREFIX:
            data: bytes | Reject | None = part.data
            if data is None:
                data = read_media(part.path)
            if isinstance(data, Reject):
                return with_source(
                    Reject(part.label or data.path, data.reason, data.detail), src, key
                )
            where = part.label or part.path or label
            info: ImageInfo | VideoInfo | Reject
            if part.type == "image":
                info = probe_image(data, where, max_pixels=lim.max_image_pixels)
                ext = None if isinstance(info, Reject) else info.ext
            else:
                info = probe_video(data, where, max_seconds=lim.max_video_seconds)
                # a table's bytes have no name: their container says what they are
                named = part.ext or (Path(part.path or "").suffix if part.data is None else "")
                ext = (named or video_container(data) or "mp4").lower().lstrip(".")
            if isinstance(info, Reject):
                return with_source(info, src, key)
            member = f"{MEDIA_PREFIX[part.type]}{counters[part.type]}.{ext}"
            counters[part.type] += 1
            segments.append({"type": part.type, "member": member, **info.meta()})
            media.append((member, data))
        else:
            return src.reject(label, "bad-record", f"unknown segment type {part.type!r}", key)
    if not segments:
        return src.reject(label, "empty-document", "no text or media after validation", key)
    origin = dict(origin)
    if repaired:
        origin["repaired_utf8"] = repaired
    doc = {
        "source": src.spec.name,
        "kind": src.kind,
        "origin": origin,
        "meta": meta,
        "segments": segments,
    }
    return Sample(key, doc, media)


def not_strings(seg: dict, position: int) -> str | None:
    """Why a segment of our schema (an interleaved JSONL line's, a wds tar's own ``KEY.json``)
    cannot be read: a number, a list or a boolean where a string belongs (its text, language or
    role; a media segment's path)."""
    fields = ("text", "lang", "role") if seg.get("type") in ("text", "code") else ("path", "file")
    for name in fields:
        if seg.get(name) is not None and not isinstance(seg[name], str):
            got = json.dumps(seg[name], default=str)[:60]
            return f'segment {position}: its "{name}" is {got}, not a string'
    return None


def pop_caption(rec: dict, default: object = None) -> object:
    """Pop a record's caption: its ``caption``, else its ``text`` (a Hugging Face dataset's name
    for it), either name also in another case or with spaces around it (``Caption``, a CSV
    header's `` caption``); the rest of the record stays its meta."""
    for name in ("caption", "text"):
        if name in rec:
            return rec.pop(name)
        for key in rec:
            if isinstance(key, str) and key.strip().lower() == name:
                return rec.pop(key)
    return default


def caption_part(caption: object, path: str) -> tuple[Part | None, str | None]:
    """The caption segment of a caption value as a table, a sidecar or a tar gives it, and why
    the value is no caption. None and NaN (a missing value in a pandas-written table) are no
    caption; bytes are decoded as a .txt file is (a parquet column of plain binary); a number
    is taken as its text (7, 1.5, 100000 for 100000.0); an object, a list or a boolean is refused: its
    Python repr would be trained on as the caption."""
    if caption is None or isinstance(caption, float) and math.isnan(caption):
        return None, None
    if isinstance(caption, (dict, list, tuple, bool)):
        kind = {dict: "an object", bool: "a boolean"}.get(type(caption), "a list")
        return None, f"its caption is {kind} ({json.dumps(caption, default=str)[:60]}), not text"
    if isinstance(caption, float) and math.isfinite(caption):  # 100000.0 as 100000
        caption = str(int(caption)) if caption.is_integer() else repr(caption)
    text = caption if isinstance(caption, (str, bytes)) else str(caption)
    return Part("text", text, path=path, role="caption"), None


def read_media(path: str | None) -> bytes | Reject:
    if not path:
        return Reject("?", "missing-media", "segment without a path")
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return Reject(path, "missing-media", "file does not exist")
    except OSError as e:
        return Reject(path, "unreadable-file", str(e))


def read_file(path: Path, label: str) -> bytes | Reject:
    try:
        return path.read_bytes()
    except OSError as e:
        return Reject(label, "unreadable-file", str(e))


def walk(
    root: Path, skip_dir: Callable[[str], str | None], *, follow: bool = False
) -> Iterator[tuple[str, Skip | None]]:
    """Files under ``root`` as sorted relative paths; a skipped folder is yielded once as
    ``("dir/", Skip("vendored", why))`` and not entered. A symlinked folder is not entered when
    it leads inside ``root`` (its files are listed where they really are; the link, a loop back
    to a parent among them, is yielded as ``("dir/", Skip("link-inside-source", ...))``); one
    that leads out is yielded as ``("dir/", Skip("link-outside-source", ...))``, or entered
    with ``follow``. Files are yielded whatever their links: the caller checks them (``Source.outside``); hidden and
    system files, and names that are not UTF-8, come with their Skip. A folder that cannot be
    listed is yielded as ``("dir/", Skip("unreadable-file", ...))``; ``root`` itself so raises
    PermissionError. A file ``root`` yields just its own name."""
    if root.is_file():
        yield root.name, None
        return
    real_root = root.resolve()
    seen = {real_root}
    unlisted: list[OSError] = []  # folders os.walk could not list (a permission): each a reject

    def unlisted_folders() -> Iterator[tuple[str, Skip]]:
        while unlisted:
            e = unlisted.pop(0)
            rel = os.path.relpath(e.filename, root) if e.filename else "."
            if rel == ".":  # the source's own folder: nothing of it can be read
                raise PermissionError(f"{root}: the folder cannot be listed: {e.strerror or e}")
            why = f"a folder that cannot be listed: {e.strerror or e}; its files are not read"
            yield f"{rel}/", Skip("unreadable-file", why)

    for dirpath, dirnames, filenames in os.walk(root, followlinks=True, onerror=unlisted.append):
        yield from unlisted_folders()
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        keep = []
        for dirname in sorted(dirnames):
            why = skip_dir(dirname)
            full = Path(dirpath, dirname)
            if why:
                yield f"{rel_dir}{dirname}/", Skip("vendored", why)
            elif bad_name := name_not_utf8(dirname):  # every file under it would carry it
                yield f"{rel_dir}{dirname}/", Skip("unsafe-name", bad_name)
            elif not full.is_symlink():
                keep.append(dirname)
            elif (real := full.resolve()).is_relative_to(real_root):  # listed, not entered
                where = os.path.relpath(real, real_root)
                detail = f"a symlink to {'the source folder' if where == '.' else where + '/'}"
                # a link into a folder the walk skips reads nothing: that folder's reject says why
                skipped = next(filter(None, map(skip_dir, Path(where).parts)), None)
                detail += f", not read: {skipped}" if skipped else ", read there"
                yield f"{rel_dir}{dirname}/", Skip("link-inside-source", detail)
            else:
                if not follow:
                    detail = f"a symlink leads to {real}, outside the source's folder {real_root}"
                    yield f"{rel_dir}{dirname}/", Skip(LINK_OUTSIDE, detail)
                elif real not in seen:  # followed once each (a link back would loop)
                    seen.add(real)
                    keep.append(dirname)
        dirnames[:] = keep
        for fname in sorted(filenames):
            why = special_file(Path(dirpath, fname))
            yield f"{rel_dir}{fname}", Skip("unreadable-file", why) if why else skipped_file(fname)
    yield from unlisted_folders()


# Files an operating system writes beside the user's: macOS's ._NAME (the resource fork of NAME,
# whose key NAME's would be) and .DS_Store, Windows's Thumbs.db and desktop.ini
SYSTEM_FILES = frozenset({"Thumbs.db", "desktop.ini"})


def skipped_file(name: str) -> Skip | None:
    if name.startswith(".") or name in SYSTEM_FILES:
        return Skip("vendored", "hidden or system file skipped")
    if why := name_not_utf8(name):
        return Skip("unsafe-name", why)
    return None


def hidden_dir(name: str) -> str | None:
    return f"hidden folder {name!r} skipped" if name.startswith(".") else None


def on_disk(path: Path) -> Path:
    """``path``, or the same name in the other Unicode form where only that one exists: macOS
    writes names decomposed (NFD: "e" + U+0301), a table typed elsewhere holds them composed
    (NFC: U+00E9), and Linux compares bytes, so café.jpg would be a missing file."""
    try:
        if path.exists():
            return path
        for form in ("NFC", "NFD"):
            other = Path(unicodedata.normalize(form, str(path)))
            if other.exists():
                return other
    except OSError:  # a name too long to be a file's: its stat fails, and no_size says why
        pass
    return path


def special_file(path: Path) -> str | None:
    """What ``path`` is when it is neither a regular file nor a folder (a named pipe, a socket, a
    device: opening a pipe with no writer waits for ever), or None (also when it cannot be
    stat'ed: the callers say why)."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kind = (
        "a named pipe (FIFO)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "a special file"
    )
    return f"not a regular file but {kind}: not opened"


def stat_size(path: Path) -> int | None:
    """The size of the file at ``path``; None when it cannot be stat'ed or is a special file."""
    try:
        st = path.stat()
    except (OSError, ValueError):  # ValueError: a NUL in the name
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) else None


def unstatable(path: Path) -> str:
    """Why ``stat_size`` found no size for ``path`` (a symlink loop, a broken link, a
    permission, a named pipe), for a reject's detail."""
    try:
        path.stat()
    except OSError as e:
        return f"cannot stat it: {e.strerror or e}"
    except ValueError as e:
        return f"cannot stat it: {e}"
    return special_file(path) or "cannot stat it"


def no_size(path: Path) -> tuple[str, str]:
    """(reason, detail) of a media file a table names that ``stat_size`` found no size for: not
    there, there as a link that loops or is broken, or there as a named pipe or device."""
    if why := unnameable(str(path)):
        return "missing-media", why
    if path.is_symlink() or special_file(path):
        return "unreadable-file", unstatable(path)
    stripped = Path(*(part.strip() for part in path.parts))
    if stripped != path and stripped.exists():  # a spreadsheet's cell with a space around it
        return (
            "missing-media",
            f"file does not exist ({stripped} does: the path has spaces around it)",
        )
    if "\\" in str(path):  # a table written on Windows: its folders are separated by "\"
        return "missing-media", "file does not exist (folders are separated by / here, not \\)"
    return "missing-media", "file does not exist"


def is_video_name(name: str) -> bool:
    return Path(name).suffix.lower() in VIDEO_EXTS
