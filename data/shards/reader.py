"""Read raw shards back: documents with their media, located through the index (no tar scan).

Design choices:
- A shard is opened once and members are read by offset; media bytes are fetched only when a
  caller asks for them, so text-only passes (tokenizer training) never read images or videos.
- Only the extensions we write are interpreted; nothing is ever unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from data.shards.index import read_exact, read_index
from data.shards.manifest import load_manifest


@dataclass
class RawDoc:
    key: str
    doc: dict
    entry: dict  # the index line
    shard: Path
    _f: BinaryIO

    def member(self, name: str) -> bytes:
        return read_exact(self._f, self.shard, self.entry, name)


def shard_entries(
    manifest_dir: str | Path, sources: list[str] | None = None
) -> list[tuple[Path, Path, dict]]:
    """(tar, index, manifest entry) of every shard in a raw shard folder, optionally by source."""
    root = Path(manifest_dir)
    manifest = load_manifest(root)
    known = {source["name"] for source in manifest["sources"]}
    for source in sources or []:
        if source not in known:
            raise ValueError(f"{root}: no source {source!r} (it has {sorted(known)})")
    return [
        (root / source["path"], root / source["index"], source)
        for source in manifest["shards"]
        if sources is None or source["source"] in sources
    ]


class ShardReader:
    """Documents of one shard through one open file: ``with ShardReader(tar, idx) as docs:``.
    A ``RawDoc`` reads its media lazily, so it must be used before the block ends."""

    def __init__(self, tar: Path, index: Path) -> None:
        self.tar, self.entries = Path(tar), read_index(index)
        self._f: BinaryIO | None = None

    def __enter__(self) -> Iterator[RawDoc]:
        self._f = open(self.tar, "rb")
        return self._docs(self._f)

    def __exit__(self, *exc) -> None:
        if self._f:
            self._f.close()

    def _docs(self, f: BinaryIO) -> Iterator[RawDoc]:
        for entry in self.entries:
            raw = read_exact(f, self.tar, entry, "json")
            try:
                doc = json.loads(raw)
            except ValueError as err:
                raise ValueError(
                    f"{self.tar}: {entry['key']}.json is not valid JSON ({err})"
                ) from None
            yield RawDoc(entry["key"], doc, entry, self.tar, f)


def iter_shard(tar: Path, index: Path) -> Iterator[RawDoc]:
    """Documents one at a time; each must be used before the next is asked for."""
    with ShardReader(tar, index) as docs:
        yield from docs


def iter_docs(manifest_dir: str | Path, sources: list[str] | None = None) -> Iterator[RawDoc]:
    for tar, index, _ in shard_entries(manifest_dir, sources):
        yield from iter_shard(tar, index)
