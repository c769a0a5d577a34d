"""Read token documents straight from token shards, in index order, without the packing loader.

For the offline passes that want whole documents rather than packed rows: the unigram baseline
(data/unigram.py), the evaluation command (tools/evaluate/) and the held-out checks. A document
is its ids, its per-token modality and its visual blocks ``[start, end, t, h, w]`` (from the
index), plus the source and key it came from.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.loader.config import SourceConfig
from data.loader.sample_check import check_ids, read_members
from data.loader.store import ShardFiles
from data.loader.table import SampleTable, TokenTable
from data.loader.table_load import load_table
from data.names import INDEX_SUFFIX
from data.shards.npy import read_npy

log = logging.getLogger(__name__)
LOGGED_PER_SOURCE = 5  # unreadable documents of one source named one by one, then a count


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
    """The sample tables of a token folder, local or an fsspec URL (``s3://bucket/tokens``): one
    source per sub-folder holding shards (``tokens/code``, ``tokens/photos``; a folder that holds
    shards itself is one source), so ``tokens/val``, where ingest's ``--val-fraction`` split
    lands, gives its held-out sources. Or the tables of a list of ``SourceConfig``."""
    if isinstance(folder_or_sources, (str, Path)):
        sources = folder_sources(folder_or_sources)
    else:
        sources = list(folder_or_sources)
    return [_tokenized(load_table(s)) for s in sources]


def _tokenized(table: SampleTable) -> TokenTable:
    if not isinstance(table, TokenTable):
        raise ValueError(
            f"source {table.name}: raw shards; tokenize them (earlyfuse-prep tokenize)"
        )
    return table


def folder_sources(url: str | Path) -> list[SourceConfig]:
    """One source per folder directly below ``url`` holding shard indexes (named after it), or
    ``url`` itself when it holds them; sorted by name."""
    from data.shards.storage import Folder

    root = Folder(url)
    files = root.sizes()
    if not files:
        # TOKENS/val exists only where ingest --val-fraction held documents out
        held_out = posixpath.basename(root.url.rstrip("/").replace(os.sep, "/")) == "val"
        hint = "; ingest --val-fraction writes it" if held_out else ""
        raise ValueError(f"{root.url}: no such folder, or an empty one{hint}")
    found = sorted(
        {posixpath.dirname(rel.replace(os.sep, "/")) for rel in files if rel.endswith(INDEX_SUFFIX)}
    )

    def shards_at(rel: str) -> str:
        # a link's target, locally: the shards' manifest is found from where they really are
        if root.remote:
            return root.child(rel) if rel else root.url
        return os.path.realpath(root.local / rel)

    if "" in found:  # the folder holds shards itself
        return [SourceConfig(name=posixpath.basename(root.url.rstrip("/")), shards=[shards_at("")])]
    names = [name for name in found if "/" not in name]
    if not names:
        where = f" (only deeper: {', '.join(found[:3])})" if found else ""
        raise ValueError(
            f"{root.url}: no shards here or in a folder directly below{where}; give a token "
            "folder (earlyfuse-prep tokenize --out) or one of its source folders"
        )
    return [SourceConfig(name=name, shards=[shards_at(name)]) for name in names]


def iter_documents(
    tables: list[SampleTable],
    *,
    max_docs_per_source: int = 0,
    ranges: np.ndarray | None = None,
    skipped: list[tuple[str, str, str]] | None = None,
    samples: Iterable[int] | None = None,
) -> Iterator[TokenDocument]:
    """Every document of every token table (a raw one: ValueError) in index order (or the first
    ``max_docs_per_source``; or with one table, its documents numbered in ``samples``, in order),
    checked like the loader checks them: the members' SHA-256 against the index and,
    with ``ranges`` (``VocabLayout.modality_ranges`` as int64 [modality, 2]), every id within its
    modality's range. A document that fails is left out, never raised: one corrupted sample must
    not stop a run at start (the unigram baseline reads every training document) or an
    evaluation. Each one left out is appended to ``skipped`` as (source, key, why) and the first
    ``LOGGED_PER_SOURCE`` of a source are logged, then one line with how many more (a source
    corrupted whole would otherwise print a line per document)."""
    files = ShardFiles()
    try:
        if samples is not None and len(tables) != 1:
            raise ValueError("iter_documents: samples are numbers within one table")
        for table in map(_tokenized, tables):
            count = len(table) if not max_docs_per_source else min(len(table), max_docs_per_source)
            left_out = 0
            for index in range(count) if samples is None else samples:
                try:
                    shard, _, _, *members = table.locate_members(index)
                    url, end = table.shards[shard], table.shard_end(shard)
                    view = functools.partial(files.view, url, min_bytes=end)
                    ids_bytes, mod_bytes = read_members(members, view, True)
                    # copies: the views of the shard's map end with this generator
                    ids, mod = read_npy(ids_bytes).copy(), read_npy(mod_bytes).copy()
                    check_ids(ids, mod, ranges)
                except (OSError, ValueError, EOFError) as error:
                    try:
                        key = table.key_of(index)
                    except (OSError, ValueError, EOFError):  # the index naming it is the damage
                        shard, number = table.locate(index)
                        key = f"#{number} of {table.shards[shard]}"
                    left_out += 1
                    if left_out <= LOGGED_PER_SOURCE:
                        log.warning(f"source {table.name}: document {key} left out: {error}")
                    if skipped is not None:
                        skipped.append((table.name, key, str(error)))
                    continue
                yield TokenDocument(
                    table.name, table.key_of(index), ids, mod, table.blocks_of(index)
                )
            if left_out > LOGGED_PER_SOURCE:
                log.warning(
                    f"source {table.name}: {left_out - LOGGED_PER_SOURCE} more document(s) left "
                    f"out ({left_out} of the {count} read)"
                )
    finally:
        files.close()
