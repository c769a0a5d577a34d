"""Read token documents straight from token shards, in index order, without the packing loader.

For the offline passes that want whole documents rather than packed rows: the unigram baseline
(data/unigram.py), the evaluation command (tools/evaluate/) and the held-out checks. A document
is its ids, its per-token modality and its visual blocks ``[start, end, t, h, w]`` (from the
index), plus the source and key it came from.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data.loader.config import SourceConfig
from data.loader.store import ShardFiles
from data.loader.stream import read_npy
from data.loader.table import SampleTable, load_table


@dataclass
class TokenDocument:
    source: str
    key: str
    ids: np.ndarray  # int32 [n]
    modality: np.ndarray  # uint8 [n]
    blocks: list  # [[start, end, t, h, w], ...] (t = 0 for an image)

    def content_hash(self) -> str:
        """SHA-256 of the ids alone: equal documents have equal ids, whatever their key."""
        return hashlib.sha256(np.ascontiguousarray(self.ids, dtype=np.int32).tobytes()).hexdigest()


def source_tables(folder_or_sources) -> list[SampleTable]:
    """The sample tables of a token folder (one source per sub-folder holding shards) or of a
    list of ``SourceConfig``."""
    from pathlib import Path

    if isinstance(folder_or_sources, (str, Path)):
        root = Path(folder_or_sources)
        if not (root / "manifest.json").is_file():
            raise ValueError(f"{root}: not a token shard folder (no manifest.json)")
        names = sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*.idx.jsonl")))
        if not names:
            raise ValueError(f"{root}: no source folder with shards")
        sources = [SourceConfig(name=n, shards=[str(root / n)]) for n in names]
    else:
        sources = list(folder_or_sources)
    tables = [load_table(s) for s in sources]
    for t in tables:
        if t.kind != "tokens":
            raise ValueError(
                f"source {t.name}: raw shards; tokenize them (earlyfuse-prep tokenize)"
            )
    return tables


def iter_documents(
    tables: list[SampleTable], *, max_docs_per_source: int = 0
) -> Iterator[TokenDocument]:
    """Every document of every table in index order (or the first ``max_docs_per_source``)."""
    files = ShardFiles()
    try:
        for t in tables:
            n = len(t) if not max_docs_per_source else min(len(t), max_docs_per_source)
            for i in range(n):
                url = t.shards[t.shard[i]]
                ids = read_npy(files.read(url, int(t.ids_at[i][0]), int(t.ids_at[i][1])))
                mod = read_npy(files.read(url, int(t.mod_at[i][0]), int(t.mod_at[i][1])))
                yield TokenDocument(t.name, t.keys[i], ids, mod, list(t.blocks[i]))
    finally:
        files.close()
