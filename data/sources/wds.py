"""``wds:PATH`` — existing webdataset shards (a folder of ``.tar`` files, or one ``.tar``) in
img2dataset / video2dataset layout: ``KEY.jpg`` (or png/webp, or ``KEY.mp4``) with
``KEY.txt`` (the caption) and/or ``KEY.json`` (its ``caption`` field; the rest goes to meta).

Members are located by their byte offsets when the plan is made and read by seeking, so a
worker never scans a whole tar for one sample. A tar cut short keeps every sample before the
cut and records one ``truncated-tar`` reject for the rest.

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

from data.media import IMAGE_EXTS, VIDEO_EXTS
from data.names import INDEX_SUFFIX
from data.schema import Reject, Sample, sanitize_key, unsafe_name_reason
from data.shards.storage import is_remote, retried
from data.sources.base import Item, Part, Source, hidden_dir, walk
from data.sources.text import parse_record


def split_member(name: str) -> tuple[str, str]:
    """webdataset's rule: the key is everything before the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _open(path: str):
    """A tar's file, local or remote (fsspec: ranged reads, a block cache for scanning)."""
    if not is_remote(path):
        return open(path, "rb")
    import fsspec

    filesystem, inner = fsspec.core.url_to_fs(path)
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


def list_members(path: Path | str) -> tuple[list[tuple[str, int, int]], str | None]:
    """(name, data offset, size) of the regular members, and why the listing stopped early."""
    members: list[tuple[str, int, int]] = []
    try:
        with _open(str(path)) as f:
            total = f.seek(0, os.SEEK_END)
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r:") as archive:
                for member in archive:
                    if not member.isfile():
                        continue
                    if member.offset_data + member.size > total:
                        return (
                            members,
                            f"ends inside member {member.name!r} "
                            f"(byte {total} of {member.offset_data + member.size})",
                        )
                    members.append((member.name, member.offset_data, member.size))
    except (tarfile.ReadError, OSError) as e:
        after = f" after member {members[-1][0]!r}" if members else ""
        return members, f"unreadable{after}: {e}"
    return members, None


def remote_tars(url: str) -> list[tuple[str, str]]:
    """(label, URL) of the tars of a remote wds source: one .tar, or every .tar below a folder."""
    if url.endswith(".tar"):
        return [(url.rsplit("/", 1)[-1], url)]
    import fsspec

    filesystem, inner = fsspec.core.url_to_fs(url)
    found = sorted(
        found_path
        for found_path in retried(url, lambda: filesystem.find(inner))
        if found_path.endswith(".tar")
    )
    return [
        (found_path[len(inner) + 1 :], f"{url}/{found_path[len(inner) + 1 :]}")
        for found_path in found
    ]


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
        for wkey, group in groups:
            why = unsafe_name_reason(wkey)
            key = self.key(sanitize_key(wkey))
            where = f"{label}:{wkey}"
            if why:
                yield self.rejected_item(key, where, "unsafe-name", why)
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
                    "no image or video member (" + ", ".join(member[0] for member in group) + ")",
                )
                continue
            size = sum(member[2] for member in group)
            yield Item(key, where, ("tar", str(path), label, wkey, json.dumps(group)), size)
        if broken:
            yield self.rejected_item(
                self.key(sanitize_key(rel) + "-truncated"),
                label,
                "truncated-tar",
                broken + "; the samples before it are kept",
            )

    def load(self, item: Item) -> Sample | Reject:
        _, path, label, wkey, group_json = item.ref
        where = f"{label}:{wkey}"
        data = read_members(path, json.loads(group_json))
        meta: dict = {}
        caption: str | bytes | None = None
        if "json" in data:
            rec = parse_record(data.pop("json"), where + ".json")
            if isinstance(rec, Reject):
                return self.reject(rec.path, rec.reason, rec.detail, item.key)
            if isinstance(rec.get("segments"), list):
                return self._load_native(item, rec, data, label, wkey, where)
            caption = rec.pop("caption", None)
            meta.update(rec)
        if "txt" in data:
            caption = data.pop("txt")
        parts = []
        for ext in list(data):
            last = "." + ext.rsplit(".", 1)[-1]
            if last in IMAGE_EXTS or last in VIDEO_EXTS:
                kind = "image" if last in IMAGE_EXTS else "video"
                parts.append(Part(kind, path=f"{where}.{ext}", data=data.pop(ext), ext=last))
        if caption is not None:
            parts.append(
                Part(
                    "text",
                    caption if isinstance(caption, (str, bytes)) else str(caption),
                    path=where,
                    role="caption",
                )
            )
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
