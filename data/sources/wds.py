"""``wds:PATH`` — existing webdataset shards (a folder of ``.tar`` files, or one ``.tar``) in
img2dataset / video2dataset layout: ``KEY.jpg`` (or png/webp, or ``KEY.mp4``) with
``KEY.txt`` (the caption) and/or ``KEY.json`` (its ``caption`` field; the rest goes to meta).

Members are located by their byte offsets when the plan is made and read by seeking, so a
worker never scans a whole tar for one sample. A tar that stops before its end-of-archive
blocks (cut inside a member, inside a header or between members) keeps every whole sample
before the cut and records one ``truncated-tar`` reject saying where it stopped and what was
lost; a sample that may have had members after the cut is left out and named there. A damaged
header with data after it, or data after the end blocks, is a ``corrupt-tar`` reject.

PATH may be an fsspec URL (``wds:s3://bucket/laion/``, a folder of ``.tar`` or one ``.tar``):
the plan reads each tar once, in order, to list its members; workers read members by ranged
requests (docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from data.media import IMAGE_EXTS, VIDEO_EXTS
from data.names import INDEX_SUFFIX
from data.schema import Reject, Sample, sanitize_key, unsafe_name_reason
from data.shards import storage
from data.shards.storage import is_remote, retried
from data.sources.base import (
    Item,
    Part,
    Source,
    caption_part,
    hidden_dir,
    not_strings,
    pop_caption,
    walk,
)
from data.sources.rows import parse_record


def split_member(name: str) -> tuple[str, str]:
    """webdataset's rule: the key is everything before the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _open(path: str):
    """A tar's file, local or remote (fsspec: ranged reads, a block cache for scanning)."""
    if not is_remote(path):
        return open(path, "rb")
    filesystem, inner = storage.filesystem(path)
    return retried(
        path, lambda: filesystem.open(inner, "rb", block_size=4 << 20, cache_type="readahead")
    )


_REMOTE: dict[str, object] = {}  # per worker: the remote tar being read (its samples come in order)


def _reader(path: str):
    """A local tar opened for this sample, or the worker's open handle on a remote one."""
    if not is_remote(path):
        return open(path, "rb")
    if path not in _REMOTE:
        for old in _REMOTE.values():
            old.close()  # type: ignore[attr-defined]
        _REMOTE.clear()
        _REMOTE[path] = _open(path)
    return _REMOTE[path]


def read_members(path: str, group: list) -> dict[str, bytes]:
    """The bytes of one sample's members; remote reads retried on a fresh handle."""

    def once() -> dict[str, bytes]:
        handle = _reader(path)
        try:
            data = {}
            for ext, off, size in group:
                handle.seek(off)
                data[ext] = handle.read(size)
            return data
        except Exception:
            _REMOTE.pop(path, None)
            raise
        finally:
            if not is_remote(path):
                handle.close()

    return retried(path, once) if is_remote(path) else once()


def _member_ending(data: dict[str, bytes], suffix: str) -> str | None:
    """The member named ``suffix`` (``txt``), else the one member ending in ``.suffix``; None."""
    if suffix in data:
        return suffix
    found = [ext for ext in data if ext.endswith("." + suffix)]
    return found[0] if len(found) == 1 else None


class TarBreak(NamedTuple):
    """Where and how a tar's listing stopped before its end-of-archive blocks."""

    reason: str  # truncated-tar | corrupt-tar
    what: str  # for people: where it stopped and why
    name: str  # the member at the break: its whole name, the part of it that is there, or ""
    whole: bool  # whether ``name`` is the member's whole name
    after_end: bool = False  # the break lies after the end-of-archive blocks: every member listed
    not_tar: bool = False  # the first block is no tar header: another kind of file


def list_members(path: Path | str) -> tuple[list[tuple[str, int, int]], TarBreak | None]:
    """(name, data offset, size) of the members, and why the listing stopped early. A member
    that holds no bytes of its own (a link, a device) has offset -1: its sample cannot be read.

    tarfile takes a short or invalid header after the first member for the end of the archive,
    so the bytes where it stopped are checked here: the end-of-archive blocks (zeros) are the
    only proper end; anything else is a cut or damage that would lose the rest unseen."""
    members: list[tuple[str, int, int]] = []
    try:
        with _open(str(path)) as f:
            total = f.seek(0, os.SEEK_END)
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as archive:
                for member in archive:
                    end = member.offset_data + member.size
                    if end > total:
                        what = f"ends inside member {member.name!r} (byte {total} of {end})"
                        return members, TarBreak("truncated-tar", what, member.name, True)
                    if member.isfile():
                        members.append((member.name, member.offset_data, member.size))
                    elif not member.isdir():
                        members.append((member.name, -1, 0))
                stop = archive.offset
            return members, _check_end(f, stop, total, members)
    except (tarfile.ReadError, OSError) as e:
        if not members and str(e) in ("invalid header", "bad checksum"):
            # a whole first block that is no tar header: another kind of file, not a cut tar
            return members, TarBreak(
                "corrupt-tar", f"not a tar archive ({e})", "", False, not_tar=True
            )
        after = f" after member {members[-1][0]!r}" if members else ""
        return members, TarBreak("truncated-tar", f"unreadable{after}: {e}", "", False)


def _check_end(f, stop: int, total: int, members: list) -> TarBreak | None:
    """Why the bytes at ``stop`` (where tarfile stopped listing) are not a proper end, or None."""
    f.seek(stop)
    block = f.read(512)
    last = f" after member {members[-1][0]!r}" if members else ""
    if not block:
        what = f"ends at byte {total}{last}, without the end-of-archive blocks"
        return TarBreak("truncated-tar", what, "", False)
    if block.count(0) == len(block):
        # the end-of-archive blocks (cut inside them loses nothing); data after them would be
        # a second archive appended to the first, which tar readers never reach
        while chunk := f.read(1 << 20):
            if chunk.count(0) != len(chunk):
                what = f"holds data after its end-of-archive blocks at byte {stop}"
                return TarBreak("corrupt-tar", what, "", False, after_end=True)
        return None
    name, whole = _header_name(block)
    shown = (
        f"member {name!r}"
        if whole
        else f"a member whose name starts {name!r}"
        if name
        else "a member whose name is unreadable"
    )
    if len(block) < 512:
        what = f"ends at byte {total}, inside the header of {shown} (bytes {stop}-{stop + 511})"
        return TarBreak("truncated-tar", what, name, whole)
    what = (
        f"holds no valid member header at byte {stop} ({shown}){last}; "
        f"its {total - stop} bytes from there are not read"
    )
    return TarBreak("corrupt-tar", what, name, whole)


def _header_name(block: bytes) -> tuple[str, bool]:
    """The member name in a (possibly cut or damaged) 512-byte tar header, and whether it is
    whole: the 100-byte name field up to its NUL, after the ustar prefix field if there is one."""
    field, nul, _ = block[:100].partition(b"\0")
    ended = bool(nul) or len(block) >= 100
    ustar = len(block) >= 500 and block[257:262] == b"ustar"
    prefix = block[345:500].split(b"\0", 1)[0] if ustar else b""
    name = field.decode("utf-8", errors="replace")
    if prefix:
        name = prefix.decode("utf-8", errors="replace") + "/" + name
    whole = ended and name.isprintable() and "\ufffd" not in name
    # a cut before the ustar prefix field may hide a folder in front of the name; the key's
    # last part is still known, which is what the caller compares
    return name, whole


def remote_tars(url: str) -> list[tuple[str, str]]:
    """(label, URL) of the tars of a remote wds source: one .tar, or every .tar below a folder."""
    if url.endswith(".tar"):
        return [(url.rsplit("/", 1)[-1], url)]
    filesystem, inner = storage.filesystem(url)
    found = sorted(
        found_path
        for found_path in retried(url, lambda: filesystem.find(inner))
        if found_path.endswith(".tar")
    )
    return [
        (found_path[len(inner) + 1 :], f"{url}/{found_path[len(inner) + 1 :]}")
        for found_path in found
    ]


def _cut_sample(groups: list[tuple[str, list]], broken: TarBreak) -> tuple[str, list] | None:
    """The last sample listed when it may have had members after the break: its key is the
    key of the member at the break, or that member's name is too damaged or cut to tell."""
    if not groups or broken.after_end:
        return None
    last_key = groups[-1][0]
    if broken.whole and "." in broken.name.rpartition("/")[2]:
        key = split_member(broken.name)[0]
        # a header cut before its ustar prefix field shows the name without its folder
        if last_key != key and not last_key.endswith("/" + key):
            return None
    return groups[-1]


def _what_is_lost(broken: TarBreak, cut: tuple[str, list] | None) -> str:
    """What a break cost, for the reject's detail."""
    known = broken.whole and "." in broken.name.rpartition("/")[2]
    if known:
        said = f"sample {split_member(broken.name)[0]!r} and every sample after it are lost"
        if cut is not None:
            said += (
                " (its members before the break too: "
                + ", ".join(f"{cut[0]}.{member[0]}" for member in cut[1])
                + ")"
            )
        return said
    if broken.after_end:
        return "the samples of the appended archive are not read"
    said = (
        "the sample of that member and every sample after it are lost"
        if broken.name
        else "whatever followed is lost"
    )
    if cut is not None:
        said += f"; sample {cut[0]!r} may be incomplete and is left out"
    return said


class WdsSource(Source):
    kind = "wds"

    def items(self) -> Iterator[Item]:
        if is_remote(self.spec.path):
            for label, url in remote_tars(self.spec.path):
                yield from self._tar_items(label, label, url)
            return
        for rel, skipped in walk(self.root, hidden_dir, follow=self.limits.follow_links_outside):
            label = self.display(rel)
            path = self.root / rel if self.root.is_dir() else self.root
            skipped = skipped or self.outside(path)
            if skipped:
                yield self.rejected_item(
                    self.key(sanitize_key(rel)), label, skipped.reason, skipped.detail
                )
                continue
            if not rel.endswith(".tar"):
                if not rel.endswith(INDEX_SUFFIX):
                    yield self.rejected_item(
                        self.key(sanitize_key(rel)),
                        label,
                        "unknown-type",
                        "wds takes plain .tar shards",
                    )
                continue
            yield from self._tar_items(rel, label, str(path))

    def _tar_items(self, rel: str, label: str, path: str) -> Iterator[Item]:
        """The samples of one tar, grouped by key, in member order."""
        members, broken = list_members(path)
        groups: list[tuple[str, list]] = []
        for name, off, size in members:
            key, ext = split_member(name)
            if groups and groups[-1][0] == key:
                groups[-1][1].append((ext, off, size))
            else:
                groups.append((key, [(ext, off, size)]))
        lost = _cut_sample(groups, broken) if broken else None
        if lost is not None:
            groups.pop()  # its members after the cut are gone: never kept without them
        seen: set[str] = set()
        for wkey, group in groups:
            why = unsafe_name_reason(wkey)
            key = self.key(sanitize_key(wkey))
            where = f"{label}:{wkey}"
            earlier = wkey in seen
            seen.add(wkey)
            if why:
                yield self.rejected_item(key, where, "unsafe-name", why)
                continue
            exts = [member[0] for member in group]
            if twice := sorted({ext for ext in exts if exts.count(ext) > 1}):
                # tar -r appends a second copy: one would be read, the other silently lost
                names = ", ".join(f"{wkey}.{ext}" for ext in twice)
                detail = f"{names} appears twice in the tar (appended with tar -r?): keep one"
                yield self.rejected_item(key, where, "duplicate-key", detail)
                continue
            if earlier:  # webdataset groups consecutive members: this key's are split apart
                detail = (
                    f"members of {wkey} ({', '.join(f'{wkey}.{ext}' for ext in exts)}) come "
                    f"after other keys' members: a sample's members must stand together in the tar"
                )
                yield self.rejected_item(key, where, "duplicate-key", detail)
                continue
            if links := [f"{wkey}.{m[0]}" if m[0] else wkey for m in group if m[1] < 0]:
                why = (
                    f"{', '.join(links)}: a link (or device) member, not a file: it holds no "
                    "bytes (write the tar without links: tar --dereference)"
                )
                yield self.rejected_item(key, where, "unreadable-file", why)
                continue
            media = [
                member
                for member in group
                if "." + member[0].rsplit(".", 1)[-1] in IMAGE_EXTS | VIDEO_EXTS
            ]
            if not media:
                yield self.rejected_item(
                    key,
                    where,
                    "missing-media",
                    "no image or video member (its members: "
                    + ", ".join(f"{wkey}.{m[0]}" if m[0] else wkey for m in group)
                    + ")",
                )
                continue
            size = sum(member[2] for member in group)
            yield Item(key, where, ("tar", str(path), label, wkey, json.dumps(group)), size)
        if broken:
            yield self.rejected_item(
                self.key(sanitize_key(rel) + "-truncated"),
                label,
                broken.reason,
                f"{broken.what}: nothing in it is read"
                if broken.not_tar
                else f"{broken.what}: {_what_is_lost(broken, lost)}; "
                f"the {len(groups)} sample(s) before it are kept",
            )

    def load(self, item: Item) -> Sample | Reject:
        _, path, label, wkey, group_json = item.ref
        where = f"{label}:{wkey}"
        data = read_members(path, json.loads(group_json))
        meta: dict = {}
        caption: object = None
        # KEY.json and KEY.txt, or the one such member of a key holding dots (a.b.jpg, a.b.txt:
        # webdataset's key is "a", so the members are "b.jpg" and "b.txt")
        if ext := _member_ending(data, "json"):
            rec = parse_record(data.pop(ext), f"{where}.{ext}")
            if isinstance(rec, Reject):
                return self.reject(rec.path, rec.reason, rec.detail, item.key)
            if isinstance(rec.get("segments"), list):
                return self._load_native(item, rec, data, label, wkey, where)
            caption = pop_caption(rec)
            meta.update(rec)
        if ext := _member_ending(data, "txt"):
            caption = data.pop(ext)
        caption_seg, no_text = caption_part(caption, where)
        if no_text:
            return self.reject(where, "bad-record", no_text, item.key)
        parts = []
        for ext in list(data):
            last = "." + ext.rsplit(".", 1)[-1]
            if last in IMAGE_EXTS or last in VIDEO_EXTS:
                kind = "image" if last in IMAGE_EXTS else "video"
                parts.append(Part(kind, path=f"{where}.{ext}", data=data.pop(ext), ext=last))
        if caption_seg is not None:
            parts.append(caption_seg)
        origin = {"path": label, "key": wkey}
        if data:
            origin["ignored_members"] = sorted(data)
        return self.assemble(item.key, parts, meta, origin, where)

    def _load_native(
        self, item: Item, doc: dict, data: dict[str, bytes], label: str, wkey: str, where: str
    ) -> Sample | Reject:
        """A sample in our own schema (an earlier ingest's shard): keep its segments as they are."""
        parts = []
        for index, seg in enumerate(doc["segments"]):
            kind = seg.get("type") if isinstance(seg, dict) else None
            if kind and (wrong := not_strings(seg, index)):
                return self.reject(where, "bad-record", wrong, item.key)
            if kind in ("text", "code"):
                parts.append(
                    Part(
                        kind,
                        seg.get("text", ""),
                        path=where,
                        lang=seg.get("lang"),
                        role=seg.get("role"),
                    )
                )
            elif kind in ("image", "video") and seg.get("member") in data:
                member_name = seg["member"]
                parts.append(
                    Part(
                        kind,
                        path=f"{where}.{member_name}",
                        data=data.pop(member_name),
                        ext="." + member_name.rsplit(".", 1)[-1],
                    )
                )
            else:
                return self.reject(
                    where,
                    "bad-record",
                    f"segment {index}: type {kind!r} or its member is missing",
                    item.key,
                )
        origin = {"path": label, "key": wkey, "from": doc.get("origin", {})}
        return self.assemble(item.key, parts, doc.get("meta", {}), origin, where)
