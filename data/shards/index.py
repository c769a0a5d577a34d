"""Read a shard index (``*.idx.jsonl``) and check it against its tar."""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path
from typing import BinaryIO

from data.names import INDEX_SUFFIX
from data.shards.writer import sample_hash

ENTRY_FIELDS = ("key", "members", "sha256", "types")  # what an index line holds at least


def index_path_for(tar_path: str | Path) -> Path:
    tar = Path(tar_path)
    return (
        tar.with_name(tar.name[: -len(".tar")] + INDEX_SUFFIX)
        if tar.name.endswith(".tar")
        else tar.with_name(tar.name + INDEX_SUFFIX)
    )


def read_index(path: str | Path) -> list[dict]:
    with open(path, "rb") as f:
        return parse_index(f, str(path))


def parse_index(lines, where: str) -> list[dict]:
    """The entries of an index's lines (an open file, or its bytes split at newlines);
    ``where`` names it in an error."""
    entries = []
    for lineno, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}:{lineno}: not a JSON index line ({e})") from None
        # Every reader looks these up: a line without them is a damaged index, said as one.
        lacks = [
            field for field in ENTRY_FIELDS if not isinstance(entry, dict) or field not in entry
        ]
        if lacks or not isinstance(entry["members"], dict):
            what = f"no {', '.join(lacks)}" if lacks else "members is not an object"
            raise ValueError(f"{where}:{lineno}: not an index entry ({what})")
        entries.append(entry)
    return entries


def index_of(folder, rel: str) -> list[dict]:
    """The entries of index ``rel`` of a ``data.shards.storage.Folder`` (local or remote)."""
    return parse_index(folder.read_bytes(rel).splitlines(), folder.child(rel))


def read_exact(f: BinaryIO, tar_path: str | Path, entry: dict, suffix: str) -> bytes:
    """One member's bytes from the open shard ``f``, at the offset its index entry gives; a tar
    cut (or replaced) after it was written is said to be, naming the member."""
    try:
        off, size = entry["members"][suffix]
    except KeyError:  # a document naming a member its index line does not list (written by hand)
        raise ValueError(
            f"{tar_path}: sample {entry['key']} names a member {suffix!r} that its index line's "
            f"members ({', '.join(entry['members'])}) do not list"
        ) from None
    f.seek(off)
    data = f.read(size)
    if len(data) != size:
        raise ValueError(
            f"{tar_path}: cut short: member {entry['key']}.{suffix} lies at bytes {off}-"
            f"{off + size}, {len(data)} of its {size} B are there (earlyfuse-prep verify checks "
            "a whole folder)"
        )
    return data


def read_member(tar_path: str | Path, entry: dict, suffix: str) -> bytes:
    with open(tar_path, "rb") as f:
        return read_exact(f, tar_path, entry, suffix)


def file_sha256(path: str | Path) -> str:
    """A local file's SHA-256 (hex): shards, indexes, checkpoint and release files."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def check_index(tar_path: str | Path, index: list[dict]) -> list[str]:
    """Problems found when the tar's real members are compared with its index (empty = fine)."""
    problems: list[str] = []
    expected = []
    for index_entry in index:
        for suffix, (off, size) in index_entry["members"].items():
            expected.append((f"{index_entry['key']}.{suffix}", off, size))
    # index lines keep members by name; the tar by offset
    expected.sort(key=lambda member: member[1])
    try:
        with tarfile.open(tar_path, mode="r:") as tf:
            actual = [
                (member.name, member.offset_data, member.size) for member in tf if member.isfile()
            ]
    except (tarfile.TarError, OSError) as e:
        return [f"{tar_path}: unreadable tar ({e})"]
    if actual != expected:
        actual_set, expected_set = set(actual), set(expected)
        for name, off, size in sorted(expected_set - actual_set)[:5]:
            problems.append(f"{tar_path}: index lists {name} at {off} ({size} B), the tar does not")
        for name, off, size in sorted(actual_set - expected_set)[:5]:
            problems.append(f"{tar_path}: tar holds {name} at {off} ({size} B), the index does not")
        if not problems:
            problems.append(f"{tar_path}: members are in a different order than the index says")
        return problems
    with open(tar_path, "rb") as f:
        for entry in index:
            members = []
            for suffix, (off, size) in entry["members"].items():
                f.seek(off)
                members.append((suffix, f.read(size)))
            if sample_hash(members) != entry["sha256"]:
                problems.append(f"{tar_path}: sample {entry['key']} does not match its hash")
    return problems
